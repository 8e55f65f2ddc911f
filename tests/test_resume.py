"""Preemption: real SIGKILL / SIGTERM of `python -m experiments.train`, then resume (issue: checkpoints).

Each run is a subprocess on the tiny number-words split with a tiny model, so the whole file takes about a
minute on 2 cores.
"""

import json
import os
import random
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import helpers
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.workdir import Workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 40
CHECKPOINT_EVERY = 8


def _command(workdir, shared, num_steps=NUM_STEPS, extra=()):
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
          "--config.data.builder_config=tiny", f"--config.data.tfds_data_dir={shared}/tfds",
          f"--config.data.vocab_path={shared}/spm.model", "--config.data.vocab_size=128",
          "--config.data.tokens_per_batch=2048", "--config.data.max_len=32",
          "--config.model.d_model=64", "--config.model.d_ff=256", "--config.model.num_heads=2",
          "--config.model.num_encoder_layers=2", "--config.model.num_decoder_layers=2",
          "--config.model.dropout_rate=0.1", f"--config.num_train_steps={num_steps}",
          "--config.warmup_steps=10", "--config.log_every_steps=1", "--config.evals.loss.every_steps=0",
          f"--config.checkpoint_every_steps={CHECKPOINT_EVERY}", "--config.checkpoint_keep=10", "--config.final_eval.split=",
          *extra]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO
  return env


def _run(cmd, timeout=300):
  result = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _logged_losses(workdir):
  """step -> list of every train loss logged for it (a killed run and its resume may both log a step)."""
  losses = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if "train/loss" in row:
        losses.setdefault(row["step"], []).append(row["train/loss"])
  return losses


def _final_params(workdir):
  directory = str(Workdir(workdir).checkpoints)
  step = checkpoint_lib.Checkpointer(directory, read_only=True).latest_step()
  params = checkpoint_lib.restore_params(directory)
  return step, params


def _complete_checkpoints(workdir):
  directory = str(Workdir(workdir).checkpoints)
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def _logged_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.strip().endswith("}")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  shared = tmp_path_factory.mktemp("shared")
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(_command(workdir, shared))
  return shared, workdir


def test_sigkill_then_resume_is_bitwise_identical(uninterrupted, tmp_path):
  shared, reference = uninterrupted
  extra_steps = random.Random(os.getpid()).randint(1, CHECKPOINT_EVERY - 1)
  proc = subprocess.Popen(_command(tmp_path, shared), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  # Kill a random number of steps after the first complete checkpoint.
  helpers.wait_for(lambda: _complete_checkpoints(tmp_path) and max(_logged_steps(tmp_path), default=0)
            >= _complete_checkpoints(tmp_path)[0] + extra_steps, proc, timeout=240, poll=0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(_logged_steps(tmp_path))
  assert killed_at < NUM_STEPS, "the run finished before it was killed"

  resumed = _run(_command(tmp_path, shared))
  assert "Resumed from the checkpoint at step" in resumed.stderr

  ref_step, ref_params = _final_params(reference)
  step, params = _final_params(tmp_path)
  assert step == ref_step == NUM_STEPS
  for a, b in zip(jax.tree_util.tree_leaves(ref_params), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  ref_losses, losses = _logged_losses(reference), _logged_losses(tmp_path)
  assert sorted(losses) == list(range(1, NUM_STEPS + 1))
  overlapping = [s for s, values in losses.items() if len(values) > 1]
  for s, values in losses.items():
    assert all(v == ref_losses[s][0] for v in values), f"step {s}: {values} vs {ref_losses[s]}"
  print(f"killed after step {killed_at}; steps logged twice (replayed after resume): {overlapping}")


def test_sigterm_saves_the_current_step_and_resume_continues(uninterrupted, tmp_path):
  shared, reference = uninterrupted
  proc = subprocess.Popen(_command(tmp_path, shared, num_steps=10_000), cwd=REPO, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  helpers.wait_for(lambda: any(s >= 6 for s in _logged_steps(tmp_path)), proc, timeout=240, poll=0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  assert "Received SIGTERM" in stderr
  last_step = max(_logged_steps(tmp_path))
  ckpt = checkpoint_lib.Checkpointer(str(Workdir(tmp_path).checkpoints), read_only=True)
  assert ckpt.latest_step() == last_step  # saved at the step it was received, not at a multiple of 4

  resumed = _run(_command(tmp_path, shared, num_steps=last_step + 2))
  assert f"Resumed from the checkpoint at step {last_step}" in resumed.stderr
  assert max(_logged_steps(tmp_path)) == last_step + 2
