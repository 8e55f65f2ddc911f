"""A `jax.profiler` trace of chosen training steps, on demand (`config.profile_steps = (start, stop)`).

    profiler = StepProfiler((5, 8), workdir.profile, first_step=start_step + 1)
    with profiler.step(step, outputs=lambda: run.state):   # around each train step
      run.state, metrics = run.train_step(run.state, batch, rng)
    profiler.close()                                       # ends a trace a stop signal cut short

Steps `start` to `stop`, both included, are traced (flax's `periodic_actions.Profile`, MaxText's `profiler:
xplane`): the work of earlier steps is awaited before the trace starts and the last traced step's is awaited
before it stops, so the trace holds exactly those steps, each inside a `jax.profiler.StepTraceAnnotation`
("train", step_num) that the profile plugin's step-time view reads. Outside the window nothing is added to
a step. The trace is XProf's `.xplane.pb` under `<directory>/plugins/profile/<time>/`, what TensorBoard's
profile plugin (`tensorboard --logdir=<workdir>`, with `tensorboard-plugin-profile`) and
`benchmarks.profile` read (`jax.profiler.ProfileData`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import jax


class StepProfiler:
  """Traces steps `window[0]..window[1]` (inclusive; `()` = never) into `directory`.

  A window that starts before `first_step` (a run resumed past its start) or after `last_step` (the run's last
  step) is not traced, one that ends after `last_step` is traced to it, and a trace that `close` ends before
  the window's end (a stop signal, the time budget, early stopping) holds the steps run: each is logged as a
  warning, saying which steps the trace holds.
  """

  def __init__(self, window: Sequence[int], directory: os.PathLike | str, first_step: int = 1,
               last_step: int | None = None):
    self.start, self.stop = (int(window[0]), int(window[1])) if window else (0, -1)
    self.directory = str(directory)
    self.active = False
    self.last_traced = 0
    if window and (self.start < first_step or (last_step is not None and self.start > last_step)):
      logging.warning("profile_steps %s: the run runs steps %d-%s, outside the window; no trace", tuple(window),
                      first_step, last_step)
      self.start, self.stop = 0, -1
    elif window and last_step is not None and self.stop > last_step:
      logging.warning("profile_steps %s: the run ends at step %d; the trace will hold steps %d-%d",
                      tuple(window), last_step, self.start, last_step)
      self.stop = last_step

  @contextlib.contextmanager
  def step(self, step: int, outputs: Callable[[], Any]) -> Iterator[None]:
    """Runs the body (one train step) inside the trace when `step` is in the window; `outputs()` returns
    the arrays a step writes (the train state), awaited before the trace starts and after its last step."""
    if not self.start <= step <= self.stop:
      yield
      return
    if step == self.start:
      jax.block_until_ready(outputs())
      jax.profiler.start_trace(self.directory)
      self.active = True
      logging.info("Profiling steps %d-%d into %s", self.start, self.stop, self.directory)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      yield
    self.last_traced = step
    if step == self.stop:
      jax.block_until_ready(outputs())
      self.close()

  def close(self) -> None:
    """Ends the trace (writing it) if one is running."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self.last_traced < self.stop:
        logging.warning("profile_steps (%d, %d): the run stopped after step %d, inside the window", self.start,
                        self.stop, self.last_traced)
      logging.info("Wrote the profile of steps %d-%d to %s", self.start, self.last_traced, self.directory)
