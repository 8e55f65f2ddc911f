"""The library's floors: no package imports one on its floor or above, no module circle inside a package, and
project imports sit at the top of the file.

The floors, lowest first (README's "Where things live" and docs/layout.md draw the same chain):

    accelerators / dropout / multihost -> config -> workdir / sharding -> data / attention -> model
      -> evaluation -> decoding / training -> serving -> run -> interop -> transformer_jax (the API)
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"

# Each unit (a root module or a subpackage) and its floor; a unit imports only units on lower floors. Inside a
# subpackage, modules import each other freely as long as they form no circle (test below).
FLOORS = {
    "accelerators": 0,  # chips' facts, TPU topologies, the backend rule: jax only
    "dropout": 0,       # fusable dropout masks
    "multihost": 0,     # the host collectives (process 0 decides, every host agrees)
    "config": 1,        # ModelConfig and presets
    "workdir": 2,       # the run directory's files and reuse keys (they name ModelConfig's fields)
    "sharding": 2,      # mesh, logical rules, placement, the one jit wrapper: knows only ModelConfig
    "data": 3,          # sources, tokenizer, normalisation, the streaming pipeline (DataConfig is its own leaf)
    "attention": 3,     # the math, the decoding caches, the layer
    "model": 4,
    "evaluation": 5,    # metrics (sacreBLEU, chrF), attention diagnostics, plots
    "decoding": 6,      # searches, the Transformer's step, the toolkit, host-side inference, int8 weights
    "training": 6,      # loss, optimizer and schedule, train state, the partitioned steps
    "serving": 7,       # a corpus translated across hosts, dynamic batching onto compiled shapes, the HTTP API
    "run": 8,           # the schema and the run's orchestration: factories, evaluators, checkpoints, the loop
    "interop": 9,       # conversions to and from other ecosystems
    "__init__": 10,     # the public API
}


def _unit(module: str) -> str:
  """`transformer_jax.run.trainer` -> `run`; `transformer_jax` -> `__init__`."""
  parts = module.split(".")
  unit = parts[1] if len(parts) > 1 else "__init__"
  assert unit in FLOORS, f"{module} has no floor in tests/test_layering.py: add its package or module"
  return unit


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    yield name, path


def _is_module(name: str) -> bool:
  path = PACKAGE.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _project_imports(tree: ast.Module):
  """(imported module, line, at top level) for every `transformer_jax` import in the file."""
  top = {id(node) for node in tree.body}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer_jax"):
      names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
               for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.startswith("transformer_jax")]
    else:
      continue
    for name in names:
      yield name, node.lineno, id(node) in top


@pytest.mark.parametrize("module, path", list(_modules()), ids=lambda x: str(x).split("/")[-1])
def test_no_module_imports_one_on_its_floor_or_above(module, path):
  tree = ast.parse(path.read_text())
  for imported, line, at_top in _project_imports(tree):
    assert at_top, f"{path.name}:{line} imports {imported} inside a function: project imports go at the top"
    if _unit(imported) == _unit(module):
      continue  # inside one package: the circle test below
    assert FLOORS[_unit(imported)] < FLOORS[_unit(module)], (
        f"{path.name}:{line}: {module} (floor {FLOORS[_unit(module)]}) imports {imported} "
        f"(floor {FLOORS[_unit(imported)]})")


def _package_graph(package: str) -> dict[str, set[str]]:
  """module -> the modules of the same package it imports (a package's __init__ left out: it re-exports)."""
  graph = {}
  for module, path in _modules():
    if module.startswith(f"transformer_jax.{package}.") and path.name != "__init__.py":
      graph[module] = {m for m, _, _ in _project_imports(ast.parse(path.read_text()))
                       if m.startswith(f"transformer_jax.{package}.") and m != module}
  return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
  """One import circle of `graph` (a list of modules, first == last), or [] when there is none."""
  state = {}

  def visit(node, trail):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return trail[trail.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt, trail + [nxt])):
        return found
    state[node] = "done"
    return []

  for node in sorted(graph):
    if node not in state and (found := visit(node, [node])):
      return found
  return []


@pytest.mark.parametrize("package", sorted(u for u in FLOORS if (PACKAGE / u).is_dir()))
def test_no_import_circle_inside_a_package(package):
  assert not _circle(_package_graph(package)), " -> ".join(_circle(_package_graph(package)))


def test_every_module_has_a_floor():
  assert {_unit(module) for module, _ in _modules()} == set(FLOORS)


def test_the_floors_are_few_and_the_root_is_small():
  assert len(FLOORS) <= 16
  root_modules = [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
  assert len(root_modules) <= 12, root_modules


def test_a_planted_import_up_a_floor_fails(tmp_path, monkeypatch):
  """The floor check catches the import that data/config.py exists to prevent (data reading the run's schema)."""
  planted = tmp_path / "transformer_jax" / "data"
  planted.mkdir(parents=True)
  (planted / "planted.py").write_text("from transformer_jax.run.experiment_config import ExperimentConfig\n")
  with pytest.raises(AssertionError, match="floor 3.*imports transformer_jax.run.experiment_config.*floor 8"):
    test_no_module_imports_one_on_its_floor_or_above("transformer_jax.data.planted", planted / "planted.py")


def test_the_circle_check_finds_a_planted_circle():
  graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
  assert _circle(graph) == ["a.x", "a.y", "a.z", "a.x"]
  assert _circle({"a.x": {"a.y"}, "a.y": set()}) == []


def test_library_reads_config_attributes_not_defaults():
  """Every config key lives in the schema (transformer_jax/run/experiment_config.py); the library never guesses one."""
  offenders = [f"{p.name}:{i}" for p in PACKAGE.rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1) if "config.get(" in line]
  offenders += [f"{p.name}:{node.lineno}" for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
                if _is_getattr_with_default_of_a_config(node)]
  assert not offenders, offenders


def _is_getattr_with_default_of_a_config(node: ast.AST) -> bool:
  """`getattr(<...config...>, "key", default)`: a default guessed for a config key (the `data.lowercase` slip)."""
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
          and len(node.args) == 3 and "config" in ast.unparse(node.args[0]))


def test_the_getattr_default_check_finds_the_slip_it_names():
  slip = ast.parse('bool(getattr(data_config, "lowercase", False))')
  assert any(_is_getattr_with_default_of_a_config(n) for n in ast.walk(slip))
  assert not any(_is_getattr_with_default_of_a_config(n) for n in ast.walk(ast.parse("getattr(config.evals, name)")))


UNTYPED = ("Any", "typing.Any", "object")


def _untyped_config_parameters(path: pathlib.Path):
  """(function, parameter, line) of every parameter named `*config` that is unannotated or annotated `Any`."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      args = node.args
      for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None and arg.arg.endswith("config") and (
            arg.annotation is None or ast.unparse(arg.annotation) in UNTYPED):
          yield getattr(node, "name", "<lambda>"), arg.arg, node.lineno


def test_no_library_function_takes_an_untyped_config():
  """A library function takes a typed config (`ExperimentConfig`, `DataConfig`, `MeshConfig`, `ModelConfig`),
  never an untyped one (an `ml_collections.ConfigDict` or `Any`): the programs convert at their boundary
  (`ExperimentConfig.from_config_dict`)."""
  offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} {function}({name})" for path in sorted(PACKAGE.rglob("*.py"))
               for function, name, line in _untyped_config_parameters(path)]
  assert not offenders, offenders


def test_the_untyped_config_check_finds_what_it_names(tmp_path):
  source = tmp_path / "m.py"
  source.write_text("def a(config): ...\ndef b(data_config: Any): ...\ndef c(config: DataConfig, x: Any): ...\n"
                    "f = lambda mesh_config: 0\n")
  assert [(f, p) for f, p, _ in _untyped_config_parameters(source)] == [
      ("a", "config"), ("b", "data_config"), ("<lambda>", "mesh_config")]


def _trainer_uses(tree: ast.Module):
  """(name, line) of each `trainer.<name>` in a file that imports `transformer_jax.run.trainer`."""
  if not any(isinstance(node, ast.ImportFrom) and node.module == "transformer_jax"
             and any(a.name == "trainer" for a in node.names) for node in ast.walk(tree)):
    return
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
      yield node.attr, node.lineno


def test_programs_use_the_trainer_only_to_run_training():
  """The trainer is the run's loop and lifecycle, not a toolbox: programs and benchmarks build models, optimizers,
  states and steps through `factories`, a trained model through `trained`, an import's config through
  `imported_workdir`; of `trainer` they use only `train_and_evaluate` and its `TrainResult`."""
  programs = [*(PACKAGE.parent / "experiments").rglob("*.py"), *(PACKAGE.parent / "benchmarks").rglob("*.py")]
  offenders = [f"{path.name}:{line} trainer.{name}" for path in sorted(programs)
               for name, line in _trainer_uses(ast.parse(path.read_text()))
               if name not in ("train_and_evaluate", "TrainResult")]
  assert not offenders, offenders


def _function_lengths(root: pathlib.Path):
  """(lines without the docstring, "file:line name") of every function under `root`."""
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        first = node.body[0]
        docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                     and isinstance(first.value.value, str))
        length = node.end_lineno - node.lineno + 1 - ((first.end_lineno - first.lineno + 1) if docstring else 0)
        yield length, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"


MAX_FUNCTION_LINES = 60  # a function reads on one screen (issue 52); the docstring does not count


def test_no_function_is_longer_than_a_screen():
  """The library, the programs and the benchmarks: every function under `MAX_FUNCTION_LINES` lines of code."""
  roots = [PACKAGE, PACKAGE.parent / "experiments", PACKAGE.parent / "benchmarks"]
  offenders = [(n, where) for root in roots for n, where in _function_lengths(root) if n > MAX_FUNCTION_LINES]
  assert not offenders, sorted(offenders, reverse=True)


def test_programs_never_import_the_benchmarks():
  """Folders stack as the library, then experiments/ (its programs and their glue), then benchmarks/ (which
  measure both and use the programs' glue): no module of experiments/ imports benchmarks/."""
  offenders = []
  for path in sorted((PACKAGE.parent / "experiments").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
               else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
      offenders += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] == "benchmarks"]
  assert not offenders, offenders


# The programs' floors: what each top-level package of programs may import besides the library.
PROGRAM_IMPORTS = {
    "launch": ("launch",),
    "experiments": ("launch", "experiments"),
    "benchmarks": ("launch", "experiments.configs", "benchmarks"),  # the recipes, never another program
}


def _program_files():
  for package in PROGRAM_IMPORTS:
    for path in sorted((PACKAGE.parent / package).rglob("*.py")):
      yield package, path


@pytest.mark.parametrize("package, path", list(_program_files()), ids=lambda x: str(x).split("/")[-1])
def test_programs_stand_on_the_library_the_launcher_and_the_recipes(package, path):
  for node in ast.walk(ast.parse(path.read_text())):
    names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
             else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
    for name in names:
      if name.split(".")[0] in PROGRAM_IMPORTS:
        assert name.startswith(PROGRAM_IMPORTS[package]), (
            f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}: {package}/ may import the library "
            f"and {', '.join(PROGRAM_IMPORTS[package])} only")


@pytest.mark.parametrize("package, path", list(_program_files()), ids=lambda x: str(x).split("/")[-1])
def test_programs_use_no_private_names_of_other_modules(package, path):
  """`module._name` reaches into another module's internals: programs use the library's public names."""
  tree = ast.parse(path.read_text())
  ours = ("transformer_jax", *PROGRAM_IMPORTS)
  modules = {alias.asname or alias.name.split(".")[-1] for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ours) or
             isinstance(node, ast.Import) and any(a.name.startswith(ours) for a in node.names)
             for alias in node.names}
  private = [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
             and node.attr.startswith("_") and not node.attr.startswith("__")]
  assert not private, private
