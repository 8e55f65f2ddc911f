"""Checkpointing of training runs with Orbax (`orbax-checkpoint` 0.12.x `CheckpointManager` API).

One checkpoint step directory `<directory>/<step>/` holds these items:

* `state`   the `TrainState` pytree (`step`, `params`, `opt_state`; `apply_fn`/`tx` are static and not saved),
* `rng`     `{"key": uint32 key data}` (a typed key is stored as its `jax.random.key_data`),
* `data`    JSON: the input iterator position, e.g. `{"epoch": 3, "index": 1200, "seed": 0}`,
* `config`  JSON: the resolved experiment config as a plain dict,
* `metrics` JSON, optional: e.g. validation BLEU/loss (Orbax's own metrics item; used to keep the best step).

Orbax writes a step into a temporary directory and renames it when every item is finalized, so a step
that `all_steps()` lists was complete when it was written. It can still be damaged later (a truncated
file); `Checkpointer.restore_latest_complete` then falls back to older steps and deletes nothing.

Restoring onto an abstract target (`jax.eval_shape` output whose leaves carry `.sharding`) reads each array
straight into the target sharding, so a checkpoint written on one device count / mesh restores onto another.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_policies

logger = logging.getLogger(__name__)

PyTree = Any

CHECKPOINT_SUBDIR = "checkpoints"
STATE, RNG, DATA, CONFIG = "state", "rng", "data", "config"
METRICS = "metrics"  # the item name Orbax's CheckpointManager reads metrics from
_RNG_KEY = "key"
_MAX_ERROR_CHARS = 600


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored step. Unpacks as `state, rng, data_state, config, metrics`; `.step` says which step it was."""

  state: PyTree
  rng: jax.Array | None
  data_state: dict
  config: dict
  metrics: dict | None
  step: int

  def __iter__(self):
    return iter((self.state, self.rng, self.data_state, self.config, self.metrics))


# --------------------------------------------------------------------------------------------------------
# Small helpers.


def checkpoint_dir(workdir: str | os.PathLike) -> str:
  """`<workdir>/checkpoints`, the directory a training run keeps its checkpoints in."""
  return os.path.join(os.fspath(workdir), CHECKPOINT_SUBDIR)


def to_jsonable(value: Any) -> Any:
  """A JSON-serialisable deep copy: dataclasses/mappings -> dicts, tuples -> lists, numpy/jax scalars -> Python.

  The copy also decouples the saved JSON from the caller's objects, which matters for asynchronous saves
  (the JSON items are written in a background thread after `save` returns).
  """
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_jsonable(v) for v in value]
  if isinstance(value, (str, bool)) or value is None:
    return value
  if isinstance(value, (int, float)):
    return value
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    array = np.asarray(value)
    if array.ndim == 0:
      return array.item()
    return array.tolist()
  if isinstance(value, np.dtype):
    return str(value)
  # e.g. jnp dtypes, enums, paths: their string form.
  return str(value)


def _metric_score(metric: str, mode: str):
  """`best_fn` for Orbax: the metric value; missing/NaN values rank worst."""
  worst = -math.inf if mode == "max" else math.inf

  def score(metrics: PyTree) -> float:
    try:
      value = float(metrics[metric])
    except (KeyError, TypeError, ValueError):
      return worst
    return worst if math.isnan(value) else value

  return score


@dataclasses.dataclass
class BestByMetric:
  """Preservation policy: keep the `n` best steps by `metrics[metric]` (steps without it are not kept)."""

  metric: str
  mode: str = "max"
  n: int = 1

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    score = _metric_score(self.metric, self.mode)
    scored = []
    for index, info in enumerate(checkpoints):
      if info.metrics is None:
        continue
      value = score(info.metrics)
      if math.isinf(value):
        continue
      scored.append((value, info.step, index))
    # Best first; among equal values the newer step wins.
    scored.sort(key=lambda item: (item[0] if self.mode == "max" else -item[0], item[1]), reverse=True)
    keep = {index for _, _, index in scored[:self.n]}
    return [index in keep for index in range(len(checkpoints))]


def _first_sharding(tree: PyTree) -> jax.sharding.Sharding | None:
  for leaf in jax.tree_util.tree_leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
      return sharding
  return None


def replicated_sharding_like(tree: PyTree) -> jax.sharding.Sharding:
  """A fully replicated sharding over the devices the leaves of `tree` use (device 0 if none carry one)."""
  sharding = _first_sharding(tree)
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  if len(devices) == 1:
    return jax.sharding.SingleDeviceSharding(devices[0])
  mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _as_abstract(tree: PyTree, default_sharding: jax.sharding.Sharding) -> PyTree:
  """`jax.ShapeDtypeStruct` leaves with a sharding (missing ones get `default_sharding`).

  Orbax restores a `ShapeDtypeStruct` leaf without a sharding as a NumPy array, which a later jitted step
  would then place on the default device; giving every leaf a sharding keeps the restore on-device.
  """

  def leaf(x):
    if x is None:
      return None
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
      sharding = default_sharding
    shape = tuple(getattr(x, "shape", np.shape(x)))
    dtype = getattr(x, "dtype", None)
    if dtype is None:  # Python scalars (e.g. a fresh TrainState's `step`): JAX's default dtype.
      dtype = jnp.asarray(x).dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  return jax.tree_util.tree_map(leaf, tree)


def _abstract_from_metadata(metadata_tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
  """An abstract target mirroring a saved tree's metadata, every array placed with `sharding`."""

  def is_leaf(x):
    return isinstance(x, ocp.metadata.value.Metadata)

  def leaf(meta):
    if isinstance(meta, ocp.metadata.value.ArrayMetadata):
      return jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=sharding)
    return meta

  return jax.tree_util.tree_map(leaf, metadata_tree, is_leaf=is_leaf)


def _rng_key_data(rng: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  return rng


def _step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, str(step))


def _item_tree_metadata(directory: str, step: int, item: str) -> PyTree:
  """The saved tree metadata (shapes, dtypes) of an array item, read without touching other items."""
  handler = ocp.handlers.StandardCheckpointHandler()
  try:
    return handler.metadata(epath.Path(_step_dir(directory, step)) / item).tree
  finally:
    handler.close()


def _handler_registry(state_handler: str = "standard") -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Which Orbax handler saves/restores each item (so a fresh manager can restore without a prior save)."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  if state_handler == "standard":
    registry.add(STATE, ocp.args.StandardSave, ocp.handlers.StandardCheckpointHandler())
    registry.add(STATE, ocp.args.StandardRestore, ocp.handlers.StandardCheckpointHandler())
  else:  # "pytree": for partial restores (`PyTreeRestore(partial_restore=True)`); same on-disk format.
    registry.add(STATE, ocp.args.PyTreeSave, ocp.handlers.PyTreeCheckpointHandler())
    registry.add(STATE, ocp.args.PyTreeRestore, ocp.handlers.PyTreeCheckpointHandler())
  registry.add(RNG, ocp.args.StandardSave, ocp.handlers.StandardCheckpointHandler())
  registry.add(RNG, ocp.args.StandardRestore, ocp.handlers.StandardCheckpointHandler())
  for item in (DATA, CONFIG):
    registry.add(item, ocp.args.JsonSave, ocp.handlers.JsonCheckpointHandler())
    registry.add(item, ocp.args.JsonRestore, ocp.handlers.JsonCheckpointHandler())
  return registry


class _Manager(ocp.CheckpointManager):
  """`CheckpointManager` whose per-step metrics reads tolerate a damaged metrics file.

  Orbax reads every step's metrics when the manager is created and only tolerates a missing file, so one
  truncated `<step>/metrics/metrics` would make the whole directory unusable. Here such a step counts as
  having no metrics (it is kept or deleted like any step without them).
  """

  def metrics(self, step: int) -> PyTree | None:
    try:
      return super().metrics(step)
    except Exception as error:  # pylint: disable=broad-except
      logger.warning("Could not read the metrics of checkpoint step %d in %s (%s: %s); ignoring them.",
                     step, self.directory, type(error).__name__, error)
      return None


# --------------------------------------------------------------------------------------------------------
# The checkpointer.


class Checkpointer:
  """A thin wrapper around `ocp.CheckpointManager` for one run's `<workdir>/checkpoints` directory.

  Args:
    directory: the checkpoint directory (use `checkpoint_dir(workdir)` or `Checkpointer.for_workdir`).
    max_to_keep: keep the newest `max_to_keep` steps (None: keep all).
    best_metric: if set, additionally keep the `keep_best` best steps by `metrics[best_metric]`, even after
      they age out of the newest `max_to_keep`.
    best_mode: "max" (e.g. BLEU) or "min" (e.g. loss).
    keep_best: how many best steps to keep.
    save_interval_steps: `save(step)` without `force` only writes every this many steps.
    enable_async_checkpointing: write in a background thread; `save` returns once the arrays are copied
      off the device. Call `wait()` before reading the files or exiting (or use `close()`/`with`).
    read_only: never write or delete (for evaluation/translation programs).
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 5,
               best_metric: str | None = None, best_mode: str = "max", keep_best: int = 1,
               save_interval_steps: int = 1, enable_async_checkpointing: bool = True,
               read_only: bool = False):
    if best_mode not in ("min", "max"):
      raise ValueError(f"best_mode={best_mode!r}; expected 'min' or 'max'")
    if keep_best < 1:
      raise ValueError(f"keep_best={keep_best} must be >= 1")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 or None")
    self.directory = os.path.abspath(os.fspath(directory))
    self.best_metric = best_metric
    self.best_mode = best_mode
    policies: list = [ocp_policies.LatestN(n=max_to_keep)]
    if best_metric is not None:
      policies.append(BestByMetric(best_metric, best_mode, keep_best))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else save_interval_steps,
        # Deletion is decided by `preservation_policy` alone (latest K + best by metric). `best_fn` stays
        # unset: with it the manager warns on every save without metrics; `save` writes the metrics item
        # itself instead (same `<step>/metrics/metrics` file the manager reads back).
        preservation_policy=ocp_policies.AnyPreservationPolicy(policies),
        enable_async_checkpointing=enable_async_checkpointing,
        read_only=read_only,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
    )
    self._manager = _Manager(self.directory, options=options,
                             handler_registry=_handler_registry())

  @classmethod
  def for_workdir(cls, workdir: str | os.PathLike, **kwargs) -> "Checkpointer":
    return cls(checkpoint_dir(workdir), **kwargs)

  @property
  def manager(self) -> ocp.CheckpointManager:
    return self._manager

  # -- bookkeeping ---------------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """The best step by `best_metric` among the kept ones (None without `best_metric` or metrics)."""
    if self.best_metric is None:
      return None
    self.wait()
    score = _metric_score(self.best_metric, self.best_mode)
    sign = 1.0 if self.best_mode == "max" else -1.0
    best = None
    for step in self.all_steps():
      metrics = self.metrics(step)
      value = None if metrics is None else score(metrics)
      if value is None or math.isinf(value):
        continue
      if best is None or (sign * value, step) >= (sign * best[0], best[1]):
        best = (value, step)
    return None if best is None else best[1]

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def metrics(self, step: int) -> dict | None:
    """The metrics saved with `step` (None if none were)."""
    return self._manager.metrics(step)

  def reload(self) -> None:
    """Re-read the directory (after another process wrote or deleted steps)."""
    self._manager.reload()

  def wait(self) -> None:
    """Block until pending asynchronous saves (and the deletions they trigger) are finished."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- save ----------------------------------------------------------------------------------------------

  def save(self, step: int, state: PyTree, rng: jax.Array | None, data_state: Mapping | None,
           config_dict: Mapping | Any | None, metrics: Mapping | None = None, force: bool = False,
           custom_metadata: Mapping | None = None) -> bool:
    """Saves one step; returns whether a save was started.

    Without `force`, only steps the save interval allows (and newer than the latest) are written. A step
    that already exists is never overwritten (returns False). With asynchronous checkpointing the call
    returns once the arrays are copied off the devices; `wait()` blocks until the files are final.
    """
    step = int(step)
    if step in self._manager.all_steps():
      logger.info("Checkpoint for step %d already exists in %s; not saving it again.", step, self.directory)
      return False
    items = {
        STATE: ocp.args.StandardSave(state),
        DATA: ocp.args.JsonSave(to_jsonable(dict(data_state or {}))),
        CONFIG: ocp.args.JsonSave(to_jsonable(config_dict if config_dict is not None else {})),
    }
    if rng is not None:
      items[RNG] = ocp.args.StandardSave({_RNG_KEY: _rng_key_data(rng)})
    if metrics is not None:
      metrics = to_jsonable(dict(metrics))
      items[METRICS] = ocp.args.JsonSave(metrics)
    return bool(self._manager.save(
        step, args=ocp.args.Composite(**items),
        metrics=metrics,  # the manager's in-memory record, which the preservation policy sees
        force=force,
        custom_metadata=None if custom_metadata is None else to_jsonable(dict(custom_metadata))))

  # -- restore -------------------------------------------------------------------------------------------

  def _has_item(self, step: int, item: str) -> bool:
    return os.path.isdir(os.path.join(_step_dir(self.directory, step), item))

  def restore(self, step: int | None = None, abstract_state: PyTree | None = None, *,
              abstract_rng: jax.ShapeDtypeStruct | None = None) -> Restored:
    """Restores `step` (default: the latest) as `(state, rng, data_state, config, metrics)`.

    `abstract_state` is the target: typically `jax.eval_shape(make_state)` with each leaf's `sharding`
    set (`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`); arrays are read straight into those
    shardings, whatever device count/mesh wrote the checkpoint. Leaves without a sharding are placed like
    the rng (replicated over the target's devices). Without `abstract_state`, the state comes back as the
    saved nested dicts/lists placed with the shardings recorded at save time (same topology only).
    The rng is restored replicated over the devices of `abstract_state` unless `abstract_rng` says otherwise.
    """
    self.wait()  # a step still being written asynchronously is not readable yet
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No checkpoints in {self.directory}.")
    step = int(step)
    replicated = replicated_sharding_like(abstract_state)
    items = {DATA: ocp.args.JsonRestore(), CONFIG: ocp.args.JsonRestore()}
    if abstract_state is None:
      items[STATE] = ocp.args.StandardRestore()
    else:
      items[STATE] = ocp.args.StandardRestore(_as_abstract(abstract_state, replicated))
    has_rng = self._has_item(step, RNG)
    if has_rng:
      if abstract_rng is None:
        rng_meta = _item_tree_metadata(self.directory, step, RNG)
        rng_target = _abstract_from_metadata(rng_meta, replicated)
      else:
        rng_target = {_RNG_KEY: _as_abstract(abstract_rng, replicated)}
      items[RNG] = ocp.args.StandardRestore(rng_target)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    rng = restored[RNG][_RNG_KEY] if has_rng else None
    return Restored(state=restored[STATE], rng=rng, data_state=restored[DATA], config=restored[CONFIG],
                    metrics=self.metrics(step), step=step)

  def restore_latest_complete(self, abstract_state: PyTree | None = None, *,
                              abstract_rng: jax.ShapeDtypeStruct | None = None) -> Restored | None:
    """Restores the newest step that reads back without error (`.step` of the result says which).

    A step that fails to restore (truncated/corrupt file, missing item, ...) is logged as a warning
    naming the step and the error, and the previous step is tried. Nothing is deleted. Returns None when
    there are no steps; raises `RuntimeError` (listing each step's error) when every step fails.
    """
    self.wait()
    self.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    errors = []
    for step in steps:
      try:
        return self.restore(step, abstract_state, abstract_rng=abstract_rng)
      except Exception as error:  # pylint: disable=broad-except
        message = f"{type(error).__name__}: {error}"
        if len(message) > _MAX_ERROR_CHARS:  # TensorStore errors embed whole JSON specs.
          message = message[:_MAX_ERROR_CHARS] + " ..."
        logger.warning("Could not restore checkpoint step %d in %s (%s); falling back to an older step.",
                       step, self.directory, message)
        errors.append(f"step {step}: {message}")
    raise RuntimeError(f"No checkpoint in {self.directory} could be restored:\n" + "\n".join(errors))

  def restore_params(self, step: int | None = None, abstract_params: PyTree | None = None, *,
                     sharding: jax.sharding.Sharding | None = None) -> PyTree:
    """Only `state.params` of `step` (see `restore_params_only`)."""
    self.wait()
    return restore_params_only(self.directory, step, abstract_params=abstract_params, sharding=sharding)[1]


# --------------------------------------------------------------------------------------------------------
# Inference-side helpers.


def _read_only_manager(directory: str, state_handler: str = "standard") -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                         save_interval_steps=0)
  return _Manager(os.path.abspath(os.fspath(directory)), options=options,
                  handler_registry=_handler_registry(state_handler))


def restore_params_only(directory: str | os.PathLike, step: int | None = None, *,
                        abstract_params: PyTree | None = None,
                        sharding: jax.sharding.Sharding | None = None) -> tuple[int, PyTree]:
  """`(step, params)`: just `state.params` of a checkpoint, without building or reading the optimizer state.

  Uses a partial restore (`ocp.args.PyTreeRestore(..., partial_restore=True)`), so `opt_state` is never
  read. Arrays are placed like `abstract_params` (leaves with `.sharding`); without it, the shapes come
  from the checkpoint metadata and every array goes to `sharding` (default: the first device).
  """
  manager = _read_only_manager(os.fspath(directory), state_handler="pytree")
  try:
    if step is None:
      step = manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"No checkpoints in {directory}.")
    step = int(step)
    default = sharding or replicated_sharding_like(abstract_params)
    if abstract_params is None:
      metadata = _item_tree_metadata(manager.directory, step, STATE)
      target = {"params": _abstract_from_metadata(metadata["params"], default)}
    else:
      target = {"params": _as_abstract(abstract_params, default)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)}))
    return step, restored[STATE]["params"]
  finally:
    manager.close()


def restore_params(directory: str | os.PathLike, model_config: Any = None, step: int | None = None, *,
                   sharding: jax.sharding.Sharding | None = None) -> PyTree:
  """The params of `step` (default: latest) for inference, checked against `model_config` if given.

  With a `ModelConfig`, the target shapes come from `jax.eval_shape` of the model's init, so a checkpoint of
  a different architecture fails with a shape/structure error instead of loading.
  """
  abstract = None
  if model_config is not None:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    from transformer_jax.training.steps import init_params  # pylint: disable=import-outside-toplevel
    abstract = jax.eval_shape(lambda: nn.unbox(init_params(model_config, jax.random.key(0))))
  return restore_params_only(directory, step, abstract_params=abstract, sharding=sharding)[1]


def read_config(directory: str | os.PathLike, step: int | None = None) -> dict | None:
  """The `config` item of `step` (default: latest), or None when there is no checkpoint."""
  manager = _read_only_manager(os.fspath(directory))
  try:
    step = manager.latest_step() if step is None else int(step)
    if step is None:
      return None
    return manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]
  finally:
    manager.close()


# --------------------------------------------------------------------------------------------------------
# Checkpoint averaging.


def average_trees(trees: Sequence[PyTree]) -> PyTree:
  """Leaf-wise mean of pytrees with the same structure, accumulated in float32 (at least).

  Uses the running mean `m_k = m_{k-1} + (x_k - m_{k-1}) / k`, which returns exactly `x` for identical
  inputs. Floating leaves come back in their own dtype; non-floating leaves (counters) are taken from the
  last tree.
  """
  trees = list(trees)
  if not trees:
    raise ValueError("average_trees needs at least one tree")

  def mean(*leaves):
    first = leaves[0]
    dtype = jnp.result_type(first)
    if not jnp.issubdtype(dtype, jnp.floating):
      return leaves[-1]
    acc_dtype = jnp.promote_types(dtype, jnp.float32)
    acc = jnp.asarray(first, acc_dtype)
    for k, leaf in enumerate(leaves[1:], start=2):
      acc = acc + (jnp.asarray(leaf, acc_dtype) - acc) / k
    return acc.astype(dtype)

  return jax.tree_util.tree_map(mean, *trees)


def _select_steps(all_steps: Sequence[int], steps: Iterable[int] | None, last_n: int | None) -> list[int]:
  all_steps = sorted(all_steps)
  if (steps is None) == (last_n is None):
    raise ValueError("Give exactly one of `steps` or `last_n`.")
  if steps is not None:
    chosen = sorted({int(s) for s in steps})
    missing = [s for s in chosen if s not in all_steps]
    if missing:
      raise ValueError(f"Steps {missing} are not among the saved steps {all_steps}.")
  else:
    if last_n < 1:
      raise ValueError(f"last_n={last_n} must be >= 1")
    if last_n > len(all_steps):
      raise ValueError(f"last_n={last_n} but only {len(all_steps)} steps are saved: {all_steps}")
    chosen = all_steps[-last_n:]
  if not chosen:
    raise ValueError("No steps to average.")
  return chosen


def average_checkpoints(directory: str | os.PathLike, steps: Iterable[int] | None = None, *,
                        last_n: int | None = None, output_directory: str | os.PathLike,
                        sharding: jax.sharding.Sharding | None = None) -> int:
  """Writes the mean of the params of some checkpoints as a checkpoint in `output_directory`.

  The output step is the newest averaged step and has the usual item layout, so `Checkpointer` restores it
  like any other: `state` = the newest step's state (step, opt_state) with the averaged params, and the
  newest step's `rng`, `data` and `config`; the step's custom metadata records `averaged_steps`.
  Everything is read onto `sharding` (default: the first device) whatever topology wrote it.
  Returns the output step.
  """
  directory = os.path.abspath(os.fspath(directory))  # orbax wants absolute paths
  manager = _read_only_manager(directory)
  try:
    chosen = _select_steps(manager.all_steps(), steps, last_n)
    newest = chosen[-1]
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state_target = _abstract_from_metadata(_item_tree_metadata(directory, newest, STATE), sharding)
    items = {STATE: ocp.args.StandardRestore(state_target), DATA: ocp.args.JsonRestore(),
             CONFIG: ocp.args.JsonRestore()}
    if os.path.isdir(os.path.join(_step_dir(directory, newest), RNG)):
      items[RNG] = ocp.args.StandardRestore(
          _abstract_from_metadata(_item_tree_metadata(directory, newest, RNG), sharding))
    newest_items = manager.restore(newest, args=ocp.args.Composite(**items))
  finally:
    manager.close()

  # Running mean, one checkpoint in memory at a time (plus the accumulator).
  acc = None
  for k, step in enumerate(chosen, start=1):
    params = newest_items[STATE]["params"] if step == newest else restore_params_only(
        directory, step, abstract_params=state_target["params"])[1]
    if acc is None:
      acc = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.promote_types(p.dtype, jnp.float32)), params)
    else:
      acc = jax.tree_util.tree_map(lambda a, p: a + (p.astype(a.dtype) - a) / k, acc, params)
  template = newest_items[STATE]["params"]
  averaged = jax.tree_util.tree_map(lambda a, p: a.astype(p.dtype), acc, template)

  state = dict(newest_items[STATE])
  state["params"] = averaged
  rng = newest_items[RNG][_RNG_KEY] if RNG in items else None
  with Checkpointer(output_directory, max_to_keep=None, enable_async_checkpointing=False) as out:
    out.save(newest, state, rng, newest_items[DATA], newest_items[CONFIG], force=True,
             custom_metadata={"averaged_steps": chosen, "source_directory": os.path.abspath(directory)})
  logger.info("Averaged the params of steps %s of %s into %s (step %d).", chosen, directory,
              output_directory, newest)
  return newest


# --------------------------------------------------------------------------------------------------------
# Config compatibility.


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    flat = {}
    for key, value in tree.items():
      flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    if not tree and prefix:
      flat[prefix] = {}
    return flat
  return {prefix: tree}


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, bool) or isinstance(b, bool):  # True == 1 in Python; not for a config.
    return type(a) is type(b) and a == b
  return a == b


def _format(value: Any) -> str:
  return "<missing>" if value is _MISSING else repr(value)


def config_diff(saved: Mapping, requested: Mapping, keys: Sequence[str] | None = ("model",)) -> list[str]:
  """Differences between two config dicts, as `"model.d_model: saved 128, requested 256"` lines.

  Only entries at or under the dotted prefixes in `keys` are compared (None: everything). Both sides go
  through `to_jsonable` first, so tuples equal lists and dataclasses (e.g. `ModelConfig`) equal their dicts.
  An empty list means compatible.
  """
  flat_saved = _flatten(to_jsonable(saved))
  flat_requested = _flatten(to_jsonable(requested))

  def selected(name: str) -> bool:
    return keys is None or any(name == k or name.startswith(k + ".") for k in keys)

  messages = []
  for name in sorted(set(flat_saved) | set(flat_requested)):
    if not selected(name):
      continue
    a = flat_saved.get(name, _MISSING)
    b = flat_requested.get(name, _MISSING)
    if a is _MISSING or b is _MISSING or not _same(a, b):
      messages.append(f"{name}: saved {_format(a)}, requested {_format(b)}")
  return messages
