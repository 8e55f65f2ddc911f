"""Numerical tests of the encoder-decoder Transformer: masking, decoding, packing, embeddings, sizes."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import model as model_lib
from transformer_jax.config import base, big, tiny
from transformer_jax.decoding.alignment import cross_attention_alignment
from transformer_jax.model import Embed, Transformer, shift_right, sinusoid_table

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 64


def small(**overrides):
  values = dict(vocab_size=VOCAB, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                num_heads=4, max_len=64)
  values.update(overrides)
  return tiny(**values)


CFG = small()


def _ids(seed, shape, low=4):
  return jnp.asarray(np.random.default_rng(seed).integers(low, VOCAB, size=shape), jnp.int32)


def _abstract_params(cfg):
  """Boxed parameter shapes (no computation, no compilation)."""
  ids = jnp.ones((1, 4), jnp.int32)
  return jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), ids, ids))["params"]


_PARAMS_CACHE = {}


def params_for(cfg, seed=0):
  """Random parameters for the behavioural tests, drawn with NumPy (initialising through Flax would cost
  a compilation per config). Unlike the real init, biases are non-zero and LayerNorm scales are not 1,
  so every parameter takes part in the equivalences checked below. Init values are tested separately."""
  key = (cfg, seed)
  if key not in _PARAMS_CACHE:
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
      name = jax.tree_util.keystr(path)
      shape = leaf.shape
      if "embedding" in name:
        value = rng.normal(size=shape) * cfg.d_model ** -0.5
      elif "scale" in name:
        value = 1.0 + 0.1 * rng.normal(size=shape)
      elif "bias" in name:
        value = 0.1 * rng.normal(size=shape)
      else:  # kernels: fan_in is the leading axis, or (heads, kv) for the attention output projection
        fan_in = shape[0] * shape[1] if len(shape) == 3 and shape[-1] == cfg.d_model else shape[0]
        value = rng.normal(size=shape) / math.sqrt(fan_in)
      return jnp.asarray(value, jnp.float32)

    _PARAMS_CACHE[key] = jax.tree_util.tree_map_with_path(draw, nn.unbox(_abstract_params(cfg)))
  return _PARAMS_CACHE[key]


def logits_fn(cfg):
  # Eager: a tiny forward pass is cheaper op by op than compiling it once per new shape.
  return lambda p, src, tgt: Transformer(cfg).apply({"params": p}, src, tgt)


def _batch(seed=1):
  """Two rows; row 1 has a shorter source (3 pad tokens) and shorter target (2 pad tokens)."""
  src = np.array(_ids(seed, (2, 7)))
  tgt = np.array(_ids(seed + 1, (2, 6)))
  src[1, 4:] = 0
  tgt[1, 4:] = 0
  return jnp.asarray(src), jnp.asarray(tgt)


CONFIGS = {
    "post_ln": CFG,
    "pre_ln": small(pre_ln=True),
    "learned": small(position_embedding="learned"),
    "unshared": small(share_embeddings=False, pre_ln=True),
}


# ----------------------------------------------------------------------------------------------------------
# Masking: padding and causality
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["post_ln", "pre_ln", "learned"])
def test_extra_padding_does_not_change_real_logits(name):
  cfg = CONFIGS[name]
  params, f = params_for(cfg), logits_fn(cfg)
  src, tgt = _batch()
  ref = np.asarray(f(params, src, tgt))
  src_pad = jnp.pad(src, ((0, 0), (0, 2)))
  tgt_pad = jnp.pad(tgt, ((0, 0), (0, 2)))
  real = np.asarray(tgt != 0)
  for s, t in ((src_pad, tgt), (src_pad, tgt_pad)):
    out = np.asarray(f(params, s, t))[:, : tgt.shape[1]]
    np.testing.assert_allclose(out[real], ref[real], **TOL)
  # Sanity: the model does depend on the real source tokens.
  other = np.asarray(f(params, src.at[1, 0].set(5 if src[1, 0] != 5 else 6), tgt))
  assert np.abs(other[1][real[1]] - ref[1][real[1]]).max() > 1e-3


def test_padded_target_ids_do_not_change_real_logits():
  params, f = params_for(CFG), logits_fn(CFG)
  src, tgt = _batch()
  ref = np.asarray(f(params, src, tgt))
  # Row 1 has padding at target positions 4, 5; put arbitrary tokens there.
  changed = tgt.at[1, 4:].set(jnp.array([17, 42]))
  out = np.asarray(f(params, src, changed))
  np.testing.assert_allclose(out[1, :4], ref[1, :4], **TOL)
  np.testing.assert_allclose(out[0], ref[0], **TOL)


@pytest.mark.parametrize("name", ["post_ln", "pre_ln"])
def test_causality(name):
  cfg = CONFIGS[name]
  params, f = params_for(cfg), logits_fn(cfg)
  src, tgt = _ids(3, (2, 7)), _ids(4, (2, 6))
  ref = np.asarray(f(params, src, tgt))
  for t in range(tgt.shape[1]):
    changed = tgt.at[:, t:].set((tgt[:, t:] + 7) % (VOCAB - 4) + 4)
    out = np.asarray(f(params, src, changed))
    # Logit position i predicts target i from targets < i: positions 0..t are unaffected.
    np.testing.assert_allclose(out[:, : t + 1], ref[:, : t + 1], **TOL)
    if t + 1 < tgt.shape[1]:
      assert np.abs(out[:, t + 1] - ref[:, t + 1]).max() > 1e-4


def test_shift_right():
  tgt = jnp.array([[5, 6, 7, 8], [9, 10, 0, 0]])
  np.testing.assert_array_equal(shift_right(tgt, 2), [[2, 5, 6, 7], [2, 9, 10, 0]])
  packed = jnp.array([[5, 6, 7, 8, 9]])
  positions = jnp.array([[0, 1, 0, 1, 2]])
  np.testing.assert_array_equal(shift_right(packed, 2, positions), [[2, 5, 2, 7, 8]])


# ----------------------------------------------------------------------------------------------------------
# KV-cached decoding
# ----------------------------------------------------------------------------------------------------------

def cached_decode_logits(cfg, params, src, tgt):
  """Teacher-forced logits computed one position at a time through the KV cache."""
  model = Transformer(cfg)
  batch, length = tgt.shape
  encoded = model.apply({"params": params}, src, method=Transformer.encode)
  bos = jnp.full((batch, 1), cfg.bos_id, jnp.int32)
  _, variables = model.apply({"params": params}, encoded, src, bos, use_cache=True, max_decode_len=length,
                             mutable=["cache"], method=Transformer.decode)
  cache = variables["cache"]

  def step(cache, token):
    logits, variables = model.apply({"params": params, "cache": cache}, encoded, src, token, use_cache=True,
                                    max_decode_len=length, mutable=["cache"], method=Transformer.decode)
    return logits[:, 0], variables["cache"]

  outputs, token = [], bos
  for t in range(length):
    logits, cache = step(cache, token)
    outputs.append(logits)
    token = tgt[:, t:t + 1]
  return np.stack([np.asarray(o) for o in outputs], axis=1)


@pytest.mark.parametrize("name", ["post_ln", "pre_ln", "learned", "unshared"])
def test_cached_decoding_matches_teacher_forcing(name):
  cfg = CONFIGS[name]
  params = params_for(cfg)
  src, _ = _batch(seed=5)  # row 1 has a padded source
  tgt = _ids(8, (2, 6))
  full = np.asarray(logits_fn(cfg)(params, src, tgt))
  stepped = cached_decode_logits(cfg, params, src, tgt)
  np.testing.assert_allclose(stepped, full, **TOL)


# ----------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["post_ln", "learned"])
def test_packed_row_equals_examples_alone(name):
  cfg = CONFIGS[name]
  params, f = params_for(cfg), logits_fn(cfg)
  # Two examples of 4 source and 4 target tokens, run alone (one per batch row: rows never interact).
  src_ab, tgt_ab = _ids(10, (2, 4)), _ids(11, (2, 4))
  alone = np.asarray(f(params, src_ab, tgt_ab))
  alone_a, alone_b = alone[0], alone[1]
  src_a, src_b, tgt_a, tgt_b = src_ab[:1], src_ab[1:], tgt_ab[:1], tgt_ab[1:]

  # Row 0: [a a a a b b b b pad] / [a a a a b b b b]; row 1 packs them the other way round.
  pad = jnp.zeros((1, 1), jnp.int32)
  src = jnp.concatenate([jnp.concatenate([src_a, src_b, pad], 1), jnp.concatenate([src_b, src_a, pad], 1)])
  tgt = jnp.concatenate([jnp.concatenate([tgt_a, tgt_b], 1), jnp.concatenate([tgt_b, tgt_a], 1)])
  inputs_position = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 0]] * 2)
  inputs_segmentation = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 0]] * 2)
  targets_position = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
  targets_segmentation = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2]] * 2)
  packed = np.asarray(Transformer(cfg).apply(
      {"params": params}, src, tgt, inputs_position=inputs_position, targets_position=targets_position,
      inputs_segmentation=inputs_segmentation, targets_segmentation=targets_segmentation))
  assert np.all(np.isfinite(packed))
  np.testing.assert_allclose(packed[0, :4], alone_a, **TOL)
  np.testing.assert_allclose(packed[0, 4:], alone_b, **TOL)
  np.testing.assert_allclose(packed[1, :4], alone_b, **TOL)
  np.testing.assert_allclose(packed[1, 4:], alone_a, **TOL)
  # Without the packing information the second example would see the first: the test is not vacuous.
  unpacked = np.asarray(f(params, src, tgt))
  assert np.abs(unpacked[0, 4:] - alone_b).max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# Positions and embeddings
# ----------------------------------------------------------------------------------------------------------

def test_sinusoid_table_matches_paper_formula():
  max_len, d = 50, 16
  table = sinusoid_table(max_len, d)
  assert table.dtype == np.float32 and table.shape == (max_len, d)
  expected = np.zeros((max_len, d))
  for pos in range(max_len):
    for i in range(d // 2):
      angle = pos / 10000 ** (2 * i / d)
      expected[pos, 2 * i] = math.sin(angle)
      expected[pos, 2 * i + 1] = math.cos(angle)
  np.testing.assert_allclose(table, expected, rtol=0, atol=1e-6)
  np.testing.assert_allclose(table[0, 0::2], 0.0)
  np.testing.assert_allclose(table[0, 1::2], 1.0)


def test_encoder_input_is_scaled_embedding_plus_sinusoid():
  params = params_for(CFG)
  src, tgt = _batch()
  _, state = Transformer(CFG).apply({"params": params}, src, tgt, capture_intermediates=True,
                                    mutable=["intermediates"])
  (x,) = state["intermediates"]["encoder"]["positions"]["__call__"]
  emb = np.asarray(params["shared_embedding"]["embedding"])
  expected = emb[np.asarray(src)] * math.sqrt(CFG.d_model) + sinusoid_table(CFG.max_len, CFG.d_model)[:7]
  np.testing.assert_allclose(np.asarray(x), expected, **TOL)
  # The decoder sees BOS + targets shifted right, through the same embedding.
  (y,) = state["intermediates"]["decoder"]["positions"]["__call__"]
  dec_in = np.asarray(shift_right(tgt, CFG.bos_id))
  expected = emb[dec_in] * math.sqrt(CFG.d_model) + sinusoid_table(CFG.max_len, CFG.d_model)[:6]
  np.testing.assert_allclose(np.asarray(y), expected, **TOL)


def test_shared_embedding_is_the_output_projection():
  params = params_for(CFG)
  assert set(params) == {"shared_embedding", "encoder", "decoder"}
  assert "logits" not in params["decoder"]
  src, tgt = _batch()
  logits, state = Transformer(CFG).apply({"params": params}, src, tgt, capture_intermediates=True,
                                         mutable=["intermediates"])
  (hidden,) = state["intermediates"]["decoder"][f"layer_{CFG.num_decoder_layers - 1}"]["__call__"]
  emb = np.asarray(params["shared_embedding"]["embedding"], np.float64)
  expected = np.asarray(hidden, np.float64) @ emb.T
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)


def test_unshared_embeddings_have_separate_params_and_output_layer():
  cfg = CONFIGS["unshared"]  # pre-LN: the last hidden state is the final LayerNorm's output
  params = params_for(cfg)
  assert set(params) == {"source_embedding", "target_embedding", "encoder", "decoder"}
  assert params["decoder"]["logits"]["kernel"].shape == (cfg.d_model, VOCAB)
  src, tgt = _batch()
  # Perturb the logits bias so that it is checked too.
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["decoder"]["logits"]["bias"] = jnp.linspace(-1.0, 1.0, VOCAB)
  logits, state = Transformer(cfg).apply({"params": params}, src, tgt, capture_intermediates=True,
                                         mutable=["intermediates"])
  (hidden,) = state["intermediates"]["decoder"]["final_layer_norm"]["__call__"]
  p = params["decoder"]["logits"]
  expected = np.asarray(hidden, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"])
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)
  # The source embedding feeds only the encoder, the target embedding only the decoder.
  model = Transformer(cfg)
  memory = model.apply({"params": params}, src, method=Transformer.encode)
  no_target = dict(params, target_embedding={"embedding": jnp.zeros((VOCAB, cfg.d_model))})
  np.testing.assert_array_equal(
      np.asarray(model.apply({"params": no_target}, src, method=Transformer.encode)), np.asarray(memory))
  no_source = dict(params, source_embedding={"embedding": jnp.zeros((VOCAB, cfg.d_model))})
  np.testing.assert_array_equal(
      np.asarray(model.apply({"params": no_source}, memory, src, tgt, method=Transformer.decode)),
      np.asarray(logits))
  assert np.abs(np.asarray(model.apply({"params": no_target}, src, tgt)) - np.asarray(logits)).max() > 1e-3


def test_embedding_init_std():
  cfg = tiny(vocab_size=2000, d_model=512, d_ff=64, num_heads=8)
  emb = np.asarray(nn.unbox(Embed(cfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))
                   ["params"]["embedding"])
  assert emb.shape == (2000, 512)
  assert abs(emb.std() - 512 ** -0.5) < 0.01 * 512 ** -0.5
  assert abs(emb.mean()) < 1e-3
  # Scaled by sqrt(d_model), embedded tokens have unit variance.
  out = Embed(cfg).apply({"params": {"embedding": emb}}, jnp.arange(2000)[None])
  assert abs(float(jnp.std(out)) - 1.0) < 0.01


def test_init_values_of_every_parameter():
  """Xavier-uniform kernels, zero biases, LayerNorm scale 1 / bias 0, embedding ~ N(0, d_model^-0.5)."""
  cfg = small(d_model=64, d_ff=256, num_encoder_layers=1, num_decoder_layers=1)
  ids = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(0), ids, ids)["params"])
  seen = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name, leaf = jax.tree_util.keystr(path), np.asarray(leaf)
    kind = name.rsplit("'", 2)[-2]
    seen.add(kind)
    if kind == "bias" and "layer_norm" not in name:
      np.testing.assert_array_equal(leaf, 0.0, err_msg=name)
    elif "layer_norm" in name:
      np.testing.assert_array_equal(leaf, 1.0 if kind == "scale" else 0.0, err_msg=name)
    elif kind == "embedding":
      assert abs(leaf.std() - cfg.d_model ** -0.5) < 0.05 * cfg.d_model ** -0.5
    else:
      assert kind == "kernel", name
      if leaf.ndim == 3:  # attention projections: the d_model x d_model matrix
        fan_in, fan_out = cfg.d_model, cfg.d_model
      else:
        fan_in, fan_out = leaf.shape
      bound = math.sqrt(6.0 / (fan_in + fan_out))
      assert np.abs(leaf).max() <= bound, name
      assert np.abs(leaf).max() > 0.98 * bound, name
      assert abs(leaf.std() - bound / math.sqrt(3)) < 0.05 * bound / math.sqrt(3), name
  assert seen == {"kernel", "bias", "scale", "embedding"}
  ffn = params["encoder"]["layer_0"]["ffn"]
  assert ffn["wi"]["kernel"].shape == (64, 256) and ffn["wo"]["kernel"].shape == (256, 64)


# ----------------------------------------------------------------------------------------------------------
# Sizes and logical axis names
# ----------------------------------------------------------------------------------------------------------

def _count(params):
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.unbox(params)))


def _expected_count(vocab, n, d, d_ff):
  attention = 4 * (d * d + d)
  ffn = d * d_ff + d_ff + d_ff * d + d
  norm = 2 * d
  encoder_layer = attention + ffn + 2 * norm
  decoder_layer = 2 * attention + ffn + 3 * norm
  return vocab * d + n * encoder_layer + n * decoder_layer


def test_parameter_count_base():
  count = _count(_abstract_params(base(vocab_size=37000)))
  assert count == _expected_count(37000, 6, 512, 2048) == 63_082_496


def test_parameter_count_big():
  count = _count(_abstract_params(big(vocab_size=37000)))
  assert count == _expected_count(37000, 6, 1024, 4096) == 214_245_376


def test_parameter_count_gated_ffn():
  """ffn_glu adds one [d_model, d_ff] projection and its bias per layer (Shazeer, 2020)."""
  n, d, d_ff = 2, 32, 64
  plain = _count(_abstract_params(small()))
  gated = _count(_abstract_params(small(ffn_glu=True)))
  assert plain == _expected_count(VOCAB, n, d, d_ff)
  assert gated - plain == 2 * n * (d * d_ff + d_ff)


@pytest.mark.parametrize("activation,act", [("relu", jax.nn.relu), ("swish", jax.nn.silu)])
def test_gated_ffn_computes_the_glu_variant(activation, act):
  """(act(x W + b) * (x V + c)) W2 + b2: ReGLU / SwiGLU of Shazeer (2020), checked against the formula."""
  from transformer_jax.model import FeedForward
  cfg = small(ffn_glu=True, activation=activation)
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))  # [batch, length, d_model]
  module = FeedForward(cfg)
  params = nn.unbox(module.init(jax.random.key(0), x)["params"])
  assert set(params) == {"wi", "wi_linear", "wo"}
  params = jax.tree_util.tree_map(  # non-zero biases, so each one's place in the formula is tested
      lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
  dense = lambda p, v: v @ p["kernel"] + p["bias"]
  expected = dense(params["wo"], act(dense(params["wi"], x)) * dense(params["wi_linear"], x))
  np.testing.assert_allclose(module.apply({"params": params}, x), expected, **TOL)


def test_gated_ffn_flag_must_be_boolean():
  with pytest.raises(ValueError, match="ffn_glu='yes' must be True or False"):
    small(ffn_glu="yes")


ALLOWED_NAMES = {"vocab", "embed", "mlp", "heads", "kv", None}


@pytest.mark.parametrize(
    "cfg", [CFG, small(position_embedding="learned", pre_ln=True, share_embeddings=False), small(ffn_glu=True)],
    ids=["default", "learned_preln_unshared", "gated_ffn"])
def test_every_parameter_has_logical_axis_names(cfg):
  params = _abstract_params(cfg)
  leaves = jax.tree_util.tree_leaves_with_path(
      params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert len(leaves) > 10
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.LogicallyPartitioned), where
    assert len(leaf.names) == len(leaf.value.shape), where
    assert set(leaf.names) <= ALLOWED_NAMES, (where, leaf.names)
  names = {jax.tree_util.keystr(p): l.names for p, l in leaves}
  if cfg.share_embeddings:
    assert names["['shared_embedding']['embedding']"] == ("vocab", "embed")
  else:
    assert names["['decoder']['logits']['kernel']"] == ("embed", "vocab")
    assert names["['decoder']['positions']['position_embedding']"] == (None, "embed")
  assert names["['encoder']['layer_0']['ffn']['wi']['kernel']"] == ("embed", "mlp")
  if cfg.ffn_glu:
    assert names["['decoder']['layer_1']['ffn']['wi_linear']['kernel']"] == ("embed", "mlp")


# ----------------------------------------------------------------------------------------------------------
# Dropout, remat, attention weights
# ----------------------------------------------------------------------------------------------------------

def test_dropout_determinism():
  cfg = small(dropout_rate=0.3)
  params = params_for(cfg)
  src, tgt = _batch()
  model = Transformer(cfg)
  apply = lambda p, s, t, key, det: model.apply({"params": p}, s, t, deterministic=det,
                                                 rngs={"dropout": key})
  det_a = apply(params, src, tgt, jax.random.key(0), True)
  det_b = apply(params, src, tgt, jax.random.key(1), True)
  np.testing.assert_array_equal(np.asarray(det_a), np.asarray(det_b))
  np.testing.assert_array_equal(np.asarray(det_a), np.asarray(model.apply({"params": params}, src, tgt)))
  drop_a = apply(params, src, tgt, jax.random.key(0), False)
  drop_a2 = apply(params, src, tgt, jax.random.key(0), False)
  drop_b = apply(params, src, tgt, jax.random.key(1), False)
  np.testing.assert_array_equal(np.asarray(drop_a), np.asarray(drop_a2))
  assert np.abs(np.asarray(drop_a) - np.asarray(drop_b)).max() > 1e-2
  assert np.abs(np.asarray(drop_a) - np.asarray(det_a)).max() > 1e-2


def test_remat_gives_identical_logits_and_gradients():
  cfg = small(num_encoder_layers=1, num_decoder_layers=1)  # dropout 0.1
  cfg_remat = cfg.replace(remat=True)
  params = params_for(cfg)
  abstract = nn.unbox(_abstract_params(cfg_remat))
  assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(params)
  src, tgt = _batch()

  def loss(p, c):
    # Dropout on: both versions must also draw the same masks.
    logits = Transformer(c).apply({"params": p}, src, tgt, deterministic=False,
                                  rngs={"dropout": jax.random.key(3)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5] * (tgt != 0)), logits

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l0, logits0), g0 = grad_fn(params, cfg)
  (l1, logits1), g1 = grad_fn(params, cfg_remat)
  np.testing.assert_allclose(np.asarray(logits1), np.asarray(logits0), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


_RENAMES = {"self_attention": "attention", "cross_attention": "source_attention", "layer_0": "block_0",
            "layer_1": "block_1"}


def _renamed(tree):
  return {_RENAMES.get(k, k): _renamed(v) if isinstance(v, dict) else v for k, v in tree.items()}


def test_attention_weights_follow_renamed_submodules_and_fail_loudly_otherwise(monkeypatch):
  """The sown weights are read through the names the model gives its submodules (as the decoder reaches its
  caches through `attention.kvcache`'s accessors): renamed submodules give the same weights and alignments;
  weights sown under other names than the reader's are an error naming the path, never a silent miss."""
  params, (src, tgt) = params_for(CFG), _batch()
  before = model_lib.attention_weights(params, CFG, src, tgt)
  aligned = cross_attention_alignment([params], CFG, src, tgt)
  monkeypatch.setattr(model_lib, "SELF_ATTENTION", "attention")
  monkeypatch.setattr(model_lib, "CROSS_ATTENTION", "source_attention")
  monkeypatch.setattr(model_lib, "layer_name", lambda i: f"block_{i}")
  renamed = _renamed(params)
  assert (jax.tree_util.tree_structure(renamed) ==
          jax.tree_util.tree_structure(nn.unbox(_abstract_params(CFG))))  # the model itself is renamed
  after = model_lib.attention_weights(renamed, CFG, src, tgt)
  for kind in model_lib.ATTENTION_KINDS:
    assert len(after[kind]) == 2
    for a, b in zip(before[kind], after[kind]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(cross_attention_alignment([renamed], CFG, src, tgt)), np.asarray(aligned))
  _, sown = Transformer(CFG).apply({"params": renamed}, src, tgt, sow_attention_weights=True,
                                   mutable=["intermediates"])
  monkeypatch.undo()  # a reader that still uses the old names
  with pytest.raises(ValueError, match=r"no attention weights sown at encoder/layer_0/self_attention/"
                                       r"attention_weights: encoder holds \['block_0', 'block_1'\]"):
    model_lib.sown_attention_weights(sown["intermediates"], CFG)


def test_sow_attention_weights_sows_normalised_weights():
  cfg = CFG
  params = params_for(CFG)
  src, tgt = _batch()
  model = Transformer(cfg)
  default = np.asarray(model.apply({"params": params}, src, tgt))
  out, state = model.apply({"params": params}, src, tgt, sow_attention_weights=True, mutable=["intermediates"])
  np.testing.assert_allclose(np.asarray(out), default, **TOL)
  inter = state["intermediates"]
  src_valid = np.asarray(src != 0)
  for stack, kinds in (("encoder", ("self_attention",)), ("decoder", ("self_attention", "cross_attention"))):
    for i in range(2):
      for kind in kinds:
        (w,) = inter[stack][f"layer_{i}"][kind]["attention_weights"]
        w = np.asarray(w)
        q_len = src.shape[1] if stack == "encoder" else tgt.shape[1]
        k_len = tgt.shape[1] if (stack, kind) == ("decoder", "self_attention") else src.shape[1]
        assert w.shape == (2, cfg.num_heads, q_len, k_len)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        if kind == "cross_attention" or stack == "encoder":
          # No weight on padded source keys.
          assert np.all(w[~np.broadcast_to(src_valid[:, None, None, :], w.shape)] == 0.0)
        else:
          # Causal: nothing above the diagonal.
          assert np.all(np.triu(w, k=1) == 0.0)
