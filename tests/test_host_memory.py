"""`python -m experiments.<program>` restarts itself once with glibc huge pages (experiments/launch.py)."""

import os
import subprocess
import sys

import pytest

from experiments import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTICE = "restarting with GLIBC_TUNABLES="


def test_environment_with_huge_pages_keeps_other_tunables():
  assert launch.environment_with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  env = launch.environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
  assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "X": "1"}
  same = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own choice is kept
  assert launch.environment_with_huge_pages(same) == same


def _run(**env):
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TRANSFORMER_JAX_HUGE_PAGES")}
  # `experiments.average_checkpoints --helpshort` (absl's help, exit status 1) imports the package the way every program does.
  return subprocess.run([sys.executable, "-m", "experiments.average_checkpoints", "--helpshort"],
                        cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not launch.huge_pages_available(), reason="no glibc >= 2.35 / transparent huge pages")
def test_program_restarts_once_with_huge_pages():
  proc = _run()
  assert "--workdir" in proc.stdout + proc.stderr, proc.stderr  # the program ran (absl's help text)
  assert proc.stderr.count(NOTICE + "glibc.malloc.hugetlb=1") == 1


def test_program_does_not_restart_when_opted_out_or_already_set():
  for env in ({"TRANSFORMER_JAX_HUGE_PAGES": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
    proc = _run(**env)
    assert "--workdir" in proc.stdout + proc.stderr, proc.stderr
    assert NOTICE not in proc.stderr


def test_importing_the_package_never_restarts():
  # pytest itself imported `experiments` above without being re-executed; a plain import in a child
  # process does not restart either (only `python -m experiments.<program>` does).
  proc = subprocess.run([sys.executable, "-c", "import experiments; print('imported')"], cwd=REPO,
                        env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
                        capture_output=True, text=True, timeout=120)
  assert proc.stdout.strip() == "imported" and NOTICE not in proc.stderr
