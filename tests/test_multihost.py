"""The host collectives (transformer_jax/multihost.py): no-ops on one process; on two (simulated by replacing
`jax.process_count` and the `multihost_utils` primitive under them) every host takes process 0's value or
every process's value in process order. Real two-process runs go through them in tests/test_distributed_data.py
and the multi-host trainer tests."""

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from transformer_jax import multihost


@pytest.fixture
def two_hosts(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)


def test_distributed_initialisation_only_when_asked():
  assert multihost.maybe_initialize_distributed(False) is False
  assert not jax.distributed.is_initialized()


def test_agree_across_hosts_takes_process_0s_decision(monkeypatch):
  assert multihost.agree_across_hosts(True) is True and multihost.agree_across_hosts(False) is False
  # Two hosts whose clocks disagree: every host ends up with what process 0 broadcast.
  sent = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                      lambda x: sent.append(int(x)) or np.asarray(0, np.int32))  # process 0 said "no"
  assert multihost.agree_across_hosts(True) is False
  assert sent == [1]


def test_agree_on_ints_takes_process_0s_values(monkeypatch):
  assert multihost.agree_on_ints(3433, 858) == (3433, 858)
  # Two hosts whose clocks gave different run lengths: every host takes process 0's.
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: np.asarray([3400, 850], np.int32))
  assert multihost.agree_on_ints(3433, 858) == (3400, 850)


def test_gather_json_returns_every_process_value_in_process_order(monkeypatch, two_hosts):
  # Process 1's value (longer JSON than ours) arrives through the two all-gathers: lengths, then padded bytes.
  other = np.frombuffer(b'{"consumed": 123456, "epoch": 2}', np.uint8)

  def allgather(x):
    x = np.asarray(x)
    if x.dtype == np.int32:  # the lengths [1]
      return np.stack([x, np.asarray([other.size], np.int32)])
    padded = np.zeros_like(x)
    padded[:other.size] = other
    return np.stack([x, padded])

  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  assert multihost.gather_json({"epoch": 1, "consumed": 7}) == [{"consumed": 7, "epoch": 1},
                                                                {"consumed": 123456, "epoch": 2}]


def test_gather_json_on_one_process_is_its_own_value():
  assert multihost.gather_json((1, "a")) == [(1, "a")]  # untouched: no JSON round trip on one host


def test_sync_processes_waits_only_on_several_hosts(monkeypatch):
  names = []
  monkeypatch.setattr(multihost_utils, "sync_global_devices", names.append)
  multihost.sync_processes("vocabulary")
  assert names == []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  multihost.sync_processes("vocabulary")
  assert names == ["vocabulary"]


def test_preemption_sync_point(monkeypatch):
  asked = []
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: asked.append(step) or step == 7)
  assert multihost.reached_preemption_sync_point(7) is False and asked == []  # one host: never asks
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert multihost.reached_preemption_sync_point(6) is False and multihost.reached_preemption_sync_point(7) is True

  def disabled(step):
    raise RuntimeError("Preemption sync manager has not been initialized")

  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", disabled)
  assert multihost.reached_preemption_sync_point(7) is False
