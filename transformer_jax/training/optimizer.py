"""The optimizer: Adam as in the paper (section 5.3), AdamW's decoupled weight decay and its mask, and an
exponential moving average of the parameters kept in the optimizer state.

Each is an `optax.GradientTransformation` (or a function of one), named as optax names its own:

* `adam(schedule, ...)`: Adam (Kingma & Ba, 2015) with the paper's β1 0.9, β2 0.98, ε 1e-9 driven by a learning-rate
  schedule of the paper's step (`training/schedule.py`); with `weight_decay` > 0 AdamW (Loshchilov & Hutter,
  2019) on the matrices `weight_decay_mask` selects. `adam_with_schedule` is the paper's optimizer in one call.
* `param_ema(decay)`: the moving average of the weights, chained last; `ParamEmaState` is its state and
  `ema_params(opt_state)` reads the average back (from a live state or a checkpoint's tree, under `EMA_KEY`).

The trainer builds its optimizer from the config with these (`factories.optimizer`); the state they keep lives in
the `TrainState`, so it is sharded, checkpointed and restored with the parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from transformer_jax.training.schedule import rsqrt_schedule


def weight_decay_mask(params: Any) -> Any:
  """A tree of bools like `params`: True for the arrays of rank >= 2 (kernels, embedding tables), False for
  biases and LayerNorm scales (the parameters decoupled weight decay shrinks, as in nanoGPT and big_vision)."""
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def adam(schedule: optax.Schedule, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam driven by `schedule(step)` of the paper's step (counted from 1): update k uses `schedule(k)`.

  `weight_decay` > 0: AdamW (Loshchilov & Hutter, 2019, "Decoupled Weight Decay Regularization"), which the
  paper does not use: every update also subtracts `schedule(k) * weight_decay * p` from each matrix `p`
  (`weight_decay_mask`: kernels and embeddings; not biases or LayerNorm scales), optax's and PyTorch's convention of
  scaling the decay by the rate, so it cools down with it. 0 gives `optax.adam` itself, whose state (and so a
  checkpoint's tree) has no decay entry. Raises ValueError for a negative `weight_decay`.
  """
  if weight_decay < 0:
    raise ValueError(f"weight_decay={weight_decay} must be >= 0")
  learning_rate = lambda count: schedule(count + 1)  # noqa: E731
  if weight_decay == 0:
    return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
  return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask)


EMA_KEY = "params_ema"  # `ParamEmaState`'s field of the average: its name in an optimizer state and a checkpoint


class ParamEmaState(NamedTuple):
  """`param_ema`'s state: `count` (int32 updates seen) and `params_ema`, a tree like the parameters."""
  count: jax.Array
  params_ema: Any


def param_ema(decay: float) -> optax.GradientTransformation:
  """An exponential moving average of the parameters, kept in the optimizer state; the updates pass unchanged.

  Chain it last (`optax.chain(adam(...), param_ema(0.999))`): it sees the final updates and the parameters
  before them, so it averages the parameters `params + updates` each update leaves. Update k (counted from 1)
  does `ema = d_k * ema + (1 - d_k) * params_k` with `d_k = min(decay, (1 + k) / (10 + k))`, which starts the
  average at the initial parameters and lets it forget them fast before the decay takes over (the warm-up of
  TensorFlow's `ExponentialMovingAverage(num_updates=...)`; Polyak & Juditsky, 1992, on averaging iterates).
  The average has the parameters' tree, dtypes and (built from boxed parameters) logical axis names, so it is
  sharded, checkpointed and restored with the rest of the state. The average spans ~1 / (1 - decay) updates
  (1,000 for 0.999) once k > ~9 / (1 - decay); before that, the last ~k / 9 updates.
  Read it back with `ema_params(opt_state)`. Raises ValueError unless 0 < `decay` < 1.
  """
  if not 0.0 < decay < 1.0:
    raise ValueError(f"ema decay={decay} must be in (0, 1)")

  def init(params):
    return ParamEmaState(count=jnp.zeros([], jnp.int32), params_ema=jax.tree_util.tree_map(jnp.array, params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("param_ema needs the parameters: call tx.update(updates, opt_state, params)")
    count = optax.safe_increment(state.count)
    k = count.astype(jnp.float32)
    d = jnp.minimum(decay, (1.0 + k) / (10.0 + k))
    params_ema = jax.tree_util.tree_map(
        lambda e, p, u: (d * e + (1.0 - d) * (p + u)).astype(e.dtype), state.params_ema, params, updates)
    return updates, ParamEmaState(count=count, params_ema=params_ema)

  return optax.GradientTransformation(init, update)


def ema_params(opt_state: Any) -> Any:
  """The parameters' moving average `param_ema` keeps in `opt_state` (a chain's state or a checkpoint's tree).

  Raises ValueError when `opt_state` holds none (the run was trained without `param_ema`)."""
  found = optax.tree_utils.tree_get(opt_state, EMA_KEY)
  if found is None:
    raise ValueError("the optimizer state holds no moving average of the parameters (trained with ema_decay 0)")
  return found


def adam_with_schedule(d_model: int, warmup_steps: int = 4000, scale: float = 1.0, b1: float = 0.9,
                       b2: float = 0.98, eps: float = 1e-9) -> optax.GradientTransformation:
  """Adam(β1 0.9, β2 0.98, ε 1e-9) driven by `rsqrt_schedule` (section 5.3); update k uses step k."""
  return adam(rsqrt_schedule(d_model, warmup_steps, scale), b1=b1, b2=b2, eps=eps)
