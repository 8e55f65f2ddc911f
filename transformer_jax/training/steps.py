"""Train state and the pure train/eval steps.

A batch is a dict of int32 arrays `[batch, length]`: `inputs`, `targets` and, for packed rows,
`inputs_position`, `targets_position`, `inputs_segmentation`, `targets_segmentation`. With gradient
accumulation every array has a leading micro-batch axis: `[accum_steps, batch, length]`.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from transformer_jax.config import ModelConfig
from transformer_jax.model import Transformer
from transformer_jax.training.loss import (smoothed_cross_entropy_and_correct,
                                           token_weights)

Batch = Mapping[str, jax.Array]
PACKING_KEYS = ("inputs_position", "targets_position", "inputs_segmentation", "targets_segmentation")


class TrainState(train_state.TrainState):
  """`step`, `params`, `opt_state` (+ the static `apply_fn` and `tx`) of one training run."""


def init_params(config: ModelConfig, rng: jax.Array, length: int = 8) -> Any:
  """Parameters of `Transformer(config)` (boxed with their logical axis names, see `flax.linen.spmd`)."""
  ids = jnp.ones((1, length), jnp.int32)
  return Transformer(config).init(rng, ids, ids)["params"]


def _model_kwargs(batch: Batch) -> dict:
  return {key: batch[key] for key in PACKING_KEYS if key in batch}


def _forward_sums(params, batch: Batch, *, config: ModelConfig, label_smoothing: float,
                  dropout_rng: jax.Array | None):
  """Sums over real target tokens of the smoothed loss, the NLL, correct predictions, and their count."""
  deterministic = dropout_rng is None
  rngs = None if deterministic else {"dropout": dropout_rng}
  logits = Transformer(config).apply({"params": params}, batch["inputs"], batch["targets"],
                                     **_model_kwargs(batch), deterministic=deterministic, rngs=rngs)
  targets = batch["targets"]
  weights = token_weights(targets, config.pad_id)
  loss, nll, correct = smoothed_cross_entropy_and_correct(logits, targets, float(label_smoothing))
  return {"loss_sum": jnp.sum(loss * weights), "nll_sum": jnp.sum(nll * weights),
          "correct_sum": jnp.sum(correct * weights), "token_count": jnp.sum(weights)}


def metrics_from_sums(sums: Mapping[str, jax.Array]) -> dict:
  """Per-token `loss`, `nll`, `accuracy` (and `token_count`) from summed `eval_step`/`train_step` sums."""
  count = jnp.maximum(sums["token_count"], 1.0)
  return {"loss": sums["loss_sum"] / count, "nll": sums["nll_sum"] / count,
          "accuracy": sums["correct_sum"] / count, "token_count": sums["token_count"]}


def train_step(state: TrainState, batch: Batch, rng: jax.Array, *, config: ModelConfig,
               label_smoothing: float = 0.1, grad_accum_steps: int = 1,
               learning_rate_fn=None) -> tuple[TrainState, dict]:
  """One optimizer update on `batch`; the loss is normalised by the number of real target tokens.

  With `grad_accum_steps > 1` the batch carries a leading micro-batch axis; gradients of the summed loss
  are accumulated over the micro-batches with `lax.scan` and divided by the total token count once, so k
  micro-batches of B rows give the same update as one batch of k·B rows.
  Dropout keys are `fold_in(rng, step)` (and the micro-batch index), so a resumed run draws the same masks.
  """
  step_rng = jax.random.fold_in(rng, state.step)

  def sums_and_grads(params, micro_batch, micro_rng):
    def loss_sum(p):
      sums = _forward_sums(p, micro_batch, config=config, label_smoothing=label_smoothing,
                           dropout_rng=micro_rng)
      return sums["loss_sum"], sums
    (_, sums), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
    return sums, grads

  if grad_accum_steps == 1:
    sums, grads = sums_and_grads(state.params, batch, step_rng)
  else:
    def accumulate(carry, xs):
      index, micro_batch = xs
      sums, grads = sums_and_grads(state.params, micro_batch, jax.random.fold_in(step_rng, index))
      return jax.tree_util.tree_map(jnp.add, carry, (sums, grads)), None

    zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "nll_sum", "correct_sum", "token_count")}
    zero_grads = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    (sums, grads), _ = jax.lax.scan(accumulate, (zero_sums, zero_grads),
                                    (jnp.arange(grad_accum_steps), batch))

  grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(sums["token_count"], 1.0), grads)
  new_state = state.apply_gradients(grads=grads)
  metrics = metrics_from_sums(sums)
  metrics["grad_norm"] = optax.tree.norm(grads)
  if learning_rate_fn is not None:
    metrics["learning_rate"] = learning_rate_fn(state.step + 1)
  return new_state, metrics


def eval_step(params, batch: Batch, *, config: ModelConfig, label_smoothing: float = 0.1) -> dict:
  """Summed loss/NLL/correct/token_count over a batch (sum across batches, then `metrics_from_sums`).

  Jit it through `partitioned.jit_eval_step` (the one jit road).
  """
  return _forward_sums(params, batch, config=config, label_smoothing=label_smoothing, dropout_rng=None)
