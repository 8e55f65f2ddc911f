r"""The Multi30k recipe end to end: train, average the weights, score test2016, write docs/results.md.

    python -m experiments.multi30k --workdir=runs/multi30k [--config.data.dir=../shared/data/multi30k] \
        [--config.num_train_steps=...]

Scores: the published-style BLEU (hypotheses lowercased, punctuation-normalised, Moses-tokenised, against
test_2016_flickr.lc.norm.tok.de with tokenize='none') and detokenised sacreBLEU with its signature (cased, or
lowercased for a case-folded vocabulary, `data.lowercase`),
for the average of the last `decode.average_last` checkpoints, the recipe's figure, or with `ema_decay` > 0 for
the moving average of the parameters instead (and, with
`--score_last_checkpoint` or without checkpoints to average, for the last checkpoint; decoded with `decode`: beam
size, α and, when `decode.mbr_utility` is set, the MBR choice from the n-best list), on the first
`final_eval.max_examples` test2016 sentences (0 = all 1,000). Writes `<workdir>/results.json` (scores, wall
minutes, steps/s, the machine's load), the learning curve PNG (train/val loss and val BLEU against minutes) and
the generated block of `--results` (between `<!-- multi30k:last-run:start/end -->`; the lever table and notes
around it are hand-written and kept).
"""

import json
import os
import time

import jax
from absl import flags
from etils import epath

import launch
from launch import docblock
from transformer_jax.data.parallel_text import read_lines
from transformer_jax.decoding import inference
from transformer_jax.evaluation import metrics, visualize
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run import factories, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import Workdir, read_json, write_json_atomically

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Run directory.")
flags.DEFINE_string("results", "docs/results.md", "Markdown file for the results table.")
flags.DEFINE_string("curve", "docs/multi30k_learning_curve.png", "Learning-curve PNG.")
flags.DEFINE_bool("score_last_checkpoint", False,
                  "Also score the last checkpoint on test2016 (one more decode, 1-2 min of the hour on 2 cores).")
RESULTS_BLOCK = "multi30k:last-run"  # the generated block of --results; the rest of the file is hand-written
launch.define_config_flag(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "multi30k.py"),
                          "Recipe config.")
flags.mark_flags_as_required(["workdir"])


def _wall_clock_start(workdir: Workdir) -> float:
  """When this recipe first started in `workdir` (kept across resumed/re-scored runs), as a Unix time."""
  saved = read_json(workdir.wall_clock_start_json)
  if saved is not None:
    return float(saved["start"])
  start = time.time()
  write_json_atomically(workdir.wall_clock_start_json, {"start": start})
  return start


def _logged(metrics_jsonl: str) -> list[dict]:
  """Every row of the run's `metrics.jsonl` ({"step", "time", name: value, ...}), in logging order."""
  text = epath.Path(metrics_jsonl).read_text(encoding="utf-8")
  return [json.loads(line) for line in text.split("\n") if line.strip()]


def _last_logged(logged: list[dict], prefix: str) -> dict:
  """The last logged value of every metric whose name starts with `prefix`."""
  last = {}
  for row in logged:
    last.update({k: v for k, v in row.items() if k.startswith(prefix)})
  return last


def score(params, model_config, tokenizer, sources, references, lc_references, decode_cfg):
  start = time.time()
  hyps = inference.translate_texts(params, model_config, tokenizer, sources, beam_size=decode_cfg.beam_size,
                                   alpha=decode_cfg.alpha, extra_len=decode_cfg.extra_len,
                                   mbr_utility=decode_cfg.mbr_utility, target_lang="de")
  out = metrics.sacrebleu_scores(hyps, references, lowercase=tokenizer.lowercase, target_lang="de")
  out["lc_tok_bleu"] = metrics.lowercased_tokenized_bleu(hyps, lc_references, lang="de")
  out["decode_seconds"] = time.time() - start
  return out, hyps


def _read_test(data_dir: str, max_examples: int) -> tuple[list[str], list[str], list[str]]:
  """test2016 sources, cased references and the lowercased/normalised/tokenised references (published-style
  BLEU), the first `max_examples` lines of each when > 0 (the shortened recipe of the tests)."""
  names = ("test2016.en", "test2016.de", "test_2016_flickr.lc.norm.tok.de")
  files = [read_lines(os.path.join(data_dir, name)) for name in names]
  if len({len(lines) for lines in files}) != 1:
    raise ValueError(f"{data_dir}: {', '.join(names)} must have the same number of lines, got "
                     f"{', '.join(str(len(lines)) for lines in files)}")
  return tuple(lines[:max_examples] if max_examples else lines for lines in files)


@launch.program
def main():
  config = ExperimentConfig.from_config_dict(FLAGS.config)
  test_src, test_ref, test_lc = _read_test(config.data.dir, config.final_eval.max_examples)
  run_dir = Workdir(FLAGS.workdir)
  wall_start = _wall_clock_start(run_dir)
  result = trainer.train_and_evaluate(config, FLAGS.workdir)
  if result.stopped_early:
    return
  train_minutes = (time.time() - wall_start) / 60
  config = result.config  # num_train_steps as the time budget set it
  model_config, tokenizer = result.model_config, result.datasets.tokenizer

  rows = {}
  ckpt_dir, averaged_dir = os.fspath(run_dir.checkpoints), os.fspath(run_dir.averaged)
  steps = checkpoint_lib.Checkpointer(ckpt_dir, read_only=True).all_steps()
  n = min(config.decode.average_last, len(steps))
  if FLAGS.score_last_checkpoint or (n <= 1 and not config.ema_decay):
    rows["last checkpoint"], hyps = score(result.state.params, model_config, tokenizer, test_src, test_ref,
                                          test_lc, config.decode)
  if config.ema_decay:  # the moving average is the run's model (and its hypotheses the file's); no averaging
    rows[f"moving average ({config.ema_decay:g})"], hyps = score(
        factories.inference_params(config, result.state), model_config, tokenizer, test_src, test_ref, test_lc,
        config.decode)
  elif n > 1:
    if epath.Path(averaged_dir).is_dir():
      epath.Path(averaged_dir).rmtree()
    checkpoint_lib.average_checkpoints(ckpt_dir, last_n=n, output_directory=averaged_dir)
    params = checkpoint_lib.restore_params(averaged_dir, model_config)
    rows[f"average of last {n}"], hyps = score(params, model_config, tokenizer, test_src, test_ref, test_lc,
                                               config.decode)
  total_minutes = (time.time() - wall_start) / 60

  run_dir.hypotheses("test2016").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
  visualize.plot_learning_curves(os.fspath(run_dir.metrics_jsonl), FLAGS.curve)
  logged = _logged(os.fspath(run_dir.metrics_jsonl))
  summary = {"train_minutes": train_minutes, "total_minutes": total_minutes, "rows": rows,
             "val": _last_logged(logged, "val/"), "val_bleu_by_step": _logged_by_step(logged, "val/bleu"),
             "steps": config.num_train_steps, "seed": config.seed,
             "steps_per_s": _mean_steps_per_s(logged), "train_budget": run_dir.read_train_budget(),
             "load_average_1_5_15min": os.getloadavg(), "cpu_count": os.cpu_count(),
             "devices": jax.device_count(),
             "machine": launch.machine_info(),
             "test_sentences": len(test_src), "model": model_config.__dict__,
             "lowercase": tokenizer.lowercase}  # a case-folded vocabulary: sacreBLEU and chrF lowercased
  run_dir.results_json.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
  docblock.replace_block(FLAGS.results, RESULTS_BLOCK,
                         run_markdown(FLAGS.results, FLAGS.curve, config, model_config, rows, summary))
  for name, r in rows.items():
    print(f"{name}: test2016 lc-tok BLEU {r['lc_tok_bleu']:.2f} | sacreBLEU {r['bleu']:.2f} "
          f"({r['bleu_signature']}) | chrF {r['chrf']:.2f}")
  print(f"total wall time {total_minutes:.1f} min (training {train_minutes:.1f} min, "
        f"{summary['steps_per_s']:.3f} steps/s); load average {os.getloadavg()[2]:.2f} (15 min)")


def _logged_by_step(logged: list[dict], key: str) -> list[tuple[int, float]]:
  """[(step, value)] of every logged `key`, in logging order."""
  return [(r["step"], r[key]) for r in logged if key in r]


def _mean_steps_per_s(logged: list[dict]) -> float:
  """Training steps per second of wall time between the first and the last logged training step (evaluations
  and checkpoints in between included)."""
  train = [r for r in logged if "train/steps_per_s" in r]
  if len(train) < 2:
    return float(train[0]["train/steps_per_s"]) if train else float("nan")
  return (train[-1]["step"] - train[0]["step"]) / max(train[-1]["time"] - train[0]["time"], 1e-9)


def _cpu_words(machine: dict) -> str:
  simd = machine.get("simd") or "no AVX2"
  return f"{machine.get('cpu_model', 'an unnamed CPU')} ({simd})"


def _devices_words(summary: dict) -> str:
  devices = summary.get("devices", 1)
  return f", data parallel over {devices} devices" if devices > 1 else ""


def _budget_words(decision: dict | None) -> str:
  if not decision:
    return ""
  return (f"; the length fits a {decision['budget_minutes']:g}-minute training budget at the "
          f"{decision['steps_per_s']:.3f} steps/s measured up to step {decision['decided_at_step']}, "
          f"cap {decision['cap']}")


def _shape_words(shape: str) -> str:
  return "" if shape == "linear" else f" ({shape})"


def _regularisation_words(config, model_config) -> str:
  """"dropout 0.1 (0.2 from step 2400), attention dropout 0.1, label smoothing 0.2, weight decay 0.1": the
  residual rate with its stages, the attention weights' rate and the decoupled weight decay where they are set."""
  stages = "; ".join(f"{rate:g} from step {step}" for step, rate in config.dropout_schedule)
  words = f"dropout {model_config.dropout_rate:g}" + (f" ({stages})" if stages else "")
  if model_config.attention_dropout_rate:
    words += f", attention dropout {model_config.attention_dropout_rate:g}"
  words += f", label smoothing {config.label_smoothing:g}"
  if config.weight_decay:
    words += f", weight decay {config.weight_decay:g}"
  if config.ema_decay:
    words += f", a moving average of the weights (decay {config.ema_decay:g})"
  return words


def _mbr_words(decode_cfg) -> str:
  utility = decode_cfg.mbr_utility
  return f", the MBR choice from the {decode_cfg.beam_size}-best list ({utility} utility)" if utility else ""


def run_markdown(path, curve, config, model_config, rows, summary) -> str:
  """The generated part of docs/results.md: this run's recipe, test2016 scores, wall time and curve."""
  lowercase = summary.get("lowercase", False)
  case = "lowercased" if lowercase else "cased"
  lines = [
      f"Produced by `python -m experiments.multi30k` on {time.strftime('%Y-%m-%d')} "
      f"({summary['cpu_count']} cores of {_cpu_words(summary['machine'])}, load average "
      f"{summary['load_average_1_5_15min'][2]:.2f} over the last 15 min). Model: "
      f"{model_config.num_encoder_layers}+{model_config.num_decoder_layers} layers, d_model {model_config.d_model}, "
      f"d_ff {model_config.d_ff}, {model_config.num_heads} heads, "
      f"{_regularisation_words(config, model_config)}, shared BPE vocabulary {model_config.vocab_size}"
      f"{' (lowercased text)' if lowercase else ''}; "
      f"{config.num_train_steps} steps of {config.data.tokens_per_batch} tokens{_devices_words(summary)} "
      f"(warm-up {config.warmup_steps}, "
      f"cool-down {config.cooldown_steps}{_shape_words(config.cooldown_shape)}, seed {config.seed}"
      f"{_budget_words(summary['train_budget'])}); "
      f"beam {config.decode.beam_size}, "
      f"α {config.decode.alpha}{_mbr_words(config.decode)}; {summary['test_sentences']} test2016 sentences.",
      "",
      f"| checkpoint | test2016 BLEU (lc, norm, tok; published-style) | sacreBLEU ({case}, detok) | chrF |",
      "|---|---|---|---|",
  ]
  for name, r in rows.items():
    lines.append(f"| {name} | {r['lc_tok_bleu']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} |")
  sig = next(iter(rows.values()))["bleu_signature"]
  val = ", ".join(f"{k} {v:.3f}" for k, v in sorted(summary["val"].items())
                  if isinstance(v, float) and "/attention/" not in k)
  bleu_by_step = ", ".join(f"{step}: {bleu:.2f}" for step, bleu in summary.get("val_bleu_by_step", []))
  lines += ["", f"sacreBLEU signature: `{sig}`; the published-style score uses `tokenize='none'` against "
            "`test_2016_flickr.lc.norm.tok.de`.", "",
            f"Wall time: **{summary['total_minutes']:.1f} min** in total from the recipe's first start in its "
            f"workdir (data preparation, training at {summary['steps_per_s']:.3f} steps/s with periodic "
            f"validation, {'' if config.ema_decay else 'averaging and '}test decoding; a resumed or "
            "re-scored run counts from the first start).",
            "", f"Validation at the end: {val}", "",
            f"Validation BLEU (greedy, cased sacreBLEU) by step: {bleu_by_step}", "",
            f"![learning curve]({os.path.relpath(curve, os.path.dirname(os.path.abspath(path)))})"]
  return "\n".join(lines)


if __name__ == "__main__":
  launch.run(main)
