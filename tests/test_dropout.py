"""The fused dropout gives flax's masks bit for bit; the tied-logits VJP gives autodiff's gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import dropout
from transformer_jax.config import tiny
from transformer_jax.model import Transformer, tied_logits


@pytest.mark.parametrize("shape", [(7,), (3, 5, 11), (4, 64, 33)])
def test_random_bits_equal_jax_random_bits(shape):
  for key in (jax.random.key(0), jax.random.key(12345), jax.random.PRNGKey(7)):
    np.testing.assert_array_equal(np.asarray(dropout.random_bits32(key, shape)),
                                  np.asarray(jax.random.bits(key, shape, jnp.uint32)))


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.9])
def test_bernoulli_equals_jax_random_bernoulli(rate):
  key = jax.random.key(3)
  shape = (16, 128, 24)
  ours = np.asarray(dropout.keep_mask(key, 1.0 - rate, shape))
  np.testing.assert_array_equal(ours, np.asarray(jax.random.bernoulli(key, 1.0 - rate, shape)))
  assert abs(ours.mean() - (1.0 - rate)) < 0.01  # and it is a Bernoulli(1 - rate) draw


@pytest.mark.parametrize("rate,broadcast_dims", [(0.1, ()), (0.3, ()), (0.5, (0,)), (0.2, (1,))])
def test_dropout_module_equals_flax(rate, broadcast_dims):
  x = jax.random.normal(jax.random.key(1), (4, 33, 16))
  for key in (jax.random.key(5), jax.random.PRNGKey(5)):
    rngs = {"dropout": key}
    ours = dropout.Dropout(rate, broadcast_dims=broadcast_dims).apply({}, x, deterministic=False, rngs=rngs)
    ref = nn.Dropout(rate, broadcast_dims=broadcast_dims).apply({}, x, deterministic=False, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_dropout_module_edge_cases_and_other_prng():
  x = jnp.ones((2, 8))
  module = dropout.Dropout(0.5)
  np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
  np.testing.assert_array_equal(dropout.Dropout(0.0).apply({}, x, deterministic=False), x)
  np.testing.assert_array_equal(
      dropout.Dropout(1.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)}), 0 * x)
  # Another PRNG implementation: not fusable, falls back to flax's draw (same values as flax).
  rbg = jax.random.key(0, impl="rbg")
  assert not dropout._fusable(rbg, 16)
  np.testing.assert_array_equal(
      module.apply({}, x, deterministic=False, rngs={"dropout": rbg}),
      nn.Dropout(0.5).apply({}, x, deterministic=False, rngs={"dropout": rbg}))


def test_dropout_mask_is_fused_without_a_loop():
  """The point of the module: no rolled threefry `while` loop over the activation (flax's has one; the
  scalar key derivation of `make_rng` keeps its small loop in both)."""
  x = jnp.ones((8, 16, 32))
  key = jax.random.key(0)

  def activation_loops(cls):
    hlo = jax.jit(lambda x, k: cls(0.1).apply({}, x, deterministic=False, rngs={"dropout": k})
                  ).lower(x, key).compile().as_text()
    return [line for line in hlo.splitlines() if " while(" in line and "[8,16,32]" in line]

  assert not activation_loops(dropout.Dropout)
  assert activation_loops(nn.Dropout)


def test_training_with_dropout_is_unchanged_by_the_fused_masks(monkeypatch):
  """Whole-model check: the library's model trains on exactly the values flax's Dropout would give."""
  from transformer_jax import model as model_lib
  cfg = tiny(vocab_size=50, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
             dropout_rate=0.2)
  src = jnp.asarray(np.random.default_rng(0).integers(4, 50, (3, 9)), jnp.int32)
  tgt = jnp.asarray(np.random.default_rng(1).integers(4, 50, (3, 7)), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(0), src, tgt)["params"]
  run = lambda: Transformer(cfg).apply({"params": params}, src, tgt, deterministic=False,
                                       rngs={"dropout": jax.random.key(9)})
  ours = run()
  monkeypatch.setattr(model_lib, "Dropout", nn.Dropout)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(run()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tied_logits_gradients_equal_autodiff(dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 5, 16)), dtype)
  emb = jnp.asarray(rng.standard_normal((40, 16)), dtype)
  cot = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.float32)
  plain = lambda x, e: jnp.einsum("bld,vd->blv", x, e, preferred_element_type=jnp.float32)
  out, vjp = jax.vjp(tied_logits, x, emb)
  ref_out, ref_vjp = jax.vjp(plain, x, emb)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-1)
  for ours, ref in zip(vjp(cot), ref_vjp(cot)):
    assert ours.dtype == ref.dtype == dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), **tol)
