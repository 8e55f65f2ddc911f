r"""Side by side: the training step of a recipe's variants on that recipe's own data, in one process.

    python -m benchmarks.recipe_speed --workdir=runs/multi30k \
        --variant='rows 128:data.max_len=128,data.tokens_per_batch=4096' \
        --variant='rows 64, 2048 tokens:data.max_len=64,data.tokens_per_batch=2048' \
        --variant='4+4 x d128:model.d_model=128,model.num_encoder_layers=4,model.num_decoder_layers=4'

What it answers: which sizes give the most real target tokens per second on this machine, before an hour is
spent on a run (the run log, docs/multi30k_runs.md, quotes it). Each `--variant` is `NAME:KEY=VALUE,...` of overrides
to `--config` (a module in `experiments/configs`, the one the workdir was trained with by default), the first is
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

import argparse
import ast
import importlib
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from experiments import launch
from benchmarks import common
from transformer_jax import run_checks, sharding
from transformer_jax.data import pipeline
from transformer_jax.experiment_config import ConfigError, ExperimentConfig
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


def variant_config(config_module: str, vocab_size: int, overrides: dict) -> ExperimentConfig:
  """The recipe's config with `overrides` applied, typed (`ExperimentConfig.from_config_dict`). Raises KeyError
  naming a key the config does not have, TypeError for a value of another type than the key's, ConfigError for
  a value its rule refuses."""
  config = importlib.import_module(f"experiments.configs.{config_module}").get_config()
  config.model.vocab_size = vocab_size
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise KeyError(f"--variant key {key!r} is not in experiments/configs/{config_module}.py")
    node[leaf] = value
  return ExperimentConfig.from_config_dict(config)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a run whose data/train.ids/ and config.json to use")
  parser.add_argument("--config", default="multi30k", help="module in experiments/configs")
  parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps_per_round", type=int, default=4)
  parser.add_argument("--batches", type=int, default=6, help="distinct batches cycled per variant")
  args = parser.parse_args(argv)

  run_dir = Workdir(args.workdir)
  ids_path, config_json = os.fspath(run_dir.token_ids("train")), os.fspath(run_dir.config_json)
  shards = pipeline.IdShards.newest(ids_path)
  for path, present in ((ids_path, shards is not None), (config_json, os.path.exists(config_json))):
    if not present:
      print(f"error: {path} does not exist or is incomplete (run experiments.train or experiments.multi30k there "
            "first)",
            file=sys.stderr)
      return 1
  try:
    variants = [parse_variant(v) for v in (args.variant or ["recipe:"])]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  vocab_size = int(run_dir.require_config()["model"]["vocab_size"])

  runs = {}
  for name, overrides in variants:
    try:
      config = variant_config(args.config, vocab_size, overrides)
    except (KeyError, TypeError, ConfigError) as e:
      print(f"error: {e.args[0]}", file=sys.stderr)
      return 1
    devices = max(config.num_cpu_devices, 1)
    if devices > jax.device_count():
      print(f"error: variant {name!r} wants {devices} devices (num_cpu_devices); this process has "
            f"{jax.device_count()}", file=sys.stderr)
      return 1
    mesh = sharding.mesh_from_config(config.mesh, devices=jax.devices()[:devices])
    try:
      run_checks.check_batch_rows(config.data, mesh)
    except ValueError as e:
      print(f"error: variant {name!r}: {e}", file=sys.stderr)
      return 1
    built = common.build_train_step(config, mesh)
    batches = pipeline.TrainStream(shards, tokens_per_batch=config.data.tokens_per_batch,
                                   row_length=config.data.max_len, seed=config.seed,
                                   pad_id=built.model_config.pad_id)
    batches = [next(batches) for _ in range(args.batches)]
    real = float(np.mean([(b["targets"] != built.model_config.pad_id).sum() for b in batches]))
    batches = [sharding.shard_batch(b, built.mesh, built.rules) for b in batches]
    start = time.perf_counter()
    state, metrics = built.step(built.state, batches[0], built.rng)
    jax.block_until_ready(metrics)
    params = sum(x.size for x in jax.tree.leaves(state.params))
    print(f"[recipe_speed] {name}: {params / 1e6:.2f}M parameters, first step (compiles) "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    runs[name] = dict(built=built, state=state, batches=batches, real=real, params=params, devices=devices,
                      times=[])

  for _ in range(args.rounds):
    for run in runs.values():
      for i in range(args.steps_per_round):
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
  return 0


if __name__ == "__main__":
  launch.set_cpu_devices(os.cpu_count() or 1)  # each variant takes the first num_cpu_devices of them
  sys.exit(main())
