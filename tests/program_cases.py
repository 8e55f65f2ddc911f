r"""Many command lines of one program at the cost of one start: each case is the real program, run in a fork.

    python tests/program_cases.py experiments.train < cases.json > results.json

Reads a JSON list of argument lists; imports what the program imports (not the program itself, whose flags are
defined at its import), then for each case forks a child that runs `python -m <program> <args>` as runpy does
(`sys.argv`, `__main__`), its stdout and stderr captured, and prints one JSON list of `{"returncode", "stdout",
"stderr"}`. A case costs milliseconds instead of a start of Python, JAX and the program's imports (seconds).
No JAX backend is started in the parent, so the children fork a process without threads of JAX's. Used by
`helpers.run_cases`.
"""

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import traceback

# Started as a file, Python puts tests/ first on the path; the programs are imported from the checkout.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASE_SECONDS = 120
PRELOADED = {  # what each program imports at its top (flags are defined by the program module itself)
    "experiments.train": ("launch", "transformer_jax.run.imported_workdir",
                          "transformer_jax.run.trainer", "ml_collections.config_flags"),
}


def _child(program: str, args: list, out_path: str, err_path: str) -> None:
  """Runs the program in this (forked) process with stdout/stderr to the files; never returns."""
  code = 0
  with open(out_path, "w") as out, open(err_path, "w") as err:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = os.fdopen(1, "w", closefd=False), os.fdopen(2, "w", closefd=False)
    sys.argv = [program.replace(".", "/") + ".py", *args]
    signal.alarm(CASE_SECONDS)  # a case the program wrongly accepts must not train for hours
    try:
      runpy.run_module(program, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
      code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # pylint: disable=broad-except (a traceback is what the caller checks for)
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
  os._exit(code)  # no atexit handlers of the parent's imports


def run(program: str, cases: list) -> list:
  """`[{returncode, stdout, stderr}]` of `python -m program *args` for each args of `cases`, in order."""
  for module in PRELOADED.get(program, ()):
    importlib.import_module(module)
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, args in enumerate(cases):
      out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        _child(program, args, out_path, err_path)
      _, status = os.waitpid(pid, 0)
      with open(out_path) as out, open(err_path) as err:
        results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(),
                        "stderr": err.read()})
  return results


if __name__ == "__main__":
  print(json.dumps(run(sys.argv[1], json.load(sys.stdin))))
