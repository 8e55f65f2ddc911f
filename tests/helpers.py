"""Helpers several test files share: a tiny number-words config, a poisoned train step, waiting on a process,
a tiny trained workdir made by the program, many command lines of one program at the cost of one start, and a
free local port."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
from flax import linen as nn
from flax import traverse_util

from experiments.configs import number_words
from transformer_jax.run import factories


def tiny_number_words_config(tmp_path):
  """The built-in task's tiny split with a 1+1-layer d_model 32 model and synchronous checkpoints: a run that
  trains in seconds. Callers set the steps and evaluations they need."""
  config = number_words.get_config()
  config.data.builder_config = "tiny"
  config.data.vocab_size = 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.data.tokens_per_batch = 512
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2)
  config.async_checkpointing = False
  return config


def poison_train_step(monkeypatch, at_step: int, **metrics) -> None:
  """Makes the trainer's compiled step report `metrics` (e.g. `loss=nan`) after update `at_step`."""
  real = factories.make_train_step

  def poisoned(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def run(state, batch, rng):
      new_state, reported = step_fn(state, batch, rng)
      if int(new_state.step) == at_step:
        reported = dict(reported, **{k: np.float32(v) for k, v in metrics.items()})
      return new_state, reported
    return run

  monkeypatch.setattr(factories, "make_train_step", poisoned)


def wait_for(predicate, proc, timeout: float, poll: float = 0.1) -> None:
  """Waits until `predicate()` holds; AssertionError (with the process's stderr tail) if `proc` exits first
  or `timeout` seconds pass (then `proc` is killed)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc.poll() is not None:
      raise AssertionError(f"training exited early: {proc.stderr.read()[-3000:]}")
    time.sleep(poll)
  proc.kill()
  raise AssertionError("timed out waiting for training progress")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `experiments.train` flags of a tiny number-words run (seconds): what the translation tools' tests decode with.
TINY_TRAIN_FLAGS = ["--config.data.builder_config=tiny", "--config.data.vocab_size=128", "--config.model.d_model=32",
                    "--config.model.d_ff=64", "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
                    "--config.model.num_decoder_layers=1", "--config.num_train_steps=30", "--config.warmup_steps=10",
                    "--config.evals.loss.every_steps=0", "--config.checkpoint_every_steps=30",
                    "--config.final_eval.split="]


def program_env() -> dict:
  """The environment of a program a test starts: this checkout first, CPU, no huge-pages restart."""
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", TRANSFORMER_JAX_HUGE_PAGES="0")


def train_tiny(workdir) -> None:
  """Trains the tiny run (`TINY_TRAIN_FLAGS`) into `workdir` with `experiments.train`."""
  subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *TINY_TRAIN_FLAGS], cwd=REPO,
                 env=program_env(), check=True, capture_output=True, timeout=300)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cache_entries(cache, kind: type) -> dict:
  """`{path: entry}` of the entries of type `kind` (e.g. `kvcache.SelfAttentionCache`) in a `cache` collection."""
  return {path: x for path, x in traverse_util.flatten_dict(nn.unbox(cache)).items() if isinstance(x, kind)}


def run_cases(program: str, cases: list) -> list:
  """`subprocess.CompletedProcess`-like results of `python -m program *args` for each args list of `cases`: the
  real program in a fork of one process that imported what it imports (`tests/program_cases.py`), so a case
  costs milliseconds, not a Python and JAX start. For refusals at parse time and before training starts."""
  driver = subprocess.run([sys.executable, os.path.join(REPO, "tests", "program_cases.py"), program], cwd=REPO,
                          env=program_env(), input=json.dumps(cases), capture_output=True, text=True,
                          timeout=120 + 30 * len(cases), check=True)
  return [subprocess.CompletedProcess(args, r["returncode"], r["stdout"], r["stderr"])
          for args, r in zip(cases, json.loads(driver.stdout))]
