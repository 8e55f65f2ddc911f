"""Sharded training on 8 forced host CPU devices (see conftest.py): data, FSDP and tensor parallelism.

Every mesh must reproduce the single-device train step (dropout 0.1 included): in float32 the loss and
gradient norm agree to rtol 1e-5, and every parameter and Adam moment after the step to rtol 1e-5 / atol 1e-6 (the sharded programs
only reorder float reductions).

The optimizer is the paper's Adam + rsqrt schedule with eps raised from 1e-9 to 1e-3. With eps 1e-9 Adam's
first update is lr * sign(g) for every gradient above 1e-9, which turns rounding noise into full ±lr steps
wherever the exact gradient is zero: the key biases (softmax ignores a shift shared by all keys, so their
gradient is exactly zero in real arithmetic and ~1e-9 noise in float32), embedding rows of rare tokens.
That would test Adam's conditioning, not the sharding; with eps 1e-3 the update is smooth in g.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distributed_workers
from transformer_jax import decoding, sharding
from transformer_jax.config import tiny
from transformer_jax.decoding import constraints, generate
from transformer_jax.training.optimizer import adam, adam_with_schedule, ema_params, param_ema
from transformer_jax.training.partitioned import jit_eval_step, jit_train_step
from transformer_jax.training.schedule import rsqrt_schedule
from transformer_jax.training.state import create_train_state

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

RTOL, ATOL = 1e-5, 1e-6
# Dropout on: threefry is partitionable, so a sharded step must draw exactly the single-device masks.
CFG = tiny(vocab_size=64, num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4,
           dropout_rate=0.1, max_len=32)
ROWS, LENGTH = 16, 12
MESHES = {"data8": dict(data=8), "fsdp8": dict(data=1, fsdp=8), "data4_tensor2": dict(data=4, tensor=2)}


# One optimizer object: it is a static field of TrainState, and jit's in_shardings (a TrainState tree)
# must match the state's tree structure, static fields included.
TX = adam_with_schedule(CFG.d_model, warmup_steps=4, scale=2.0, eps=1e-3)


def _lr():
  return rsqrt_schedule(CFG.d_model, 4, 2.0)


def _batch(rows=ROWS, seed=0):
  """Packed rows (two examples per row, then padding) of random ids; some rows are all padding."""
  rng = np.random.default_rng(seed)
  out = {k: np.zeros((rows, LENGTH), np.int32) for k in ("inputs", "targets", "inputs_position",
                                                          "targets_position", "inputs_segmentation",
                                                          "targets_segmentation")}
  for r in range(rows - 1):  # the last row stays padding
    for side in ("inputs", "targets"):
      first, second = rng.integers(1, 6), rng.integers(1, 6)
      ids = rng.integers(4, CFG.vocab_size, first + second)
      out[side][r, :first + second] = ids
      out[f"{side}_position"][r, :first + second] = np.r_[np.arange(first), np.arange(second)]
      out[f"{side}_segmentation"][r, :first + second] = np.r_[np.ones(first), 2 * np.ones(second)]
  return out


def _host(tree):
  return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
  actual, expected = _host(actual), _host(expected)
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _param(tree, *names):
  for name in names:
    tree = tree[name]
  return tree


WI = ("encoder", "layer_0", "ffn", "wi", "kernel")
QUERY = ("decoder", "layer_0", "self_attention", "query", "kernel")
OUT = ("decoder", "layer_0", "cross_attention", "out", "kernel")
EMBEDDING = ("shared_embedding", "embedding")


# ----------------------------------------------------------------------------------------------------------
# Single-device reference (device 0, no mesh)
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
  """The initial state (host copy) and the single-device results of one step, one accumulated step, eval."""
  state = create_train_state(CFG, TX, jax.random.key(0))  # mesh=None: one device
  initial = _host(state)
  one = sharding.single_device_mesh()
  shardings = sharding.shardings_of(state)
  rng = jax.random.key(1)
  batch = _batch()
  step = jit_train_step(CFG, one, shardings, label_smoothing=0.1, learning_rate_fn=_lr())
  new_state, metrics = step(sharding.device_put_sharded(initial, shardings), batch, rng)
  accum_batch = {k: v.reshape(2, ROWS // 2, LENGTH) for k, v in batch.items()}
  accum_step = jit_train_step(CFG, one, shardings, label_smoothing=0.1, grad_accum_steps=2,
                                       learning_rate_fn=_lr())
  accum_state, accum_metrics = accum_step(sharding.device_put_sharded(initial, shardings), accum_batch, rng)
  eval_batch = {k: v[:10] for k, v in _batch(seed=3).items() if k in ("inputs", "targets")}
  eval_sums = jit_eval_step(CFG, one, shardings.params, label_smoothing=0.1)(
      sharding.device_put_sharded(initial.params, shardings.params), eval_batch)
  return dict(initial=initial, rng=rng, batch=batch, state=_host(new_state), metrics=_host(metrics),
              accum_batch=accum_batch, accum_state=_host(accum_state), accum_metrics=_host(accum_metrics),
              eval_batch=eval_batch, eval_sums=_host(eval_sums))


@functools.lru_cache(maxsize=None)
def _sharded(name):
  mesh = sharding.make_mesh(**MESHES[name])
  state = create_train_state(CFG, TX, jax.random.key(0), mesh)
  return mesh, state, sharding.shardings_of(state)


# ----------------------------------------------------------------------------------------------------------
# One train step on every mesh == one step on one device
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MESHES))
def test_train_step_matches_single_device(reference, name):
  mesh, born, shardings = _sharded(name)
  # Born sharded, with the single-device initial values (the jitted initialiser may differ in the last bit).
  _assert_trees_close(born.params, reference["initial"].params, rtol=0, atol=1e-6)
  state = sharding.device_put_sharded(reference["initial"], shardings)  # identical start for an exact comparison
  step = jit_train_step(CFG, mesh, shardings, label_smoothing=0.1, learning_rate_fn=_lr())
  batch = sharding.shard_batch(reference["batch"], mesh)
  new_state, metrics = step(state, batch, reference["rng"])

  np.testing.assert_allclose(metrics["loss"], reference["metrics"]["loss"], rtol=RTOL)
  np.testing.assert_allclose(metrics["grad_norm"], reference["metrics"]["grad_norm"], rtol=RTOL)
  assert float(metrics["token_count"]) == float(reference["metrics"]["token_count"])
  _assert_trees_close(new_state.params, reference["state"].params)
  _assert_trees_close(new_state.opt_state, reference["state"].opt_state)
  assert int(new_state.step) == 1
  # The state keeps its layout across steps (in == out shardings), metrics are replicated.
  assert all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(new_state),
                                             jax.tree_util.tree_leaves(shardings)))
  assert metrics["loss"].sharding.is_fully_replicated


def test_weight_decay_step_on_an_fsdp_mesh_matches_single_device(reference):
  """AdamW (`optimizer.adam(weight_decay=...)`): its mask is computed on the boxed parameters the state is born
  from and on the plain ones the step updates; one step on the fsdp mesh equals the single-device step."""
  tx = adam(_lr(), eps=1e-3, weight_decay=0.1)
  results = []
  for mesh in (sharding.single_device_mesh(), sharding.make_mesh(**MESHES["fsdp8"])):
    shardings = sharding.shardings_of(create_train_state(CFG, tx, jax.random.key(0), mesh))
    state = sharding.device_put_sharded(
        reference["initial"].replace(tx=tx, opt_state=tx.init(reference["initial"].params)), shardings)
    step = jit_train_step(CFG, mesh, shardings, label_smoothing=0.1, learning_rate_fn=_lr())
    results.append(step(state, sharding.shard_batch(reference["batch"], mesh), reference["rng"])[0])
  _assert_trees_close(results[1].params, results[0].params)
  # The decay moved the matrices away from plain Adam's step, not the vectors.
  plain = reference["state"].params
  assert not np.allclose(_param(_host(results[0].params), *WI), _param(plain, *WI), rtol=0, atol=1e-7)
  bias = ("encoder", "layer_0", "ffn", "wi", "bias")
  np.testing.assert_allclose(_param(_host(results[0].params), *bias), _param(plain, *bias), rtol=1e-6, atol=1e-7)


def test_moving_average_is_sharded_like_the_parameters_and_its_step_matches_single_device(reference):
  """`optimizer.param_ema` in the optimizer state: born from the boxed parameters, the average takes their
  logical names and so their shardings on the fsdp mesh; one step there updates it as on one device."""
  tx = optax.chain(adam(_lr(), eps=1e-3), param_ema(0.5))
  results = []
  for mesh in (sharding.single_device_mesh(), sharding.make_mesh(**MESHES["fsdp8"])):
    born = create_train_state(CFG, tx, jax.random.key(0), mesh)
    shardings = sharding.shardings_of(born)
    assert jax.tree_util.tree_leaves(ema_params(shardings.opt_state)) == jax.tree_util.tree_leaves(shardings.params)
    state = sharding.device_put_sharded(
        reference["initial"].replace(tx=tx, opt_state=tx.init(reference["initial"].params)), shardings)
    step = jit_train_step(CFG, mesh, shardings, label_smoothing=0.1, learning_rate_fn=_lr())
    results.append(step(state, sharding.shard_batch(reference["batch"], mesh), reference["rng"])[0])
  assert any(not s.is_fully_replicated for s in jax.tree_util.tree_leaves(ema_params(shardings.opt_state)))
  _assert_trees_close(ema_params(results[1].opt_state), ema_params(results[0].opt_state))
  # One update from the initial parameters: d_1 = min(0.5, 2 / 11), so ema = d_1 p_0 + (1 - d_1) p_1.
  d = 2 / 11
  expected = jax.tree_util.tree_map(lambda p0, p1: d * np.asarray(p0) + (1 - d) * np.asarray(p1),
                                    _host(reference["initial"].params), _host(results[0].params))
  _assert_trees_close(ema_params(results[0].opt_state), expected)


def test_grad_accumulation_matches_single_device(reference):
  mesh, _, shardings = _sharded("data4_tensor2")
  state = sharding.device_put_sharded(reference["initial"], shardings)
  step = jit_train_step(CFG, mesh, shardings, label_smoothing=0.1, grad_accum_steps=2,
                                         learning_rate_fn=_lr())
  batch = sharding.shard_batch(reference["accum_batch"], mesh)
  assert batch["inputs"].shape == (2, ROWS // 2, LENGTH)
  assert batch["inputs"].sharding.spec == P(None, ("data", "fsdp"))
  assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(2, ROWS // 2 // 4, LENGTH)}
  new_state, metrics = step(state, batch, reference["rng"])
  np.testing.assert_allclose(metrics["loss"], reference["accum_metrics"]["loss"], rtol=RTOL)
  _assert_trees_close(new_state.params, reference["accum_state"].params)


def test_model_activation_constraints_resolve_under_the_mesh(reference):
  """The traced step carries the model's `with_logical_constraint`s as real sharding constraints."""
  mesh, state, shardings = _sharded("data4_tensor2")
  step = jit_train_step(CFG, mesh, shardings, learning_rate_fn=_lr())
  text = step.lower(state, sharding.shard_batch(reference["batch"], mesh), reference["rng"]).as_text()
  # [batch, length, mlp] -> (('data', 'fsdp'), None, 'tensor'); [batch, length, embed] -> rows only.
  assert '[{"data", "fsdp"}, {}, {"tensor"}]> : tensor<16x12x64xf32>' in text
  assert '[{"data", "fsdp"}, {}, {}]> : tensor<16x12x32xf32>' in text


def test_eval_step_with_padded_uneven_batch_matches_single_device(reference):
  mesh, state, shardings = _sharded("data4_tensor2")
  params = jax.device_put(reference["initial"].params, shardings.params)
  eval_fn = jit_eval_step(CFG, mesh, shardings.params, label_smoothing=0.1)
  with pytest.raises(ValueError, match="10 rows, not divisible by the 4-way batch split"):
    sharding.shard_batch(reference["eval_batch"], mesh, process_local=False)
  with pytest.raises(ValueError, match="needs pad_id"):
    sharding.shard_batch(reference["eval_batch"], mesh, process_local=False, pad_rows=True)
  batch = sharding.shard_batch(reference["eval_batch"], mesh, process_local=False, pad_rows=True,
                               pad_id=CFG.pad_id)
  assert batch["inputs"].shape == (12, LENGTH)  # 10 rows + 2 padding rows
  assert (np.asarray(batch["targets"])[10:] == CFG.pad_id).all()
  sums = eval_fn(params, batch)
  for key, value in reference["eval_sums"].items():
    np.testing.assert_allclose(sums[key], value, rtol=RTOL, err_msg=key)


# ----------------------------------------------------------------------------------------------------------
# Parameters really are split as the rules say
# ----------------------------------------------------------------------------------------------------------

def _shard_shapes(x):
  return {s.data.shape for s in x.addressable_shards}


def test_data_parallel_replicates_parameters():
  _, state, _ = _sharded("data8")
  for leaf in jax.tree_util.tree_leaves(state):
    assert leaf.sharding.is_fully_replicated
    assert _shard_shapes(leaf) == {leaf.shape}
    assert len(leaf.addressable_shards) == 8


def test_fsdp_splits_parameters_and_adam_moments_along_embed():
  _, state, _ = _sharded("fsdp8")
  wi = _param(state.params, *WI)
  assert wi.shape == (32, 64) and wi.sharding.spec == P("fsdp", "tensor")
  assert _shard_shapes(wi) == {(4, 64)}
  embedding = _param(state.params, *EMBEDDING)
  assert embedding.sharding.spec == P("tensor", "fsdp") and _shard_shapes(embedding) == {(64, 4)}
  query = _param(state.params, *QUERY)
  assert query.sharding.spec == P("fsdp", "tensor", None) and _shard_shapes(query) == {(4, 4, 8)}
  out = _param(state.params, *OUT)
  assert out.sharding.spec == P("tensor", None, "fsdp") and _shard_shapes(out) == {(4, 8, 4)}
  adam = state.opt_state[0]  # scale_by_adam: count, mu, nu
  for moments in (adam.mu, adam.nu):
    assert _param(moments, *WI).sharding == wi.sharding
    assert _shard_shapes(_param(moments, *WI)) == {(4, 64)}
  assert adam.count.sharding.is_fully_replicated and state.step.sharding.is_fully_replicated


def test_tensor_parallel_splits_heads_mlp_and_vocab():
  _, state, _ = _sharded("data4_tensor2")
  wi = _param(state.params, *WI)
  assert wi.sharding.spec == P("fsdp", "tensor") and _shard_shapes(wi) == {(32, 32)}
  wo = _param(state.params, "encoder", "layer_0", "ffn", "wo", "kernel")
  assert wo.sharding.spec == P("tensor", "fsdp") and _shard_shapes(wo) == {(32, 32)}
  query = _param(state.params, *QUERY)
  assert _shard_shapes(query) == {(32, 2, 8)}  # 4 heads over 2 devices
  assert _shard_shapes(_param(state.params, *EMBEDDING)) == {(32, 32)}  # 64 vocabulary rows over 2
  # Each device holds one of the two halves: devices of the same tensor index hold equal data.
  halves = {tuple(idx[1].indices(64)) for idx in wi.sharding.devices_indices_map(wi.shape).values()}
  assert halves == {(0, 32, 1), (32, 64, 1)}


def test_fsdp_state_memory_per_device_is_an_eighth():
  data_bytes = sharding.per_device_bytes(_sharded("data8")[1])
  fsdp_bytes = sharding.per_device_bytes(_sharded("fsdp8")[1])
  assert len(data_bytes) == len(fsdp_bytes) == 8
  total = sum(x.nbytes for x in jax.tree_util.tree_leaves(_sharded("data8")[1]))
  assert set(data_bytes.values()) == {total}
  # Everything with an `embed` dimension is split 8 ways; only the mlp/heads biases stay whole.
  assert max(fsdp_bytes.values()) < 0.15 * total


def test_batch_is_split_along_the_data_axes():
  for name, ways in (("data8", 8), ("fsdp8", 8), ("data4_tensor2", 4)):
    mesh = _sharded(name)[0]
    batch = sharding.shard_batch(_batch(), mesh)
    assert batch["targets"].sharding.spec == P(("data", "fsdp"))
    assert _shard_shapes(batch["targets"]) == {(ROWS // ways, LENGTH)}
    np.testing.assert_array_equal(np.asarray(batch["targets"]), _batch()["targets"])
  assert sharding.batch_sharding(mesh, accum=True).spec == P(None, ("data", "fsdp"))


# ----------------------------------------------------------------------------------------------------------
# Two processes x 4 CPU devices: jax.distributed, per-process rows, the same step as one device
# ----------------------------------------------------------------------------------------------------------

_WORKER = """
    import warnings
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    import test_sharding as T
    mesh = sharding.make_mesh(data=4, tensor=2)
    state = T.create_train_state(T.CFG, T.TX, jax.random.key(0), mesh)
    shardings = sharding.shardings_of(state)
    full = T._batch()
    rows = T.ROWS // jax.process_count()  # what the data pipeline yields on this host
    local = {k: v[process_id * rows:(process_id + 1) * rows] for k, v in full.items()}
    batch = sharding.shard_batch(local, mesh)
    step = T.jit_train_step(T.CFG, mesh, shardings, learning_rate_fn=T._lr())
    state, metrics = step(state, batch, jax.random.key(1))
    wi = state.params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"]
    print("RESULT " + json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                                  "batch_shape": list(batch["inputs"].shape), "loss": float(metrics["loss"]),
                                  "local_shards": len(wi.addressable_shards)}), flush=True)
"""


def test_two_processes_assemble_the_global_batch_and_match_one_device(reference, tmp_path):
  results = distributed_workers.run_workers(_WORKER, tmp_path, num_processes=2, devices_per_process=4)
  for result in results:
    assert result["processes"] == 2 and result["devices"] == 8 and result["local_shards"] == 4
    assert result["batch_shape"] == [ROWS, LENGTH]  # two 8-row halves -> one 16-row global batch
    np.testing.assert_allclose(result["loss"], reference["metrics"]["loss"], rtol=RTOL)


# ----------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------

def test_mesh_shape_errors():
  assert jax.device_count() == 8
  assert sharding.make_mesh().shape == {"data": 8, "fsdp": 1, "tensor": 1}
  assert dict(sharding.make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in sharding.make_mesh().axis_types)
  with pytest.raises(ValueError, match=r"product 3 must equal the number of devices \(8\)"):
    sharding.make_mesh(data=3)
  with pytest.raises(ValueError, match=r"product 16 must equal the number of devices \(8\)"):
    sharding.make_mesh(data=4, fsdp=2, tensor=2)
  with pytest.raises(ValueError, match="only one axis may be -1"):
    sharding.make_mesh(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8 devices"):
    sharding.make_mesh(data=-1, tensor=3)
  with pytest.raises(ValueError, match="positive integer or -1"):
    sharding.make_mesh(data=0)
  with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
    sharding.MeshConfig(data=-1, model=2)
  assert dict(sharding.mesh_from_config(sharding.MeshConfig(tensor=2)).shape) == {"data": 4, "fsdp": 1, "tensor": 2}


def test_model_that_does_not_fit_the_mesh_is_refused():
  mesh = sharding.make_mesh(data=1, tensor=8)
  with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by the 8 devices of mesh axis 'tensor'"):
    create_train_state(CFG, TX, jax.random.key(0), mesh)
  with pytest.raises(ValueError, match="num_heads=4"):
    jit_train_step(CFG, mesh, None)
  fsdp = sharding.make_mesh(data=1, fsdp=8)
  with pytest.raises(ValueError, match=r"d_model=36 is not divisible by the 8 devices of mesh axis 'fsdp'"):
    sharding.validate_model_for_mesh(CFG.replace(d_model=36), fsdp)
  with pytest.raises(ValueError, match=r"d_ff=62 is not divisible by the 4 devices"):
    sharding.validate_model_for_mesh(CFG.replace(d_ff=62), sharding.make_mesh(data=2, tensor=4))


def test_vocabulary_that_does_not_divide_is_replicated_with_a_warning(caplog):
  mesh = sharding.make_mesh(data=4, tensor=2)
  rules = sharding.validate_model_for_mesh(CFG.replace(vocab_size=65), mesh)
  assert dict(rules)["vocab"] is None and dict(rules)["mlp"] == "tensor"
  assert "vocab_size=65 is not divisible" in caplog.text
  assert dict(sharding.validate_model_for_mesh(CFG, mesh))["vocab"] == "tensor"


def test_uneven_training_batch_is_refused():
  mesh = _sharded("data8")[0]
  with pytest.raises(ValueError, match="12 rows, not divisible by the 8-way batch split"):
    sharding.shard_batch(_batch(12), mesh)


# ----------------------------------------------------------------------------------------------------------
# Decoding on sharded parameters
# ----------------------------------------------------------------------------------------------------------

def test_greedy_decoding_on_sharded_params_matches_single_device(reference):
  params = reference["state"].params  # after one step
  inputs = reference["batch"]["inputs"][:8]
  tokens, log_probs = decoding.greedy_search(jax.device_put(params, jax.devices()[0]), CFG, inputs, 8)

  mesh, _, shardings = _sharded("data4_tensor2")
  sharded_params = jax.device_put(params, shardings.params)
  sharded_inputs = sharding.shard_batch({"inputs": inputs}, mesh, process_local=False)["inputs"]
  with sharding.mesh_context(mesh):  # the model's activation constraints apply while decoding
    sharded_tokens, sharded_log_probs = decoding.greedy_search(sharded_params, CFG, sharded_inputs, 8)
  np.testing.assert_array_equal(np.asarray(sharded_tokens), np.asarray(tokens))
  np.testing.assert_allclose(np.asarray(sharded_log_probs), np.asarray(log_probs), rtol=1e-5, atol=1e-5)
  # Without the context too (jit follows the parameters' shardings; host inputs are replicated).
  plain_tokens, _ = decoding.greedy_search(sharded_params, CFG, inputs, 8)
  np.testing.assert_array_equal(np.asarray(plain_tokens), np.asarray(tokens))


def test_decoding_toolkit_on_a_two_device_mesh_matches_single_device(reference):
  """An ensemble (own caches), n-best beam search with per-token log-probs, a forced prefix, lexical
  constraints, nucleus sampling with per-source keys and alignments, on parameters sharded over a 2-device
  tensor mesh."""
  first, second = reference["initial"].params, reference["state"].params  # two different models
  inputs = np.asarray(reference["batch"]["inputs"][:4])
  limits = np.full((4,), 8, np.int32)
  prefix_tokens, prefix_lengths = np.full((4, 8), 5, np.int32), np.array([0, 1, 2, 0], np.int32)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(3), i))(np.arange(4))
  phrases = constraints.pack([[[7, 9]], [], [[11]], [[5], [6]]], 8)
  settings = [(generate.DecodeOptions(beam_size=3, nbest=2, alignment=True), None),
              (generate.DecodeOptions(beam_size=3, nbest=2), phrases),
              (generate.DecodeOptions(strategy="sample", top_p=0.8, temperature=1.3, alignment=True), None)]

  def run(params_list, options, cons):
    fn = jax.jit(lambda ps, x, k: generate.generate(ps, CFG, x, limits, options, 8, keys=k,
                                                    prefix_tokens=prefix_tokens, prefix_lengths=prefix_lengths,
                                                    constraints=cons))
    return jax.tree_util.tree_map(np.asarray, fn(params_list, inputs, keys))

  mesh = sharding.make_mesh(data=1, tensor=2, devices=jax.devices()[:2])
  state_shardings = sharding.shardings_of(create_train_state(CFG, TX, jax.random.key(0), mesh))
  for options, cons in settings:
    single = run(tuple(jax.device_put(p, jax.devices()[0]) for p in (first, second)), options, cons)
    sharded = run(tuple(jax.device_put(p, state_shardings.params) for p in (first, second)), options, cons)
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    if options.alignment:
      np.testing.assert_array_equal(sharded.alignment, single.alignment)
    np.testing.assert_allclose(sharded.token_log_probs, single.token_log_probs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sharded.log_probs, single.log_probs, rtol=1e-5, atol=1e-5)
    assert (single.tokens[1, 0, :1] == 5).all() and (single.tokens[2, 0, :2] == 5).all()  # the prefixes
    if cons is not None:
      assert constraints.satisfied(single.tokens[0, 0].tolist(), [[7, 9]])
      assert constraints.satisfied(single.tokens[3, 0].tolist(), [[5], [6]])


# ----------------------------------------------------------------------------------------------------------
# Checkpoints across device counts (saved on 1 device, restored on an 8-device mesh, and back)
# ----------------------------------------------------------------------------------------------------------

def _assert_leaves_equal(state, expected):
  """Bitwise equal step, params and optimizer state (static fields such as apply_fn are not compared)."""
  for a, b in zip(jax.tree_util.tree_leaves(_host((state.step, state.params, state.opt_state))),
                  jax.tree_util.tree_leaves(_host((expected.step, expected.params, expected.opt_state)))):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_restores_across_device_counts(reference, tmp_path):
  from transformer_jax.run import checkpoint as checkpoint_lib
  single = jax.device_put(reference["initial"], jax.devices()[0])
  with checkpoint_lib.Checkpointer(tmp_path / "one", enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, single, jax.random.key(3), {"epoch": 0, "index": 1, "seed": 0}, {"model": {}})

  mesh, sharded_state, shardings = _sharded("fsdp8")
  with checkpoint_lib.Checkpointer(tmp_path / "one", read_only=True) as ckpt:
    restored = ckpt.restore(1, sharding.abstract_state(sharded_state)).state
  _assert_leaves_equal(restored, reference["initial"])
  wi = _param(restored.params, *WI)
  assert wi.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert {s.data.shape for s in wi.addressable_shards} == {(CFG.d_model // 8, CFG.d_ff)}

  with checkpoint_lib.Checkpointer(tmp_path / "eight", enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, restored, jax.random.key(3), {"epoch": 0, "index": 1, "seed": 0}, {"model": {}})
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(
          jax.devices()[0])), single)
  with checkpoint_lib.Checkpointer(tmp_path / "eight", read_only=True) as ckpt:
    back = ckpt.restore(1, target).state
  _assert_leaves_equal(back, reference["initial"])
  assert len(_param(back.params, *WI).sharding.device_set) == 1
