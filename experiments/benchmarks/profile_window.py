r"""The time cost of `config.profile_steps` stays inside its window: step times before, during and after it.

    python -m experiments.benchmarks.profile_window                 # tiny number-words runs, ~1-2 min on 2 cores
    python -m experiments.benchmarks.profile_window --steps=80 --window=30,33

Trains the same tiny number-words config twice in this process, in temporary workdirs, with `log_every_steps=1`:
once with `profile_steps` = the window, once without. From each run's `metrics.jsonl` (`train/steps_per_s` of
every step) it prints the median step time before the window (after the first 5 steps, which compile), inside
it and after it, and the ratio profiled / plain for each part: before and after should read ~1.00 (within the
noise of a shared machine), inside it the profiler's own cost.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from experiments.configs import number_words
from transformer_jax import trainer
from transformer_jax.workdir import Workdir


def tiny_config(steps: int, window: tuple[int, int] | tuple[()], tfds_dir: str):
  config = number_words.get_config()
  config.data.builder_config, config.data.vocab_size, config.data.tfds_data_dir = "tiny", 128, tfds_dir
  config.data.tokens_per_batch = 512
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=64, d_ff=256, num_heads=2)
  config.num_train_steps, config.warmup_steps, config.log_every_steps = steps, 10, 1
  config.evals.loss.every_steps = config.evals.attention.every_steps = 0
  config.checkpoint_every_steps, config.final_eval.split, config.async_checkpointing = 0, "", False
  config.profile_steps = window
  return config


def step_seconds(workdir: str) -> dict[int, float]:
  """step -> seconds of that step (1 / train/steps_per_s, logged every step)."""
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  return {r["step"]: 1.0 / r["train/steps_per_s"] for r in rows if "train/steps_per_s" in r}


def parts(seconds: dict[int, float], window: tuple[int, int]) -> dict[str, float]:
  start, stop = window
  pick = lambda keep: float(np.median([s for step, s in seconds.items() if keep(step)]))  # noqa: E731
  return {"before": pick(lambda k: 5 < k < start), "inside": pick(lambda k: start <= k <= stop),
          "after": pick(lambda k: k > stop + 1)}  # the step after the window waits for the trace to be written


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--window", default="25,28")
  args = parser.parse_args(argv)
  window = tuple(int(x) for x in args.window.split(","))
  results = {}
  with tempfile.TemporaryDirectory(prefix="profile_window_") as tmp:
    for name, profile in (("plain", ()), ("profiled", window), ("plain again", ())):
      workdir = f"{tmp}/{name.replace(' ', '_')}"
      trainer.train_and_evaluate(tiny_config(args.steps, profile, f"{tmp}/tfds"), workdir)
      results[name] = parts(step_seconds(workdir), window)
  print(f"median step time (ms) of {args.steps}-step tiny runs, profile_steps={window}:")
  print(f"{'run':12s} {'before':>8s} {'inside':>8s} {'after':>8s}")
  for name, r in results.items():
    print(f"{name:12s} " + " ".join(f"{1e3 * r[k]:8.2f}" for k in ("before", "inside", "after")))
  plain = {k: float(np.mean([results['plain'][k], results['plain again'][k]])) for k in ("before", "inside", "after")}
  print("profiled / plain (mean of the two plain runs): " + ", ".join(
      f"{k} {results['profiled'][k] / plain[k]:.2f}x" for k in ("before", "inside", "after")))


if __name__ == "__main__":
  main()
