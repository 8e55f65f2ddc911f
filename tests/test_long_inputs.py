"""Long-input attention options (relative positions, local windows, query chunks) against NumPy references.

The reference `_np_attention` writes Shaw et al. (2018) eqs. 3-5 directly in float64: e_ij = x_i W^Q (x_j W^K +
a^K_ij)ᵀ / √d, z_i = Σ_j α_ij (x_j W^V + a^V_ij), a_ij = w[clip(j - i, -k, k)], with the mask rules (padding,
segments, causality, |i - j| < window) applied as -inf before the softmax.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from test_model import _batch, _ids, cached_decode_logits, logits_fn, params_for, small
import helpers
from transformer_jax import decoding
from transformer_jax import dropout as dropout_lib
from transformer_jax.attention import (AttentionMask, RelativePositions, blocked_attention,
                                       dot_product_attention, full_attention_weights)
from transformer_jax.attention import kvcache
from transformer_jax.config import ModelConfig
from transformer_jax.evaluation import diagnostics
from transformer_jax.model import Transformer

TOL = dict(rtol=1e-5, atol=1e-5)


def _np_attention(q, k, v, *, valid, q_pos, k_pos, q_seg=None, k_seg=None, causal=False, window=0,
                  rel_key=None, rel_value=None, max_distance=0):
  """Float64 reference; q `[b,q,h,d]`, k/v `[b,k,h,d]`, valid `[b,k]`, positions/segments `[b,q]`/`[b,k]`."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, lq, h, d = q.shape
  lk = k.shape[1]
  out = np.zeros((b, lq, h, d))
  for n in range(b):
    for i in range(lq):
      for head in range(h):
        logits = np.full(lk, -np.inf)
        rel = np.zeros((lk, d))
        for j in range(lk):
          allowed = valid[n, j]
          allowed &= q_seg is None or q_seg[n, i] == k_seg[n, j]
          allowed &= not causal or j <= i
          allowed &= not window or abs(q_pos[n, i] - k_pos[n, j]) < window
          if not allowed:
            continue
          r = int(np.clip(k_pos[n, j] - q_pos[n, i], -max_distance, max_distance)) + max_distance
          key_j = k[n, j, head] + (rel_key[r] if rel_key is not None else 0.0)
          logits[j] = q[n, i, head] @ key_j / np.sqrt(d)
          rel[j] = rel_value[r] if rel_value is not None else 0.0
        if np.all(np.isinf(logits)):  # no key to attend to (a padding query): not compared
          out[n, i, head] = np.nan
          continue
        w = np.exp(logits - logits.max())
        w /= w.sum()
        out[n, i, head] = w @ (v[n, :, head] + rel)
  return out


def _inputs(seed=0, b=2, lq=11, lk=11, h=2, d=4, k=3):
  rng = np.random.default_rng(seed)
  q, kk, v = (rng.normal(size=(b, n, h, d)).astype(np.float32) for n in (lq, lk, lk))
  valid = np.ones((b, lk), bool)
  valid[1, lk - 3:] = False  # row 1: three padding keys
  rel_key = rng.normal(size=(2 * k + 1, d)).astype(np.float32)
  rel_value = rng.normal(size=(2 * k + 1, d)).astype(np.float32)
  return q, kk, v, valid, rel_key, rel_value


def _mask(valid, lq, *, causal=False, window=0, packed=False):
  b, lk = valid.shape
  pos_q = np.broadcast_to(np.arange(lq), (b, lq)).copy()
  pos_k = np.broadcast_to(np.arange(lk), (b, lk)).copy()
  seg_q = seg_k = None
  if packed:  # two examples per row: 0..4 | 0..(len - 6)
    seg_q = np.where(np.arange(lq) < 5, 1, 2)[None].repeat(b, 0)
    seg_k = np.where(np.arange(lk) < 5, 1, 2)[None].repeat(b, 0)
    pos_q, pos_k = np.where(seg_q == 1, pos_q, pos_q - 5), np.where(seg_k == 1, pos_k, pos_k - 5)
  as_array = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
  mask = AttentionMask(jnp.asarray(valid), as_array(pos_q), as_array(pos_k), as_array(seg_q), as_array(seg_k),
                       causal=causal, window=window)
  ref = dict(valid=valid, q_pos=pos_q, k_pos=pos_k, q_seg=seg_q, k_seg=seg_k, causal=causal, window=window)
  return mask, ref


CASES = {  # name: (chunk_size, causal, window, relative, packed)
    "chunked": (4, False, 0, False, False),
    "chunked_causal_packed": (3, True, 0, False, True),
    "windowed": (4, False, 3, False, False),
    "windowed_causal": (2, True, 4, False, False),
    "windowed_band_skips_blocks": (2, False, 2, False, False),  # visits 3 of 6 key blocks per chunk
    "relative": (11, False, 0, True, False),
    "relative_chunked_causal": (4, True, 0, True, False),
    "everything_packed": (2, True, 2, True, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_blocked_attention_matches_numpy(name):
  chunk, causal, window, relative, packed = CASES[name]
  q, k, v, valid, rel_key, rel_value = _inputs(seed=len(name))
  mask, ref = _mask(valid, q.shape[1], causal=causal, window=window, packed=packed)
  tables = RelativePositions(jnp.asarray(rel_key), jnp.asarray(rel_value), max_distance=3) if relative else None
  out = blocked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, chunk_size=chunk,
                          band=max(window - 1, 0), relative=tables)
  expected = _np_attention(q, k, v, **ref, rel_key=rel_key if relative else None,
                           rel_value=rel_value if relative else None, max_distance=3)
  seen = ~np.isnan(expected)
  np.testing.assert_allclose(np.asarray(out)[seen], expected[seen], **TOL)
  if relative:  # the one-block path that diagnostics use computes the same
    one_block, weights = full_attention_weights(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, tables)
    np.testing.assert_allclose(np.asarray(one_block)[seen], expected[seen], **TOL)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_relative_attention_dropout_drops_the_weights():
  """Dropout on the weights with relative positions: Σ_j keep_ij α_ij / (1 - rate) (v_j + a^V_ij) for the same
  Bernoulli draw, the returned weights undropped; the same key gives the same output, another key another."""
  q, k, v, valid, rel_key, rel_value = _inputs(seed=4)
  mask, ref = _mask(valid, q.shape[1])
  tables = RelativePositions(jnp.asarray(rel_key), jnp.asarray(rel_value), max_distance=3)
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, tables)
  out, weights = full_attention_weights(*args, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  again, _ = full_attention_weights(*args, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  other, _ = full_attention_weights(*args, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  undropped, _ = full_attention_weights(*args)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
  assert not np.allclose(np.asarray(out), np.asarray(other))
  # The weights are the softmax of Shaw et al.'s logits whatever the dropout: the output without it matches NumPy.
  np.testing.assert_allclose(np.asarray(undropped), _np_attention(q, k, v, **ref, rel_key=rel_key,
                                                                  rel_value=rel_value, max_distance=3), **TOL)
  w = np.asarray(weights, np.float64)  # [b, h, q, k]
  keep = np.asarray(dropout_lib.bernoulli(jax.random.key(0), 0.5, w.shape))
  probs = np.where(keep, w / 0.5, 0.0)
  lq, lk = w.shape[2:]
  a_v = rel_value[np.clip(np.arange(lk)[None] - np.arange(lq)[:, None], -3, 3) + 3]  # [q, k, d]
  expected = (np.einsum("bhqk,bkhd->bqhd", probs, v.astype(np.float64))
              + np.einsum("bhqk,qkd->bqhd", probs, a_v.astype(np.float64)))
  np.testing.assert_allclose(np.asarray(out), expected, **TOL)
  assert (keep == 0).any() and np.abs(np.asarray(out) - np.asarray(undropped)).max() > 1e-2


def test_model_attention_dropout_with_relative_positions():
  """`attention_dropout_rate` with `max_relative_position`: seeded in training, off when deterministic."""
  cfg = small(max_relative_position=3, attention_dropout_rate=0.3, dropout_rate=0.0, **ONE_LAYER)
  params = params_for(cfg)
  src, tgt = _batch(seed=6)
  model = Transformer(cfg)
  train = lambda seed: np.asarray(model.apply({"params": params}, src, tgt, deterministic=False,
                                              rngs={"dropout": jax.random.key(seed)}))
  np.testing.assert_array_equal(train(0), train(0))
  assert not np.allclose(train(0), train(1))
  evaluated = np.asarray(model.apply({"params": params}, src, tgt))
  without = np.asarray(logits_fn(cfg.replace(attention_dropout_rate=0.0))(params, src, tgt))
  np.testing.assert_array_equal(evaluated, without)
  # Dropout is the only randomness here (dropout_rate 0): with the rate at 0 training equals evaluation.
  no_dropout = Transformer(cfg.replace(attention_dropout_rate=0.0))
  np.testing.assert_allclose(np.asarray(no_dropout.apply({"params": params}, src, tgt, deterministic=False,
                                                         rngs={"dropout": jax.random.key(0)})), without, **TOL)


def test_relative_key_embeddings_change_the_output():
  """Not vacuous: without a^K/a^V the same inputs give plainly different outputs."""
  q, k, v, valid, rel_key, rel_value = _inputs()
  mask, ref = _mask(valid, q.shape[1])
  with_rel = _np_attention(q, k, v, **ref, rel_key=rel_key, rel_value=rel_value, max_distance=3)
  tables = RelativePositions(jnp.asarray(rel_key), None, max_distance=3)
  keys_only = blocked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, chunk_size=5,
                                relative=tables)
  np.testing.assert_allclose(np.asarray(keys_only), _np_attention(q, k, v, **ref, rel_key=rel_key, max_distance=3),
                             **TOL)
  assert np.abs(np.asarray(keys_only) - with_rel).max() > 1e-2


def _full_loss(q, k, v, mask):
  out = dot_product_attention(q, k, v, mask.to_dense())
  return jnp.sum(jnp.sin(out))


def _chunked_loss(q, k, v, mask, chunk):
  return jnp.sum(jnp.sin(blocked_attention(q, k, v, mask, chunk_size=chunk)))


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_gradients_equal_full_attention(causal):
  q, k, v, valid, _, _ = _inputs(seed=7, lq=13, lk=13)
  mask, _ = _mask(valid, 13, causal=causal)
  args = tuple(jnp.asarray(a) for a in (q, k, v))
  full = jax.grad(_full_loss, argnums=(0, 1, 2))(*args, mask)
  chunked = jax.grad(_chunked_loss, argnums=(0, 1, 2))(*args, mask, 4)
  for g_full, g_chunked in zip(full, chunked):
    np.testing.assert_allclose(np.asarray(g_chunked), np.asarray(g_full), **TOL)


def _largest_intermediate(fn, *args) -> int:
  """Elements of the largest array any equation of `fn`'s jaxpr (sub-jaxprs included) produces."""
  largest = 0

  def walk(jaxpr):
    nonlocal largest
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        largest = max(largest, int(np.prod(var.aval.shape)) if hasattr(var.aval, "shape") else 0)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return largest


def test_chunked_gradient_never_materialises_the_score_tensor():
  """The gradient's largest array is O(length * chunk), far below `[batch, heads, length, length]`."""
  b, length, h, d, chunk = 1, 256, 2, 4, 16
  q = k = v = jnp.ones((b, length, h, d))
  mask = AttentionMask.from_dense(None, b, length, length).replace(causal=True)
  grad = jax.grad(_chunked_loss, argnums=(0, 1, 2))
  largest = _largest_intermediate(lambda q, k, v: grad(q, k, v, mask, chunk), q, k, v)
  full = _largest_intermediate(lambda q, k, v: jax.grad(_full_loss, argnums=(0, 1, 2))(q, k, v, mask), q, k, v)
  assert full >= b * h * length * length
  assert largest <= b * length * h * d * 4, largest  # a few activations' worth, no length x length


# ----------------------------------------------------------------------------------------------------------
# The model: every option in training, packed batches and cached decoding
# ----------------------------------------------------------------------------------------------------------

ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)  # eager step-by-step decoding is per layer
OPTIONS = {
    "relative": small(max_relative_position=3, **ONE_LAYER),
    "relative_keys_only_no_sinusoids": small(max_relative_position=2, relative_values=False,
                                             position_embedding="none", **ONE_LAYER),
    "window": small(attention_window=2, **ONE_LAYER),
    "chunked": small(query_chunk_size=4, **ONE_LAYER),
    "all": small(max_relative_position=3, attention_window=3, query_chunk_size=2, pre_ln=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_cached_decoding_matches_teacher_forcing(name):
  cfg = OPTIONS[name]
  params = params_for(cfg)
  src, _ = _batch(seed=5)
  tgt = _ids(8, (2, 6))
  full = np.asarray(logits_fn(cfg)(params, src, tgt))
  stepped = cached_decode_logits(cfg, params, src, tgt)
  np.testing.assert_allclose(stepped, full, **TOL)


def test_windowed_cache_is_a_ring_buffer_of_the_window():
  cfg = OPTIONS["window"]
  model, params = Transformer(cfg), params_for(cfg)
  src = _ids(1, (2, 7))
  encoded = model.apply({"params": params}, src, method=Transformer.encode)
  bos = jnp.full((2, 1), cfg.bos_id, jnp.int32)
  _, variables = model.apply({"params": params}, encoded, src, bos, use_cache=True, max_decode_len=100,
                             mutable=["cache"], method=Transformer.decode)
  caches = helpers.cache_entries(variables["cache"], kvcache.SelfAttentionCache)  # one per decoder layer
  assert len(caches) == cfg.num_decoder_layers
  for entry in caches.values():
    assert entry.key.shape == entry.value.shape == (2, cfg.num_heads, cfg.attention_window, cfg.head_dim)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_packed_row_equals_examples_alone(name):
  cfg = OPTIONS[name]
  params, f = params_for(cfg), logits_fn(cfg)
  src_ab, tgt_ab = _ids(10, (2, 5)), _ids(11, (2, 5))
  alone = np.asarray(f(params, src_ab, tgt_ab))
  pad = jnp.zeros((1, 1), jnp.int32)
  src = jnp.concatenate([src_ab[:1], src_ab[1:], pad], 1)
  tgt = jnp.concatenate([tgt_ab[:1], tgt_ab[1:]], 1)
  positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
  segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
  packed = np.asarray(Transformer(cfg).apply(
      {"params": params}, src, tgt, inputs_position=jnp.concatenate([positions, pad], 1),
      targets_position=positions, inputs_segmentation=jnp.concatenate([segments, pad], 1),
      targets_segmentation=segments))
  np.testing.assert_allclose(packed[0, :5], alone[0], **TOL)
  np.testing.assert_allclose(packed[0, 5:], alone[1], **TOL)


@pytest.mark.parametrize("option", ["attention_window", "query_chunk_size"])
def test_window_or_chunk_at_least_the_length_equals_full_attention(option):
  base = small()
  params = params_for(base)
  src, tgt = _batch(seed=3)
  full = np.asarray(logits_fn(base)(params, src, tgt))
  wide = np.asarray(logits_fn(base.replace(**{option: 64}))(params, src, tgt))
  np.testing.assert_allclose(wide, full, **TOL)
  narrow = np.asarray(logits_fn(base.replace(attention_window=2))(params, src, tgt))
  assert np.abs(narrow - full).max() > 1e-3  # the window does restrict attention


def test_sown_weights_with_options_are_normalised_and_windowed():
  cfg = OPTIONS["all"]
  src, tgt = _batch(seed=2)
  _, state = Transformer(cfg).apply({"params": params_for(cfg)}, src, tgt, sow_attention_weights=True,
                                    mutable=["intermediates"])
  (weights,) = state["intermediates"]["encoder"]["layer_0"]["self_attention"]["attention_weights"]
  weights = np.asarray(weights)  # [batch, heads, src, src]
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
  i, j = np.indices(weights.shape[2:])
  outside = (np.abs(i - j) >= cfg.attention_window)[None, None] & (np.asarray(src) != 0)[:, None, :, None]
  assert np.all(weights[np.broadcast_to(outside, weights.shape)] == 0.0)  # real queries, outside the window


@pytest.mark.parametrize("changes, message", [
    (dict(attention_window=-1), r"attention_window=-1 must be an integer in \[0, 2147483647\] \(0 = off\)"),
    (dict(query_chunk_size=2.5), r"query_chunk_size=2.5 must be an integer in \[0, 2147483647\] \(0 = off\)"),
    (dict(max_relative_position=True), "max_relative_position=True must be an integer"),
    (dict(position_embedding="none"), "position_embedding='none' needs max_relative_position > 0"),
    (dict(query_chunk_size=8, attention_dropout_rate=0.1), "attention_dropout_rate=0.1 is not supported with"),
    (dict(attention_window=4, max_relative_position=2, attention_dropout_rate=0.1),
     "attention_dropout_rate=0.1 is not supported with attention_window; set it to 0"),
])
def test_config_rejects_bad_long_input_options(changes, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**changes)


# ----------------------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------------------

def test_head_entropy_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 4, 5)) * np.array([0.0, 1.0, 8.0])[None, :, None, None]  # uniform..peaked
  logits[1, :, :, 3:] = -np.inf  # row 1: two masked keys, support 3
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  query_valid = np.array([[True] * 4, [True, True, False, False]])
  entropy, normalised = diagnostics.head_entropy(jnp.asarray(weights, jnp.float32), jnp.asarray(query_valid))
  with np.errstate(divide="ignore", invalid="ignore"):
    h = -np.nansum(weights * np.log(weights), axis=-1)  # [b, heads, q]
  n = h / np.log(np.array([5, 3]))[:, None, None]
  keep = np.broadcast_to(query_valid[:, None, :], h.shape)
  expected_h = np.array([h[:, i][keep[:, i]].mean() for i in range(3)])
  expected_n = np.array([n[:, i][keep[:, i]].mean() for i in range(3)])
  np.testing.assert_allclose(np.asarray(entropy), expected_h, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(normalised), expected_n, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(normalised)[0], 1.0, rtol=1e-6)  # head 0 is exactly uniform


def test_attention_statistics_flag_uniform_heads():
  """With zero query/key kernels every self-attention head is uniform over its support: share 100%."""
  cfg = small()
  params = jax.tree_util.tree_map(lambda x: x, params_for(cfg))
  for stack, n in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    for i in range(n):
      attn = params[stack][f"layer_{i}"]["self_attention"]
      attn["query"] = {k: jnp.zeros_like(v) for k, v in attn["query"].items()}
  src, tgt = _batch(seed=4)
  stats = diagnostics.attention_statistics(params, cfg, src, tgt)
  assert float(stats["encoder_self"]["near_uniform_share"]) == 1.0
  assert float(stats["decoder_self"]["near_uniform_share"]) == 1.0
  np.testing.assert_allclose(np.asarray(stats["encoder_self"]["normalised_entropy"]), 1.0, rtol=1e-5)
  scalars = diagnostics.summary_scalars(stats)
  assert scalars["attention/encoder_self/near_uniform_share"] == 1.0
  assert len(scalars) == 3 + cfg.num_heads * (2 * cfg.num_decoder_layers + cfg.num_encoder_layers)


def test_beam_search_with_every_option_cached_equals_uncached():
  """The ring-buffer cache survives the beam search's reordering: same beams as recomputing every prefix."""
  cfg = OPTIONS["all"]
  params, src = params_for(cfg), _ids(3, (2, 7))
  out = decoding.beam_search(params, cfg, src, 3, 0.6, 9, full_output=True)
  ref = decoding.beam_search_uncached(params, cfg, src, 3, 0.6, 9, full_output=True)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.scores, ref.scores, rtol=1e-5, atol=1e-5)
