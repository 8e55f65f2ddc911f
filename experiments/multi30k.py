r"""The Multi30k recipe end to end: train, average the last checkpoints, score test2016, write docs/results.md.

    python -m experiments.multi30k --workdir=runs/multi30k --data_dir=../shared/data/multi30k \
        [--config.num_train_steps=...]

Scores: the published-style BLEU (hypotheses lowercased, punctuation-normalised, Moses-tokenised, against
test_2016_flickr.lc.norm.tok.de with tokenize='none') and cased detokenised sacreBLEU with its signature,
for the last checkpoint and for the average of the last `decode.average_last` checkpoints. Also writes the learning
curve PNG (train/val loss and val BLEU against minutes).
"""

import json
import os
import shutil
import sys
import time

from absl import app, flags, logging

from experiments import common, launch
from transformer_jax import checkpoint as checkpoint_lib
from transformer_jax import inference, metrics, trainer, visualize
from transformer_jax.data.parallel_text import read_lines
from transformer_jax.workdir import Workdir

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory.")
flags.DEFINE_string("data_dir", None, "The Multi30k directory (overrides config.data.dir).")
flags.DEFINE_string("results", "docs/results.md", "Markdown file for the results table.")
flags.DEFINE_string("curve", "docs/multi30k_learning_curve.png", "Learning-curve PNG.")
launch.define_config_flag(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "multi30k.py"),
                          "Recipe config.")
flags.mark_flags_as_required(["workdir"])


def _wall_clock_start(workdir: str) -> float:
  """When this recipe first started in `workdir` (kept across resumed/re-scored runs), as a Unix time."""
  path = os.path.join(workdir, "wall_clock_start.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return float(json.load(f)["start"])
  os.makedirs(workdir, exist_ok=True)
  start = time.time()
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"start": start}, f)
  return start


def _last_logged(metrics_jsonl: str, prefix: str) -> dict:
  """The last logged value of every metric whose name starts with `prefix`."""
  last = {}
  with open(metrics_jsonl, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      last.update({k: v for k, v in row.items() if k.startswith(prefix)})
  return last


def score(params, model_config, tokenizer, sources, references, lc_references, decode_cfg):
  start = time.time()
  hyps = inference.translate_texts(params, model_config, tokenizer, sources, beam_size=decode_cfg.beam_size,
                                   alpha=decode_cfg.alpha, extra_len=decode_cfg.extra_len)
  out = metrics.sacrebleu_scores(hyps, references)
  out["lc_tok_bleu"] = metrics.lowercased_tokenized_bleu(hyps, lc_references, lang="de")
  out["decode_seconds"] = time.time() - start
  return out, hyps


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  common.setup_logging()

  config = FLAGS.config
  if FLAGS.data_dir:
    config.data.dir = FLAGS.data_dir
  data_dir = config.data.dir
  wall_start = _wall_clock_start(FLAGS.workdir)
  try:
    test_src = read_lines(os.path.join(data_dir, "test2016.en"))
    test_ref = read_lines(os.path.join(data_dir, "test2016.de"))
    test_lc = read_lines(os.path.join(data_dir, "test_2016_flickr.lc.norm.tok.de"))
    result = trainer.train_and_evaluate(config, FLAGS.workdir)
  except common.USER_ERRORS as e:
    common.fail(str(e))
  if result.stopped_early:
    return
  train_minutes = (time.time() - wall_start) / 60
  model_config, tokenizer = result.model_config, result.datasets.tokenizer

  rows = {}
  last, hyps = score(result.state.params, model_config, tokenizer, test_src, test_ref, test_lc, config.decode)
  rows["last checkpoint"] = last
  run_dir = Workdir(FLAGS.workdir)
  ckpt_dir, averaged_dir = os.fspath(run_dir.checkpoints), os.fspath(run_dir.averaged)
  steps = checkpoint_lib.Checkpointer(ckpt_dir, read_only=True).all_steps()
  n = min(config.decode.average_last, len(steps))
  if n > 1:
    if os.path.isdir(averaged_dir):
      shutil.rmtree(averaged_dir)
    checkpoint_lib.average_checkpoints(ckpt_dir, last_n=n, output_directory=averaged_dir)
    params = checkpoint_lib.restore_params(averaged_dir, model_config)
    rows[f"average of last {n}"], hyps = score(params, model_config, tokenizer, test_src, test_ref, test_lc,
                                               config.decode)
  total_minutes = (time.time() - wall_start) / 60

  with open(os.path.join(FLAGS.workdir, "test2016.hyp"), "w", encoding="utf-8") as f:
    f.writelines(h + "\n" for h in hyps)
  visualize.plot_learning_curves(os.fspath(run_dir.metrics_jsonl), FLAGS.curve)
  summary = {"train_minutes": train_minutes, "total_minutes": total_minutes, "rows": rows,
             "val": _last_logged(os.fspath(run_dir.metrics_jsonl), "val/"),
             "steps": config.num_train_steps,
             "model": model_config.__dict__}
  with open(os.path.join(FLAGS.workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, default=str)
  write_markdown(FLAGS.results, FLAGS.curve, config, model_config, rows, summary)
  for name, r in rows.items():
    print(f"{name}: test2016 lc-tok BLEU {r['lc_tok_bleu']:.2f} | sacreBLEU {r['bleu']:.2f} "
          f"({r['bleu_signature']}) | chrF {r['chrf']:.2f}")
  print(f"total wall time {total_minutes:.1f} min (training {train_minutes:.1f} min)")


def write_markdown(path, curve, config, model_config, rows, summary):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  lines = [
      "# Results",
      "",
      "## Multi30k EN→DE on a 2-core CPU (`experiments/configs/multi30k.py`)",
      "",
      f"Produced by `python -m experiments.multi30k` on {time.strftime('%Y-%m-%d')} "
      f"({os.cpu_count()} CPU cores). Model: {model_config.num_encoder_layers}+{model_config.num_decoder_layers} "
      f"layers, d_model {model_config.d_model}, d_ff {model_config.d_ff}, {model_config.num_heads} heads, "
      f"dropout {model_config.dropout_rate}, shared BPE vocabulary {model_config.vocab_size}; "
      f"{config.num_train_steps} steps of {config.data.tokens_per_batch} tokens; beam {config.decode.beam_size}, "
      f"α {config.decode.alpha}.",
      "",
      "| checkpoint | test2016 BLEU (lc, norm, tok; published-style) | sacreBLEU (cased, detok) | chrF |",
      "|---|---|---|---|",
  ]
  for name, r in rows.items():
    lines.append(f"| {name} | {r['lc_tok_bleu']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} |")
  sig = next(iter(rows.values()))["bleu_signature"]
  lines += ["", f"sacreBLEU signature: `{sig}`; the published-style score uses `tokenize='none'` against "
            "`test_2016_flickr.lc.norm.tok.de`.", "",
            f"Wall time: {summary['total_minutes']:.1f} min in total from the recipe's first start in its workdir "
            f"(data preparation, training with periodic validation, averaging and test decoding; a resumed or "
            f"re-scored run counts from the first start).", "",
            f"Validation at the end: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(summary['val'].items())
                                                  if isinstance(v, float)), "",
            f"![learning curve]({os.path.relpath(curve, os.path.dirname(os.path.abspath(path)))})", ""]
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))


if __name__ == "__main__":
  launch.run(main)
