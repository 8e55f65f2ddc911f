r"""Translate a file with our decoder and with the same model exported to CTranslate2; count identical lines.

    python -m experiments.compare_ctranslate2 --workdir=DIR --input=../shared/data/multi30k/test2016.en \
        --ct2_dir=OUT [--beam_sizes=1,4] [--alpha=0] [--report=compare.json]

Exports the workdir's model to `--ct2_dir` first when that directory is empty or missing. Both sides get the
same source ids (our tokenizer, EOS appended), the same output cap (source length + `--extra_len`) and the
same banned tokens (pad and BOS); beam search compares at `--alpha` with CTranslate2's `length_penalty`
equal to it: the two penalties coincide only at 0 (ours is GNMT's ((5+|Y|)/6)^alpha, CTranslate2's |Y|^alpha).

Every differing line is explained from our model's own log-probabilities (teacher-forced): for greedy, the
gap between the two systems' tokens at the first position where they part (a near-tie = float rounding
decides); for beam search, the length-normalised scores of both outputs (which search found the better one).
"""

from __future__ import annotations

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common, launch
from transformer_jax import inference
from transformer_jax.decode import length_penalty
from transformer_jax.interop import ctranslate2 as ct2
from transformer_jax.interop.ctranslate2 import translate_pieces
from transformer_jax.model import Transformer

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A trained (or imported) workdir.")
flags.DEFINE_string("input", None, "Source text file, one sentence per line.")
flags.DEFINE_string("ct2_dir", None, "CTranslate2 model directory (exported here when empty or missing).")
flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to compare (1 = greedy).")
flags.DEFINE_float("alpha", 0.0, "Length-penalty exponent for beam search on both sides (0: no penalty).")
flags.DEFINE_integer("extra_len", 50, "Output cap = source length + extra_len tokens (EOS included).")
flags.DEFINE_integer("threads", 2, "CTranslate2 intra-op threads.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_string("report", None, "Write the comparison (counts and every difference) to this JSON file.")
flags.mark_flags_as_required(["workdir", "input", "ct2_dir"])


def token_log_probs(params, config, source, target):
  """Our model's log-probabilities `[len(target)]` of each target id given the previous ones."""
  logits = Transformer(config).apply({"params": params}, jnp.asarray([source]), jnp.asarray([target]))
  log_probs = np.asarray(jax.nn.log_softmax(logits[0]))
  return log_probs, log_probs[np.arange(len(target)), target]


def explain(params, config, source, ours, theirs, cap, beam_size, alpha):
  """Why two outputs (id lists without EOS) differ, from our model's log-probabilities."""
  finish = lambda ids: ids + [config.eos_id] if len(ids) < cap else ids  # noqa: E731 (cap reached: no EOS)
  a, b = finish(ours), finish(theirs)
  t = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
  full, lp_a = token_log_probs(params, config, source, a)
  _, lp_b = token_log_probs(params, config, source, b)
  row = {"first_difference": t, "ours_len": len(ours), "ct2_len": len(theirs)}
  if t < len(a) and t < len(b):
    row["gap_at_difference"] = float(full[t, a[t]] - full[t, b[t]])
  row["score_ours"] = float(lp_a.sum() / length_penalty(len(a), alpha))
  row["score_ct2"] = float(lp_b.sum() / length_penalty(len(b), alpha))
  if beam_size == 1:
    row["kind"] = "near-tie (|gap| < 1e-3)" if abs(row.get("gap_at_difference", 1.0)) < 1e-3 else "real gap"
  else:
    row["kind"] = ("CTranslate2 found a better-scoring output (our search error)" if row["score_ct2"] >
                   row["score_ours"] + 1e-4 else "ours scores better (CTranslate2 search error)"
                   if row["score_ours"] > row["score_ct2"] + 1e-4 else "equal scores (tie)")
  return row


def compare(params, config, tokenizer, translator, lines, beam_size, alpha, extra_len) -> dict:
  sources = [tokenizer.encode(line) for line in lines]
  ours = inference.translate_ids(params, config, sources, beam_size=beam_size, alpha=alpha, extra_len=extra_len)
  banned = tokenizer.pieces(sorted({config.pad_id, config.bos_id}))
  theirs = translate_pieces(translator, [tokenizer.pieces(s) for s in sources], beam_size=beam_size,
                            length_penalty=alpha, extra_len=extra_len, banned=banned)
  piece_id = {tokenizer.pieces([i])[0]: i for i in range(config.vocab_size)}
  diffs = []
  for i, (src, a, b) in enumerate(zip(sources, ours, theirs)):
    b_ids = [piece_id[p] for p in b]
    if a != b_ids:
      row = explain(params, config, src, a, b_ids, len(src) - 1 + extra_len, beam_size, alpha)
      diffs.append({"line": i + 1, "ours": tokenizer.decode(a), "ct2": tokenizer.decode(b_ids), **row})
  same = len(lines) - len(diffs)
  return {"beam_size": beam_size, "alpha": alpha, "lines": len(lines), "identical": same,
          "identical_percent": 100.0 * same / max(len(lines), 1), "differences": diffs}


@common.program
def main():
  lines = common.read_lines(FLAGS.input)
  model_config, params, tokenizer = common.load_for_inference(FLAGS.workdir, FLAGS.checkpoint)
  if not (os.path.isdir(FLAGS.ct2_dir) and os.listdir(FLAGS.ct2_dir)):
    ct2.export_ctranslate2(params, model_config, FLAGS.ct2_dir, tokenizer_path=tokenizer.path)
  translator = ct2.translator(FLAGS.ct2_dir, threads=FLAGS.threads)
  reports = []
  for beam in (int(b) for b in FLAGS.beam_sizes):
    alpha = FLAGS.alpha if beam > 1 else 0.0
    report = compare(params, model_config, tokenizer, translator, lines, beam, alpha, FLAGS.extra_len)
    kinds = collections.Counter(d["kind"] for d in report["differences"])
    print(f"beam {beam} (alpha {alpha}): {report['identical']}/{report['lines']} lines identical "
          f"({report['identical_percent']:.2f}%); differences: {dict(kinds)}")
    for d in report["differences"]:
      print(f"  line {d['line']}: {d['kind']}; first difference at token {d['first_difference']}, "
            f"gap {d.get('gap_at_difference', float('nan')):.2e}, scores ours {d['score_ours']:.4f} "
            f"ct2 {d['score_ct2']:.4f}\n    ours: {d['ours']}\n    ct2:  {d['ct2']}")
    reports.append(report)
  if FLAGS.report:
    with open(FLAGS.report, "w", encoding="utf-8") as f:
      json.dump({"workdir": FLAGS.workdir, "input": FLAGS.input, "ct2_dir": FLAGS.ct2_dir, "runs": reports}, f,
                indent=1, ensure_ascii=False)


if __name__ == "__main__":
  launch.run(main)
