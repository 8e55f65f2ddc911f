"""The multi-head attention layer (Vaswani et al., 2017, section 3.2.2): projections and dispatch.

`MultiHeadAttention` projects queries, keys and values, picks the attention that the config and the call ask
for (`attention.core`: the fused XLA/cuDNN path, one exact block, or `blocked_attention`) and, when decoding
with `use_cache=True`, keeps its keys/values in the `cache` collection as one typed entry of
`attention.kvcache` (the decoder reaches those entries through kvcache's accessors, never by name).
"""

from __future__ import annotations

from typing import Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.attention import kvcache
from transformer_jax.attention.core import (AttentionMask, RelativePositions, blocked_attention,
                                            dot_product_attention, full_attention_weights)
from transformer_jax.config import ModelConfig

Array = jax.Array

SOWN_WEIGHTS = "attention_weights"  # the `intermediates` entry `sow_attention_weights=True` fills (one per call)


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
    return project_heads(x, kernel, bias, self.dtype)


def project_heads(x: Array, kernel: Array, bias: Array, dtype) -> Array:
  """x `[batch, length, d_model]` · kernel `[d_model, heads, head_dim]` + bias `[heads, head_dim]`, in `dtype`."""
  return jnp.einsum("bld,dhk->blhk", x.astype(dtype), kernel.astype(dtype)) + bias.astype(dtype)


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


class MultiHeadAttention(nn.Module):
  """Multi-head attention with h parallel heads and an output projection W^O (section 3.2.2).

  Projections are Xavier-uniform with zero biases. With `use_cache=True` the module keeps one `attention.kvcache`
  entry in the `cache` collection and takes one query position per call:
    * self-attention (`is_cross=False`): a `SelfAttentionCache`; keys/values of each new position t are written
      at slot `t % cache_len`, where cache_len = max_decode_len, or min(attention_window, max_decode_len) with a
      window: then the cache is a ring buffer holding the last w positions (memory O(w) per step, not
      O(length)); when the decoder has put it in beam form (`BeamSelfAttentionCache`), that form attends, its
      queries, keys and values projected by one dot (`_fused_self_projections`);
    * cross-attention (`is_cross=True`): a `CrossAttentionCache`; the encoder memory is projected once, when
      the cache is created, and reused at every step; beam search shares it among the beams of a source
      (`BeamCrossAttentionCache`).
  Self-attention applies the config's long-input options: relative positions (`max_relative_position`, the
  learned tables `relative_key`/`relative_value` `[2k+1, head_dim]` of this layer), the local window
  (`attention_window`) and query chunking (`query_chunk_size`); see `blocked_attention`. Cross-attention
  applies query chunking only.
  Passing `sow_attention_weights=True` sows the attention weights `[batch, heads, q_len, kv_len]` into the
  `intermediates` collection under `SOWN_WEIGHTS` (read them with `model.attention_weights`).
  """

  config: ModelConfig
  is_cross: bool = False

  def _projection(self, name: str) -> HeadProjection:
    cfg = self.config
    return HeadProjection(cfg.num_heads, cfg.head_dim, dtype=cfg.compute_dtype, name=name)

  def _relative_positions(self) -> Optional[RelativePositions]:
    """This layer's tables `[2k+1, head_dim]`, ~ N(0, head_dim^-0.5) like the token embeddings; None if off."""
    cfg = self.config
    if self.is_cross or not cfg.max_relative_position:
      return None
    shape = (2 * cfg.max_relative_position + 1, cfg.head_dim)
    init = nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.head_dim ** -0.5), (None, "kv"))
    table_key = self.param("relative_key", init, shape, jnp.float32)
    table_value = self.param("relative_value", init, shape, jnp.float32) if cfg.relative_values else None
    return RelativePositions(table_key, table_value, max_distance=cfg.max_relative_position)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Union[None, Array, AttentionMask], *,
               deterministic: bool = True, use_cache: bool = False,
               max_decode_len: Optional[int] = None, sow_attention_weights: bool = False) -> Array:
    """inputs_q `[batch, q_len, d_model]`, inputs_kv `[batch, kv_len, d_model]` -> `[batch, q_len, d_model]`.

    `mask`: boolean, broadcastable to `[batch, heads, q_len, kv_len]`, or an `AttentionMask`.
    """
    cfg = self.config
    output = lambda x: OutputProjection(cfg.d_model, dtype=cfg.compute_dtype, name="out")(x)  # noqa: E731
    entry = self.get_variable("cache", kvcache.ENTRY) if use_cache else None
    if isinstance(entry, kvcache.BeamCrossAttentionCache):  # beam search: a source's memory read once
      dense = mask.to_dense() if isinstance(mask, AttentionMask) else mask
      result, weights = entry.attend(self._projection("query")(inputs_q), dense)
      if sow_attention_weights:
        self.sow("intermediates", SOWN_WEIGHTS, weights)
      return output(result)
    if isinstance(entry, kvcache.BeamSelfAttentionCache):  # beam search's never-reordered cache
      result, updated = entry.attend(*self._fused_self_projections(inputs_q))
      self.put_variable("cache", kvcache.ENTRY, updated)
      return output(result)

    query = self._projection("query")(inputs_q)  # [batch, q_len, heads, head_dim]
    key_proj, value_proj = self._projection("key"), self._projection("value")
    relative = self._relative_positions()
    if use_cache and self.is_cross:
      key, value = self._cached_memory(key_proj, value_proj, inputs_kv)
    elif use_cache:
      key, value, mask = self._update_self_cache(key_proj(inputs_kv), value_proj(inputs_kv), mask,
                                                 max_decode_len)
    else:
      key, value = key_proj(inputs_kv), value_proj(inputs_kv)

    result = self._attend(query, key, value, mask, relative, deterministic=deterministic,
                          use_cache=use_cache, sow_attention_weights=sow_attention_weights)
    return output(result)

  def _fused_self_projections(self, x: Array) -> tuple[Array, Array, Array]:
    """W^Q, W^K and W^V of self-attention as one dot: x `[batch, 1, d_model]` -> three `[batch, 1, heads,
    head_dim]`, the values of the three `HeadProjection`s (decoding only, where the parameters exist). One
    `[rows, d_model] x [d_model, 3 d_model]` product instead of three: small dots run below the matmul kernel's
    rate (docs/performance.md, "Start-up and the smaller choices")."""
    params = nn.unbox(self.variables["params"])
    names = ("query", "key", "value")
    kernel = jnp.concatenate([params[n]["kernel"] for n in names], axis=1)  # [d_model, 3 heads, head_dim]
    bias = jnp.concatenate([params[n]["bias"] for n in names], axis=0)  # [3 heads, head_dim]
    return tuple(jnp.split(project_heads(x, kernel, bias, self.config.compute_dtype), 3, axis=2))

  def _attend(self, query: Array, key: Array, value: Array, mask, relative, *, deterministic: bool,
              use_cache: bool, sow_attention_weights: bool) -> Array:
    """Dispatches to the fused path, to one exact block (`full_attention_weights`: sown weights, or attention
    dropout with relative positions) or to `blocked_attention` when an option needs it; `[b, q, h, d]`."""
    cfg = self.config
    batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
    window = 0 if self.is_cross or use_cache else cfg.attention_window  # the cache applies its own window
    chunk = 0 if use_cache else cfg.query_chunk_size or window
    dropout_rng = None
    if cfg.attention_dropout_rate > 0.0 and not deterministic:
      dropout_rng = self.make_rng("dropout")
    if relative is None and not chunk:
      dense = mask.to_dense() if isinstance(mask, AttentionMask) else mask
      result = dot_product_attention(
          query, key, value, dense, implementation=cfg.attention_impl,
          dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,
          return_weights=sow_attention_weights)
      if sow_attention_weights:
        result, weights = result
        self.sow("intermediates", SOWN_WEIGHTS, weights)
      return result

    if not isinstance(mask, AttentionMask):
      mask = AttentionMask.from_dense(mask, batch, q_len, kv_len)
    if sow_attention_weights or dropout_rng is not None:
      # One exact block: diagnostics need the full weights, and dropout drops them (the config refuses it with
      # the blocked options, attention_window and query_chunk_size, so here chunk is 0 when dropout is on).
      result, weights = full_attention_weights(query, key, value, mask, relative,
                                               dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng)
      if sow_attention_weights:
        self.sow("intermediates", SOWN_WEIGHTS, weights)
      return result
    return blocked_attention(query, key, value, mask, chunk_size=chunk or max(q_len, kv_len),
                             band=max(window - 1, 0), relative=relative)

  def _cached_memory(self, key_proj, value_proj, memory: Array):
    """Cross-attention keys/values `[batch, src_len, heads, head_dim]`, projected once per sentence
    (`kvcache.CrossAttentionCache`)."""
    entry = self.variable("cache", kvcache.ENTRY,
                          lambda: kvcache.CrossAttentionCache.create(lambda: key_proj(memory),
                                                                     lambda: value_proj(memory)))
    return entry.value.read()

  def _update_self_cache(self, key: Array, value: Array, mask: Optional[Array],
                         max_decode_len: Optional[int]):
    """Writes this step's key/value `[batch, 1, heads, head_dim]` into the `kvcache.SelfAttentionCache`;
    returns the cache's keys/values `[batch, cache_len, heads, head_dim]` and an `AttentionMask` over them.

    On the call that creates the cache nothing is written and the step attends to itself only, so that
    creating the cache costs one position's work.
    """
    batch, q_len, heads, head_dim = key.shape
    cfg = self.config
    is_initialized = self.has_variable("cache", kvcache.ENTRY)
    cache_len = max_decode_len or q_len
    if cfg.attention_window:
      cache_len = min(cache_len, cfg.attention_window)
    entry = self.variable("cache", kvcache.ENTRY, kvcache.SelfAttentionCache.create, batch, heads, cache_len,
                          head_dim, key.dtype, value.dtype)
    if not is_initialized:
      zeros = jnp.zeros((batch, q_len), jnp.int32)
      return key, value, AttentionMask(jnp.ones((batch, q_len), bool), zeros, zeros, dense=mask)
    if q_len != 1:
      raise ValueError(f"use_cache=True takes one target position per call, got q_len={q_len}")
    entry.value, keys, values, step_mask = entry.value.write(key, value, mask)
    return keys, values, step_mask
