r"""The time cost of `config.profile_steps` stays inside its window: step times before, during and after it.

    python -m benchmarks.profile_window                 # tiny number-words runs, ~1-2 min on 2 cores
    python -m benchmarks.profile_window --steps=80 --window=30,33

Trains the same tiny number-words config in this process, in temporary workdirs, with `log_every_steps=1`,
`--rounds` times each way in turns: without `profile_steps` and with it = the window. From each run's
`metrics.jsonl` (`train/steps_per_s` of every step) it takes the median step time before the window (after
the first 5 steps, which compile), inside it and after it (from the second step after it: the first waits for
the trace to be written), and prints per round and the median over rounds of profiled / plain for each part:
before and after should read ~1.00 (within the noise of a shared machine), inside it the profiler's own cost.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
from absl import flags

import launch
from benchmarks import common
from experiments.configs import number_words
from transformer_jax.run import trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import Workdir


def tiny_config(steps: int, window: tuple[int, int] | tuple[()], tfds_dir: str) -> ExperimentConfig:
  config = number_words.get_config()
  config.data.builder_config, config.data.vocab_size, config.data.tfds_data_dir = "tiny", 128, tfds_dir
  config.data.tokens_per_batch = 512
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=64, d_ff=256, num_heads=2)
  config.num_train_steps, config.warmup_steps, config.log_every_steps = steps, 10, 1
  config.evals.loss.every_steps = config.evals.attention.every_steps = 0
  config.checkpoint_every_steps, config.final_eval.split, config.async_checkpointing = 0, "", False
  config.profile_steps = window
  return ExperimentConfig.from_config_dict(config)


def step_seconds(workdir: str) -> dict[int, float]:
  """step -> seconds of that step (1 / train/steps_per_s, logged every step)."""
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  return {r["step"]: 1.0 / r["train/steps_per_s"] for r in rows if "train/steps_per_s" in r}


def parts(seconds: dict[int, float], window: tuple[int, int]) -> dict[str, float]:
  start, stop = window
  pick = lambda keep: float(np.median([s for step, s in seconds.items() if keep(step)]))  # noqa: E731
  return {"before": pick(lambda k: 5 < k < start), "inside": pick(lambda k: start <= k <= stop),
          "after": pick(lambda k: k > stop + 1)}  # the step after the window waits for the trace to be written


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program)."""
  flags.DEFINE_integer("steps", 60, "training steps of each run")
  common.define_int_list("window", [25, 28], "the profiled steps: FIRST,LAST (config.profile_steps)")
  flags.DEFINE_integer("rounds", 3, "runs each way, in turns")
  flags.register_multi_flags_validator(
      ["window", "steps"], lambda v: len(v["window"]) == 2 and 6 < v["window"][0] <= v["window"][1] < v["steps"] - 1,
      message="--window must be FIRST,LAST with 6 < FIRST <= LAST < --steps - 1 (steps before, inside and after it)")


@launch.program
def main() -> None:
  window = tuple(FLAGS.window)
  rows = []
  with tempfile.TemporaryDirectory(prefix="profile_window_") as tmp:
    for r in range(FLAGS.rounds):
      for name, profile in (("plain", ()), ("profiled", window)):
        workdir = f"{tmp}/{name}_{r}"
        trainer.train_and_evaluate(tiny_config(FLAGS.steps, profile, f"{tmp}/tfds"), workdir)
        rows.append((r, name, parts(step_seconds(workdir), window)))
  print(f"median step time (ms) of {FLAGS.steps}-step tiny runs, profile_steps={window}:")
  print(f"{'round':5s} {'run':10s} {'before':>8s} {'inside':>8s} {'after':>8s}")
  for r, name, part in rows:
    print(f"{r:<5d} {name:10s} " + " ".join(f"{1e3 * part[k]:8.2f}" for k in ("before", "inside", "after")))
  ratios = {k: [p[k] / q[k] for (_, _, q), (_, _, p) in zip(rows[0::2], rows[1::2])]
            for k in ("before", "inside", "after")}
  print("profiled / plain, median of the rounds (each round's runs back to back): " + ", ".join(
      f"{k} {np.median(v):.2f}x ({', '.join(f'{x:.2f}' for x in v)})" for k, v in ratios.items()))


if __name__ == "__main__":
  define_flags()
  launch.run(main)
