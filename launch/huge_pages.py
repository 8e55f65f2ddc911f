"""Huge pages for XLA's host buffers: every `python -m` program of ours restarts itself once with them.

XLA:CPU allocates each step's large temporary buffers (the `[tokens, vocab]` logits and their gradient, 131 MB
at 4096 tokens x 8000 words) with `malloc`, which maps fresh 4 KiB pages for every allocation above 32 MiB;
touching them costs one page fault per 4 KiB in every step. With glibc's `glibc.malloc.hugetlb=1` tunable those
mappings use transparent huge pages (2 MiB), and a CPU-preset training step runs ~1.4x faster (base preset
~1.15x; docs/performance.md). glibc reads the tunable when the process starts, so a program re-executes itself
once with it added to `GLIBC_TUNABLES` (Linux, glibc >= 2.35, transparent huge pages not disabled).

The restart happens in `launch/__init__.py`, which `experiments/__init__.py` and `benchmarks/__init__.py` import
first, while Python locates the `-m` module and before the program imports anything heavy (JAX, TensorFlow, the
trainer): restarting after those imports cost every program start ~6 s of imports done twice. Importing the
packages from other code (a notebook, pytest, `python -c`) never restarts. `TRANSFORMER_JAX_HUGE_PAGES=0` opts out; code that imports the library gets the same effect by
starting Python with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. Standard library only, so it costs nothing.
"""

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
PROGRAM_PACKAGES = ("experiments.", "benchmarks.")  # whose `python -m` programs restart with the tunable


def available() -> bool:
  """True where glibc's huge-page tunable exists and the kernel's transparent huge pages are not off."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
      return False
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return "[never]" not in f.read()
  except (OSError, ValueError, AttributeError):
    return False


def environment(env=None) -> dict:
  """A copy of `env` (default: os.environ) with the tunable added to GLIBC_TUNABLES (a user's own value kept)."""
  env = dict(os.environ if env is None else env)
  tunables = env.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" not in tunables:
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
  return env


def starting_as_program() -> bool:
  """True while `python -m experiments.<module>` or `benchmarks.<module>` is being located (Python sets
  `sys.argv[0]` to "-m" then)."""
  argv = getattr(sys, "orig_argv", [])
  if sys.argv[:1] != ["-m"] or "-m" not in argv[1:-1]:
    return False
  return argv[argv.index("-m", 1) + 1].startswith(PROGRAM_PACKAGES)  # the interpreter's options come before -m


def maybe_reexecute() -> None:
  """Re-executes this process once with the tunable; returns where it is set, opted out or unavailable."""
  argv = getattr(sys, "orig_argv", [])
  if (not argv or os.environ.get("TRANSFORMER_JAX_HUGE_PAGES", "1") == "0"
      or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", "") or not available()):
    return
  env = environment()
  print(f"[experiments] restarting with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} (huge pages for XLA's host "
        "buffers; TRANSFORMER_JAX_HUGE_PAGES=0 to opt out)", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable] + argv[1:], env)
