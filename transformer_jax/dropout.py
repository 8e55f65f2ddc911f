"""Dropout whose mask XLA can fuse into the surrounding elementwise work (section 5.4, P_drop).

`flax.linen.Dropout` draws its mask with `jax.random.bernoulli`, whose Threefry-2x32 hash JAX lowers on CPU
as a rolled 5-iteration loop: every dropout site then runs that loop over the whole activation and writes a
`uint32` buffer before the mask is applied (~12% of a CPU-preset training step, 35 `while` loops per step).
`Dropout` here evaluates the same hash unrolled, as plain `uint32` elementwise ops on an iota of element
indices, so XLA fuses hash, compare and select into one pass with no intermediate buffer.

The masks are bit-identical to `flax.linen.Dropout`'s for the same key (tested): the counter layout is that
of `jax.random.bits` with `jax_threefry_partitionable` (JAX's default), and `uniform(bits) < keep_prob` is
evaluated exactly on the 23 mantissa bits `uniform` uses. Keys of another PRNG implementation, the
non-partitionable counter layout, or arrays of 2^32 elements or more fall back to `flax.linen.Dropout`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# Threefry-2x32, 20 rounds (Salmon et al., 2011, "Parallel random numbers: as easy as 1, 2, 3"), with the
# rotation schedule and key-schedule parity constant JAX uses.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, d: int) -> jax.Array:
  return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def threefry2x32(key: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The Threefry-2x32 block function, unrolled: key `uint32[2]`, counters `x0, x1` (any shape, uint32)."""
  k0, k1 = key[0], key[1]
  ks = (k0, k1, k0 ^ k1 ^ _KEY_PARITY)
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def _flat_index(shape: Sequence[int]) -> jax.Array:
  """Row-major element index `uint32[shape]` built from per-dimension iotas (fuses; no materialised iota)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
    stride *= shape[dim]
  return index


def random_bits32(key: jax.Array, shape: Sequence[int]) -> jax.Array:
  """`jax.random.bits(key, shape, uint32)` for a threefry key, partitionable layout, < 2^32 elements."""
  bits0, bits1 = threefry2x32(jax.random.key_data(key), jnp.zeros(shape, jnp.uint32), _flat_index(shape))
  return bits0 ^ bits1


def keep_mask(key: jax.Array, keep_prob: float, shape: Sequence[int]) -> jax.Array:
  """`jax.random.bernoulli(key, keep_prob, shape)`, bit for bit: `uniform < p` on uniform's 23-bit grid."""
  # uniform = (bits >> 9) * 2^-23 exactly, so `uniform < p` <=> `bits >> 9 < ceil(p32 * 2^23)`.
  threshold = math.ceil(float(np.float32(keep_prob)) * 2.0 ** 23)
  return (random_bits32(key, shape) >> np.uint32(9)) < np.uint32(threshold)


def _fusable(key: jax.Array, size: int) -> bool:
  if size >= 2 ** 32 or not jax.config.jax_threefry_partitionable:
    return False
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.shape == () and str(jax.random.key_impl(key)) == "threefry2x32"
  # A raw `jax.random.PRNGKey` (uint32[2]) uses the default implementation.
  return key.shape == (2,) and key.dtype == jnp.uint32 and jax.config.jax_default_prng_impl == "threefry2x32"


def bernoulli(key: jax.Array, p: float, shape: Sequence[int]) -> jax.Array:
  """`jax.random.bernoulli(key, p, shape)` (same values), fused where possible (see module docstring)."""
  if _fusable(key, math.prod(shape)):
    return keep_mask(key, p, shape)
  return jax.random.bernoulli(key, p, shape)


class Dropout(nn.Dropout):
  """`flax.linen.Dropout` with the mask hash unrolled so XLA fuses it (same masks, same interface)."""

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: Optional[bool] = None,
               rng: Optional[jax.Array] = None) -> jax.Array:
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic or self.rate == 1.0:
      return super().__call__(inputs, deterministic=deterministic, rng=rng)
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    shape = [1 if dim in self.broadcast_dims else n for dim, n in enumerate(inputs.shape)]
    keep_prob = 1.0 - self.rate
    mask = jnp.broadcast_to(bernoulli(rng, keep_prob, shape), inputs.shape)
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
