"""The library's layers: no module imports one above it; project imports sit at the top of the file.

    trainer / interop -> trained -> checkpoint -> data
      -> decoding (inference -> generate -> ensemble / prefix / constraints / alignment -> step -> search)
      / training -> model -> early_stopping -> attention (layer -> kvcache -> core) / trackers / owner_lock
      / sharding / metrics -> dropout / config / workdir / profiling / multihost
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"

# Rank of each module (or package prefix); a module may import only modules of a strictly lower rank, or
# siblings inside its own package (`data.*`, `training.*`, `interop.*`) of the same rank (the package's own).
RANKS = {
    "transformer_jax.config": 0, "transformer_jax.workdir": 0, "transformer_jax.metrics": 1,
    "transformer_jax.dropout": 0, "transformer_jax.data.normalize": 0,  # text normalisation: a leaf
    # attention: the math, below the decoding caches (typed entries + the decoder's accessors), below the layer
    "transformer_jax.attention.core": 1, "transformer_jax.attention.kvcache": 1.2,
    "transformer_jax.attention.layer": 1.4, "transformer_jax.attention": 1.5,
    "transformer_jax.profiling": 0,  # jax.profiler around chosen steps: a leaf
    "transformer_jax.multihost": 0,  # the host collectives (process 0 decides, every host agrees): jax only
    "transformer_jax.trackers": 1,   # metrics.jsonl, TensorBoard, W&B: writers that know only the workdir
    "transformer_jax.owner_lock": 1,  # train.lock: one trainer per workdir, local or gs://
    "transformer_jax.sharding": 1,  # mesh, logical rules, placement, THE jit wrapper: knows only ModelConfig
    "transformer_jax.early_stopping": 2,  # the rule over a metric's values (metrics' direction table)
    "transformer_jax.model": 2,
    "transformer_jax.training": 3, "transformer_jax.visualize": 3, "transformer_jax.diagnostics": 3,
    # decoding, above the model: the model-agnostic searches, the Transformer's step, the toolkit's wrappers
    # over the step seam, the one compiled decoding that combines them, host-side inference on top
    "transformer_jax.decoding.search": 3, "transformer_jax.decoding.scoring": 3,  # scoring: the model only
    "transformer_jax.decoding.mbr": 3,  # n-best selection by a sentence metric (metrics' BLEU), no model code
    "transformer_jax.decoding.step": 3.2,
    "transformer_jax.decoding.ensemble": 3.5, "transformer_jax.decoding.prefix": 3.5,
    "transformer_jax.decoding.alignment": 3.5, "transformer_jax.decoding.constraints": 3.5,
    "transformer_jax.decoding.generate": 3.7, "transformer_jax.decoding.inference": 3.9,
    "transformer_jax.decoding": 3.95,  # __init__: the searches' public names
    "transformer_jax.data": 4,
    "transformer_jax.checkpoint": 5,
    "transformer_jax.trained": 5.5,  # a trained workdir loaded for inference: checkpoint + tokenizer + config
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
  """Every config key lives in experiments/configs/default.py; the library never guesses one."""
  offenders = [f"{p.name}:{i}" for p in PACKAGE.rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1) if "config.get(" in line]
  assert not offenders, offenders
