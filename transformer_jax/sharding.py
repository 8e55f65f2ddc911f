"""Data, FSDP and tensor parallelism with one `jax.sharding.Mesh` and Flax logical axis names.

The model names every parameter axis (`vocab`, `embed`, `mlp`, `heads`, `kv`, None) and constrains its
activations (`batch`, `length`, `embed`, `mlp`); this module maps those names onto a 3-axis device mesh

    ('data', 'fsdp', 'tensor')      e.g. --config.mesh.data=-1 --config.mesh.fsdp=1 --config.mesh.tensor=1

and provides everything the training loop needs to run sharded under `jax.jit` (no `pmap`):

* `make_mesh` / `mesh_from_config`: the mesh (Auto axis types, which Flax logical partitioning needs; recent
  `jax.make_mesh` defaults to Explicit), refusing a shape whose product is not the device count.
* `LOGICAL_AXIS_RULES`: the default logical -> mesh table (see its comment), `validate_model_for_mesh`.
* `check_divisible`, `shardings_of`, `abstract_state`, `shardings_like`, `device_put_sharded`: the placement of
  a state (`training/state.py` creates the `TrainState` born sharded with them).
* `shard_batch` / `batch_sharding`: host NumPy batches -> global `jax.Array`s split over the batch axes
  (multi-process via `jax.make_array_from_process_local_data`).
* `partition(fn, mesh, rules, in_shardings=, out_shardings=)`: THE jit wrapper (t5x's partitioned callable):
  traced under the mesh and the rules so that the model's `nn.with_logical_constraint` calls resolve to real
  sharding constraints, with `.lower` for benchmarks. `training/partitioned.py` passes the train and eval
  steps through it (`jit_train_step` / `jit_eval_step`); training, evaluation, benchmarks and profiles use them.
* `mesh_context`: the same context for anything else (e.g. decoding on sharded params).
* `per_device_bytes` (state memory per device, for benchmarks), `sharding_summary` (for logs).

The host collectives (process 0's decisions on every host, barriers) are `transformer_jax.multihost`.

Three parallelism styles, all from the same rule table:

* data parallel (`data=N`): parameters and optimizer state replicated, batch rows split N ways, gradients
  all-reduced by XLA.
* FSDP / ZeRO-3 (`fsdp=N`): batch rows split N ways too, but every parameter and its Adam moments are split
  along their `embed` dimension; XLA all-gathers a weight before use and reduce-scatters its gradient.
* tensor parallel (`tensor=N`, Megatron style): attention heads, the FFN inner dimension and the vocabulary
  are split N ways; activations `[batch, length, mlp]` stay split along `mlp`, the batch is replicated over
  `tensor`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from transformer_jax.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh of a run (`config.mesh`): the size of each of `MESH_AXES`, -1 = the remaining devices."""

  data: int = -1                       # batch rows split this many ways, parameters replicated
  fsdp: int = 1                        # batch rows and every parameter's `embed` dimension split this many ways
  tensor: int = 1                      # heads, the FFN's inner dimension and the vocabulary split this many ways

LogicalRules = Sequence[tuple[str, Any]]

# Logical axis name -> mesh axis (or axes, or None = replicated). Flax applies the rules IN ORDER and never
# uses one mesh axis twice within one array, which this table relies on:
#   * `batch` comes first and takes ('data', 'fsdp'): FSDP is data parallelism with sharded weights, so the
#     rows are split over both axes. For activations `[batch, length, embed]` the later `embed -> fsdp` rule
#     then finds 'fsdp' taken and leaves `embed` unsharded (activations are split by rows, not features).
#   * `embed -> fsdp`: every parameter has an `embed` (d_model) dimension except the FFN/attention biases
#     over `mlp`/`heads` (small), so FSDP splits (almost) all weights and, through them, the Adam moments.
#   * `mlp`, `heads`, `vocab -> tensor`: Megatron tensor parallelism: W1 by columns and W2 by rows, Q/K/V by
#     heads and W^O by heads, the (shared) embedding and pre-softmax projection by vocabulary rows.
#   * `kv` (head_dim) and `length` are never split.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("embed", "fsdp"),
)


# ----------------------------------------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------------------------------------

def mesh_shape(data: int = -1, fsdp: int = 1, tensor: int = 1, num_devices: Optional[int] = None
               ) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with a single -1 resolved to the rest of the devices; refuses impossible shapes."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ValueError(f"mesh.{name}={size!r}: each mesh axis must be a positive integer or -1 (the rest)")
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"mesh {_describe(sizes)}: only one axis may be -1 (got {len(free)}: {', '.join(free)})")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f"mesh {_describe(sizes)}: the fixed axes multiply to {fixed}, which does not divide "
                       f"the {num_devices} devices, so mesh.{free[0]}=-1 cannot take the rest")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"mesh {_describe(sizes)}: the product {fixed} must equal the number of devices "
                     f"({num_devices}); set one axis to -1 to use the rest")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def _describe(sizes: Mapping[str, int]) -> str:
  return " x ".join(f"{name}={size}" for name, size in sizes.items())


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all of them, every process) with Auto axes.

  Devices of several TPU slices (`device.slice_index`) get a hybrid mesh: `data` is split across the slices
  (DCN) first, then within each; ValueError when `data` is not a multiple of the slice count.

  Flax's logical partitioning emits ordinary sharding constraints, which need Auto (GSPMD-propagated)
  axes; `jax.make_mesh` now defaults to Explicit axes, so the types are set here.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(data, fsdp, tensor, num_devices=len(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices == 1:
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  # Multi-slice (MaxText's DCN data parallelism): the slices split the data axis; fsdp, tensor and the rest of
  # data stay within a slice, on its ICI links. Only the gradients' all-reduce crosses DCN.
  if shape[0] % slices:
    raise ValueError(f"mesh data={shape[0]} must be a multiple of the {slices} slices: the data axis spans "
                     "the slices over DCN (fsdp and tensor stay within a slice)")
  grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, shape[1], shape[2]), (slices, 1, 1), devices)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def mesh_from_config(mesh_config: MeshConfig = MeshConfig(), devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """`make_mesh` of a run's `config.mesh` (`MeshConfig`: data, fsdp, tensor)."""
  return make_mesh(mesh_config.data, mesh_config.fsdp, mesh_config.tensor, devices=devices)


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Iterator[None]:
  """`jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)`: the model's logical constraints become real.

  Trace (i.e. first call) jitted model code inside it; outside, `nn.with_logical_constraint` is a no-op.
  `jax.set_mesh` cannot be entered inside `jax.jit`: wrap the call, not the function body.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


# ----------------------------------------------------------------------------------------------------------
# Rules and validation
# ----------------------------------------------------------------------------------------------------------

def _axis_size(mesh: Mesh, axes: Any) -> int:
  if axes is None:
    return 1
  if isinstance(axes, str):
    return mesh.shape[axes]
  return math.prod(mesh.shape[a] for a in axes)


def _mesh_axes_of(logical_name: str, rules: LogicalRules) -> Any:
  for name, axes in rules:
    if name == logical_name:
      return axes
  return None


_warned_vocab: set[tuple[int, int]] = set()


def validate_model_for_mesh(model_config: ModelConfig, mesh: Mesh,
                            rules: LogicalRules = LOGICAL_AXIS_RULES) -> tuple[tuple[str, Any], ...]:
  """Checks that `model_config` can be split as `rules` say on `mesh`; returns the rules to use.

  Raises ValueError naming the numbers when heads, d_ff or d_model do not divide by the mesh axes they are
  split over. A vocabulary that does not divide is not an error: its rule is dropped (the vocabulary
  dimension is replicated) with a warning; pad the vocabulary to a multiple to split it.
  """
  rules = tuple((name, axes) for name, axes in rules)
  unknown = {a for _, axes in rules for a in ((axes,) if isinstance(axes, str) else (axes or ()))
             } - set(mesh.axis_names)
  if unknown:
    raise ValueError(f"logical axis rules name mesh axes {sorted(unknown)}, the mesh has {mesh.axis_names}")
  checks = (("heads", "num_heads", model_config.num_heads),
            ("mlp", "d_ff", model_config.d_ff),
            ("embed", "d_model", model_config.d_model))
  errors = []
  for logical, field, size in checks:
    axes = _mesh_axes_of(logical, rules)
    ways = _axis_size(mesh, axes)
    if size % ways:
      errors.append(f"{field}={size} is not divisible by the {ways} devices of mesh axis {axes!r} that "
                    f"'{logical}' is split over")
  if errors:
    raise ValueError(f"model does not fit mesh {dict(mesh.shape)}: " + "; ".join(errors))
  vocab_axes = _mesh_axes_of("vocab", rules)
  vocab_ways = _axis_size(mesh, vocab_axes)
  if model_config.vocab_size % vocab_ways:
    if (model_config.vocab_size, vocab_ways) not in _warned_vocab:
      _warned_vocab.add((model_config.vocab_size, vocab_ways))
      logging.warning("vocab_size=%d is not divisible by the %d devices of mesh axis %r: the vocabulary "
                      "dimension is replicated instead (pad the vocabulary to a multiple of %d to split it)",
                      model_config.vocab_size, vocab_ways, vocab_axes, vocab_ways)
    rules = tuple((name, None if name == "vocab" else axes) for name, axes in rules)
  return rules


def batch_mesh_axes(rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
  """The mesh axes the batch rows are split over (('data', 'fsdp') by default)."""
  return _mesh_axes_of("batch", rules)


def batch_ways(mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> int:
  """How many devices a batch's rows are split over: the product of the batch axes' sizes (data x fsdp)."""
  return _axis_size(mesh, batch_mesh_axes(rules))


def batch_sharding(mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES, *, accum: bool = False
                   ) -> NamedSharding:
  """Sharding of batch arrays `[rows, length]` (or `[accum, rows, length]`): rows over the batch axes."""
  axes = batch_mesh_axes(rules)
  return NamedSharding(mesh, P(None, axes) if accum else P(axes))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# ----------------------------------------------------------------------------------------------------------
# A state's placement
# ----------------------------------------------------------------------------------------------------------

def path_name(path: Sequence[Any]) -> str:
  """A pytree key path as `"encoder/layer_0/.../kernel"`: dict keys, attribute names and sequence indices joined
  by "/" (`jax.tree_util.keystr`'s simple form), the names errors and checkpoint signatures use."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def check_divisible(abstract_tree: Any, shardings: Any) -> None:
  """Raises ValueError (naming up to five arrays, their shapes and mesh axes) unless every sharded dimension of
  `abstract_tree` divides by the devices of its mesh axes in `shardings` (jit refuses uneven in/out shardings)."""
  problems = []

  def check(path, leaf, sharding):
    for dim, (size, axes) in enumerate(zip(leaf.shape, tuple(sharding.spec) + (None,) * leaf.ndim)):
      ways = _axis_size(sharding.mesh, axes)
      if size % ways:
        problems.append(f"{path_name(path)} {tuple(leaf.shape)}: dimension {dim} ({size}) over mesh axis "
                        f"{axes!r} ({ways} devices)")

  jax.tree_util.tree_map_with_path(check, abstract_tree, shardings)
  if problems:
    raise ValueError("parameters cannot be split evenly as the rules say: " + "; ".join(problems[:5]) +
                     (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def single_device_mesh() -> Mesh:
  """A 1x1x1 ('data', 'fsdp', 'tensor') mesh on the first device: the unsharded case of every function here."""
  return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def shardings_of(tree: Any) -> Any:
  """The `.sharding` of every array of `tree`, as a tree of the same structure (jit in/out shardings)."""
  return jax.tree_util.tree_map(lambda x: x.sharding, tree)


def abstract_state(state: Any) -> Any:
  """`jax.ShapeDtypeStruct`s with shardings for `state` (a restore target that reads straight into shards)."""
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# ----------------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------------

def _rows_axis(array: np.ndarray, key: str) -> int:
  if array.ndim == 2:
    return 0
  if array.ndim == 3:
    return 1
  raise ValueError(f"batch[{key!r}] has shape {array.shape}; expected [rows, length] or "
                   "[accum, rows, length]")


def _local_batch_ways(mesh: Mesh, axes: Any) -> int:
  """How many distinct row blocks of the batch split this process's devices hold."""
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  positions = [mesh.axis_names.index(a) for a in names]
  local = np.vectorize(lambda d: d.process_index == jax.process_index(), otypes=[bool])(mesh.devices)
  return max(len({tuple(int(c[i]) for i in positions) for c in np.argwhere(local)}), 1)


_TOKEN_KEYS = ("inputs", "targets")  # batch keys that hold token ids (the rest: positions, segmentation)


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES, *,
                process_local: bool = True, pad_rows: bool = False,
                pad_id: Optional[int] = None) -> dict[str, jax.Array]:
  """Host NumPy batch -> global `jax.Array`s with rows split over the batch mesh axes.

  Arrays are `[rows, length]` or, with gradient accumulation, `[accum, rows, length]` (split along rows).

  process_local=True (training): each process passes ITS OWN rows (the data pipeline's per-host slice,
    `process_index`/`process_count`); the global batch is their concatenation
    (`jax.make_array_from_process_local_data`). With one process this is the whole batch.
  process_local=False (evaluation, decoding): every process passes the same, whole batch.
  pad_rows: append all-padding rows up to a multiple of the batch split: `inputs`/`targets` hold `pad_id`
    (the model's `ModelConfig.pad_id`, required then), other keys 0. Padding rows carry no target tokens, so
    summed eval metrics are unchanged. Without it an uneven row count is refused (ValueError).
  """
  if pad_rows and pad_id is None:
    raise ValueError("shard_batch(pad_rows=True) needs pad_id (the model's pad id) for the padding rows")
  axes = batch_mesh_axes(rules)
  ways = _axis_size(mesh, axes)
  out = {}
  for key, value in batch.items():
    array = np.asarray(value)
    axis = _rows_axis(array, key)
    spec = P(*([None] * axis), axes)
    sharding = NamedSharding(mesh, spec)
    # A process provides the rows of the distinct row blocks its own devices hold.
    multiple = _local_batch_ways(mesh, axes) if process_local else ways
    rows = array.shape[axis]
    if rows % multiple:
      if not pad_rows:
        what = "this process's rows" if process_local and jax.process_count() > 1 else "rows"
        raise ValueError(f"batch[{key!r}] has {rows} {what}, not divisible by the {multiple}-way batch split "
                         f"over mesh axes {axes!r} {dict(mesh.shape)}; make the rows per batch a multiple "
                         f"or pass pad_rows=True")
      pad = [(0, 0)] * array.ndim
      pad[axis] = (0, -rows % multiple)
      array = np.pad(array, pad, constant_values=pad_id if key in _TOKEN_KEYS else 0)
    if process_local:
      out[key] = jax.make_array_from_process_local_data(sharding, array)
    else:
      out[key] = jax.make_array_from_callback(array.shape, sharding, lambda index, a=array: a[index])
  return out


# ----------------------------------------------------------------------------------------------------------
# The one partitioned-callable road (t5x `partitioning.py`: `partition(fn, in_shardings, out_shardings)`)
# ----------------------------------------------------------------------------------------------------------

def shardings_like(tree: Any, shardings: Any) -> Any:
  """`shardings` (e.g. a state's) re-attached to the structure of `tree`, leaf for leaf.

  A `TrainState`'s tree structure includes its static fields (`apply_fn`, `tx`), so the shardings of one
  state are not a valid jit/device_put specification for another state built elsewhere (say, a reference
  state or one restored from a checkpoint) even when every array matches; this fixes that.
  Raises ValueError when the two trees hold different numbers of arrays.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  sharding_leaves = jax.tree_util.tree_leaves(shardings)
  if len(leaves) != len(sharding_leaves):
    raise ValueError(f"tree has {len(leaves)} arrays but the shardings have {len(sharding_leaves)}; "
                     "they describe different states")
  return jax.tree_util.tree_unflatten(treedef, sharding_leaves)


def device_put_sharded(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` leaf for leaf (see `shardings_like`); single-process host data."""
  return jax.device_put(tree, shardings_like(tree, shardings))


class PartitionedFunction:
  """`fn` under `jax.jit` with in/out shardings, traced and run inside `mesh_context(mesh, rules)`.

  Call it like `fn`; `.lower(*args)` gives the `jax.stages.Lowered` of exactly the program a call runs
  (benchmarks time it, tests compare it). Positional arguments only. An argument whose tree structure is not
  that of its `in_shardings` entry but holds the same arrays (a `TrainState` built or restored elsewhere has
  other static fields) gets the shardings re-attached (`shardings_like`), and so does every `out_shardings`
  entry that is that same object; one jitted program is kept per argument structure.

  `.compile(*args)` (arrays or `jax.ShapeDtypeStruct`s) compiles ahead of time and keeps the executable: a
  later call whose arguments' leaves have the same shapes and dtypes, in order, runs it without compiling again
  (the trainer runs the step its fit check, `plan.check_run_fits`, compiled on abstract arguments). Leaves are
  passed in the compiled program's structure (a `TrainState` built elsewhere has other static fields: its
  optimizer object) and the executable checks their shardings itself (`jax.stages.Compiled`: committed arrays
  on other shardings raise ValueError).
  """

  def __init__(self, fn: Callable, mesh: Mesh, rules: LogicalRules, in_shardings: tuple,
               out_shardings: Any, donate_argnums: tuple[int, ...] = ()):
    self.fn, self.mesh, self.rules = fn, mesh, tuple(rules)
    self.in_shardings, self.out_shardings = tuple(in_shardings), out_shardings
    self.donate_argnums = tuple(donate_argnums)
    self._jitted: dict[tuple, Callable] = {}
    self._compiled: dict[tuple, jax.stages.Compiled] = {}

  def _bind(self, args: tuple) -> Callable:
    key = tuple(jax.tree_util.tree_structure(a) for a in args)
    if key not in self._jitted:
      in_shardings, out_shardings = list(self.in_shardings), self.out_shardings
      for i, (arg, spec) in enumerate(zip(args, self.in_shardings)):
        if isinstance(spec, jax.sharding.Sharding) or jax.tree_util.tree_structure(arg) == \
            jax.tree_util.tree_structure(spec):
          continue
        in_shardings[i] = shardings_like(arg, spec)
        out_shardings = jax.tree_util.tree_map(
            lambda o, spec=spec, new=in_shardings[i]: new if o is spec else o, out_shardings,
            is_leaf=lambda o, spec=spec: o is spec)
      self._jitted[key] = jax.jit(self.fn, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                                  donate_argnums=self.donate_argnums)
    return self._jitted[key]

  def __call__(self, *args):
    if self._compiled:
      leaves = jax.tree_util.tree_leaves(args)
      compiled = self._compiled.get(_leaf_signature(leaves))
      if compiled is not None:
        return compiled(*jax.tree_util.tree_unflatten(compiled.in_tree.children()[0], leaves))
    with mesh_context(self.mesh, self.rules):
      return self._bind(args)(*args)

  def lower(self, *args) -> jax.stages.Lowered:
    with mesh_context(self.mesh, self.rules):
      return self._bind(args).lower(*args)

  def compile(self, *args) -> jax.stages.Compiled:
    """`self.lower(*args).compile()`, kept for later calls on arguments of the same shapes and dtypes."""
    compiled = self.lower(*args).compile()
    self._compiled[_leaf_signature(jax.tree_util.tree_leaves(args))] = compiled
    return compiled


def _leaf_signature(leaves: list) -> tuple:
  """((shape, dtype) of each leaf of a call's arguments): what a kept executable is looked up by."""
  return tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)


def partition(fn: Callable, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES, *, in_shardings: tuple,
              out_shardings: Any, donate_argnums: tuple[int, ...] = ()) -> PartitionedFunction:
  """`fn` jitted for `mesh` with these shardings (see `PartitionedFunction`); the only jit wrapper here."""
  return PartitionedFunction(fn, mesh, rules, in_shardings, out_shardings, donate_argnums)


# ----------------------------------------------------------------------------------------------------------
# Inspection
# ----------------------------------------------------------------------------------------------------------

def per_device_bytes(tree: Any) -> dict[jax.Device, int]:
  """Bytes of the addressable shards of every array in `tree`, per device (this process's devices)."""
  totals: dict[jax.Device, int] = collections.defaultdict(int)
  for leaf in jax.tree_util.tree_leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    itemsize = np.dtype(leaf.dtype).itemsize if not jax.dtypes.issubdtype(
        leaf.dtype, jax.dtypes.prng_key) else 8
    for shard in leaf.addressable_shards:
      totals[shard.device] += math.prod(shard.data.shape) * itemsize
  return dict(sorted(totals.items(), key=lambda kv: kv[0].id))


def sharding_summary(tree: Any, max_lines: Optional[int] = None) -> str:
  """One line per array: path, global shape, partition spec (for logs)."""
  lines = []

  def describe(path, leaf):
    if isinstance(leaf, jax.Array):
      spec = getattr(leaf.sharding, "spec", leaf.sharding)
      lines.append(f"{path_name(path)} {tuple(leaf.shape)} {spec}")

  jax.tree_util.tree_map_with_path(describe, tree)
  if max_lines is not None and len(lines) > max_lines:
    lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more)"]
  return "\n".join(lines)
