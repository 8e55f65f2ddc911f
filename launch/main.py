"""What every program does around its work: one-line errors and exit status, quiet library logs, the host it ran on.

`@program` over a program's `def main():` (then `launch.run(main)`): bad input or state ends in one `error:` line
on stderr and exit status 1 (`USER_ERRORS`, storage clients' failures, XLA's out-of-memory), never a traceback."""

from __future__ import annotations

import datetime
import functools
import gc
import logging
import os
import platform
import re
import subprocess
import sys
from typing import Any, Callable

import jax
import tensorflow_datasets as tfds
from absl import app
from absl import logging as absl_logging

from transformer_jax.data import parallel_text
from transformer_jax.data.tokenizer import VocabularyError
from transformer_jax.run.train_log import NonFiniteLossError

# Exceptions that mean "bad input or state": printed as one line, exit status 1, no traceback.
USER_ERRORS = (ValueError, OSError, VocabularyError, NonFiniteLossError, UnicodeDecodeError)


_QUIET_LIBRARIES = ("/orbax/", "/tensorflow_datasets/", "/etils/", "/tensorstore/")


class _LibraryInfoFilter:
  """Drops INFO/DEBUG records of chatty libraries (orbax logs every save step by step) from absl logs, and
  prints their warnings and errors on one line each, without tracebacks."""

  def filter(self, record) -> bool:
    if not any(p in record.pathname for p in _QUIET_LIBRARIES):
      return True
    if record.exc_info or "\n" in record.getMessage():  # a failed background save: the program says it in one line
      record.msg, record.args = " ".join(record.getMessage().split())[:300], ()
      record.exc_info, record.exc_text = None, None
    # Orbax warns that a read-only checkpoint directory is read only every time one is opened.
    return record.levelno >= logging.WARNING and "is read only" not in record.getMessage()


_failed = False  # set by `fail`: the program has said its error line


def _quiet_unraisable(hook):
  """`sys.unraisablehook` for the programs: an exception that nobody awaits in a library's background work
  (orbax/tensorstore coroutines and callbacks of a save or restore that already failed: the failure itself reaches
  the program, which says it in one line) prints no traceback. After `fail` nothing more is printed, so the
  `error:` line stays the last; before it, one `warning:` line; asyncio's "Event loop is closed" is dropped."""
  def unraisablehook(unraisable):
    if _failed or (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
      return
    if unraisable.exc_value is None:
      return hook(unraisable)
    text = " ".join(str(unraisable.exc_value).split())[:300]
    print(f"warning: ignored in background work: {unraisable.exc_type.__name__}: {text}", file=sys.stderr)
  return unraisablehook


class _OneLineBackgroundErrors(logging.Filter):
  """asyncio's "Task exception was never retrieved" (orbax's restore tasks left over once one of them failed: the
  failure itself reaches the program) as one line without its traceback, and nothing after `fail`."""

  def filter(self, record: logging.LogRecord) -> bool:
    if _failed:
      return False
    if record.exc_info and record.exc_info[1] is not None:
      error = record.exc_info[1]
      record.msg, record.args = f"ignored in background work: {type(error).__name__}: " + " ".join(
          str(error).split())[:300], ()
      record.exc_info = record.exc_text = None
    return True


def setup_logging() -> None:
  """Our own progress at INFO; orbax/tfds chatter only from WARNING up; no tfds progress bars; background work's
  unretrieved errors in one line (`_quiet_unraisable`, `_OneLineBackgroundErrors`)."""
  sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
  logging.getLogger("asyncio").addFilter(_OneLineBackgroundErrors())
  absl_logging.set_verbosity(absl_logging.INFO)
  absl_logging.get_absl_handler().addFilter(_LibraryInfoFilter())
  tfds.disable_progress_bar()


def program(body: Callable[[], Any]) -> Callable[[list[str]], Any]:
  """The absl `main(argv)` of a program whose work is `body()` (flags come from `absl.flags.FLAGS`).

  Refuses positional arguments (absl usage error), sets up logging, runs `body`, and turns the errors that mean
  bad input or state (`USER_ERRORS`) into one `error: ...` line on stderr and exit status 1, as the house asks
  of every program. Use as a decorator: `@launch.program` over `def main():`, then `launch.run(main)`.
  """

  @functools.wraps(body)
  def main(argv: list[str]):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    setup_logging()
    try:
      return body()
    except USER_ERRORS as error:
      fail(str(error))
    except Exception as error:  # pylint: disable=broad-except (re-raised unless a storage client's failure)
      message = storage_error(error) or out_of_memory(error)
      if message is None:
        raise
      fail(message)

  return main


def _words(class_name: str) -> str:
  return re.sub(r"(?<!^)(?=[A-Z])", " ", class_name.removesuffix("Error")).lower()


def storage_error(error: BaseException) -> str | None:
  """One line for a failure of the storage clients a workdir is reached through, else None.

  TensorFlow's file system (what `etils.epath` and tfds use for gs://) raises `tf.errors.OpError` subclasses
  (e.g. `PermissionDeniedError: Error executing an HTTP request: HTTP response code 403 with body '{json}'
  when uploading gs://b/run/`); google-cloud-storage (orbax, the owner lock) raises `GoogleAPIError`s. Either
  becomes "<path>: <kind> (HTTP <code>: <the service's message>) when <operation>". Neither library is
  imported here: an error of a library the program never loaded cannot occur.
  """
  tf_errors = sys.modules.get("tensorflow.python.framework.errors_impl")
  api_errors = sys.modules.get("google.api_core.exceptions")
  if tf_errors is not None and isinstance(error, tf_errors.OpError):
    text = error.message
    code = re.search(r"HTTP response code (\d+)", text)
    service = re.search(r'"message":\s*"([^"]+)"', text)
    where = re.search(r"when (\w+(?: \w+)*?) (\S+://\S+)\s*$", text)
    detail = f"HTTP {code.group(1)}: {service.group(1)}" if code and service else " ".join(text.split())[:300]
    if where:
      return f"{where.group(2)}: {_words(type(error).__name__)} ({detail}) when {where.group(1)}"
    return f"{_words(type(error).__name__)} ({detail})"
  if api_errors is not None and isinstance(error, api_errors.GoogleAPIError):
    return f"Cloud Storage: {_words(type(error).__name__)} ({' '.join(str(error).split())[:300]})"
  return None


def out_of_memory(error: BaseException) -> str | None:
  """One line for XLA's RESOURCE_EXHAUSTED (a batch, beam or length the device cannot hold), else None."""
  if isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error):
    return (f"out of memory: {' '.join(str(error).split())[:300]}; use smaller sizes (beam, batch, length "
            "flags or config keys)")
  return None


def fail(message: str) -> None:
  """Prints `error: <message>` on one line to stderr and exits with status 1 (the garbage of the failed work
  collected first, so that its unraisable exceptions come before the line or not at all: `_quiet_unraisable`).
  A process of a multi-host run exits at once (`os._exit`, after the program's cleanup has run)."""
  global _failed
  gc.collect()
  _failed = True
  print("error: " + " ".join(str(message).split()), file=sys.stderr)
  if jax.distributed.is_initialized():  # peers' collectives and orbax's barriers would hold the exit for
    sys.stdout.flush()                  # their timeouts (20 minutes) in threads Python waits for: exit now
    sys.stderr.flush()
    os._exit(1)
  sys.exit(1)


def read_lines(path: str | None) -> list[str]:
  """Lines of `path` (stdin when None) without line endings; invalid UTF-8 names the file and line."""
  return parallel_text.read_lines(path) if path else parallel_text.decode_lines(sys.stdin.buffer, "<stdin>")


def machine_info() -> dict:
  """The host a result was measured on: date, platform, CPU model, cores, SIMD flags, load average, jax/flax."""
  info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
          "platform": platform.platform(), "python": platform.python_version(),
          "logical_cpus": os.cpu_count()}
  try:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    for key, name in (("Model name", "cpu_model"), ("Core(s) per socket", "cores_per_socket"),
                      ("Socket(s)", "sockets"), ("Thread(s) per core", "threads_per_core"),
                      ("Flags", "flags")):
      m = re.search(rf"^{re.escape(key)}:\s*(.+)$", lscpu, re.M)
      if m:
        info[name] = m.group(1).strip()
    flags = info.pop("flags", "")
    info["simd"] = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                            if f in flags.split())
  except (OSError, subprocess.SubprocessError):
    pass
  try:
    info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    pass
  try:
    import jax
    import flax
    info["jax"], info["flax"] = jax.__version__, flax.__version__
  except ImportError:
    pass
  return info
