"""The training scalars between logging steps: collected per step, fetched once per log, checked, reduced.

    log = TrainLog(start_step)
    log.add(step, metrics, position)         # every step: the device metrics, no host sync
    scalars = log.flush(step, total_steps)   # at a logging step: one `device_get`, then the log line

`flush` returns the means of the steps since the last flush (`loss`, `nll`, `accuracy`, `grad_norm`), the last
`learning_rate`, and the rates (`steps_per_s`, `tokens_per_s`: wall time between flushes), which the trainer
writes as `train/<name>` (`trackers.MetricWriter`); it refuses the first non-finite quantity
(`NonFiniteLossError`), naming the step and its batch's data position.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import jax
import numpy as np


class NonFiniteLossError(FloatingPointError):
  """The training loss (or another training quantity) became NaN or Inf; the message names the first one,
  the step and the data position of its batch."""


def format_eta(seconds: float) -> str:
  """`1h05m` from an hour on, else `4m07s` (negative: `0m00s`)."""
  seconds = max(0, int(seconds))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _check_finite(pending: list, fetched: list) -> None:
  """Raises NonFiniteLossError at the first step whose nll, loss or grad_norm is NaN/Inf (computation order)."""
  for (s, _, position), m in zip(pending, fetched):
    bad = [k for k in ("nll", "loss", "grad_norm") if k in m and not np.isfinite(m[k])]
    if bad:
      where = (f"; its batch was read in epoch {position['epoch']} of the data stream (seed {position['seed']}, "
               f"process {position['process_index']}'s position {position['grain']})") if position else ""
      raise NonFiniteLossError(
          f"training {bad[0]} is {m[bad[0]]} at step {s} (non-finite: {', '.join(bad)}){where}; every token id "
          "and position of it was within the model's tables (checked before each step), so the cause is "
          "numerical (learning rate, warm-up, dtype); stopping")


class TrainLog:
  """Collects the step metrics between logging steps and turns them into scalars (one host sync per log)."""

  def __init__(self, start_step: int):
    self.pending: list[tuple[int, dict, Mapping | None]] = []  # (step, metrics, data position)
    self.last_time, self.last_step = time.time(), start_step

  def add(self, step: int, metrics: dict, position: Mapping | None = None) -> None:
    """`metrics`: the train step's (device arrays); `position`: the data position its batch was read from
    (`TrainStream.get_state()` before it)."""
    self.pending.append((step, metrics, position))

  def flush(self, step: int, total_steps: int) -> dict[str, float]:
    """Scalars since the last flush; raises NonFiniteLossError at the first NaN/Inf training quantity."""
    fetched = jax.device_get([m for _, m, _ in self.pending])
    _check_finite(self.pending, fetched)
    now = time.time()
    steps_per_s = (step - self.last_step) / max(now - self.last_time, 1e-9)
    scalars = {k: float(np.mean([m[k] for m in fetched])) for k in ("loss", "nll", "accuracy", "grad_norm")}
    scalars.update(learning_rate=float(fetched[-1]["learning_rate"]), steps_per_s=steps_per_s,
                   tokens_per_s=sum(float(m["token_count"]) for m in fetched) / max(now - self.last_time, 1e-9))
    logging.info("step %d/%d | loss %.3f | acc %.3f | lr %.2e | %.0f tok/s | %.2f steps/s | eta %s", step,
                 total_steps, scalars["loss"], scalars["accuracy"], scalars["learning_rate"],
                 scalars["tokens_per_s"], steps_per_s, format_eta((total_steps - step) / max(steps_per_s, 1e-9)))
    self.pending, self.last_time, self.last_step = [], now, step
    return scalars
