"""The library's layers: no module imports one above it; project imports sit at the top of the file.

    trainer / interop -> trained -> factories / imported_workdir -> checkpoint -> evaluators / run_checks -> data
      -> decoding (inference -> generate -> ensemble / prefix / constraints / alignment -> step -> search)
      / training -> experiment_config -> model -> early_stopping -> attention (layer -> kvcache -> core)
      / trackers / owner_lock / sharding / metrics / train_log -> dropout / config / workdir / profiling / multihost
      / stop_signal
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"

# Rank of each module (or package prefix); a module may import only modules of a strictly lower rank, or
# siblings inside its own package (`data.*`, `training.*`, `interop.*`) of the same rank (the package's own).
RANKS = {
    "transformer_jax.config": 0, "transformer_jax.workdir": 0.5,  # the workdir's reuse keys name the model's fields
    "transformer_jax.metrics": 1,
    "transformer_jax.dropout": 0, "transformer_jax.data.normalize": 0,  # text normalisation: a leaf
    "transformer_jax.data.config": 0,  # DataConfig, the schema's data section: a leaf the data package reads
    # attention: the math, below the decoding caches (typed entries + the decoder's accessors), below the layer
    "transformer_jax.attention.core": 1, "transformer_jax.attention.kvcache": 1.2,
    "transformer_jax.attention.layer": 1.4, "transformer_jax.attention": 1.5,
    "transformer_jax.profiling": 0,  # jax.profiler around chosen steps: a leaf
    "transformer_jax.multihost": 0,  # the host collectives (process 0 decides, every host agrees): jax only
    "transformer_jax.accelerators": -1,  # chips' facts, TPU topologies, the backend rule: jax only
    "transformer_jax.stop_signal": 0.5,  # SIGTERM/SIGINT and the preemption notice (multihost)
    "transformer_jax.train_log": 1,  # the training scalars between logging steps (NonFiniteLossError)
    "transformer_jax.trackers": 1,   # metrics.jsonl, TensorBoard, W&B: writers that know only the workdir
    "transformer_jax.owner_lock": 1,  # train.lock: one trainer per workdir, local or gs://
    "transformer_jax.sharding": 1,  # mesh, logical rules, placement, THE jit wrapper: knows only ModelConfig
    "transformer_jax.early_stopping": 2,  # the rule over a metric's values (metrics' direction table)
    "transformer_jax.model": 2,
    "transformer_jax.training.schedule": 0.5,  # learning-rate schedule, cool-down, dropout stages: jax/optax only
    "transformer_jax.decoding.mbr": 1.5,  # n-best selection by a sentence metric (metrics' BLEU), no model code
    # the experiment schema: every key, its default, meaning and rule (ModelConfig, MeshConfig, the schedule's,
    # trackers' and MBR's names nested); below everything that reads a typed config
    "transformer_jax.experiment_config": 2.5,
    "transformer_jax.budget": 2.7,  # the time budget: pure decisions over the typed config and the schedule
    "transformer_jax.training": 3, "transformer_jax.visualize": 3, "transformer_jax.diagnostics": 3,
    # decoding, above the model: the model-agnostic searches, the Transformer's step, the toolkit's wrappers
    # over the step seam, the one compiled decoding that combines them, host-side inference on top
    "transformer_jax.decoding.search": 3, "transformer_jax.decoding.scoring": 3,  # scoring: the model only
    "transformer_jax.decoding.step": 3.2,
    "transformer_jax.decoding.ensemble": 3.5, "transformer_jax.decoding.prefix": 3.5,
    "transformer_jax.decoding.alignment": 3.5, "transformer_jax.decoding.constraints": 3.5,
    "transformer_jax.decoding.generate": 3.7, "transformer_jax.decoding.inference": 3.9,
    "transformer_jax.decoding": 3.95,  # __init__: the searches' public names
    "transformer_jax.data": 4,
    "transformer_jax.evaluators": 4.5,  # loss / attention / BLEU evaluators: eval step, decoding, metrics
    "transformer_jax.run_checks": 4.5,  # a run's refusals: config vs tables and mesh, batch vs tables
    "transformer_jax.checkpoint": 5,
    # config -> model config, optimizer, train state, compiled steps, checkpointer (trainer and benchmarks)
    "transformer_jax.factories": 5.2,
    "transformer_jax.imported_workdir": 5.2,  # what a run does in a workdir holding an imported model
    # the run's steps compiled on abstract arrays (a TPU topology too): memory, cost, collectives, fit refusal
    "transformer_jax.plan": 5.3,
    "transformer_jax.trained": 5.5,  # a trained workdir loaded for inference: checkpoint + tokenizer + config
    "transformer_jax.corpus": 4.6,  # a corpus translated in shards across hosts: decoding, data, multihost
    "transformer_jax.serving.batching": 4.7,  # dynamic batching onto compiled shapes: decoding only
    "transformer_jax.serving.http": 4.8,  # the Starlette API over the batcher (the serve extra)
    "transformer_jax.serving": 4.9,
    "transformer_jax.quantization": 0.5,  # weight-only int8 parameters (qwix): jax only
    "transformer_jax.trainer": 6, "transformer_jax.interop": 6,
    "transformer_jax": 7,  # __init__: the public API, imports anything
}


def _rank(module: str) -> int:
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in RANKS:
      return RANKS[".".join(parts[:n])]
  raise AssertionError(f"{module} has no rank in tests/test_layering.py: add it")


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
def test_no_module_imports_one_above_it(module, path):
  tree = ast.parse(path.read_text())
  for imported, line, at_top in _project_imports(tree):
    assert at_top, f"{path.name}:{line} imports {imported} inside a function: project imports go at the top"
    if module == "transformer_jax" or imported.startswith(module + "."):
      continue  # a package's __init__ re-exporting its own modules
    same_package = module.rsplit(".", 1)[0] == imported.rsplit(".", 1)[0] and module.count(".") > 1
    if same_package and _rank(imported) == _rank(module):
      continue
    assert _rank(imported) < _rank(module), (
        f"{path.name}:{line}: {module} (layer {_rank(module)}) imports {imported} (layer {_rank(imported)})")


def test_library_reads_config_attributes_not_defaults():
  """Every config key lives in the schema (transformer_jax/experiment_config.py); the library never guesses one."""
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
  """(name, line) of each `trainer.<name>` in a file that imports `transformer_jax.trainer`."""
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
