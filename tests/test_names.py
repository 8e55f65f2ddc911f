"""Names: every global a function reads is defined, and pyflakes finds nothing in the tree.

The benchmark sections run only under `make bench` (minutes each), so a name removed in a refactor (say a helper
moved into `common`) would otherwise surface as a NameError in the middle of a benchmark run. This reads each
function's bytecode (`LOAD_GLOBAL`) and checks the name against the module's globals and the builtins; names
bound only at run time (`global x` assignments) are checked the same way, so there are none to skip.
"""

import builtins
import dis
import importlib
import os
import pkgutil
import subprocess
import sys
import types

import pytest

import benchmarks
import launch
import transformer_jax

PACKAGES = (transformer_jax, launch, benchmarks)


def _modules():
  for package in PACKAGES:
    yield package.__name__
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
      yield info.name


def _code_objects(code: types.CodeType):
  yield code
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      yield from _code_objects(const)


def _undefined_globals(module) -> list[str]:
  source = getattr(module, "__file__", None)
  if source is None:
    return []
  with open(source, encoding="utf-8") as f:
    top = compile(f.read(), source, "exec")
  defined = set(vars(module)) | set(dir(builtins))
  missing = []
  for code in _code_objects(top):
    if code is top:
      continue  # module level ran at import: a missing name there already failed
    for instruction in dis.get_instructions(code):
      if instruction.opname == "LOAD_GLOBAL" and instruction.argval not in defined:
        missing.append(f"{code.co_name}: {instruction.argval}")
  return missing


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_global_a_function_reads_is_defined(name):
  module = importlib.import_module(name)
  assert _undefined_globals(module) == []


def test_the_check_finds_an_undefined_name(tmp_path, monkeypatch):
  (tmp_path / "broken_for_test.py").write_text("def f():\n  return preset_config(1)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert _undefined_globals(importlib.import_module("broken_for_test")) == ["f: preset_config"]


def test_pyflakes_finds_no_unused_import_or_undefined_name():
  """Unused imports, undefined names, shadowed loop variables ... in the library, the programs and the tests."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-m", "pyflakes", "transformer_jax", "launch", "experiments", "benchmarks",
                           "tests"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
