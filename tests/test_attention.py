"""Numerical tests of scaled dot-product and multi-head attention against hand-written NumPy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.attention import MultiHeadAttention, dot_product_attention
from transformer_jax.config import tiny

TOL = dict(rtol=1e-5, atol=1e-5)


def _np_attention(q, k, v, mask):
  """softmax(Q Kᵀ/√d) V per head, in float64; q `[b,q,h,d]`, k/v `[b,k,h,d]`, mask `[b,h|1,q,k]` bool."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if mask is not None:
    logits = np.where(np.broadcast_to(mask, logits.shape), logits, -np.inf)
  logits = logits - logits.max(axis=-1, keepdims=True)
  e = np.exp(logits)
  w = e / e.sum(axis=-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", w, v), w


def _qkv_mask(seed=0, b=2, lq=5, lk=7, h=3, d=8):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, lq, h, d)).astype(np.float32)
  k = rng.normal(size=(b, lk, h, d)).astype(np.float32)
  v = rng.normal(size=(b, lk, h, d)).astype(np.float32)
  # Key padding (row 0 keeps 7 keys, row 1 keeps 4) combined with a random pattern; every query keeps
  # at least one key.
  valid = np.arange(lk)[None, :] < np.array([7, 4])[:, None]  # [b, lk]
  random = rng.random((b, 1, lq, lk)) < 0.7
  mask = valid[:, None, None, :] & random
  mask[..., 0] = True
  return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["none", "padding_random", "causal"])
def test_dot_product_attention_matches_numpy(mask_kind):
  q, k, v, mask = _qkv_mask()
  if mask_kind == "none":
    mask = None
  elif mask_kind == "causal":
    q, k, v = q, k[:, :5], v[:, :5]
    mask = np.tril(np.ones((5, 5), bool))[None, None]
  expected, expected_w = _np_attention(q, k, v, mask)
  jmask = None if mask is None else jnp.asarray(mask)

  fused = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jmask)
  np.testing.assert_allclose(np.asarray(fused), expected, **TOL)

  out, weights = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jmask,
                                       return_weights=True)
  np.testing.assert_allclose(np.asarray(out), expected, **TOL)
  np.testing.assert_allclose(np.asarray(weights), expected_w, **TOL)
  assert weights.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)
  if mask is not None:
    # Masked keys get exactly zero weight.
    assert np.all(np.asarray(weights)[~np.broadcast_to(mask, weights.shape)] == 0.0)


def test_dot_product_attention_per_head_mask():
  """A mask with a real heads axis `[b, h, q, k]` is applied head by head."""
  q, k, v, _ = _qkv_mask(seed=1)
  rng = np.random.default_rng(3)
  mask = rng.random((2, 3, 5, 7)) < 0.5
  mask[..., 2] = True
  expected, expected_w = _np_attention(q, k, v, mask)
  fused = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(fused), expected, **TOL)
  out, w = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
                                 return_weights=True)
  np.testing.assert_allclose(np.asarray(out), expected, **TOL)
  np.testing.assert_allclose(np.asarray(w), expected_w, **TOL)


def test_attention_dropout_path_is_rescaled_and_seeded():
  """Dropout on the weights: rate 0.5 zeroes some weights and rescales the kept ones by 2."""
  q, k, v, mask = _qkv_mask(seed=2)
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
  a = dot_product_attention(*args, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  b = dot_product_attention(*args, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  c = dot_product_attention(*args, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(a), np.asarray(c))
  # Re-compute with the same Bernoulli draw.
  _, w = _np_attention(q, k, v, mask)
  keep = np.asarray(jax.random.bernoulli(jax.random.key(0), 0.5, w.shape))
  expected = np.einsum("bhqk,bkhd->bqhd", np.where(keep, w / 0.5, 0.0), v)
  np.testing.assert_allclose(np.asarray(a), expected, **TOL)


def _mha_setup(cfg, is_cross, seed=0, lq=5, lk=6):
  rng = np.random.default_rng(seed)
  x_q = rng.normal(size=(2, lq, cfg.d_model)).astype(np.float32)
  x_kv = x_q if not is_cross else rng.normal(size=(2, lk, cfg.d_model)).astype(np.float32)
  lk = x_kv.shape[1]
  valid = np.arange(lk)[None, :] < np.array([lk, lk - 2])[:, None]
  mask = valid[:, None, None, :]
  module = MultiHeadAttention(cfg, is_cross=is_cross)
  variables = module.init(jax.random.key(seed), x_q, x_kv, mask)
  params = nn.unbox(variables["params"])
  # Non-zero biases so that the test also checks where biases enter.
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  params = jax.tree_util.tree_unflatten(
      tree, [l + 0.1 * jax.random.normal(k_, l.shape) for l, k_ in zip(leaves, keys)])
  return module, params, x_q, x_kv, mask


@pytest.mark.parametrize("is_cross", [False, True])
def test_multi_head_attention_matches_numpy(is_cross):
  cfg = tiny(vocab_size=64, d_model=32, d_ff=64, num_heads=4)
  module, params, x_q, x_kv, mask = _mha_setup(cfg, is_cross)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)

  assert p["query"]["kernel"].shape == (32, 4, 8)
  assert p["out"]["kernel"].shape == (4, 8, 32)
  q = np.einsum("bld,dhk->blhk", x_q, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("bld,dhk->blhk", x_kv, p["key"]["kernel"]) + p["key"]["bias"]
  v = np.einsum("bld,dhk->blhk", x_kv, p["value"]["kernel"]) + p["value"]["bias"]
  heads, w = _np_attention(q, k, v, mask)
  expected = np.einsum("blhk,hkd->bld", heads, p["out"]["kernel"]) + p["out"]["bias"]

  out = module.apply({"params": params}, x_q, x_kv, mask)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)

  out_w, state = module.apply({"params": params}, x_q, x_kv, mask, sow_attention_weights=True,
                              mutable=["intermediates"])
  np.testing.assert_allclose(np.asarray(out_w), expected, rtol=1e-4, atol=1e-4)
  (sown,) = state["intermediates"]["attention_weights"]
  np.testing.assert_allclose(np.asarray(sown), w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(sown).sum(-1), 1.0, atol=1e-6)


def test_multi_head_attention_xavier_init_and_zero_biases():
  cfg = tiny(vocab_size=64, d_model=512, d_ff=64, num_heads=8)
  x = jnp.zeros((1, 2, 512), jnp.float32)
  variables = MultiHeadAttention(cfg).init(jax.random.key(0), x, x, None)
  params = nn.unbox(variables["params"])
  # Projections are d_model x d_model matrices: fan_in = fan_out = 512.
  bound = np.sqrt(6.0 / (512 + 512))
  xavier_std = bound / np.sqrt(3.0)  # std of U(-bound, bound) = sqrt(2 / (fan_in + fan_out))
  assert set(params) == {"query", "key", "value", "out"}
  for name in ("query", "key", "value", "out"):
    kernel = np.asarray(params[name]["kernel"])
    assert kernel.size == 512 * 512
    assert np.abs(kernel).max() <= bound
    # Uniform, not truncated normal or too narrow: the max gets close to the bound.
    assert np.abs(kernel).max() > 0.99 * bound
    assert abs(kernel.std() - xavier_std) < 0.01 * xavier_std, (name, kernel.std(), xavier_std)
    assert abs(kernel.mean()) < 1e-3
    np.testing.assert_array_equal(np.asarray(params[name]["bias"]), 0.0)
  assert params["query"]["bias"].shape == (8, 64)
  assert params["out"]["bias"].shape == (512,)
  # Different projections get different draws.
  assert not np.allclose(params["query"]["kernel"], params["key"]["kernel"])


def test_multi_head_attention_logical_axis_names():
  cfg = tiny(vocab_size=64, d_model=32, d_ff=64, num_heads=4)
  x = jnp.zeros((1, 2, 32), jnp.float32)
  params = MultiHeadAttention(cfg).init(jax.random.key(0), x, x, None)["params"]
  assert params["query"]["kernel"].names == ("embed", "heads", "kv")
  assert params["query"]["bias"].names == ("heads", "kv")
  assert params["out"]["kernel"].names == ("heads", "kv", "embed")
  assert params["out"]["bias"].names == ("embed",)
