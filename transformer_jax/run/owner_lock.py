"""One owner at a time: `<workdir>/train.lock`, the training process that writes a workdir.

A lock is taken by an atomic exclusive create, the one operation of a store that of two racing writers lets
exactly one succeed:
- a local workdir: `open(O_CREAT | O_EXCL)` (POSIX);
- a `gs://bucket/run` workdir: an object upload with the precondition `ifGenerationMatch=0` (Cloud Storage's
  "create only if absent", https://cloud.google.com/storage/docs/request-preconditions), through
  google-cloud-storage (the `gcs` extra, which orbax needs for gs:// anyway). `etils.epath` cannot do this:
  TensorFlow's GCS filesystem has no exclusive create.

The lock holds `{"pid", "host", "started"}`. A lock of a live process, or of a process on another host (whose
liveness cannot be checked from here), refuses the second trainer in one line. A lock left by a dead process of
this host (SIGKILL, a crashed machine restarted) is stale: it is removed under a precondition that names the
stale lock exactly (a rename locally, the object's generation on gs://), so of two processes taking it over one
wins, and the lock is retaken. Readers (translate, evaluate, export) take no lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from transformer_jax.workdir import TRAIN_LOCK, Workdir

LOCK_FILENAME = TRAIN_LOCK  # `Workdir.train_lock`


class WorkdirInUseError(OSError):
  """Another live training process owns the workdir (its `train.lock`)."""


def _alive(pid: int) -> bool:
  """Whether process `pid` of this host runs (a zombie, killed but not yet reaped by its parent, does not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
  except OSError:  # no /proc (macOS): trust the signal test
    return True


class _LocalLockFile:
  """The lock as a file of a local directory. A read's `token`: None when there is no lock (the rename is the
  precondition of a stale lock's removal)."""

  def __init__(self, root: str):
    self.root, self.path = root, os.path.join(root, LOCK_FILENAME)
    self.created_root = False

  def prepare(self) -> None:
    if os.path.exists(self.root) and not os.path.isdir(self.root):
      raise NotADirectoryError(f"--workdir={self.root} is a file; a workdir is a directory (new or a run's)")
    self.created_root = not os.path.isdir(self.root)
    os.makedirs(self.root, exist_ok=True)

  def create(self, text: str) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    return True

  def read(self) -> tuple[dict, Any]:
    try:
      with open(self.path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      return {}, None
    try:
      return json.loads(text), True
    except ValueError:  # being written, or damaged: an owner we cannot name
      return {}, True

  def remove_stale(self, token: Any) -> None:
    del token  # of the processes that saw the stale lock, the one whose rename succeeds removes it
    aside = f"{self.path}.stale-{os.getpid()}"
    try:
      os.rename(self.path, aside)
      os.remove(aside)
    except FileNotFoundError:
      pass

  def remove(self) -> None:
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass
    self.forget_root()

  def forget_root(self) -> None:
    if self.created_root:
      try:
        os.rmdir(self.root)  # only when nothing else was written
      except OSError:
        pass


class _GcsLockObject:
  """The lock as the object `<prefix>/train.lock` of a bucket; a read's `token`: the object's generation (None
  when there is no lock). A failed request (permission denied, network) is an OSError of one line."""

  def __init__(self, root: str):
    try:
      from google.api_core import exceptions  # pylint: disable=import-outside-toplevel (the gcs extra)
      from google.cloud import storage  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ValueError(f"--workdir={root}: gs:// workdirs need google-cloud-storage: pip install "
                       "'transformer_jax[gcs]'") from e
    self.root, self._exceptions = root, exceptions
    bucket, _, prefix = root[len("gs://"):].partition("/")
    self._name = f"{prefix.rstrip('/')}/{LOCK_FILENAME}" if prefix.strip("/") else LOCK_FILENAME
    self.path = f"gs://{bucket}/{self._name}"
    self._bucket = storage.Client().bucket(bucket)

  def _request(self, operation, *args, **kwargs):
    """`operation(blob, ...)` on a fresh handle of the lock object; Cloud Storage's failures as one line."""
    try:
      return operation(self._bucket.blob(self._name), *args, **kwargs)
    except (self._exceptions.NotFound, self._exceptions.PreconditionFailed):
      raise
    except self._exceptions.GoogleAPIError as error:
      reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
      raise OSError(f"{self.path}: Cloud Storage failed the training run's owner lock ({reason})") from None

  def prepare(self) -> None:
    Workdir(self.root).create()  # a missing bucket: one line naming it (FileNotFoundError)

  def create(self, text: str) -> bool:
    try:
      self._request(lambda blob: blob.upload_from_string(text, content_type="application/json",
                                                          if_generation_match=0))
    except self._exceptions.PreconditionFailed:
      return False
    return True

  def read(self) -> tuple[dict, Any]:
    def download(blob):
      return blob.download_as_bytes(), blob.generation  # the generation of the bytes read (x-goog-generation)

    try:
      text, generation = self._request(download)
    except self._exceptions.NotFound:
      return {}, None  # released meanwhile: look again
    try:
      return json.loads(text), generation
    except ValueError:
      return {}, generation

  def remove_stale(self, token: Any) -> None:
    try:  # only the generation that was read as stale; another process's fresh lock is left alone
      self._request(lambda blob: blob.delete(if_generation_match=token))
    except (self._exceptions.NotFound, self._exceptions.PreconditionFailed):
      pass

  def remove(self) -> None:
    try:
      self._request(lambda blob: blob.delete())
    except self._exceptions.NotFound:
      pass

  def forget_root(self) -> None:
    pass


class OwnerLock:
  """`<workdir>/train.lock`: the one training process that writes a workdir (checkpoints, metrics, config).

  `acquire()` takes the lock (module docstring: how, on a local disk and on gs://) or raises
  `WorkdirInUseError` (an OSError) in one line naming the owner; `NotADirectoryError` when the workdir is a
  file; `ValueError` for gs:// without google-cloud-storage. `release()` removes the lock, and a local
  workdir too when `acquire` created it and nothing else was written. Multi-host runs: only process 0 takes
  it (`enabled`). A context manager.
  """

  def __init__(self, root: str | os.PathLike, enabled: bool = True):
    self.root = os.fspath(root)
    self.enabled = enabled
    self._store = None
    self._held = False

  @property
  def path(self) -> str:
    return self.root.rstrip("/") + "/" + LOCK_FILENAME

  def _describe(self, owner: dict) -> str:
    return f"pid {owner.get('pid')} on host {owner.get('host')!r} since {owner.get('started')}"

  def acquire(self) -> "OwnerLock":
    if not self.enabled:
      return self
    if "://" in self.root and not self.root.startswith("gs://"):
      raise ValueError(f"--workdir={self.root}: a workdir is a local directory or gs://bucket/path")
    self._store = _GcsLockObject(self.root) if self.root.startswith("gs://") else _LocalLockFile(self.root)
    self._store.prepare()
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(3):
      if self._store.create(json.dumps(me)):
        self._held = True
        return self
      owner, token = self._store.read()
      if token is None:
        continue  # released between our create and our read: try again
      if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
        self._store.remove_stale(token)
        continue
      self._store.forget_root()
      raise WorkdirInUseError(
          f"{self.root} is in use by another training run ({self._describe(owner)}; {self.path}): one "
          "trainer per workdir; wait for it to finish, or use another --workdir (remove the lock only if "
          "that process is gone)")
    raise WorkdirInUseError(f"{self.path}: could not take over a stale lock (another process keeps taking it)")

  def release(self) -> None:
    if self._held:
      self._store.remove()
      self._held = False

  def __enter__(self) -> "OwnerLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
