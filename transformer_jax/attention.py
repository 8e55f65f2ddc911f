"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, section 3.2).

Arrays are `[batch, length, heads, head_dim]`; masks are boolean and broadcastable to
`[batch, heads, q_length, kv_length]`, True meaning "may attend".
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import dropout as dropout_lib
from transformer_jax.config import ModelConfig

Array = jax.Array

def _xavier_fused(fan_in_axes: int):
  """Xavier/Glorot-uniform over a fused kernel, with fans taken from its 2-D (matrix) view.

  The [d_model, heads, head_dim] projection has fan_in = d_model and fan_out = heads * head_dim: exactly the
  d_model x d_model matrix of the reference implementations.
  """
  def init(key, shape, dtype=jnp.float32):
    rows = int(np.prod(shape[:fan_in_axes]))
    return nn.initializers.xavier_uniform()(key, (rows, int(np.prod(shape[fan_in_axes:]))), dtype).reshape(shape)
  return init


class HeadProjection(nn.Module):
  """x `[batch, length, d_model]` -> `[batch, length, heads, head_dim]` (W^Q, W^K or W^V of all heads)."""

  num_heads: int
  head_dim: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param("kernel", nn.with_logical_partitioning(_xavier_fused(1), ("embed", "heads", "kv")),
                        (x.shape[-1], self.num_heads, self.head_dim), jnp.float32)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")),
                      (self.num_heads, self.head_dim), jnp.float32)
    y = jnp.einsum("bld,dhk->blhk", x.astype(self.dtype), kernel.astype(self.dtype))
    return y + bias.astype(self.dtype)


class OutputProjection(nn.Module):
  """Concatenated heads `[batch, length, heads, head_dim]` -> `[batch, length, d_model]` (W^O)."""

  d_model: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    heads, head_dim = x.shape[-2:]
    kernel = self.param("kernel", nn.with_logical_partitioning(_xavier_fused(2), ("heads", "kv", "embed")),
                        (heads, head_dim, self.d_model), jnp.float32)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                      (self.d_model,), jnp.float32)
    y = jnp.einsum("blhk,hkd->bld", x.astype(self.dtype), kernel.astype(self.dtype))
    return y + bias.astype(self.dtype)


def dot_product_attention(query: Array, key: Array, value: Array, mask: Optional[Array] = None, *,
                          implementation: str = "xla", dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None, return_weights: bool = False):
  """softmax(Q Kᵀ / √d_k) V (section 3.2.1), one call for every head.

  Args:
    query: `[batch, q_len, heads, head_dim]`.
    key, value: `[batch, kv_len, heads, head_dim]`.
    mask: boolean, broadcastable to `[batch, heads, q_len, kv_len]`; True = attend.
    implementation: 'xla' or 'cudnn' (GPU, bf16/fp16), forwarded to `jax.nn.dot_product_attention`.
    dropout_rate, dropout_rng: dropout on the attention weights (not in the paper; off by default). Needs the
      explicit path below, as does `return_weights`.
    return_weights: also return the attention weights `[batch, heads, q_len, kv_len]` (float32).

  Returns:
    `[batch, q_len, heads, head_dim]` in the dtype of `query`, plus the weights when asked.
  """
  explicit = return_weights or (dropout_rate > 0.0 and dropout_rng is not None)
  if not explicit:
    # Fused path: XLA (or cuDNN) sees one attention op; the default for training and decoding.
    return jax.nn.dot_product_attention(query, key, value, mask=mask, implementation=implementation)

  depth = query.shape[-1]
  # [batch, heads, q_len, kv_len]; logits and softmax in float32 whatever the activation dtype.
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(depth))
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)
  probs = weights
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = dropout_lib.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value)
  return (out, weights) if return_weights else out


class MultiHeadAttention(nn.Module):
  """Multi-head attention with h parallel heads and an output projection W^O (section 3.2.2).

  Projections are Xavier-uniform with zero biases. In `decode` mode the module keeps a KV cache in the
  `cache` collection and takes one query position per call:
    * self-attention (`is_cross=False`): keys/values of each new position are written at `cache_index`
      into `cached_key`/`cached_value` `[batch, max_decode_len, heads, head_dim]`;
    * cross-attention (`is_cross=True`): the encoder memory is projected once, when the cache is created,
      and reused at every step.
  Passing `return_weights=True` sows the attention weights `[batch, heads, q_len, kv_len]` into the
  `intermediates` collection under `attention_weights`.
  """

  config: ModelConfig
  is_cross: bool = False

  def _projection(self, name: str) -> HeadProjection:
    cfg = self.config
    return HeadProjection(cfg.num_heads, cfg.head_dim, dtype=cfg.compute_dtype, name=name)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Optional[Array], *,
               deterministic: bool = True, decode: bool = False,
               max_decode_len: Optional[int] = None, return_weights: bool = False) -> Array:
    """inputs_q `[batch, q_len, d_model]`, inputs_kv `[batch, kv_len, d_model]` -> `[batch, q_len, d_model]`."""
    cfg = self.config
    query = self._projection("query")(inputs_q)  # [batch, q_len, heads, head_dim]
    key_proj, value_proj = self._projection("key"), self._projection("value")

    if decode and self.is_cross:
      key, value = self._cached_memory(key_proj, value_proj, inputs_kv)
    elif decode and self.has_variable("cache", "beam_ancestry"):
      result = self._beam_self_attention(query, key_proj(inputs_kv), value_proj(inputs_kv))
      return OutputProjection(cfg.d_model, dtype=cfg.compute_dtype, name="out")(result)
    elif decode:
      key, value, mask = self._update_self_cache(key_proj(inputs_kv), value_proj(inputs_kv), mask,
                                                 max_decode_len)
    else:
      key, value = key_proj(inputs_kv), value_proj(inputs_kv)

    dropout_rng = None
    if cfg.attention_dropout_rate > 0.0 and not deterministic:
      dropout_rng = self.make_rng("dropout")
    result = dot_product_attention(
        query, key, value, mask, implementation=cfg.attention_impl,
        dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng, return_weights=return_weights)
    if return_weights:
      result, weights = result
      self.sow("intermediates", "attention_weights", weights)

    return OutputProjection(cfg.d_model, dtype=cfg.compute_dtype, name="out")(result)

  def _cached_memory(self, key_proj, value_proj, memory: Array):
    """Cross-attention keys/values `[batch, src_len, heads, head_dim]`, projected once per sentence.

    Stored as `[batch, heads, head_dim, src_len]`, the layout XLA:CPU's one-query attention dots read: the
    transposes below cancel against the dots' own, where the `[batch, src_len, ...]` layout made XLA re-lay
    out every layer's cross-attention K/V at every decoding step (a quarter of a CPU beam step).
    """
    cached_key = self.variable("cache", "cached_key", lambda: jnp.transpose(key_proj(memory), (0, 2, 3, 1)))
    cached_value = self.variable("cache", "cached_value",
                                 lambda: jnp.transpose(value_proj(memory), (0, 2, 3, 1)))
    return jnp.transpose(cached_key.value, (0, 3, 1, 2)), jnp.transpose(cached_value.value, (0, 3, 1, 2))

  def _update_self_cache(self, key: Array, value: Array, mask: Optional[Array],
                         max_decode_len: Optional[int]):
    """Writes this step's key/value `[batch, 1, heads, head_dim]` into the cache; returns the full cache.

    The cache is stored heads-major, `[batch, heads, max_decode_len, head_dim]`: the attention dots contract
    over head_dim with heads as a batch dimension, so in this layout the `swapaxes` below cancels against the
    dot's own transpose and a decoding step writes one position instead of relaying out the whole cache
    (1.4-1.5x faster cached greedy and beam search on CPU).
    On the call that creates the cache (no `cache_index` yet) nothing is written and the step attends to
    itself only, so that creating the cache costs one position's work.
    """
    batch, q_len, heads, head_dim = key.shape
    is_initialized = self.has_variable("cache", "cached_key")
    cache_len = max_decode_len or q_len
    cached_key = self.variable("cache", "cached_key", jnp.zeros, (batch, heads, cache_len, head_dim),
                               key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, (batch, heads, cache_len, head_dim),
                                 value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not is_initialized:
      return key, value, mask
    if q_len != 1:
      raise ValueError(f"decode mode takes one target position per call, got q_len={q_len}")
    index = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(
        cached_key.value, jnp.swapaxes(key, 1, 2).astype(cached_key.value.dtype), (0, 0, index, 0))
    cached_value.value = jax.lax.dynamic_update_slice(
        cached_value.value, jnp.swapaxes(value, 1, 2).astype(cached_value.value.dtype), (0, 0, index, 0))
    cache_index.value = index + 1
    # Causal mask over the cache: attend to positions 0..index. [1, 1, 1, cache_len]
    step_mask = (jnp.arange(cached_key.value.shape[2]) <= index)[None, None, None, :]
    mask = step_mask if mask is None else jnp.logical_and(mask, step_mask)
    return jnp.swapaxes(cached_key.value, 1, 2), jnp.swapaxes(cached_value.value, 1, 2), mask

  def _beam_self_attention(self, query: Array, key: Array, value: Array) -> Array:
    """One decoding step of self-attention for beam search, over a K/V cache that is never reordered.

    The cache (made by `beam_self_attention_cache`) holds, per source, the K/V of its `beams` rows side by
    side, `beam_key`/`beam_value` `[batch, heads, beams * max_decode_len, head_dim]`, and `beam_ancestry`
    `[batch, beams, max_decode_len]` int32: which beam row holds position s of beam j's hypothesis. Each row
    writes only its own current position, so what it wrote earlier never changes, and a beam reorder moves
    only the ancestry table (`reorder_beam_self_attention_cache`) instead of gathering every layer's K/V
    cache at every step (the largest cost of a CPU beam step besides the decoder itself). The beams of a
    source attend as `beams` queries over the `beams * max_decode_len` cached positions, each masked to its
    own history: the same softmax(Q Kᵀ / √d_k) V as `dot_product_attention` (float32 scores and softmax).

    query, key, value `[batch * beams, 1, heads, head_dim]` -> `[batch * beams, 1, heads, head_dim]`.
    """
    ancestry = self.variable("cache", "beam_ancestry", lambda: None)
    cached_key = self.variable("cache", "beam_key", lambda: None)
    cached_value = self.variable("cache", "beam_value", lambda: None)
    cache_index = self.variable("cache", "cache_index", lambda: None)
    batch, beams, length = ancestry.value.shape
    rows, _, heads, head_dim = query.shape
    index = cache_index.value

    def write(cache, x):  # x [rows, 1, h, d] -> position `index` of every beam row of `cache`
      x = jnp.transpose(x.reshape(batch, beams, heads, 1, head_dim), (0, 2, 1, 3, 4)).astype(cache.dtype)
      cache = cache.reshape(batch, heads, beams, length, head_dim)
      return jax.lax.dynamic_update_slice(cache, x, (0, 0, 0, index, 0)).reshape(
          batch, heads, beams * length, head_dim)

    cached_key.value, cached_value.value = write(cached_key.value, key), write(cached_value.value, value)
    ancestry.value = ancestry.value.at[:, :, index].set(jnp.arange(beams, dtype=jnp.int32)[None, :])
    cache_index.value = index + 1
    q = jnp.transpose(query.reshape(batch, beams, heads, head_dim), (0, 2, 1, 3))  # [b, h, j, d]
    logits = jnp.einsum("bhjd,bhkd->bhjk", q, cached_key.value, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / np.sqrt(head_dim))  # [b, h, j, beams * L]
    # keep[b, j, m, l]: row m holds position l of beam j's history, and l has been written.
    keep = ancestry.value[:, :, None, :] == jnp.arange(beams)[None, None, :, None]
    keep = jnp.logical_and(keep, (jnp.arange(length) <= index)[None, None, None, :])
    logits = jnp.where(keep.reshape(batch, 1, beams, beams * length), logits,
                       -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(cached_value.value.dtype)
    out = jnp.einsum("bhjk,bhkd->bhjd", probs, cached_value.value)  # [b, h, j, d]
    return jnp.transpose(out, (0, 2, 1, 3)).reshape(rows, 1, heads, head_dim)


def beam_self_attention_cache(entry: dict, batch: int, beams: int) -> dict:
  """A decoding self-attention cache entry `{cached_key, cached_value, cache_index}` (rows = batch * beams,
  as tiled for beam search) -> the never-reordered beam form that `MultiHeadAttention` then uses:
  `beam_key`/`beam_value` `[batch, heads, beams * max_decode_len, head_dim]` and `beam_ancestry`
  `[batch, beams, max_decode_len]` int32 (values written before the first step are never read)."""
  rows, heads, length, head_dim = entry["cached_key"].shape
  if rows != batch * beams:
    raise ValueError(f"cache has {rows} rows, expected batch * beams = {batch} * {beams}")
  zeros = jnp.zeros((batch, heads, beams * length, head_dim), entry["cached_key"].dtype)
  return {"beam_key": zeros, "beam_value": zeros.astype(entry["cached_value"].dtype),
          "beam_ancestry": jnp.zeros((batch, beams, length), jnp.int32), "cache_index": entry["cache_index"]}


def reorder_beam_self_attention_cache(entry: dict, parent: Array) -> dict:
  """The beam reorder of a `beam_self_attention_cache` entry: beam j of source b continues the hypothesis
  of beam `parent[b, j]` `[batch, beams]`, so it takes that beam's ancestry row; the K/V stay where they are."""
  return dict(entry, beam_ancestry=jnp.take_along_axis(entry["beam_ancestry"], parent[:, :, None], axis=1))
