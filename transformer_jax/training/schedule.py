"""The paper's learning-rate schedule (Vaswani et al., 2017, section 5.3, equation 3)."""

from __future__ import annotations

import jax.numpy as jnp
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


def adam_with_schedule(d_model: int, warmup_steps: int = 4000, scale: float = 1.0, b1: float = 0.9,
                       b2: float = 0.98, eps: float = 1e-9) -> optax.GradientTransformation:
  """Adam(β1 0.9, β2 0.98, ε 1e-9) driven by `rsqrt_schedule` (section 5.3); update k uses step k."""
  schedule = rsqrt_schedule(d_model, warmup_steps, scale)
  return optax.adam(lambda count: schedule(count + 1), b1=b1, b2=b2, eps=eps)
