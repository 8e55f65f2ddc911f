r"""Translate a file with our decoder and with the same model exported to CTranslate2; count identical lines.

    python -m experiments.compare_ctranslate2 --workdir=DIR --input=../shared/data/multi30k/test2016.en \
        --ct2_dir=OUT [--beam_sizes=1,4] [--alpha=0] [--report=compare.json]

Exports the workdir's model to `--ct2_dir` first when that directory is empty or missing. CTranslate2 is used
the way its documentation uses a Marian model: source pieces from the model directory's own `source.spm`
applied to the raw text, nothing appended (no `</s>`, no banned tokens passed): what the runtime must add (source
EOS, decoder start, our normalisation, never emitting pad or BOS) is the exported model's own business
(docs/interop.md, "What the exported models add by themselves"). Ours translates the same raw text with our
tokenizer. The report counts the lines whose source pieces differ between the two (0 when the export's
normaliser is ours). Both get the same output cap (source length + `--extra_len`, at most the model's
`max_len`, our decoder's cap); beam search compares at `--alpha` with CTranslate2's `length_penalty` equal to
it: the two penalties coincide only at 0 (ours is GNMT's ((5+|Y|)/6)^alpha, CTranslate2's |Y|^alpha).

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

import launch
from transformer_jax.decoding import inference
from transformer_jax.decoding import length_penalty
from transformer_jax.interop import ctranslate2 as ct2
from transformer_jax.interop import marian
from transformer_jax.interop.ctranslate2 import translate_pieces
from transformer_jax.model import Transformer
from transformer_jax.run import trained

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A trained (or imported) workdir.")
flags.DEFINE_string("input", None, "Source text file, one sentence per line.")
flags.DEFINE_string("ct2_dir", None, "CTranslate2 model directory (exported here when empty or missing).")
flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to compare (1 = greedy).")
flags.DEFINE_float("alpha", 0.0, "Length-penalty exponent for beam search on both sides (0: no penalty).")
flags.DEFINE_integer("extra_len", 50, "Output cap = source length + extra_len tokens (EOS included).")
flags.DEFINE_integer("threads", 2, "CTranslate2 intra-op threads.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_string("marian_dir", None, "Also compare the Hugging Face Marian export used through MarianTokenizer + "
                    "generate (exported here when empty or missing); beam search at alpha 0 only.")
flags.DEFINE_string("report", None, "Write the comparison (counts and every difference) to this JSON file.")
flags.mark_flags_as_required(["workdir", "input", "ct2_dir"])
launch.check_files_exist("input")
launch.check_output_files("report")


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
    row["kind"] = ("the other runtime found a better-scoring output (our search error)" if row["score_ct2"] >
                   row["score_ours"] + 1e-4 else "ours scores better (the other runtime's search error)"
                   if row["score_ours"] > row["score_ct2"] + 1e-4 else "equal scores (tie)")
  return row


def compare(params, config, tokenizer, sources, ours, theirs, beam_size, alpha, extra_len) -> dict:
  """Our output ids vs another runtime's (`theirs`, ids) for the same source lines (`sources`: our ids)."""
  diffs = []
  for i, (src, a, b_ids) in enumerate(zip(sources, ours, theirs)):
    if a != b_ids:
      cap = min(len(src) - 1 + extra_len, config.max_len)
      row = explain(params, config, src, a, b_ids, cap, beam_size, alpha)
      diffs.append({"line": i + 1, "ours": tokenizer.decode(a), "ct2": tokenizer.decode(b_ids), **row})
  same = len(sources) - len(diffs)
  return {"beam_size": beam_size, "alpha": alpha, "lines": len(sources), "identical": same,
          "identical_percent": 100.0 * same / max(len(sources), 1), "differences": diffs}


def differing_sources(tokenizer, lines, ct2_sources) -> list[int]:
  """1-based numbers of the lines whose CTranslate2 source pieces are not our tokenizer's (without EOS)."""
  return [i + 1 for i, (line, pieces) in enumerate(zip(lines, ct2_sources))
          if tokenizer.pieces(tokenizer.encode(line, add_eos=False)) != pieces]


def _print(report: dict) -> None:
  kinds = collections.Counter(d["kind"] for d in report["differences"])
  print(f"{report['runtime']}: beam {report['beam_size']} (alpha {report['alpha']}): {report['identical']}/"
        f"{report['lines']} lines identical ({report['identical_percent']:.2f}%); differences: {dict(kinds)}")
  for d in report["differences"]:
    print(f"  line {d['line']}: {d['kind']}; first difference at token {d['first_difference']}, "
          f"gap {d.get('gap_at_difference', float('nan')):.2e}, scores ours {d['score_ours']:.4f} "
          f"theirs {d['score_ct2']:.4f}\n    ours:   {d['ours']}\n    theirs: {d['ct2']}")


@launch.program
def main():
  lines = launch.read_lines(FLAGS.input)
  for flag in ("ct2_dir", "marian_dir"):
    path = FLAGS[flag].value
    if path and os.path.exists(path) and not os.path.isdir(path):
      raise NotADirectoryError(f"--{flag}={path} is a file; expected a model directory")
  if FLAGS.marian_dir and FLAGS.alpha and any(int(b) > 1 for b in FLAGS.beam_sizes):
    raise ValueError(f"--alpha={FLAGS.alpha} with --marian_dir: generate's length penalty is |Y|^alpha, ours GNMT's; "
                     "compare beam search at --alpha=0")
  model_config, params, tokenizer = trained.load(FLAGS.workdir, FLAGS.checkpoint)
  if not (os.path.isdir(FLAGS.ct2_dir) and os.listdir(FLAGS.ct2_dir)):
    ct2.export_ctranslate2(params, model_config, FLAGS.ct2_dir, tokenizer_path=tokenizer.path)
  translator = ct2.translator(FLAGS.ct2_dir, threads=FLAGS.threads)
  ct2_sources = ct2.source_pieces(FLAGS.ct2_dir, lines)
  source_diffs = differing_sources(tokenizer, lines, ct2_sources)
  print(f"CTranslate2 fed as documented (source.spm pieces of the raw text, no </s> appended): "
        f"{len(lines) - len(source_diffs)}/{len(lines)} sources have our pieces"
        + (f"; differing lines: {source_diffs[:20]}" if source_diffs else ""))
  if FLAGS.marian_dir and not (os.path.isdir(FLAGS.marian_dir) and os.listdir(FLAGS.marian_dir)):
    data = trained.workdir_config(FLAGS.workdir).data
    marian.save_marian(params, model_config, FLAGS.marian_dir, tokenizer_path=tokenizer.path,
                       source_lang=data.source_lang, target_lang=data.target_lang)
  piece_id = {tokenizer.pieces([i])[0]: i for i in range(model_config.vocab_size)}
  sources = [tokenizer.encode(line) for line in lines]
  reports = []
  for beam in (int(b) for b in FLAGS.beam_sizes):
    alpha = FLAGS.alpha if beam > 1 else 0.0
    ours = inference.translate_ids(params, model_config, sources, beam_size=beam, alpha=alpha,
                                   extra_len=FLAGS.extra_len)
    runtimes = {"ctranslate2": [[piece_id[p] for p in out] for out in translate_pieces(
        translator, ct2_sources, beam_size=beam, length_penalty=alpha, extra_len=FLAGS.extra_len,
        max_len=model_config.max_len)]}
    if FLAGS.marian_dir:  # MarianTokenizer + generate: no length penalty (alpha 0 only)
      runtimes["marian"] = marian.generate_ids(FLAGS.marian_dir, lines, beam_size=beam, extra_len=FLAGS.extra_len,
                                               max_len=model_config.max_len)
    for runtime, theirs in runtimes.items():
      report = compare(params, model_config, tokenizer, sources, ours, theirs, beam, alpha, FLAGS.extra_len)
      report.update(runtime=runtime, differing_sources=source_diffs if runtime == "ctranslate2" else [])
      _print(report)
      reports.append(report)
  if FLAGS.report:
    with open(FLAGS.report, "w", encoding="utf-8") as f:
      json.dump({"workdir": FLAGS.workdir, "input": FLAGS.input, "ct2_dir": FLAGS.ct2_dir,
               "marian_dir": FLAGS.marian_dir, "runs": reports}, f,
                indent=1, ensure_ascii=False)


if __name__ == "__main__":
  launch.run(main)
