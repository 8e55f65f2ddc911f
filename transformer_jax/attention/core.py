"""The math of attention: scaled dot-product attention, masks, relative positions, blocked attention.

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
Without them the fused `jax.nn.dot_product_attention` (XLA or cuDNN) stays the path. Pure functions only: the
layer is `attention.layer.MultiHeadAttention`, the decoding caches `attention.kvcache`.

One mask, one softmax: every form that computes its own scores (the explicit path of `dot_product_attention`,
`full_attention_weights`, `blocked_attention`, the beam caches of `attention.kvcache`) masks them with
`masked_logits` (one constant, `MASKED_LOGIT`), and the forms that hold a whole row of scores take
`masked_softmax`. Two cannot hold the row and so keep their own normalisation over the same masked scores:
`blocked_attention` (an online softmax: a running max and normaliser over key blocks) and the beam
self-attention cache (`kvcache._attend_blocks`: the max and the sum taken across its blocks).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import dropout as dropout_lib

Array = jax.Array


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
  weights = masked_softmax(logits, mask)
  probs = _drop_weights(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value)
  return (out, weights) if return_weights else out


MASKED_LOGIT = float(np.finfo(np.float32).min)  # a masked key's logit (finite: a fully masked row stays NaN-free)


def masked_logits(logits: Array, keep: Optional[Array]) -> Array:
  """`logits` (float32) with `MASKED_LOGIT` wherever `keep` (boolean, broadcastable; None = keep all) is False."""
  return logits if keep is None else jnp.where(keep, logits, MASKED_LOGIT)


def masked_softmax(logits: Array, keep: Optional[Array]) -> Array:
  """The attention weights over the last axis of float32 `logits`, the keys where `keep` is False left out."""
  return jax.nn.softmax(masked_logits(logits, keep), axis=-1)


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
  return masked_logits(logits, mask.block(q_start, q_size, k_start, k_size))


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

    init = (jnp.full((batch, heads, chunk), MASKED_LOGIT, jnp.float32), jnp.zeros((batch, heads, chunk), jnp.float32),
            jnp.zeros((batch, chunk, heads, head_dim), jnp.float32))
    (_, normaliser, acc), _ = jax.lax.scan(visit, init, jnp.arange(visits))
    return acc / jnp.swapaxes(normaliser, 1, 2)[..., None]

  chunks = jnp.moveaxis(query.reshape(batch, num_chunks, chunk, heads, head_dim), 1, 0)
  starts = jnp.arange(num_chunks) * chunk
  out = jax.lax.map(lambda args: one_chunk(*args), (chunks, starts))  # [num_chunks, b, chunk, h, d]
  out = jnp.moveaxis(out, 0, 1).reshape(batch, q_pad, heads, head_dim)
  return out[:, :q_len].astype(query.dtype)

