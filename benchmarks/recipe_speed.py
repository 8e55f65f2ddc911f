r"""Side by side: the training step of a recipe's variants on that recipe's own data, in one process.

    python -m benchmarks.recipe_speed --workdir=runs/multi30k \
        --variant='rows 128:data.max_len=128,data.tokens_per_batch=4096' \
        --variant='rows 64, 2048 tokens:data.max_len=64,data.tokens_per_batch=2048' \
        --variant='4+4 x d128:model.d_model=128,model.num_encoder_layers=4,model.num_decoder_layers=4'

What it answers: which sizes give the most real target tokens per second on this machine, before an hour is
spent on a run (the run log, docs/multi30k_runs.md, quotes it). Each `--variant` is `NAME:KEY=VALUE,...` of overrides
to `--config` (a config file, as `experiments.train` takes it; the Multi30k recipe's by default), the first is
the reference. Every variant packs the workdir's training ids (the id shards in `data/train.ids/`, written by any
`experiments.train`/`experiments.multi30k` run) into its own batches (`pipeline.TrainStream`, its `data.max_len` row
length and `data.tokens_per_batch`), builds the trainer's own state and compiled step
(`benchmarks.common.build_train_step`) on its own mesh over the first `num_cpu_devices` host devices (1 for
0: `--variant='one device:num_cpu_devices=0'` against a recipe that uses 2), and is timed in rounds that
interleave the variants (this machine is shared: read the ratios). Run as a program, the process makes as many
host CPU devices as the machine has cores (`launch.set_cpu_devices`). Prints per variant: parameters, devices,
median step seconds, real (non-pad) target tokens per batch, real target tokens/s and its ratio to the first
variant, steps/s.

Timings only: nothing is trained to convergence and nothing in the workdir is written.
"""

from __future__ import annotations

import ast
import copy
import os
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import flags
import launch
from benchmarks import common
from transformer_jax import sharding
from transformer_jax.data import id_shards, pipeline
from transformer_jax.run import run_checks
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import Workdir


def parse_variant(text: str) -> tuple[str, dict]:
  """`NAME:KEY=VALUE,...` -> (NAME, {KEY: value}); values are Python literals or else strings.

  Raises ValueError naming the variant on a missing name or a term without `=`."""
  name, sep, body = text.partition(":")
  if not sep or not name.strip():
    raise ValueError(f"--variant={text!r}: expected NAME:KEY=VALUE,... (e.g. 'rows 64:data.max_len=64')")
  overrides = {}
  for term in filter(None, (t.strip() for t in body.split(","))):
    key, eq, value = term.partition("=")
    if not eq:
      raise ValueError(f"--variant={text!r}: {term!r} is not KEY=VALUE")
    try:
      overrides[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      overrides[key.strip()] = value.strip()
  return name.strip(), overrides


def variant_config(base: ml_collections.ConfigDict, config_file: str, vocab_size: int,
                   overrides: dict) -> ExperimentConfig:
  """A copy of the recipe's config `base` (read from `config_file`) with `overrides` applied, typed
  (`ExperimentConfig.from_config_dict`). Raises ValueError naming a key the config does not have or a value of
  another type than the key's, ConfigError (a ValueError) for a value its rule refuses."""
  config = copy.deepcopy(base)
  config.model.vocab_size = vocab_size
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise ValueError(f"--variant key {key!r} is not in {config_file}")
    try:
      node[leaf] = value
    except TypeError as error:
      raise ValueError(f"--variant key {key!r}: {error}") from None
  return ExperimentConfig.from_config_dict(config)


def train_ids(workdir: str) -> tuple[id_shards.IdShards, int]:
  """The workdir's training id shards and its vocabulary size; FileNotFoundError names what is missing."""
  run_dir = Workdir(workdir)
  ids_path, config_json = os.fspath(run_dir.token_ids("train")), os.fspath(run_dir.config_json)
  shards = id_shards.IdShards.newest(ids_path)
  for path, present in ((ids_path, shards is not None), (config_json, os.path.exists(config_json))):
    if not present:
      raise FileNotFoundError(f"{path} does not exist or is incomplete (run experiments.train or "
                              "experiments.multi30k there first)")
  return shards, int(run_dir.require_config()["model"]["vocab_size"])


def build_variant(name: str, config: ExperimentConfig, shards: id_shards.IdShards, batches: int) -> dict:
  """Variant `name`'s compiled step on its own mesh and `batches` of its own packed batches, after one step (which
  compiles). ValueError when its devices or rows do not fit this process."""
  devices = max(config.num_cpu_devices, 1)
  if devices > jax.device_count():
    raise ValueError(f"variant {name!r} wants {devices} devices (num_cpu_devices); this process has "
                     f"{jax.device_count()}")
  mesh = sharding.mesh_from_config(config.mesh, devices=jax.devices()[:devices])
  try:
    run_checks.check_batch_rows(config.data, mesh)
  except ValueError as e:
    raise ValueError(f"variant {name!r}: {e}") from None
  built = common.build_train_step(config, mesh)
  stream = pipeline.TrainStream(shards, tokens_per_batch=config.data.tokens_per_batch,
                                row_length=config.data.max_len, seed=config.seed, pad_id=built.model_config.pad_id)
  host = [next(stream) for _ in range(batches)]
  real = float(np.mean([(b["targets"] != built.model_config.pad_id).sum() for b in host]))
  sharded = [sharding.shard_batch(b, built.mesh, built.rules) for b in host]
  start = time.perf_counter()
  state, metrics = built.step(built.state, sharded[0], built.rng)
  jax.block_until_ready(metrics)
  params = sum(x.size for x in jax.tree.leaves(state.params))
  print(f"[recipe_speed] {name}: {params / 1e6:.2f}M parameters, first step (compiles) "
        f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
  return dict(built=built, state=state, batches=sharded, real=real, params=params, devices=devices, times=[])


def compare(workdir: str, base: ml_collections.ConfigDict, config_file: str, variants: list[str], rounds: int,
            steps_per_round: int, batches: int) -> None:
  """Times `variants` (`NAME:KEY=VALUE,...` texts; none: the recipe as is) of `base` side by side in `rounds`
  interleaved rounds of `steps_per_round` steps each and prints one row per variant (the first is the
  reference). Raises ValueError or FileNotFoundError (one line) on a bad variant or workdir, before timing."""
  shards, vocab_size = train_ids(workdir)
  parsed = [parse_variant(v) for v in (variants or ["recipe:"])]
  configs = {name: variant_config(base, config_file, vocab_size, overrides) for name, overrides in parsed}
  runs = {name: build_variant(name, config, shards, batches) for name, config in configs.items()}
  for _ in range(rounds):
    for run in runs.values():
      for i in range(steps_per_round):
        start = time.perf_counter()
        run["state"], metrics = run["built"].step(run["state"], run["batches"][i % len(run["batches"])],
                                                  run["built"].rng)
        jax.block_until_ready(metrics)
        run["times"].append(time.perf_counter() - start)

  print(f"{'variant':36s} {'params':>7s} {'devices':>7s} {'step (median)':>14s} {'real tgt tok/batch':>19s} "
        f"{'real tgt tok/s':>15s} {'ratio':>6s} {'steps/s':>8s}")
  reference = None
  for name, run in runs.items():
    step_s = float(np.median(run["times"]))
    tokens_per_s = run["real"] / step_s
    reference = reference or tokens_per_s
    print(f"{name:36s} {run['params'] / 1e6:6.2f}M {run['devices']:7d} {step_s:13.3f}s {run['real']:19.0f} "
          f"{tokens_per_s:15.0f} {tokens_per_s / reference:5.2f}x {1 / step_s:8.2f}")


FLAGS = flags.FLAGS
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "configs",
                              "multi30k.py")


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module)."""
  flags.DEFINE_string("workdir", None, "a run whose data/train.ids/ and config.json to use")
  launch.define_config_flag(DEFAULT_CONFIG, "the recipe's config file the variants override (default: Multi30k)")
  flags.declare_key_flag("config")  # defined by launch: listed by this program's --help
  flags.DEFINE_multi_string("variant", [], "NAME:KEY=VALUE,... (repeatable; the first is the reference)")
  flags.DEFINE_integer("rounds", 3, "interleaved rounds", lower_bound=1)
  flags.DEFINE_integer("steps_per_round", 4, "timed steps per variant and round", lower_bound=1)
  flags.DEFINE_integer("batches", 6, "distinct batches cycled per variant", lower_bound=1)
  flags.mark_flags_as_required(["workdir"])
  common.check_flag("variant", lambda texts: [parse_variant(text) for text in texts])


def _config_file() -> str:
  path = os.path.abspath(FLAGS["config"].config_filename)
  return os.path.relpath(path, common.REPO) if path.startswith(str(common.REPO) + os.sep) else path


@launch.program
def main() -> None:
  launch.set_cpu_devices(os.cpu_count() or 1)  # each variant takes the first num_cpu_devices of them
  compare(FLAGS.workdir, FLAGS.config, _config_file(), FLAGS.variant, FLAGS.rounds, FLAGS.steps_per_round,
          FLAGS.batches)


if __name__ == "__main__":
  define_flags()
  launch.run(main)
