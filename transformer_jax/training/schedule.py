"""The paper's learning-rate schedule (Vaswani et al., 2017, section 5.3, equation 3), and a cool-down.

The cool-down (`cooldown`) is not in the paper: it multiplies any schedule by a factor that falls to 0
(linearly, or as 1 - sqrt) over the last steps of a run whose length is known in advance ("warmup-stable-decay",
Hägele et al., 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"; t5x's
rsqrt-then-linear-decay).
A compute-limited run ends at a lower loss with it than at the rsqrt schedule's still-high final rate.

`dropout_rate` is the other schedule a run follows: the residual dropout rate by stages of absolute steps (the
trainer recompiles its step at each stage, as a dropout rate is a static field of the model's config).
The optimizer these schedules drive (Adam / AdamW, the moving average of the weights) is `training/optimizer.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax


def rsqrt_schedule(d_model: int, warmup_steps: int = 4000, scale: float = 1.0) -> optax.Schedule:
  """lrate(step) = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), `step` counted from 1.

  Linear warm-up for `warmup_steps`, then decay with the inverse square root of the step; the peak is at
  `step == warmup_steps` (7.0e-4 for d_model 512, warmup 4000). Step 0 gives 0 (never inf or NaN).

  The returned function takes the paper's step. Optax calls a schedule with the number of updates already
  applied (0 for the first update); `optimizer.adam` shifts it by one so that update k uses step k.
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
  1 at `T + 1`. A time budget that moves the end of a cool-down already under way (`budget.py`) pins the
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
