"""Checkpointing of training runs with Orbax (`orbax-checkpoint` 0.12.x `CheckpointManager` API).

One checkpoint step directory `<directory>/<step>/` holds these items:

* `state`   the `TrainState` pytree (`step`, `params`, `opt_state`; `apply_fn`/`tx` are static and not saved),
* `rng`     `{"key": uint32 key data}` (a typed key is stored as its `jax.random.key_data`),
* `data`    JSON: the input position, as the trainer writes it `{"processes": [<each process's grain iterator
            state>]}` (`data.pipeline`; any JSON the caller gives),
* `config`  JSON: the resolved experiment config as a plain dict,
* `metrics` JSON, optional: e.g. validation BLEU/loss (Orbax's own metrics item; used to keep the best step).

Orbax writes a step into a temporary directory and renames it when every item is finalized, so a step
that `all_steps()` lists was complete when it was written. It can still be damaged later (a truncated
file); `Checkpointer.restore_latest_complete` then falls back to older steps and deletes nothing.

Restoring onto an abstract target (`jax.eval_shape` output whose leaves carry `.sharding`) reads each array
straight into the target sharding, so a checkpoint written on one device count / mesh restores onto another.
Every restore onto a target (resume, `restore_params`, averaging) first compares the saved parameter tree
(names, shapes, dtypes) with the target's and refuses a mismatch with `CheckpointMismatchError`, one line
naming the first differing parameters: a checkpoint of another architecture never loads silently.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_policies

from transformer_jax import multihost
from transformer_jax.config import ModelConfig
from transformer_jax.sharding import path_name
from transformer_jax.training.optimizer import EMA_KEY
from transformer_jax.training.steps import init_params
from transformer_jax.workdir import absolute, to_jsonable

logger = logging.getLogger(__name__)

PyTree = Any

STATE, RNG, DATA, CONFIG = "state", "rng", "data", "config"
METRICS = "metrics"  # the item name Orbax's CheckpointManager reads metrics from
_RNG_KEY = "key"
_MAX_ERROR_CHARS = 600


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored step. Unpacks as `state, rng, data_state, config, metrics`; `.step` says which step it was.

  `rng` is a typed key (`jax.random.key` style; its data was saved with `jax.random.key_data`), or None.
  """

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


def rank_by_metric(steps_and_metrics: Iterable[tuple[int, Mapping | None]], metric: str,
                   mode: str) -> list[int]:
  """The steps that have a finite `metric`, best first (ties: the newer step first); mode "max" or "min"."""
  scored = []
  for step, metrics in steps_and_metrics:
    try:
      value = float(metrics[metric])
    except (KeyError, TypeError, ValueError):
      continue
    if math.isfinite(value):
      scored.append((value if mode == "max" else -value, step))
  return [step for _, step in sorted(scored, reverse=True)]


@dataclasses.dataclass
class BestByMetric:
  """Preservation policy: keep the `n` best steps by `metrics[metric]` (steps without it are not kept)."""

  metric: str
  mode: str = "max"
  n: int = 1

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    keep = set(rank_by_metric(((info.step, info.metrics) for info in checkpoints), self.metric,
                              self.mode)[:self.n])
    return [info.step in keep for info in checkpoints]


def _first_sharding(tree: PyTree) -> jax.sharding.Sharding | None:
  for leaf in jax.tree_util.tree_leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
      return sharding
  return None


def replicated_sharding_like(tree: PyTree) -> jax.sharding.Sharding:
  """A fully replicated sharding over the devices the leaves of `tree` use (this process's first device if none
  carry one: on several hosts, each restores its own copy, e.g. every process of `corpus.translate_corpus`)."""
  sharding = _first_sharding(tree)
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
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
  """The key's data, as a global array replicated over every process's devices when several processes save
  (orbax refuses a host-local array there; every process holds the same key, split from `config.seed`)."""
  data = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
  if jax.process_count() > 1 and data.is_fully_addressable:
    host = np.asarray(data)
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()), ("all",)),
                                            jax.sharding.PartitionSpec())
    data = jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])
  return data


def _typed_key(key_data: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(key_data.dtype, jax.dtypes.prng_key):
    return key_data
  return jax.random.wrap_key_data(key_data)


def _step_dir(directory: str, step: int) -> str:
  return os.fspath(epath.Path(directory) / str(step))


def _item_tree_metadata(directory: str, step: int, item: str) -> PyTree:
  """The saved tree metadata (shapes, dtypes) of an array item, read without touching other items."""
  handler = ocp.handlers.StandardCheckpointHandler()
  try:
    return handler.metadata(epath.Path(_step_dir(directory, step)) / item).tree
  finally:
    handler.close()


class CheckpointMismatchError(ValueError):
  """A checkpoint's tree (parameter names, shapes, dtypes) differs from the model it is restored into."""


def tree_signature(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
  """`{"encoder/layer_0/.../kernel": (shape, dtype name)}` of the arrays of a tree, abstract tree or orbax metadata."""

  def is_leaf(x):
    return isinstance(x, ocp.metadata.value.Metadata) or hasattr(x, "shape") and hasattr(x, "dtype")

  signature = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      signature[path_name(path)] = (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name)
  return signature


def check_same_tree(saved: PyTree, expected: PyTree, where: str, max_listed: int = 3) -> None:
  """Raises `CheckpointMismatchError` (one line, the first differing entries) when the two trees differ; it
  blames the optimizer when only `opt_state/...` entries differ, else the model.

  `saved` is typically orbax metadata of a checkpoint item, `expected` the abstract tree of the model's.
  """
  a, b = tree_signature(saved), tree_signature(expected)
  differing = [name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
  problems = []
  for name in differing:
    if name not in a:
      problems.append(f"{name} {b[name][0]} is missing from the checkpoint")
    elif name not in b:
      problems.append(f"{name} {a[name][0]} is in the checkpoint but not in this run")
    else:
      problems.append(f"{name}: checkpoint {a[name][0]} {a[name][1]}, this run {b[name][0]} {b[name][1]}")
  if problems:
    more = f" (and {len(problems) - max_listed} more)" if len(problems) > max_listed else ""
    optimizer_only = all(name.startswith("opt_state/") for name in differing)
    what = ("the optimizer (another optimizer state: weight decay or the moving average on in one and off in "
            "the other?)" if optimizer_only else "the model (another architecture?)")
    raise CheckpointMismatchError(f"{where} does not fit {what}: " + "; ".join(problems[:max_listed]) + more)


def abstract_params(model_config: ModelConfig, sharding: jax.sharding.Sharding | None = None) -> PyTree:
  """`jax.ShapeDtypeStruct`s of `Transformer(model_config)`'s params (placed on `sharding` if given)."""
  shapes = jax.eval_shape(lambda: nn.unbox(init_params(model_config, jax.random.key(0))))
  return shapes if sharding is None else _as_abstract(shapes, sharding)


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
  """`CheckpointManager` whose per-step metrics reads tolerate a damaged metrics file, and which keeps the error
  of a failed background write where the training thread can see it.

  Orbax reads every step's metrics when the manager is created and only tolerates a missing file, so one
  truncated `<step>/metrics/metrics` would make the whole directory unusable. Here such a step counts as
  having no metrics (it is kept or deleted like any step without them). A background write that fails is
  raised in orbax's finalize thread, which then waits at a barrier for the other processes (whose own writes
  wait for this one's): `background_error` holds it meanwhile (`Checkpointer.check_background_save`).
  """

  background_error: BaseException | None = None

  def _wait_for_checkpointers(self):  # orbax's finalize thread: waits for this process's writes
    try:
      super()._wait_for_checkpointers()
    except BaseException as error:  # pylint: disable=broad-except (re-raised: orbax's own handling goes on)
      self.background_error = error
      raise

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
    directory: the checkpoint directory (a run's is `workdir.Workdir(path).checkpoints`).
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
    self.directory = os.fspath(absolute(directory))
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
    self._pending_step: int | None = None  # the asynchronous save under way (`check_background_save`)
    self._abandoned = False  # a multi-host save that failed on some host: never waited for

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
    ranked = rank_by_metric(((step, self.metrics(step)) for step in self.all_steps()), self.best_metric,
                            self.best_mode)
    return ranked[0] if ranked else None

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def metrics(self, step: int) -> dict | None:
    """The metrics saved with `step` (None if none were)."""
    return self._manager.metrics(step)

  def reload(self) -> None:
    """Re-read the directory (after another process wrote or deleted steps)."""
    self._manager.reload()

  def wait(self) -> None:
    """Block until pending asynchronous saves (and the deletions they trigger) are finished; raises
    CheckpointWriteError (one line) if a save failed in the background."""
    step, self._pending_step = self._pending_step, None
    if self._abandoned:  # a save another host could not write: its threads wait on that host forever
      return
    try:
      self._manager.wait_until_finished()
    except Exception as error:  # pylint: disable=broad-except (orbax / tensorstore raise whatever the I/O did)
      raise CheckpointWriteError(self._failed_save_message(error, step)) from None

  def check_background_save(self) -> None:
    """Raises CheckpointWriteError (one line) as soon as an asynchronous save has failed (a full disk, a lost
    bucket), instead of at the next save; cheap while the save runs (no waiting). With several processes, a
    write that failed on one stops every one (`multihost.any_host`, one int32 allgather a step while a save is
    pending): the others' background save would wait for that process's share at orbax's barrier, for 20 minutes.
    The failed save is then abandoned (`wait` no longer waits for it)."""
    if self._pending_step is None:
      return
    step = self._pending_step
    if jax.process_count() > 1:
      error, self._manager.background_error = self._manager.background_error, None  # this process's share
      if multihost.any_host(error is not None):
        self._abandoned, self._pending_step = True, None
        elsewhere = RuntimeError("another process could not write its share; its error line says why")
        raise CheckpointWriteError(self._failed_save_message(error or elsewhere, step))
    if self._manager.is_saving_in_progress():
      return
    self.wait()
    if step not in self._manager.all_steps():
      raise CheckpointWriteError(self._failed_save_message(None, step))

  def _failed_save_message(self, error: BaseException | None, step: int | None = None) -> str:
    reason = "" if error is None else f" ({' '.join(str(error).split())[:300]})"
    complete = [s for s in self._manager.all_steps() if s != step]
    which = "the last checkpoint" if step is None else f"the checkpoint of step {step}"
    return (f"{self.directory}: {which} could not be written{reason}; the last complete checkpoint is "
            f"{f'step {max(complete)}' if complete else 'none'}")

  def close(self) -> None:
    if not self._abandoned:
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
    self.check_background_save()
    started = bool(self._manager.save(
        step, args=ocp.args.Composite(**items),
        metrics=metrics,  # the manager's in-memory record, which the preservation policy sees
        force=force,
        custom_metadata=None if custom_metadata is None else to_jsonable(dict(custom_metadata))))
    self._pending_step = step if started else self._pending_step
    return started

  # -- restore -------------------------------------------------------------------------------------------

  def _has_item(self, step: int, item: str) -> bool:
    return (epath.Path(_step_dir(self.directory, step)) / item).is_dir()

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
      check_same_tree(_item_tree_metadata(self.directory, step, STATE), abstract_state,
                      f"checkpoint {_step_dir(self.directory, step)}")
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
    rng = _typed_key(restored[RNG][_RNG_KEY]) if has_rng else None
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
      except CheckpointMismatchError:
        raise  # another architecture is not a damaged file: falling back would only hide it
      except Exception as error:  # pylint: disable=broad-except
        message = f"{type(error).__name__}: {error}"
        if len(message) > _MAX_ERROR_CHARS:  # TensorStore errors embed whole JSON specs.
          message = message[:_MAX_ERROR_CHARS] + " ..."
        logger.warning("Could not restore checkpoint step %d in %s (%s); falling back to an older step.",
                       step, self.directory, message)
        errors.append(f"step {step}: {message}")
    raise RuntimeError(f"No checkpoint in {self.directory} could be restored:\n" + "\n".join(errors))


# --------------------------------------------------------------------------------------------------------
# Inference-side helpers.


def _read_only_manager(directory: str, state_handler: str = "standard") -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                         save_interval_steps=0)
  return _Manager(os.fspath(absolute(directory)), options=options,
                  handler_registry=_handler_registry(state_handler))


def _ema_path(opt_state_metadata: PyTree) -> tuple | None:
  """The keys (dict names, list indices) from a saved `opt_state` to its `params_ema` entry, or None."""
  if isinstance(opt_state_metadata, Mapping):
    if EMA_KEY in opt_state_metadata:
      return (EMA_KEY,)
    children = opt_state_metadata.items()
  elif isinstance(opt_state_metadata, (list, tuple)):
    children = enumerate(opt_state_metadata)
  else:
    return None
  for key, child in children:
    path = _ema_path(child)
    if path is not None:
      return (key, *path)
  return None


def _partial_target(metadata: PyTree, path: tuple, leaf_target: PyTree) -> PyTree:
  """`metadata`'s containers with `leaf_target` at `path` and orbax placeholders (not read) everywhere else."""
  if not path:
    return leaf_target
  key, rest = path[0], path[1:]
  if isinstance(metadata, Mapping):
    return {k: _partial_target(v, rest, leaf_target) if k == key else
            jax.tree_util.tree_map(lambda _: ocp.PLACEHOLDER, v) for k, v in metadata.items()}
  return [_partial_target(v, rest, leaf_target) if i == key else
          jax.tree_util.tree_map(lambda _: ocp.PLACEHOLDER, v) for i, v in enumerate(metadata)]


def restore_params(directory: str | os.PathLike, model_config: ModelConfig | None = None,
                   step: int | None = None, *, abstract: PyTree | None = None,
                   sharding: jax.sharding.Sharding | None = None, ema: bool = False) -> PyTree:
  """Just `state.params` of `step` (default: the latest) of a checkpoint directory; the optimizer state is never read.

  With `ema`, the moving average of the parameters the optimizer state keeps instead (`optimizer.param_ema`,
  a run with `ema_decay` > 0): only that entry of the optimizer state is read. Raises ValueError when the
  checkpoint holds none.
  The target tree comes from `model_config` (the model's own parameter shapes) or `abstract` (leaves with
  `.shape`, `.dtype` and optionally `.sharding`); either way the saved tree must match it exactly, else
  `CheckpointMismatchError` names the first differing parameters. With neither, the saved shapes are taken
  as they are. Arrays go to their target's sharding, else to `sharding` (default: the first device).
  Raises FileNotFoundError when the directory holds no checkpoint, CheckpointReadError (an OSError) when the
  step cannot be read (files missing: removed while read by a trainer keeping `checkpoint_keep`). Uses orbax's
  partial restore (`ocp.args.PyTreeRestore(..., partial_restore=True)`).
  """
  manager = _read_only_manager(os.fspath(directory), state_handler="pytree")
  try:
    step = manager.latest_step() if step is None else int(step)
    if step is None:
      raise FileNotFoundError(f"No checkpoints in {absolute(directory)}.")
    where = f"checkpoint {_step_dir(os.fspath(manager.directory), step)}"
    if model_config is not None:
      abstract = abstract_params(model_config)
    default = sharding or replicated_sharding_like(abstract)
    metadata = _item_tree_metadata(manager.directory, step, STATE)
    path = ("params",)
    if ema:
      found = _ema_path(metadata.get("opt_state"))
      if found is None:
        raise ValueError(f"{where} holds no moving average of the parameters (trained with ema_decay 0)")
      path = ("opt_state", *found)
    saved = functools.reduce(lambda tree, key: tree[key], path, metadata)
    if abstract is None:
      params_target = _abstract_from_metadata(saved, default)
    else:
      check_same_tree(saved, abstract, where)
      params_target = _as_abstract(abstract, default)
    target = _partial_target({k: v for k, v in metadata.items() if k == path[0]}, path, params_target)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)}))
    return functools.reduce(lambda tree, key: tree[key], path, restored[STATE])
  except (OSError, ValueError):  # one line already: a missing file, a mismatch, no moving average
    raise
  except Exception as error:  # pylint: disable=broad-except (orbax/tensorstore on files removed mid-read)
    raise CheckpointReadError(f"step {step} of {absolute(directory)} could not be read: it is incomplete or was "
                              f"removed while being read ({type(error).__name__}: "
                              f"{' '.join(str(error).split())[:200]})") from None
  finally:
    manager.close()


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


def _running_mean(mean: PyTree | None, tree: PyTree, k: int) -> PyTree:
  """`m_k = m_{k-1} + (x_k - m_{k-1}) / k` leaf-wise in float32 (at least); exact for identical inputs."""
  def update(m, x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      return x  # counters: the last tree's
    x = jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))
    return x if m is None else m + (x - m) / k
  if mean is None:
    return jax.tree_util.tree_map(lambda x: update(None, x), tree)
  return jax.tree_util.tree_map(update, mean, tree)


def average_trees(trees: Iterable[PyTree]) -> PyTree:
  """Leaf-wise mean of pytrees with the same structure, a running mean accumulated in float32 (at least): a
  generator of trees keeps one in memory at a time besides the accumulator (`average_checkpoints`).

  Floating leaves come back in the first tree's dtype; non-floating leaves (counters) are the last tree's.
  Raises ValueError for no trees.
  """
  mean, dtypes = None, None
  for k, tree in enumerate(trees, start=1):
    dtypes = dtypes or jax.tree_util.tree_map(jnp.result_type, tree)
    mean = _running_mean(mean, tree, k)
  if mean is None:
    raise ValueError("average_trees needs at least one tree")
  return jax.tree_util.tree_map(lambda m, dtype: jnp.asarray(m).astype(dtype), mean, dtypes)


class CheckpointReadError(OSError):
  """A checkpoint step that cannot be read: files missing (a step the trainer removed while it was read)."""


class CheckpointWriteError(OSError):
  """A checkpoint save that orbax refused or skipped (`CheckpointManager.save` returned False)."""


def require_saved(saved: bool, directory: str | os.PathLike, step: int) -> None:
  """Raises CheckpointWriteError unless `saved` (what `Checkpointer.save` returned) says step `step` was
  written to `directory`: a refused write is an error, never a silent success."""
  if not saved:
    raise CheckpointWriteError(f"{directory}: the checkpoint of step {step} was not written (orbax refused the "
                               "save: the step exists already, or the save interval skipped it)")


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
  directory = os.fspath(absolute(directory))  # orbax wants absolute paths
  manager = _read_only_manager(directory)
  try:
    chosen = _select_steps(manager.all_steps(), steps, last_n)
    newest = chosen[-1]
    if (epath.Path(os.fspath(output_directory)) / str(newest)).exists():
      raise FileExistsError(f"{output_directory} already holds step {newest} (an earlier average?); nothing "
                            "written: choose another output directory or remove that step")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state_target = _abstract_from_metadata(_item_tree_metadata(directory, newest, STATE), sharding)
    items = {STATE: ocp.args.StandardRestore(state_target), DATA: ocp.args.JsonRestore(),
             CONFIG: ocp.args.JsonRestore()}
    if (epath.Path(_step_dir(directory, newest)) / RNG).is_dir():
      items[RNG] = ocp.args.StandardRestore(
          _abstract_from_metadata(_item_tree_metadata(directory, newest, RNG), sharding))
    newest_items = manager.restore(newest, args=ocp.args.Composite(**items))
  finally:
    manager.close()

  # One checkpoint in memory at a time (plus the accumulator); every step must be the same model.
  newest_params = newest_items[STATE]["params"]
  averaged = average_trees(newest_params if step == newest else restore_params(
      directory, step=step, abstract=state_target["params"]) for step in chosen)

  state = dict(newest_items[STATE])
  state["params"] = averaged
  rng = newest_items[RNG][_RNG_KEY] if RNG in items else None
  with Checkpointer(output_directory, max_to_keep=None, enable_async_checkpointing=False) as out:
    saved = out.save(newest, state, rng, newest_items[DATA], newest_items[CONFIG], force=True,
                     custom_metadata={"averaged_steps": chosen, "source_directory": directory})
  require_saved(saved, output_directory, newest)
  logger.info("Averaged the params of steps %s of %s into %s (step %d).", chosen, directory,
              output_directory, newest)
  return newest
