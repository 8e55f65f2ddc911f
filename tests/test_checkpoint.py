"""Tests of `transformer_jax.run.checkpoint` (tiny model, CPU, a few seconds)."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.config import tiny
from transformer_jax.run import checkpoint as ck
from transformer_jax.training.optimizer import ema_params, param_ema
from transformer_jax.training.state import create_train_state
from transformer_jax.workdir import to_jsonable

# Restoring a damaged step makes Orbax abandon its other in-flight reads; their coroutines later fail with
# "Event loop is closed" in garbage collection, which pytest reports against whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CONFIG = tiny(vocab_size=32, num_encoder_layers=1, num_decoder_layers=1, d_model=16, d_ff=32, num_heads=2,
              max_len=16)
CONFIG_DICT = {"model": to_jsonable(CONFIG), "train": {"batch_tokens": 512, "warmup": [4000, 1]}}


def make_state(seed: int = 0, updates: int = 1):
  """A tiny TrainState whose params and Adam moments have been updated (so they are not all zeros)."""
  state = create_train_state(CONFIG, optax.adam(1e-3), jax.random.key(seed))
  for i in range(updates):
    grads = jax.tree_util.tree_map(
        lambda p, k=jax.random.key(seed * 100 + i): jax.random.normal(k, p.shape, p.dtype), state.params)
    state = state.apply_gradients(grads=grads)
  return state


@pytest.fixture(scope="module")
def state():
  return make_state()


def abstract_of(state, sharding=None):
  abstract = jax.eval_shape(lambda: state)
  if sharding is None:
    return abstract
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)


def assert_trees_equal(a, b):
  leaves_a, tree_a = jax.tree_util.tree_flatten(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


RNG = jax.random.key_data(jax.random.key(42))


def test_roundtrip_is_bitwise(tmp_path, state):
  data = {"epoch": 3, "index": 1200, "seed": 0}
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    assert ckpt.save(7, state, RNG, data, CONFIG_DICT, metrics={"bleu": 12.5, "loss": 2.0})
    assert ckpt.all_steps() == [7] and ckpt.latest_step() == 7
    restored = ckpt.restore(abstract_state=abstract_of(state))
    restored_state, rng, data_state, config, metrics = restored
  assert restored.step == 7
  assert type(restored_state) is type(state)
  assert int(restored_state.step) == int(state.step) == 1
  assert_trees_equal(restored_state.params, state.params)
  assert_trees_equal(restored_state.opt_state, state.opt_state)
  assert jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)  # a typed key again
  np.testing.assert_array_equal(jax.random.key_data(rng), RNG)
  assert data_state == data
  assert config == CONFIG_DICT
  assert metrics == {"bleu": 12.5, "loss": 2.0}
  # A new program (fresh manager) restores the same thing.
  again = ck.Checkpointer(tmp_path, read_only=True).restore(7, abstract_of(state))
  assert_trees_equal(again.state.params, state.params)


def test_restore_onto_explicit_single_device_sharding(tmp_path, state):
  device = jax.devices()[-1]
  sharding = jax.sharding.SingleDeviceSharding(device)
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, RNG, {}, CONFIG_DICT)
    restored = ckpt.restore(1, abstract_of(state, sharding))
  for leaf in jax.tree_util.tree_leaves(restored.state):
    assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
  assert restored.rng.sharding == sharding
  assert_trees_equal(restored.state.params, state.params)
  # Without shardings on the target, every leaf still comes back as an on-device jax.Array.
  plain = ck.Checkpointer(tmp_path, read_only=True).restore(1, abstract_of(state))
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(plain.state))


def test_keeps_last_k(tmp_path, state):
  with ck.Checkpointer(tmp_path, max_to_keep=2, enable_async_checkpointing=False) as ckpt:
    for step in range(1, 6):
      assert ckpt.save(step, state, RNG, {"index": step}, CONFIG_DICT)
    assert ckpt.all_steps() == [4, 5]
  assert sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit()) == [4, 5]
  # Existing steps are never overwritten; older steps are not saved again.
  with ck.Checkpointer(tmp_path, max_to_keep=2, enable_async_checkpointing=False) as ckpt:
    assert not ckpt.save(5, state, RNG, {}, CONFIG_DICT, force=True)
    assert not ckpt.save(3, state, RNG, {}, CONFIG_DICT)
    assert ckpt.restore(5, abstract_of(state)).data_state == {"index": 5}


@pytest.mark.parametrize("mode,values,best", [("max", [10.0, 30.0, 5.0, 6.0, 7.0], 2),
                                              ("min", [3.0, 1.0, 4.0, 5.0, 6.0], 2)])
def test_keeps_best_by_metric(tmp_path, state, mode, values, best):
  name = "bleu" if mode == "max" else "loss"
  kwargs = dict(max_to_keep=2, best_metric=name, best_mode=mode, enable_async_checkpointing=False)
  with ck.Checkpointer(tmp_path, **kwargs) as ckpt:
    for step, value in enumerate(values, start=1):
      ckpt.save(step, state, RNG, {}, CONFIG_DICT, metrics={name: value})
    assert ckpt.all_steps() == [best, 4, 5]
    assert ckpt.best_step() == best
  # After a restart the best step is still known (metrics are read back) and survives further saves.
  with ck.Checkpointer(tmp_path, **kwargs) as ckpt:
    ckpt.save(6, state, RNG, {}, CONFIG_DICT)  # no metrics
    ckpt.save(7, state, RNG, {}, CONFIG_DICT, metrics={name: values[-1]})
    assert ckpt.all_steps() == [best, 6, 7]
    assert ckpt.restore(best, abstract_of(state)).metrics == {name: values[best - 1]}


def test_async_save_then_wait(tmp_path, state):
  with ck.Checkpointer(tmp_path, max_to_keep=2) as ckpt:  # asynchronous by default
    for step in (1, 2, 3):
      assert ckpt.save(step, state, RNG, {"index": step}, CONFIG_DICT)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["2", "3"]
    restored = ckpt.restore(3, abstract_of(state))
  assert_trees_equal(restored.state.params, state.params)
  assert restored.data_state == {"index": 3}


def _truncate_array_files(step_dir):
  """Halves every OCDBT data/b-tree file of the `state` item (what a crash mid-copy could leave)."""
  truncated = []
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(root) != "d":
      continue
    for name in files:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      with open(path, "r+b") as f:
        f.truncate(size // 2)
      truncated.append(path)
  assert truncated
  return truncated


def test_damaged_newest_step_falls_back_to_previous(tmp_path, state, caplog):
  newer = make_state(seed=1)
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, RNG, {"index": 1}, CONFIG_DICT)
    ckpt.save(2, newer, RNG, {"index": 2}, CONFIG_DICT)
  _truncate_array_files(os.path.join(tmp_path, "2"))

  ckpt = ck.Checkpointer(tmp_path)
  with caplog.at_level(logging.WARNING, logger="transformer_jax.run.checkpoint"):
    restored = ckpt.restore_latest_complete(abstract_of(state))
  assert restored.step == 1
  assert restored.data_state == {"index": 1}
  assert_trees_equal(restored.state.params, state.params)
  warnings = [r.getMessage() for r in caplog.records if r.name == "transformer_jax.run.checkpoint"]
  assert any("step 2" in message and "Error" in message for message in warnings), warnings
  # Nothing was deleted.
  assert os.path.isdir(os.path.join(tmp_path, "2"))
  assert ckpt.all_steps() == [1, 2]
  ckpt.close()


def test_restore_latest_complete_empty_and_all_broken(tmp_path, state):
  ckpt = ck.Checkpointer(tmp_path, enable_async_checkpointing=False)
  assert ckpt.restore_latest_complete(abstract_of(state)) is None
  ckpt.save(1, state, RNG, {}, CONFIG_DICT)
  _truncate_array_files(os.path.join(tmp_path, "1"))
  with pytest.raises(RuntimeError, match="step 1"):
    ckpt.restore_latest_complete(abstract_of(state))
  ckpt.close()


def test_damaged_metrics_file_does_not_block_the_directory(tmp_path, state):
  with ck.Checkpointer(tmp_path, best_metric="bleu", enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, RNG, {}, CONFIG_DICT, metrics={"bleu": 1.0})
  with open(os.path.join(tmp_path, "1", "metrics", "metrics"), "w") as f:
    f.write('{"bl')
  ckpt = ck.Checkpointer(tmp_path, best_metric="bleu")
  assert ckpt.all_steps() == [1]
  restored = ckpt.restore_latest_complete(abstract_of(state))
  assert restored.step == 1 and restored.metrics is None
  ckpt.close()


def test_average_trees_exact_mean():
  a = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.array([1.5, -2.0], jnp.float32),
       "h": jnp.array([1.0, 3.0], jnp.bfloat16), "count": jnp.array(3, jnp.int32)}
  b = {"w": 3.0 * a["w"] + 0.5, "b": jnp.array([2.5, 4.0], jnp.float32),
       "h": jnp.array([2.0, 2.0], jnp.bfloat16), "count": jnp.array(5, jnp.int32)}
  mean = ck.average_trees([a, b])
  np.testing.assert_array_equal(mean["w"], (np.asarray(a["w"]) + np.asarray(b["w"])) / 2)
  np.testing.assert_array_equal(mean["b"], np.array([2.0, 1.0], np.float32))
  assert mean["h"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(mean["h"], np.float32), [1.5, 2.5])
  assert int(mean["count"]) == 5  # non-float leaves: the last tree's
  # Identical inputs give exactly the input, for any count.
  x = jax.random.normal(jax.random.key(0), (5, 7))
  for n in (1, 3, 7):
    np.testing.assert_array_equal(ck.average_trees([x] * n), x)


def test_average_identical_checkpoints_returns_same_params(tmp_path, state):
  src, out = tmp_path / "src", tmp_path / "avg"
  with ck.Checkpointer(src, enable_async_checkpointing=False) as ckpt:
    for step in (10, 20, 30):
      ckpt.save(step, state, RNG, {"index": step}, CONFIG_DICT)
  assert ck.average_checkpoints(src, last_n=3, output_directory=out) == 30
  restored = ck.Checkpointer(out, read_only=True).restore(abstract_state=abstract_of(state))
  assert_trees_equal(restored.state.params, state.params)


def test_averaged_checkpoint_restores_through_normal_api(tmp_path):
  src, out = tmp_path / "src", tmp_path / "avg"
  s1, s2, s3 = make_state(seed=1), make_state(seed=2, updates=2), make_state(seed=3)
  with ck.Checkpointer(src, enable_async_checkpointing=False) as ckpt:
    ckpt.save(100, s1, RNG, {"index": 100}, CONFIG_DICT)
    ckpt.save(200, s2, RNG + 1, {"index": 200}, CONFIG_DICT)
    ckpt.save(300, s3, RNG, {"index": 300}, CONFIG_DICT)
  assert ck.average_checkpoints(src, steps=[100, 200], output_directory=out) == 200

  ckpt = ck.Checkpointer(out, read_only=True)
  assert ckpt.all_steps() == [200]
  state, rng, data_state, config, _ = ckpt.restore(abstract_state=abstract_of(s2))
  assert_trees_equal(state.params, jax.device_get(ck.average_trees([s1.params, s2.params])))
  assert_trees_equal(state.opt_state, s2.opt_state)  # the newest averaged step's
  assert int(state.step) == int(s2.step) == 2
  np.testing.assert_array_equal(jax.random.key_data(rng), RNG + 1)
  assert data_state == {"index": 200}
  assert config == CONFIG_DICT
  assert ckpt.manager.metadata(200).custom_metadata["averaged_steps"] == [100, 200]
  # Inference-only restore of the averaged params.
  params = ck.restore_params(out)
  assert ck.Checkpointer(out, read_only=True).latest_step() == 200
  assert_trees_equal(params, state.params)
  with pytest.raises(ValueError):
    ck.average_checkpoints(src, steps=[100, 999], output_directory=tmp_path / "x")


def test_restore_params(tmp_path, state):
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, make_state(seed=5), RNG, {}, CONFIG_DICT)
    ckpt.save(2, state, RNG, {}, CONFIG_DICT)
  assert_trees_equal(ck.restore_params(tmp_path), state.params)  # the latest, shapes as saved
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = ck.restore_params(tmp_path, step=1, abstract=abstract_of(state, sharding).params)
  assert_trees_equal(params, make_state(seed=5).params)
  assert all(leaf.sharding == sharding for leaf in jax.tree_util.tree_leaves(params))
  assert ck.read_config(tmp_path) == CONFIG_DICT
  assert_trees_equal(ck.restore_params(tmp_path, CONFIG), state.params)


def test_restore_params_reads_the_moving_average_alone_when_asked(tmp_path, state):
  """`restore_params(ema=True)`: the moving average `optimizer.param_ema` keeps in the optimizer state, with the
  model's tree; without `ema` the parameters; a checkpoint of a run without the average is refused in one line."""
  tx = optax.chain(optax.adam(1e-2), param_ema(0.9))
  averaged = create_train_state(CONFIG, tx, jax.random.key(3))
  for i in range(3):
    grads = jax.tree_util.tree_map(lambda p, k=jax.random.key(i): jax.random.normal(k, p.shape, p.dtype),
                                   averaged.params)
    averaged = averaged.apply_gradients(grads=grads)
  with ck.Checkpointer(tmp_path / "ema", enable_async_checkpointing=False) as ckpt:
    ckpt.save(3, averaged, RNG, {}, CONFIG_DICT)
  restored = ck.restore_params(tmp_path / "ema", CONFIG, ema=True)
  assert_trees_equal(restored, ema_params(averaged.opt_state))
  assert_trees_equal(ck.restore_params(tmp_path / "ema", ema=True), ema_params(averaged.opt_state))
  assert_trees_equal(ck.restore_params(tmp_path / "ema", CONFIG), averaged.params)
  assert any((np.asarray(a) != np.asarray(b)).any()
             for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(averaged.params)))
  with ck.Checkpointer(tmp_path / "plain", enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, RNG, {}, CONFIG_DICT)
  with pytest.raises(ValueError, match=r"checkpoint .*/1 holds no moving average of the parameters"):
    ck.restore_params(tmp_path / "plain", CONFIG, ema=True)


@pytest.mark.parametrize("change, named", [
    (dict(d_model=32, d_ff=64), "checkpoint (16, 2, 8) float32, this run (32, 2, 16) float32"),
    (dict(num_encoder_layers=2), "encoder/layer_1/"),
    (dict(vocab_size=40), "shared_embedding/embedding: checkpoint (32, 16) float32, this run (40, 16) float32"),
])
def test_restore_of_another_architecture_is_refused_naming_the_parameters(tmp_path, state, change, named):
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, RNG, {}, CONFIG_DICT)
  other = CONFIG.replace(**change)
  with pytest.raises(ck.CheckpointMismatchError, match="does not fit the model") as error:
    ck.restore_params(tmp_path, other)
  assert named in str(error.value) and "\n" not in str(error.value)
  # Resume (the whole train state) refuses it too, at once rather than falling back to older steps.
  other_state = create_train_state(other, optax.adam(1e-3), jax.random.key(0))
  with pytest.raises(ck.CheckpointMismatchError, match="does not fit the model"):
    ck.Checkpointer(tmp_path, read_only=True).restore_latest_complete(abstract_of(other_state))
  # Averaging steps of two architectures is refused before anything is written.
  with ck.Checkpointer(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(2, other_state, RNG, {}, CONFIG_DICT)
  with pytest.raises(ck.CheckpointMismatchError, match="does not fit the model"):
    ck.average_checkpoints(tmp_path, last_n=2, output_directory=tmp_path / "averaged")
  assert not (tmp_path / "averaged").exists()


def test_average_checkpoints_accepts_relative_paths(tmp_path, monkeypatch):
  """Orbax needs absolute paths; a user's `--workdir=runs/x` is relative."""
  monkeypatch.chdir(tmp_path)
  state = make_state()
  with ck.Checkpointer("rel/checkpoints", enable_async_checkpointing=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state, None, {}, {})
  ck.average_checkpoints("rel/checkpoints", last_n=2, output_directory="rel/averaged")
  params = ck.restore_params("rel/averaged")
  np.testing.assert_array_equal(jax.tree_util.tree_leaves(params)[0], jax.tree_util.tree_leaves(state.params)[0])
