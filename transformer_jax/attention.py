"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, section 3.2), with the long-input options.

Arrays are `[batch, length, heads, head_dim]`; masks are boolean and broadcastable to
`[batch, heads, q_length, kv_length]`, True meaning "may attend". A mask may also be an `AttentionMask`, which
keeps the mask factorised (key validity, segments, positions, causality, window) so that one block of it
can be built at a time and no `[q_length, kv_length]` array need exist.

Three options (each a `ModelConfig` field, 0 = off) go through `blocked_attention`, an exact attention over
query chunks with an online softmax over key blocks:
  * relative position representations (Shaw et al., 2018, "Self-Attention with Relative Position
    Representations", eqs. 3-5; tensor2tensor `dot_product_attention_relative`): learned key/value embeddings
    of the clipped distance `clip(j - i, -k, k)`, shared by the heads of a layer;
  * local attention: query i sees keys j with |pos_i - pos_j| < w (decoder: 0 <= pos_i - pos_j < w); each
    query chunk visits only the key blocks its window reaches, so time and memory are O(length * w);
  * memory-bounded attention (Rabe & Staats, 2021, "Self-attention does not need O(n^2) memory"): query
    chunks under `jax.checkpoint` inside `lax.map`, so neither the forward nor the gradient holds more than
    one chunk's `[batch, heads, chunk, kv_block]` scores.
Without them the fused `jax.nn.dot_product_attention` (XLA or cuDNN) stays the path.
"""

from __future__ import annotations

from typing import Optional, Union

import flax.linen as nn
import flax.struct
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


def _drop_weights(weights: Array, rate: float, rng: Optional[Array]) -> Array:
  """Dropout on attention weights `[batch, heads, q, kv]`: each zeroed with probability `rate`, the kept ones
  scaled by 1/(1 - rate); unchanged for rate 0 or no rng (tensor2tensor's attention dropout)."""
  if rate <= 0.0 or rng is None:
    return weights
  keep = dropout_lib.bernoulli(rng, 1.0 - rate, weights.shape)
  return jnp.where(keep, weights / (1.0 - rate), 0.0)


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
  probs = _drop_weights(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value)
  return (out, weights) if return_weights else out


_MASKED = float(np.finfo(np.float32).min)  # logit of a masked key (finite, so fully masked rows stay NaN-free)


def _slice(x: Optional[Array], axis: int, start, size: int) -> Optional[Array]:
  """`size` entries of `x` from `start` along `axis`; axes of size 1 (broadcast) are kept as they are."""
  if x is None or x.shape[axis] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@flax.struct.dataclass
class AttentionMask:
  """Which keys each query may attend to, kept factorised so that any block of it can be built alone.

  Fields (batch-major; segments and `dense` are optional):
    key_valid: `[batch, kv_len]` bool, False for padding keys.
    query_positions, key_positions: `[batch, q_len]`, `[batch, kv_len]` int32, the position of each token
      inside its own (packed) example; windows and relative distances are measured in them.
    query_segments, key_segments: `[batch, q_len]`, `[batch, kv_len]` int32 example ids of packed rows.
    dense: a boolean mask broadcastable to `[batch, heads, q_len, kv_len]`, and-ed in (e.g. a caller's mask).
    causal: static; key index <= query index (self-attention, q_len == kv_len).
    window: static; |query_position - key_position| < window, 0 = no window.
  """

  key_valid: Array
  query_positions: Array
  key_positions: Array
  query_segments: Optional[Array] = None
  key_segments: Optional[Array] = None
  dense: Optional[Array] = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  window: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def from_dense(cls, mask: Optional[Array], batch: int, q_len: int, kv_len: int) -> "AttentionMask":
    """Wraps a boolean mask (or None) broadcastable to `[batch, heads, q_len, kv_len]`."""
    return cls(key_valid=jnp.ones((batch, kv_len), bool),
               query_positions=jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (batch, q_len)),
               key_positions=jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len)),
               dense=mask)

  def block(self, q_start, q_size: int, k_start, k_size: int) -> Array:
    """Boolean `[batch, 1|heads, q_size, k_size]` for queries `q_start:+q_size`, keys `k_start:+k_size`."""
    mask = _slice(self.key_valid, 1, k_start, k_size)[:, None, None, :]
    if self.query_segments is not None:
      q_seg = _slice(self.query_segments, 1, q_start, q_size)
      k_seg = _slice(self.key_segments, 1, k_start, k_size)
      mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    if self.causal:
      q_index = q_start + jnp.arange(q_size)
      k_index = k_start + jnp.arange(k_size)
      mask = mask & (k_index[None, :] <= q_index[:, None])[None, None]
    if self.window:
      distance = self.distances(q_start, q_size, k_start, k_size)
      mask = mask & (jnp.abs(distance) < self.window)[:, None]
    if self.dense is not None:
      mask = mask & _slice(_slice(self.dense, 2, q_start, q_size), 3, k_start, k_size)
    return mask

  def distances(self, q_start, q_size: int, k_start, k_size: int) -> Array:
    """key position - query position, `[batch, q_size, k_size]` int32 (Shaw et al.'s j - i)."""
    q_pos = _slice(self.query_positions, 1, q_start, q_size)
    k_pos = _slice(self.key_positions, 1, k_start, k_size)
    return k_pos[:, None, :] - q_pos[:, :, None]

  def to_dense(self) -> Array:
    """The whole mask, `[batch, 1|heads, q_len, kv_len]` bool."""
    return self.block(0, self.query_positions.shape[1], 0, self.key_positions.shape[1])

  def padded(self, q_len: int, kv_len: int) -> "AttentionMask":
    """The mask of queries/keys padded at the end to `q_len`/`kv_len`; the padding keys are invalid."""
    def pad(x, axis, length, value=0):
      if x is None or x.shape[axis] == 1 or x.shape[axis] == length:
        return x
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, length - x.shape[axis])
      return jnp.pad(x, widths, constant_values=value)
    return self.replace(
        key_valid=pad(self.key_valid, 1, kv_len, False),
        query_positions=pad(self.query_positions, 1, q_len), key_positions=pad(self.key_positions, 1, kv_len),
        query_segments=pad(self.query_segments, 1, q_len), key_segments=pad(self.key_segments, 1, kv_len),
        dense=pad(pad(self.dense, 2, q_len, False), 3, kv_len, False))


@flax.struct.dataclass
class RelativePositions:
  """Shaw et al.'s learned tables: `key` `[2k+1, head_dim]` (a^K), `value` `[2k+1, head_dim]` or None (a^V).

  Row `r` embeds the clipped distance `r - k`, i.e. `a_ij = table[clip(j - i, -k, k) + k]`.
  """

  key: Array
  value: Optional[Array] = None
  max_distance: int = flax.struct.field(pytree_node=False, default=0)

  def index(self, distance: Array) -> Array:
    return jnp.clip(distance, -self.max_distance, self.max_distance) + self.max_distance


def _block_logits(query: Array, key: Array, mask: AttentionMask, q_start, k_start,
                  relative: Optional[RelativePositions]) -> Array:
  """Masked logits `[batch, heads, q_block, k_block]` (float32) of one block: q·(k + a^K)/√d (Shaw eq. 4)."""
  q_size, k_size = query.shape[1], key.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  if relative is not None:
    index = relative.index(mask.distances(q_start, q_size, k_start, k_size))  # [batch, q_block, k_block]
    per_distance = jnp.einsum("bqhd,rd->bhqr", query, relative.key.astype(query.dtype),
                              preferred_element_type=jnp.float32)  # [batch, heads, q_block, 2k+1]
    logits = logits + jnp.take_along_axis(per_distance, index[:, None], axis=-1)
  logits = logits / jnp.sqrt(jnp.float32(query.shape[-1]))
  return jnp.where(mask.block(q_start, q_size, k_start, k_size), logits, _MASKED)


def _block_values(probs: Array, value: Array, mask: AttentionMask, q_start, k_start,
                  relative: Optional[RelativePositions]) -> Array:
  """Σ_j p_ij (v_j + a^V_ij) (Shaw eq. 3) over one block: probs `[b, h, q, k]` -> `[b, q, h, d]` float32."""
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value, preferred_element_type=jnp.float32)
  if relative is not None and relative.value is not None:
    q_size, k_size = probs.shape[2:]
    index = relative.index(mask.distances(q_start, q_size, k_start, k_size))
    one_hot = jax.nn.one_hot(index, relative.value.shape[0], dtype=jnp.float32)  # [b, q, k, 2k+1]
    per_distance = jnp.einsum("bhqk,bqkr->bhqr", probs, one_hot)  # weight on each clipped distance
    out = out + jnp.einsum("bhqr,rd->bqhd", per_distance, relative.value.astype(jnp.float32))
  return out


def full_attention_weights(query: Array, key: Array, value: Array, mask: AttentionMask,
                           relative: Optional[RelativePositions] = None, *, dropout_rate: float = 0.0,
                           dropout_rng: Optional[Array] = None):
  """Exact attention in one block: (`[batch, q_len, heads, head_dim]`, weights `[batch, heads, q, kv]` f32).

  Materialises the scores; for short inputs, for diagnostics (`sow_attention_weights`) and for dropout on the
  attention weights with relative positions (`dropout_rate` with a `dropout_rng`: each weight zeroed with
  probability `dropout_rate`, the kept ones scaled by 1/(1 - rate), as in `dot_product_attention`; tensor2tensor's
  `dot_product_attention_relative` drops the weights the same way). The returned weights are the undropped ones.
  """
  weights = jax.nn.softmax(_block_logits(query, key, mask, 0, 0, relative), axis=-1)
  probs = _drop_weights(weights, dropout_rate, dropout_rng)
  return _block_values(probs, value, mask, 0, 0, relative).astype(query.dtype), weights


def _key_blocks(chunk: int, block: int, num_blocks: int, band: int) -> int:
  """How many key blocks one query chunk visits: all of them, or those within `band` positions of it."""
  if not band:
    return num_blocks
  return min(num_blocks, (chunk + 2 * band + block - 1) // block + 1)


def blocked_attention(query: Array, key: Array, value: Array, mask: AttentionMask, *, chunk_size: int,
                      band: int = 0, relative: Optional[RelativePositions] = None) -> Array:
  """Exact softmax attention, `chunk_size` queries at a time, with an online softmax over key blocks.

  Rabe & Staats (2021), algorithm 1 with query and key chunks of `chunk_size`: per query chunk a running
  maximum m, normaliser l and output accumulator are updated block by block, so the largest score tensor is
  `[batch, heads, chunk, chunk]`. Each chunk is `jax.checkpoint`-ed inside `lax.map`: the backward pass
  recomputes it instead of storing its scores, so the gradient's memory is also O(length * chunk).
  With `band` > 0 a query chunk visits only the key blocks whose indices lie within `band` of its own (local
  attention: band = window - 1), and the cost is O(length * (chunk + 2 * band)).

  Args:
    query: `[batch, q_len, heads, head_dim]`; key, value: `[batch, kv_len, heads, head_dim]`.
    mask: an `AttentionMask` over `[q_len, kv_len]`.
    chunk_size: queries (and keys) per block; lengths are padded up to a multiple of it.
    relative: Shaw et al.'s relative position tables, or None.

  Returns:
    `[batch, q_len, heads, head_dim]` in the dtype of `query`.
  """
  batch, q_len, heads, head_dim = query.shape
  kv_len = key.shape[1]
  chunk, block = min(chunk_size, q_len), min(chunk_size, kv_len)
  num_chunks, num_blocks = -(-q_len // chunk), -(-kv_len // block)
  q_pad, kv_pad = num_chunks * chunk, num_blocks * block
  query = jnp.pad(query, ((0, 0), (0, q_pad - q_len), (0, 0), (0, 0)))
  key = jnp.pad(key, ((0, 0), (0, kv_pad - kv_len), (0, 0), (0, 0)))
  value = jnp.pad(value, ((0, 0), (0, kv_pad - kv_len), (0, 0), (0, 0)))
  mask = mask.padded(q_pad, kv_pad)
  visits = _key_blocks(chunk, block, num_blocks, band)

  @jax.checkpoint
  def one_chunk(q_chunk: Array, q_start: Array) -> Array:
    """q_chunk `[batch, chunk, heads, head_dim]` -> `[batch, chunk, heads, head_dim]` float32."""
    # The key blocks within `band` of this chunk, shifted to stay inside [0, num_blocks) (no duplicates).
    first = jnp.clip((q_start - band) // block, 0, num_blocks - visits) if band else 0

    def visit(carry, j):
      running_max, normaliser, acc = carry  # [b, h, chunk], [b, h, chunk], [b, chunk, h, d]
      index = first + j
      k_start = index * block
      k_blk = jax.lax.dynamic_slice_in_dim(key, k_start, block, axis=1)
      v_blk = jax.lax.dynamic_slice_in_dim(value, k_start, block, axis=1)
      logits = _block_logits(q_chunk, k_blk, mask, q_start, k_start, relative)  # [b, h, chunk, block]
      new_max = jnp.maximum(running_max, logits.max(axis=-1))
      correction = jnp.exp(running_max - new_max)
      probs = jnp.exp(logits - new_max[..., None])
      normaliser = normaliser * correction + probs.sum(axis=-1)
      acc = acc * jnp.swapaxes(correction, 1, 2)[..., None] + _block_values(
          probs, v_blk, mask, q_start, k_start, relative)
      return (new_max, normaliser, acc), None

    init = (jnp.full((batch, heads, chunk), _MASKED, jnp.float32), jnp.zeros((batch, heads, chunk), jnp.float32),
            jnp.zeros((batch, chunk, heads, head_dim), jnp.float32))
    (_, normaliser, acc), _ = jax.lax.scan(visit, init, jnp.arange(visits))
    return acc / jnp.swapaxes(normaliser, 1, 2)[..., None]

  chunks = jnp.moveaxis(query.reshape(batch, num_chunks, chunk, heads, head_dim), 1, 0)
  starts = jnp.arange(num_chunks) * chunk
  out = jax.lax.map(lambda args: one_chunk(*args), (chunks, starts))  # [num_chunks, b, chunk, h, d]
  out = jnp.moveaxis(out, 0, 1).reshape(batch, q_pad, heads, head_dim)
  return out[:, :q_len].astype(query.dtype)


class MultiHeadAttention(nn.Module):
  """Multi-head attention with h parallel heads and an output projection W^O (section 3.2.2).

  Projections are Xavier-uniform with zero biases. With `use_cache=True` the module keeps a KV cache in the
  `cache` collection and takes one query position per call:
    * self-attention (`is_cross=False`): keys/values of each new position t are written into
      `cached_key`/`cached_value` `[batch, heads, cache_len, head_dim]` at slot `t % cache_len`, where
      cache_len = max_decode_len, or min(attention_window, max_decode_len) with a window: then the cache is a
      ring buffer holding the last w positions (memory O(w) per step, not O(length));
    * cross-attention (`is_cross=True`): the encoder memory is projected once, when the cache is created,
      and reused at every step.
  Self-attention applies the config's long-input options: relative positions (`max_relative_position`, the
  learned tables `relative_key`/`relative_value` `[2k+1, head_dim]` of this layer), the local window
  (`attention_window`) and query chunking (`query_chunk_size`); see `blocked_attention`. Cross-attention
  applies query chunking only.
  Passing `sow_attention_weights=True` sows the attention weights `[batch, heads, q_len, kv_len]` into the
  `intermediates` collection under `attention_weights`.
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
    query = self._projection("query")(inputs_q)  # [batch, q_len, heads, head_dim]
    key_proj, value_proj = self._projection("key"), self._projection("value")
    relative = self._relative_positions()

    if use_cache and self.is_cross:
      key, value = self._cached_memory(key_proj, value_proj, inputs_kv)
    elif use_cache and self.has_variable("cache", "beam_ancestry"):  # beam search's never-reordered cache
      result = self._beam_self_attention(query, key_proj(inputs_kv), value_proj(inputs_kv))
      return OutputProjection(cfg.d_model, dtype=cfg.compute_dtype, name="out")(result)
    elif use_cache:
      key, value, mask = self._update_self_cache(key_proj(inputs_kv), value_proj(inputs_kv), mask,
                                                 max_decode_len)
    else:
      key, value = key_proj(inputs_kv), value_proj(inputs_kv)

    result = self._attend(query, key, value, mask, relative, deterministic=deterministic,
                          use_cache=use_cache, sow_attention_weights=sow_attention_weights)
    return OutputProjection(cfg.d_model, dtype=cfg.compute_dtype, name="out")(result)

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
        self.sow("intermediates", "attention_weights", weights)
      return result

    if not isinstance(mask, AttentionMask):
      mask = AttentionMask.from_dense(mask, batch, q_len, kv_len)
    if sow_attention_weights or dropout_rng is not None:
      # One exact block: diagnostics need the full weights, and dropout drops them (the config refuses it with
      # the blocked options, attention_window and query_chunk_size, so here chunk is 0 when dropout is on).
      result, weights = full_attention_weights(query, key, value, mask, relative,
                                               dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng)
      if sow_attention_weights:
        self.sow("intermediates", "attention_weights", weights)
      return result
    return blocked_attention(query, key, value, mask, chunk_size=chunk or max(q_len, kv_len),
                             band=max(window - 1, 0), relative=relative)

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
    """Writes this step's key/value `[batch, 1, heads, head_dim]` into the cache; returns the cache and mask.

    The cache is stored heads-major, `[batch, heads, cache_len, head_dim]`: the attention dots contract
    over head_dim with heads as a batch dimension, so in this layout the `swapaxes` below cancels against the
    dot's own transpose and a decoding step writes one position instead of relaying out the whole cache
    (1.4-1.5x faster cached greedy and beam search on CPU).
    Position t goes to slot t % cache_len; slot s then holds position t - ((t - s) mod cache_len), valid when
    >= 0. Without a window cache_len = max_decode_len (slot = position); with a window w it is
    min(w, max_decode_len), a ring buffer of the last w positions, exactly those the window lets t see.
    On the call that creates the cache (no `cache_index` yet) nothing is written and the step attends to
    itself only, so that creating the cache costs one position's work. The returned mask is an
    `AttentionMask` carrying the slots' positions (for relative attention).
    """
    batch, q_len, heads, head_dim = key.shape
    cfg = self.config
    is_initialized = self.has_variable("cache", "cached_key")
    cache_len = max_decode_len or q_len
    if cfg.attention_window:
      cache_len = min(cache_len, cfg.attention_window)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, (batch, heads, cache_len, head_dim),
                               key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, (batch, heads, cache_len, head_dim),
                                 value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not is_initialized:
      zeros = jnp.zeros((batch, q_len), jnp.int32)
      return key, value, AttentionMask(jnp.ones((batch, q_len), bool), zeros, zeros, dense=mask)
    if q_len != 1:
      raise ValueError(f"use_cache=True takes one target position per call, got q_len={q_len}")
    index = cache_index.value
    cache_len = cached_key.value.shape[2]  # later calls need not pass max_decode_len
    slot = index % cache_len
    cached_key.value = jax.lax.dynamic_update_slice(
        cached_key.value, jnp.swapaxes(key, 1, 2).astype(cached_key.value.dtype), (0, 0, slot, 0))
    cached_value.value = jax.lax.dynamic_update_slice(
        cached_value.value, jnp.swapaxes(value, 1, 2).astype(cached_value.value.dtype), (0, 0, slot, 0))
    cache_index.value = index + 1
    # Position held by each slot, [cache_len]; negative = not written yet (causal: nothing after index).
    slot_positions = index - jnp.mod(index - jnp.arange(cache_len, dtype=jnp.int32), cache_len)
    step_mask = AttentionMask(
        key_valid=jnp.broadcast_to(slot_positions >= 0, (batch, cache_len)),
        query_positions=jnp.full((batch, 1), index, jnp.int32),
        key_positions=jnp.broadcast_to(slot_positions, (batch, cache_len)), dense=mask)
    return jnp.swapaxes(cached_key.value, 1, 2), jnp.swapaxes(cached_value.value, 1, 2), step_mask

  def _beam_self_attention(self, query: Array, key: Array, value: Array) -> Array:
    """One decoding step of self-attention for beam search, over a K/V cache that is never reordered.

    The cache (made by `beam_self_attention_cache`) holds, per source, the K/V of its `beams` rows side by
    side, and `beam_ancestry` `[batch, beams, max_decode_len]` int32: which beam row holds position s of beam
    j's hypothesis. Each row writes only its own current position, so what it wrote earlier never changes,
    and a beam reorder moves only the ancestry table (`reorder_beam_self_attention_cache`) instead of
    gathering every layer's K/V cache at every step (the largest cost of a CPU beam step besides the decoder
    itself). The beams of a source attend as `beams` queries over the `beams * max_decode_len` cached
    positions, each masked to its own history: the same softmax(Q Kᵀ / √d_k) V as `dot_product_attention`
    (float32 scores and softmax).

    The K/V are stored in the layouts the two dots read and written in place (`_write_beam_positions`):
    `beam_key` `[batch, heads, head_dim, beams * max_decode_len]` (Kᵀ: the score dot is a plain
    `[beams, head_dim] x [head_dim, beams * L]` product per source and head) and `beam_value`
    `[batch, heads, beams * max_decode_len, head_dim]`. Keys stored `[..., beams * L, head_dim]` made
    XLA:CPU transpose every layer's key cache inside the score dot at every step, and a write through a
    `[..., beams, L, ...]` reshape of the carried cache copied the cache whole (twice with the reshape's two
    readers): together about as long as the rest of a beam-4 step (base model).

    query, key, value `[batch * beams, 1, heads, head_dim]` -> `[batch * beams, 1, heads, head_dim]`.
    """
    ancestry = self.variable("cache", "beam_ancestry", lambda: None)
    cached_key = self.variable("cache", "beam_key", lambda: None)
    cached_value = self.variable("cache", "beam_value", lambda: None)
    cache_index = self.variable("cache", "cache_index", lambda: None)
    batch, beams, length = ancestry.value.shape
    rows, _, heads, head_dim = query.shape
    index = cache_index.value

    per_source = lambda x: x.reshape(batch, beams, heads, head_dim)  # noqa: E731  [rows, 1, h, d] -> [b, j, h, d]
    cached_key.value = _write_beam_positions(  # keys [b, h, d, j]
        cached_key.value, jnp.transpose(per_source(key), (0, 2, 3, 1)), index, length, axis=3)
    cached_value.value = _write_beam_positions(  # values [b, h, j, d]
        cached_value.value, jnp.transpose(per_source(value), (0, 2, 1, 3)), index, length, axis=2)
    ancestry.value = ancestry.value.at[:, :, index].set(jnp.arange(beams, dtype=jnp.int32)[None, :])
    cache_index.value = index + 1

    q = jnp.transpose(per_source(query), (0, 2, 1, 3))  # [b, h, j, d]
    logits = jnp.einsum("bhjd,bhdk->bhjk", q, cached_key.value, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / np.sqrt(head_dim))  # [b, h, j, beams * L]
    # keep[b, j, m, l]: row m holds position l of beam j's history, and l has been written.
    keep = ancestry.value[:, :, None, :] == jnp.arange(beams)[None, None, :, None]
    keep = jnp.logical_and(keep, (jnp.arange(length) <= index)[None, None, None, :])
    logits = jnp.where(keep.reshape(batch, 1, beams, beams * length), logits,
                       -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(cached_value.value.dtype)
    out = jnp.einsum("bhjk,bhkd->bhjd", probs, cached_value.value)  # [b, h, j, d]
    return jnp.transpose(out, (0, 2, 1, 3)).reshape(rows, 1, heads, head_dim)


def _write_beam_positions(cache: Array, x: Array, index: Array, length: int, axis: int) -> Array:
  """Writes slice m of `x` (`beams` along `axis`) at position `m * length + index` of `cache` (`beams * length`
  along `axis`), for every beam m: `beams` one-position in-place updates of the loop-carried buffer (no
  reshape of it, which XLA:CPU turns into whole-cache copies)."""
  for m in range(x.shape[axis]):
    start = [0] * cache.ndim
    start[axis] = m * length + index
    update = jax.lax.slice_in_dim(x, m, m + 1, axis=axis).astype(cache.dtype)
    cache = jax.lax.dynamic_update_slice(cache, update, start)
  return cache


def beam_self_attention_cache(entry: dict, batch: int, beams: int) -> dict:
  """A decoding self-attention cache entry `{cached_key, cached_value, cache_index}` (rows = batch * beams,
  as tiled for beam search) -> the never-reordered beam form that `MultiHeadAttention` then uses:
  `beam_key` `[batch, heads, head_dim, beams * max_decode_len]` (keys transposed), `beam_value`
  `[batch, heads, beams * max_decode_len, head_dim]` and `beam_ancestry` `[batch, beams, max_decode_len]`
  int32 (values written before the first step are never read)."""
  rows, heads, length, head_dim = entry["cached_key"].shape
  if rows != batch * beams:
    raise ValueError(f"cache has {rows} rows, expected batch * beams = {batch} * {beams}")
  return {"beam_key": jnp.zeros((batch, heads, head_dim, beams * length), entry["cached_key"].dtype),
          "beam_value": jnp.zeros((batch, heads, beams * length, head_dim), entry["cached_value"].dtype),
          "beam_ancestry": jnp.zeros((batch, beams, length), jnp.int32), "cache_index": entry["cache_index"]}


def reorder_beam_self_attention_cache(entry: dict, parent: Array) -> dict:
  """The beam reorder of a `beam_self_attention_cache` entry: beam j of source b continues the hypothesis
  of beam `parent[b, j]` `[batch, beams]`, so it takes that beam's ancestry row; the K/V stay where they are."""
  return dict(entry, beam_ancestry=jnp.take_along_axis(entry["beam_ancestry"], parent[:, :, None], axis=1))
