"""The paper's learning-rate schedule (Vaswani et al., 2017, section 5.3, equation 3), and a cool-down.

The cool-down (`cooldown`) is not in the paper: it multiplies any schedule by a factor that falls to 0
(linearly, or as 1 - sqrt) over the last steps of a run whose length is known in advance ("warmup-stable-decay",
Hägele et al., 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"; t5x's
rsqrt-then-linear-decay).
A compute-limited run ends at a lower loss with it than at the rsqrt schedule's still-high final rate.

`adam` is the optimizer of the paper (and, with `weight_decay`, AdamW) driven by such a schedule;
`param_ema`, chained after it, keeps an exponential moving average of the parameters in the optimizer state.
`dropout_rate` is the other schedule a run follows: the residual dropout rate by stages of absolute steps (the
trainer recompiles its step at each stage, as a dropout rate is a static field of the model's config).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


def rsqrt_schedule(d_model: int, warmup_steps: int = 4000, scale: float = 1.0) -> optax.Schedule:
  """lrate(step) = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), `step` counted from 1.

  Linear warm-up for `warmup_steps`, then decay with the inverse square root of the step; the peak is at
  `step == warmup_steps` (7.0e-4 for d_model 512, warmup 4000). Step 0 gives 0 (never inf or NaN).

  The returned function takes the paper's step. Optax calls a schedule with the number of updates already
  applied (0 for the first update); `adam_with_schedule` shifts it by one so that update k uses step k.
  """
  if warmup_steps <= 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be positive")

  def schedule(step):
    step = jnp.asarray(step, dtype=jnp.float32)
    safe = jnp.maximum(step, 1.0)
    return scale * d_model ** -0.5 * jnp.minimum(safe ** -0.5, step * warmup_steps ** -1.5)

  return schedule


COOLDOWN_SHAPES = ("linear", "1-sqrt")


def check_cooldown(total_steps: int, cooldown_steps: int, shape: str = "linear", knots=()) -> None:
  """Raises ValueError (naming the argument) unless `cooldown` can build this cool-down: `0 <= cooldown_steps <=
  total_steps`, `shape` one of `COOLDOWN_SHAPES`, and `knots` pairs `(step, progress)` with steps increasing
  inside the cool-down (`total_steps - cooldown_steps < step <= total_steps`) and progress increasing in (0, 1)."""
  if not 0 <= cooldown_steps <= total_steps:
    raise ValueError(f"cooldown_steps={cooldown_steps} must be in [0, total_steps={total_steps}]")
  if shape not in COOLDOWN_SHAPES:
    raise ValueError(f"cooldown shape {shape!r} must be one of {', '.join(map(repr, COOLDOWN_SHAPES))}")
  if knots and not cooldown_steps:
    raise ValueError(f"cooldown knots {tuple(map(tuple, knots))} need a cool-down (cooldown_steps > 0)")
  previous_step, previous_progress = total_steps - cooldown_steps, 0.0
  for knot in knots:
    if len(knot) != 2 or not (previous_step < knot[0] <= total_steps and previous_progress < knot[1] < 1):
      raise ValueError(f"cooldown knot {tuple(knot)} must be (step, progress) with steps increasing in "
                       f"({total_steps - cooldown_steps}, {total_steps}] and progress increasing in (0, 1)")
    previous_step, previous_progress = knot


def _progress_points(total_steps: int, cooldown_steps: int, knots) -> tuple[list[float], list[float]]:
  """The cool-down's progress as a piecewise-linear function of the step: through (start, 0), the knots and
  (total_steps + 1, 1)."""
  start = total_steps - cooldown_steps
  return ([start, *(float(k[0]) for k in knots), total_steps + 1.0],
          [0.0, *(float(k[1]) for k in knots), 1.0])


def cooldown_progress(step: int, total_steps: int, cooldown_steps: int, knots=()) -> float:
  """How far (0..1) step `step` is through the cool-down `cooldown(..., total_steps, cooldown_steps, knots=knots)`
  follows: 0 up to its start, 1 after `total_steps`. The budget's revisions keep it continuous (`knots`)."""
  xs, ys = _progress_points(total_steps, cooldown_steps, knots)
  return float(np.interp(step, xs, ys))


def cooldown(schedule: optax.Schedule, total_steps: int, cooldown_steps: int, shape: str = "linear",
             knots=()) -> optax.Schedule:
  """`schedule(step)` times a factor that is 1 up to `total_steps - cooldown_steps`, then falls to 0.

  With `cooldown_steps = c` and `total_steps = T`, step `T - c + k` (k = 1..c) is scaled by `1 - p` for
  `shape='linear'`, or by `1 - sqrt(p)` for `shape='1-sqrt'` (Hägele et al., 2024, section 3: the rate falls
  fastest at the start of the cool-down and lingers near 0 at its end), where the progress `p = k / (c + 1)`,
  so the last update still moves and nothing after `T` matters.

  `knots`: `(step, progress)` pairs that bend the progress piecewise-linearly through them, from 0 at the start to
  1 at `T + 1`. A time budget that moves the end of a cool-down already under way (`training/budget.py`) pins the
  progress reached so far as a knot, so the rate stays continuous and the steps taken follow the new schedule.
  `cooldown_steps = 0` returns `schedule` itself. Raises ValueError for what `check_cooldown` refuses.
  """
  check_cooldown(total_steps, cooldown_steps, shape, knots)
  if cooldown_steps == 0:
    return schedule
  xs, ys = (jnp.asarray(points, jnp.float32) for points in _progress_points(total_steps, cooldown_steps, knots))

  def cooled(step):
    progress = jnp.interp(jnp.asarray(step, dtype=jnp.float32), xs, ys)  # 0 before the start, 1 after step T
    fall = progress if shape == "linear" else jnp.sqrt(progress)
    return schedule(step) * (1.0 - fall)

  return cooled


def matrices(params: Any) -> Any:
  """A tree of bools like `params`: True for the arrays of rank >= 2 (kernels, embedding tables), False for
  biases and LayerNorm scales (the parameters decoupled weight decay shrinks, as in nanoGPT and big_vision)."""
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def adam(schedule: optax.Schedule, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam driven by `schedule(step)` of the paper's step (counted from 1): update k uses `schedule(k)`.

  `weight_decay` > 0: AdamW (Loshchilov & Hutter, 2019, "Decoupled Weight Decay Regularization"), which the
  paper does not use: every update also subtracts `schedule(k) * weight_decay * p` from each matrix `p`
  (`matrices`: kernels and embeddings; not biases or LayerNorm scales), optax's and PyTorch's convention of
  scaling the decay by the rate, so it cools down with it. 0 gives `optax.adam` itself, whose state (and so a
  checkpoint's tree) has no decay entry. Raises ValueError for a negative `weight_decay`.
  """
  if weight_decay < 0:
    raise ValueError(f"weight_decay={weight_decay} must be >= 0")
  learning_rate = lambda count: schedule(count + 1)  # noqa: E731
  if weight_decay == 0:
    return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
  return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=matrices)


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


def check_dropout_schedule(stages) -> None:
  """Raises ValueError (naming the stage) unless `stages` are `(step, rate)` pairs with integer steps >= 1,
  increasing, and rates in [0, 1)."""
  previous = 0
  for stage in stages:
    if (len(stage) != 2 or isinstance(stage[0], bool) or not isinstance(stage[0], (int, np.integer))
        or not previous < stage[0] or not 0.0 <= stage[1] < 1.0):
      raise ValueError(f"dropout stage {tuple(stage)} must be (step, rate) with integer steps increasing from "
                       f"{previous + 1} and a rate in [0, 1)")
    previous = stage[0]


def dropout_rate(stages, base_rate: float, step: int) -> float:
  """The residual dropout rate (P_drop, section 5.4) of update `step` (counted from 1) under `stages`.

  `stages`: `(step, rate)` pairs; from update `step` on the rate is `rate`, before the first stage `base_rate`
  (the model's `dropout_rate`). A rate that rises late in a run lets a short run learn at a low rate first and
  regularise more once it overfits ("late dropout", Liu et al., 2023, "Dropout Reduces Underfitting", ICML).
  The stages are in absolute steps, not fractions of the run: a slower host that gets fewer steps in its
  time budget reaches fewer of them. Raises ValueError for what `check_dropout_schedule` refuses.
  """
  check_dropout_schedule(stages)
  rate = base_rate
  for start, stage_rate in stages:
    if step >= start:
      rate = float(stage_rate)
  return rate
