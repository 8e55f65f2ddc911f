"""Stop signals: SIGTERM/SIGINT (and, on several hosts, JAX's preemption notice) ask the training loop to stop.

    stop = StopSignal()            # installs the handlers (main thread only)
    ...
    if stop.requested(step):       # after each step: save, then leave the loop
    ...
    stop.restore()                 # the previous handlers back

The loop finishes the current step, saves a checkpoint and returns; a re-run resumes from it.
"""

from __future__ import annotations

import signal

from transformer_jax import multihost


class StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes the current step, saves a checkpoint and stops.

  On multi-host runs JAX's preemption sync point (`jax.distributed` with the preemption service,
  `multihost.reached_preemption_sync_point`) is also consulted, so every host stops at the same step.
  Outside the main thread (e.g. a notebook worker) no handler can be installed and only the preemption
  notice counts.
  """

  def __init__(self):
    self.signal_name: str | None = None  # "SIGTERM", "SIGINT" or "preemption notice" once one arrived
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. in a notebook worker): no handler
        pass

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    """True once a signal (or, on several hosts, a preemption notice at `step`) asked the run to stop."""
    if self.signal_name is None and multihost.reached_preemption_sync_point(step):
      self.signal_name = "preemption notice"
    return self.signal_name is not None

  def restore(self) -> None:
    """Reinstalls the handlers that were there before."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
