"""From an experiment config to the pieces a run trains with: model config, optimizer, train state, compiled
steps, checkpoint manager.

    model_config = factories.model_config_from(config, vocab_size)
    state = factories.create_state(config, model_config, mesh, init_rng, rules)    # born sharded on `mesh`
    train_step = factories.make_train_step(config, model_config, mesh, state, rules)
    eval_step = factories.make_eval_step(config, model_config, mesh, state.params, rules)
    checkpointer = factories.checkpointer(config, workdir.checkpoints)

What the trainer (`transformer_jax.run.trainer`) and the benchmarks (`benchmarks/common.py`) both build,
so the benchmarks time the program `python -m experiments.train` runs (`tests/test_benchmarks.py` compares the
two lowered programs). `config` is the run's typed `experiment_config.ExperimentConfig` (frozen: nothing here
changes it; a program converts its `ConfigDict` once, `ExperimentConfig.from_config_dict`). The pieces are t5x's
`utils.create_train_state` / MaxText's `train_utils.create_training_tools` in this library's terms: the compiled
steps go through the one partitioned jit road (`training.partitioned.jit_train_step`, `jit_eval_step`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import optax

from transformer_jax import accelerators
from transformer_jax import sharding
from transformer_jax.config import ModelConfig
from transformer_jax.evaluation import metrics as metrics_lib
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import optimizer as optimizer_lib
from transformer_jax.training import partitioned
from transformer_jax.training import schedule as schedule_lib
from transformer_jax.training import state as state_lib
from transformer_jax.training import steps


def model_config_from(config: ExperimentConfig, vocab_size: int, platform: str | None = None) -> ModelConfig:
  """`config.model` with the vocabulary size of the run's tokenizer and `model.dtype='auto'` resolved for
  `platform` (default `jax.default_backend()`; `accelerators.resolve_dtype`). ValueError: ModelConfig's range
  errors."""
  dtype = accelerators.resolve_dtype(config.model.dtype, platform or jax.default_backend())
  return config.model.replace(vocab_size=vocab_size, dtype=dtype)


def optimizer(config: ExperimentConfig, d_model: int) -> tuple[optax.GradientTransformation, Any]:
  """Adam with the paper's schedule (section 5.3), cooled down over the last `config.cooldown_steps` (0 = the
  paper's schedule as is), decoupled weight decay `config.weight_decay` (0 = the paper's Adam), a moving
  average of the parameters when `config.ema_decay` > 0 (`optimizer.param_ema`), and the schedule itself
  (`step -> learning rate`, float32)."""
  learning_rate_fn = schedule_lib.cooldown(
      schedule_lib.rsqrt_schedule(d_model, config.warmup_steps, config.learning_rate),
      config.num_train_steps, config.cooldown_steps, config.cooldown_shape, config.cooldown_knots)
  tx = optimizer_lib.adam(learning_rate_fn, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                        weight_decay=config.weight_decay)
  if config.ema_decay:
    tx = optax.chain(tx, optimizer_lib.param_ema(config.ema_decay))
  return tx, learning_rate_fn


def create_state(config: ExperimentConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh, rng: jax.Array,
                 rules=sharding.LOGICAL_AXIS_RULES) -> steps.TrainState:
  """A fresh train state of the run, born sharded on `mesh` with the config's optimizer (`rng`: a typed key,
  `jax.random.key`, for the parameters' initialisation)."""
  tx, _ = optimizer(config, model_config.d_model)
  return state_lib.create_train_state(model_config, tx, rng, mesh, rules)


def abstract_state(config: ExperimentConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh, rng: jax.Array,
                   rules=sharding.LOGICAL_AXIS_RULES) -> steps.TrainState:
  """`create_state`'s train state as sharded `jax.ShapeDtypeStruct`s: nothing initialised, so `mesh` may hold
  compile-only devices (`transformer_jax.run.plan` compiles the run's steps on it for a TPU topology)."""
  tx, _ = optimizer(config, model_config.d_model)
  return state_lib.abstract_train_state(model_config, tx, rng, mesh, rules)


def train_model_config(config: ExperimentConfig, model_config: ModelConfig, step: int) -> ModelConfig:
  """The model config update `step` (counted from 1) trains with: `model_config` with the residual dropout rate
  `config.dropout_schedule` sets for that step (`schedule.dropout_rate`)."""
  rate = schedule_lib.dropout_rate(config.dropout_schedule, model_config.dropout_rate, step)
  return model_config if rate == model_config.dropout_rate else model_config.replace(dropout_rate=rate)


def make_train_step(config: ExperimentConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh,
                    state: steps.TrainState, rules=sharding.LOGICAL_AXIS_RULES) -> sharding.PartitionedFunction:
  """The compiled train step of a run: `(state, batch, rng) -> (state, metrics)`, the state donated.

  The trainer runs exactly this (with `train_model_config`'s dropout rate); `benchmarks` time it.
  """
  _, learning_rate_fn = optimizer(config, model_config.d_model)
  return partitioned.jit_train_step(model_config, mesh, sharding.shardings_of(state), rules,
                                 label_smoothing=config.label_smoothing,
                                 grad_accum_steps=config.grad_accum_steps, learning_rate_fn=learning_rate_fn)


def make_eval_step(config: ExperimentConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh, params: Any,
                   rules=sharding.LOGICAL_AXIS_RULES) -> sharding.PartitionedFunction:
  """The compiled eval step of a run: `(params, batch) -> sums`, replicated float32 scalars `loss_sum`,
  `nll_sum`, `correct_sum`, `token_count` (`steps.metrics_from_sums` turns them into per-token means); `params`
  keep their shardings."""
  return partitioned.jit_eval_step(model_config, mesh, sharding.shardings_of(params), rules,
                                label_smoothing=config.label_smoothing)


def inference_params(config: ExperimentConfig, state: steps.TrainState) -> Any:
  """The parameters a finished run is evaluated and translated with: the moving average when
  `config.ema_decay` > 0 (`optimizer.ema_params`), else `state.params`. Periodic validation during training
  evaluates `state.params`, the iterate being trained, so learning curves compare across runs with and
  without the average."""
  return optimizer_lib.ema_params(state.opt_state) if config.ema_decay else state.params


def checkpointer(config: ExperimentConfig, directory: str | os.PathLike) -> checkpoint_lib.Checkpointer:
  """The run's checkpoint manager over `directory` (a workdir's `checkpoints/`): the `checkpoint_keep` newest
  steps and the best by `checkpoint_best_metric` in the metric's own direction (`metrics.METRICS`),
  asynchronous writes with `async_checkpointing`. Close it (or use `with`) when done."""
  best_metric = config.checkpoint_best_metric or None
  higher = best_metric is not None and metrics_lib.higher_is_better(best_metric)
  return checkpoint_lib.Checkpointer(directory, max_to_keep=config.checkpoint_keep,
                                     best_metric=best_metric, best_mode="max" if higher else "min",
                                     enable_async_checkpointing=config.async_checkpointing)
