"""`python -m experiments.<program>` restarts itself once with glibc huge pages (launch/huge_pages.py)."""

import os
import subprocess
import sys

import pytest

from launch import huge_pages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTICE = "restarting with GLIBC_TUNABLES="


def test_environment_adds_the_tunable_and_keeps_other_tunables():
  assert huge_pages.environment({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  env = huge_pages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
  assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "X": "1"}
  same = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own choice is kept
  assert huge_pages.environment(same) == same


def _run(*python_options, **env):
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TRANSFORMER_JAX_HUGE_PAGES")}
  # `experiments.average_checkpoints --helpshort` (absl's help, exit status 1) imports the package the way every
  # program does.
  return subprocess.run([sys.executable, *python_options, "-m", "experiments.average_checkpoints", "--helpshort"],
                        cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not huge_pages.available(), reason="no glibc >= 2.35 / transparent huge pages")
def test_program_restarts_once_with_huge_pages():
  proc = _run()
  assert "--workdir" in proc.stdout + proc.stderr, proc.stderr  # the program ran (absl's help text)
  assert proc.stderr.count(NOTICE + "glibc.malloc.hugetlb=1") == 1


@pytest.mark.skipif(not huge_pages.available(), reason="no glibc >= 2.35 / transparent huge pages")
def test_the_restart_comes_before_the_program_imports_jax():
  # `-X importtime` (kept by the restart) logs every import of both processes: jax and the trainer are imported
  # once, by the restarted process, after the notice; the first process stopped at the package.
  proc = _run("-X", "importtime")
  assert proc.stderr.count(NOTICE) == 1, proc.stderr[-2000:]
  before, after = proc.stderr.split(NOTICE)
  imported = lambda text, module: any(line.rsplit("|", 1)[-1].strip() == module for line in text.splitlines())
  assert imported(before, "launch.huge_pages") and not imported(before, "jax")
  assert imported(after, "jax") and imported(after, "transformer_jax.run.trainer")


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
