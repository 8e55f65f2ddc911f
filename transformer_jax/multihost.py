"""The multi-host runtime and its few host collectives: process 0 decides, every host agrees.

A run on several hosts (one JAX process each) executes the same Python on every process; host-side decisions
taken from local state (a wall clock, a measured rate, a file only process 0 wrote) must reach every process
unchanged, or one process enters a save or a collective the others skip and the run hangs. The trainer, the
data pipeline and the time budget share these (t5x and MaxText call theirs multihost utilities):

* `maybe_initialize_distributed`: `jax.distributed.initialize` when asked (not a collective; call it first).
* `agree_across_hosts(bool)`, `agree_on_ints(*ints)`: process 0's values on every process (a broadcast).
* `gather_json(value)`: every process's JSON value, in process order, on every process (an all-gather).
* `sync_processes(name)`: a barrier.
* `reached_preemption_sync_point(step)`: whether every process stops at `step` for a preemption notice.

On one process every function is a no-op that returns its own input (no JAX collective runs), so single-host
programs pay nothing. Every collective here must be called by every process, in the same order.
Built on `jax.experimental.multihost_utils` (broadcast_one_to_all, process_allgather, sync_global_devices,
reached_preemption_sync_point).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def maybe_initialize_distributed(enabled: bool, **kwargs) -> bool:
  """`jax.distributed.initialize(**kwargs)` when `enabled` (multi-host); call before any other JAX use.

  With no kwargs JAX detects the cluster (SLURM, Open MPI, TPU pods, ...); otherwise pass
  `coordinator_address`, `num_processes`, `process_id`. Returns whether JAX now runs distributed.
  """
  if not enabled:
    return False
  if jax.distributed.is_initialized():
    return True
  jax.distributed.initialize(**kwargs)
  logging.info("jax.distributed initialised: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def agree_across_hosts(decision: bool) -> bool:
  """Process 0's `decision` on every process (a no-op on one host).

  For decisions taken from local state that must not differ between hosts, such as "the wall-clock
  checkpoint interval has elapsed": a save that only some hosts enter waits forever for the others.
  Sent as one int32 scalar (`multihost_utils.broadcast_one_to_all`).
  """
  if jax.process_count() == 1:
    return bool(decision)
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(bool(decision), np.int32)))


def agree_on_ints(*values: int) -> tuple[int, ...]:
  """Process 0's `values` on every process (a no-op on one host), e.g. a run length decided from its clock.

  Sent as one int32 vector `[len(values)]`, so each value must fit in int32."""
  if jax.process_count() == 1:
    return tuple(int(v) for v in values)
  return tuple(int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32)))


def any_host(flag: bool) -> bool:
  """True on every process when `flag` is true on any (a no-op on one host): a failure one host sees locally
  (its share of a checkpoint could not be written) that every host must act on. One int32 allgather."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag), np.int32))))


def sync_processes(name: str) -> None:
  """Waits until every process reached the point `name` (a no-op on one host): e.g. the vocabulary that
  process 0 trains is on disk before the others read it."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def gather_json(value: Any) -> list[Any]:
  """Every process's JSON-serialisable `value`, in process order, on every process (`[value]` on one host):
  e.g. each process's data position, saved together in a checkpoint.

  Each process's value travels as the uint8 bytes of its JSON text (sorted keys), padded to the longest
  (`process_allgather` of the lengths `[1]` int32, then of the bytes); what comes back is `json.loads` of
  each, so tuples come back as lists."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(row[:size].tobytes()) for row, size in zip(gathered, sizes)]


def reached_preemption_sync_point(step: int) -> bool:
  """Whether every process is to stop after `step` because a preemption notice arrived (JAX's preemption sync
  point, `jax.distributed` with its preemption service). False on one host and when the service is not enabled.
  A collective: every process calls it at every step."""
  if jax.process_count() == 1:
    return False
  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # preemption service not enabled
    return False
