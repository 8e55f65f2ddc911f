"""How every absl program of `experiments/` starts: `launch.run(main)`.

Host memory: XLA:CPU allocates each step's large temporary buffers (the `[tokens, vocab]` logits and their
gradient, 131 MB at 4096 tokens x 8000 words) with `malloc`, which maps fresh 4 KiB pages for every
allocation above 32 MiB; touching them costs one page fault per 4 KiB in every step. With glibc's
`glibc.malloc.hugetlb=1` tunable those mappings use transparent huge pages (2 MiB), and a CPU-preset
training step runs ~1.4x faster (base preset ~1.15x; docs/performance.md). The tunable is read when the
process starts, so a program started through `launch.run(main)` (every `python -m experiments.<program>`)
re-executes itself once with it added to `GLIBC_TUNABLES` (Linux, glibc >= 2.35, transparent huge pages
not disabled). Set
`TRANSFORMER_JAX_HUGE_PAGES=0` to opt out; programs that import the library get the same effect by
starting Python with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`.
"""

import os
import sys
from typing import Any, Callable

from absl import app

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages_available() -> bool:
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


def environment_with_huge_pages(env=None) -> dict:
  """A copy of `env` (default: os.environ) with the huge-page tunable added to GLIBC_TUNABLES."""
  env = dict(os.environ if env is None else env)
  tunables = env.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" not in tunables:
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE
  return env


def maybe_reexecute_with_huge_pages() -> None:
  """Re-executes this process once with the huge-page tunable (see the module docstring); else returns."""
  argv = getattr(sys, "orig_argv", [])
  if (not argv or os.environ.get("TRANSFORMER_JAX_HUGE_PAGES", "1") == "0"
      or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", "") or not huge_pages_available()):
    return
  env = environment_with_huge_pages()
  print(f"[experiments] restarting with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} (huge pages for XLA's host "
        "buffers; TRANSFORMER_JAX_HUGE_PAGES=0 to opt out)", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable] + argv[1:], env)


def run(main: Callable[[list[str]], Any]) -> None:
  """Starts an absl program: `maybe_reexecute_with_huge_pages()`, then `absl.app.run(main)`.

  Every program ends with `if __name__ == "__main__": launch.run(main)`, so the restart happens where a
  program starts and never when the package is imported.
  """
  maybe_reexecute_with_huge_pages()
  app.run(main)
