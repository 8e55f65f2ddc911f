"""The train and eval steps partitioned for a device mesh: the compiled programs the trainer runs, evaluation
uses and the benchmarks time.

`steps.train_step` / `steps.eval_step` (pure functions) through `sharding.partition`, the one jit wrapper (t5x's
partitioned callable): the state keeps its shardings, batches are split along their rows over the batch mesh
axes, rng and metrics are replicated. `.lower(...)` of the result is exactly the program a call runs.
"""

from __future__ import annotations

import functools
from typing import Any

from jax.sharding import Mesh

from transformer_jax import sharding
from transformer_jax.config import ModelConfig
from transformer_jax.training import steps


def jit_train_step(model_config: ModelConfig, mesh: Mesh, state_shardings: Any,
                   rules: sharding.LogicalRules = sharding.LOGICAL_AXIS_RULES, *, label_smoothing: float = 0.1,
                   grad_accum_steps: int = 1, learning_rate_fn=None) -> sharding.PartitionedFunction:
  """`steps.train_step` partitioned for `mesh`: `(state, batch, rng) -> (state, metrics)`, the state donated.

  The state keeps `state_shardings` (`sharding.shardings_of(state.create_train_state(...))`); the batch (from
  `sharding.shard_batch`, int32 `[rows, length]`, or `[grad_accum_steps, rows, length]`) is split along its
  rows; the rng and the metrics (float32 scalars) are replicated. This is the step the trainer runs and the
  benchmarks time (`benchmarks`). Raises ValueError when the model does not divide over the mesh.
  """
  rules = sharding.validate_model_for_mesh(model_config, mesh, rules)
  fn = functools.partial(steps.train_step, config=model_config, label_smoothing=label_smoothing,
                         grad_accum_steps=grad_accum_steps, learning_rate_fn=learning_rate_fn)
  return sharding.partition(
      fn, mesh, rules, donate_argnums=(0,),
      in_shardings=(state_shardings, sharding.batch_sharding(mesh, rules, accum=grad_accum_steps > 1),
                    sharding.replicated(mesh)),
      out_shardings=(state_shardings, sharding.replicated(mesh)))


def jit_eval_step(model_config: ModelConfig, mesh: Mesh, params_shardings: Any,
                  rules: sharding.LogicalRules = sharding.LOGICAL_AXIS_RULES, *, label_smoothing: float = 0.1
                  ) -> sharding.PartitionedFunction:
  """`steps.eval_step` partitioned for `mesh`: `(params, batch) -> sums` (replicated float32 scalars).

  Batches come from `sharding.shard_batch(batch, mesh, process_local=False, pad_rows=True)`.
  Raises ValueError when the model does not divide over the mesh.
  """
  rules = sharding.validate_model_for_mesh(model_config, mesh, rules)
  fn = functools.partial(steps.eval_step, config=model_config, label_smoothing=label_smoothing)
  return sharding.partition(fn, mesh, rules, in_shardings=(params_shardings, sharding.batch_sharding(mesh, rules)),
                            out_shardings=sharding.replicated(mesh))
