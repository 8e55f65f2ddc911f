"""The decoding caches of attention, and the accessors the decoder calls (no names matched).

Every `MultiHeadAttention` called with `use_cache=True` keeps one typed entry (a `flax.struct` dataclass) in the
`cache` collection:
  * `CrossAttentionCache`: the encoder memory's keys/values, projected once per sentence; constant while
    decoding.
  * `SelfAttentionCache`: the keys/values of the positions decoded so far, slot = position (or a ring buffer
    of the last `attention_window` positions) and the number of positions written.
  * `BeamSelfAttentionCache`: beam search's never-reordered form of a self-attention cache (the beams of a
    source interleaved in blocks of positions, and an ancestry table; a beam reorder moves only the table, and
    a step reads only the blocks written so far).
  * `BeamCrossAttentionCache`: beam search's form of a cross-attention cache, one copy of each source's
    memory read by all of its beams.
The layouts are the ones XLA:CPU's one-query attention dots read without re-laying out the cache at every
step (each class says which). The decoder (`transformer_jax.decoding.step`) never looks at module or variable
names: `split` separates the constant entries from the changing ones, `to_beams` and `share_across_beams` put
the self- and cross-attention entries in their beam forms and `reorder_beams` applies a beam reorder, all by
the entries' types, so a model whose attention submodules are named otherwise decodes the same; a cache
whose per-row state is not an entry of this module is refused by `to_beams` (the beam form could not reorder
it).
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from transformer_jax.attention.core import AttentionMask, masked_logits, masked_softmax
from transformer_jax.config import ModelConfig

Array = jax.Array

ENTRY = "kv_cache"  # the variable of a layer's entry in the `cache` collection (read by the layer only)


@flax.struct.dataclass
class CrossAttentionCache:
  """Cross-attention keys/values `key`, `value` `[batch, heads, head_dim, src_len]`, projected once.

  Stored heads-major with the source last, the layout XLA:CPU's one-query attention dots read: the transposes
  of `create` and `read` cancel against the dots' own, where the `[batch, src_len, ...]` layout made XLA re-lay
  out every layer's cross-attention K/V at every decoding step (a quarter of a CPU beam step).
  """

  key: Array
  value: Array

  @classmethod
  def create(cls, key_fn, value_fn) -> "CrossAttentionCache":
    """From the projections `key_fn()`, `value_fn()` `[batch, src_len, heads, head_dim]`, called in order."""
    return cls(key=jnp.transpose(key_fn(), (0, 2, 3, 1)), value=jnp.transpose(value_fn(), (0, 2, 3, 1)))

  def read(self) -> tuple[Array, Array]:
    """(keys, values) `[batch, src_len, heads, head_dim]`."""
    return jnp.transpose(self.key, (0, 3, 1, 2)), jnp.transpose(self.value, (0, 3, 1, 2))


@flax.struct.dataclass
class BeamCrossAttentionCache:
  """Beam search's cross-attention keys/values: one copy per source, read by all of its beams.

  `key` `[batch, heads, head_dim, src_len]` (Kᵀ, as `CrossAttentionCache`) and `value` `[batch, heads, src_len,
  head_dim]`, the layouts of the two dots, not tiled to the beam rows: the `beams` queries of a source attend
  together as one `[beams, head_dim] x [head_dim, src_len]` product per source and head, so a step reads each
  source's memory once instead of once per beam. `beams`: static.
  """

  key: Array
  value: Array
  beams: int = flax.struct.field(pytree_node=False)

  @classmethod
  def from_cross_attention(cls, entry: CrossAttentionCache, beams: int) -> "BeamCrossAttentionCache":
    """The per-source `CrossAttentionCache` (rows = sources, before any tiling) shared by `beams` rows each."""
    return cls(key=entry.key, value=jnp.swapaxes(entry.value, 2, 3), beams=beams)

  def attend(self, query: Array, mask: Optional[Array]) -> tuple[Array, Array]:
    """softmax(Q Kᵀ / √d_k) V over the source (float32 scores and softmax, as `core.dot_product_attention`).

    query `[batch * beams, 1, heads, head_dim]` (beam j of source i in row `i * beams + j`); mask None or
    boolean `[batch * beams or 1, 1, 1, src_len]` (the rows of a source share their source, so the first
    beam's row is read). Returns `(out [batch * beams, 1, heads, head_dim], weights [batch * beams, heads, 1,
    src_len] float32)`.
    """
    batch, heads, head_dim, src_len = self.key.shape
    rows = query.shape[0]
    q = jnp.transpose(query.reshape(batch, self.beams, heads, head_dim), (0, 2, 1, 3))  # [b, h, j, d]
    logits = jnp.einsum("bhjd,bhds->bhjs", q, self.key, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / np.sqrt(head_dim))  # [b, h, j, s]
    if mask is not None and mask.shape[0] == rows:
      mask = mask.reshape(batch, self.beams, *mask.shape[1:])[:, 0]  # [b, 1, 1, s]
    weights = masked_softmax(logits, mask)
    out = jnp.einsum("bhjs,bhsd->bhjd", weights.astype(self.value.dtype), self.value)  # [b, h, j, d]
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape(rows, 1, heads, head_dim)
    return out, jnp.transpose(weights, (0, 2, 1, 3)).reshape(rows, heads, 1, src_len)


@flax.struct.dataclass
class SelfAttentionCache:
  """Self-attention keys/values of the decoded positions and `index`, the positions written so far (int32).

  `key`, `value` `[batch, heads, cache_len, head_dim]`, heads-major: the attention dots contract over head_dim
  with heads as a batch dimension, so in this layout the `swapaxes` of `write` cancels against the dot's own
  transpose and a step writes one position instead of relaying out the whole cache (faster cached greedy and
  beam search: docs/performance.md, "Start-up and the smaller choices"). Position t goes to slot t % cache_len;
  slot s then holds position t - ((t - s) mod cache_len), valid when >= 0. Without a window cache_len = max_decode_len (slot = position);
  with a window w it is min(w, max_decode_len), a ring buffer of the last w positions, exactly those the
  window lets t see. (Fields in this order keep the leaf order of the decoding loop's state.)
  """

  index: Array
  key: Array
  value: Array

  @classmethod
  def create(cls, batch: int, heads: int, cache_len: int, head_dim: int, key_dtype,
             value_dtype) -> "SelfAttentionCache":
    """An empty cache (zeros, index 0)."""
    return cls(key=jnp.zeros((batch, heads, cache_len, head_dim), key_dtype),
               value=jnp.zeros((batch, heads, cache_len, head_dim), value_dtype),
               index=jnp.array(0, dtype=jnp.int32))

  def write(self, key: Array, value: Array, mask: Optional[Array]):
    """Writes one step's key/value `[batch, 1, heads, head_dim]` at slot `index % cache_len`.

    Returns `(cache, keys, values, mask)`: the updated cache, its keys/values `[batch, cache_len, heads,
    head_dim]` and an `AttentionMask` carrying the slots' positions (unwritten slots invalid; relative attention
    reads the positions), and-ed with `mask`.
    """
    batch = key.shape[0]
    index = self.index
    cache_len = self.key.shape[2]
    slot = index % cache_len
    new_key = jax.lax.dynamic_update_slice(self.key, jnp.swapaxes(key, 1, 2).astype(self.key.dtype),
                                           (0, 0, slot, 0))
    new_value = jax.lax.dynamic_update_slice(self.value, jnp.swapaxes(value, 1, 2).astype(self.value.dtype),
                                             (0, 0, slot, 0))
    updated = SelfAttentionCache(index=index + 1, key=new_key, value=new_value)
    # Position held by each slot, [cache_len]; negative = not written yet (causal: nothing after index).
    slot_positions = index - jnp.mod(index - jnp.arange(cache_len, dtype=jnp.int32), cache_len)
    step_mask = AttentionMask(
        key_valid=jnp.broadcast_to(slot_positions >= 0, (batch, cache_len)),
        query_positions=jnp.full((batch, 1), index, jnp.int32),
        key_positions=jnp.broadcast_to(slot_positions, (batch, cache_len)), dense=mask)
    return updated, jnp.swapaxes(new_key, 1, 2), jnp.swapaxes(new_value, 1, 2), step_mask


@flax.struct.dataclass
class BeamSelfAttentionCache:
  """Beam search's self-attention cache, never reordered: per source the K/V of its `beams` rows interleaved.

  `ancestry` `[batch, beams, max_decode_len]` int32: which beam row holds position s of beam j's hypothesis.
  Each row writes only its own current position, so what it wrote earlier never changes, and a beam reorder
  moves only the ancestry table (`reorder`) instead of gathering every layer's K/V cache at every step (the
  largest cost of a CPU beam step besides the decoder itself).
  The positions are cut into blocks of `prefix_block(max_decode_len)`, each block its own array, and a step
  reads only the blocks written so far (a `lax.switch` on the current block): on average about half the K/V
  bytes of reading every position, with no copy (a slice of one array would be copied before its dot), and
  writes only the current block, in place (a `lax.cond` per block). In block i, position `i * block + s` of
  beam row m is column `s * beams + m`.
  The K/V are stored in the layouts the two dots read: `key` a tuple of `[batch, heads, head_dim, block *
  beams]` (Kᵀ: the score dot is a plain `[beams, head_dim] x [head_dim, columns]` product per source and head)
  and `value` a tuple of `[batch, heads, block * beams, head_dim]`. Keys stored `[..., columns,
  head_dim]` made XLA:CPU transpose every layer's key cache inside the score dot at every step. `index`:
  positions written. (Fields in this order keep the leaf order of the decoding loop's state.)
  """

  ancestry: Array
  key: tuple
  value: tuple
  index: Array

  @classmethod
  def from_self_attention(cls, entry: SelfAttentionCache, batch: int, beams: int) -> "BeamSelfAttentionCache":
    """The beam form of a `SelfAttentionCache` whose rows are `batch * beams` (beam j of source i in row
    `i * beams + j`); values written before the first step are never read. Raises ValueError on other rows."""
    rows, heads, length, head_dim = entry.key.shape
    if rows != batch * beams:
      raise ValueError(f"cache has {rows} rows, expected batch * beams = {batch} * {beams}")
    block = prefix_block(length)
    columns = block * beams
    blocks = range(-(-length // block))
    return cls(key=tuple(jnp.zeros((batch, heads, head_dim, columns), entry.key.dtype) for _ in blocks),
               value=tuple(jnp.zeros((batch, heads, columns, head_dim), entry.value.dtype) for _ in blocks),
               ancestry=jnp.zeros((batch, beams, length), jnp.int32), index=entry.index)

  def reorder(self, parent: Array) -> "BeamSelfAttentionCache":
    """Beam j of source b continues the hypothesis of beam `parent[b, j]` `[batch, beams]`: it takes that
    beam's ancestry row; the K/V stay where they are."""
    return self.replace(ancestry=jnp.take_along_axis(self.ancestry, parent[:, :, None], axis=1))

  def attend(self, query: Array, key: Array, value: Array):
    """One decoding step of self-attention: writes each row's key/value, then attends.

    The beams of a source attend as `beams` queries over the blocks written so far, each masked to its own
    history: the same softmax(Q Kᵀ / √d_k) V as `core.dot_product_attention` (float32 scores and softmax).
    query, key, value `[batch * beams, 1, heads, head_dim]` -> `(out [batch * beams, 1, heads, head_dim], the
    updated cache)`.
    """
    batch, beams, length = self.ancestry.shape
    rows, _, heads, head_dim = query.shape
    index = self.index
    block = prefix_block(length)

    per_source = lambda x: x.reshape(batch, beams, heads, head_dim)  # noqa: E731  [rows, 1, h, d] -> [b, j, h, d]
    new_key = jnp.transpose(per_source(key), (0, 2, 3, 1)).astype(self.key[0].dtype)  # [b, h, d, j]
    new_value = jnp.transpose(per_source(value), (0, 2, 1, 3)).astype(self.value[0].dtype)  # [b, h, j, d]
    current, column = index // block, (index % block) * beams
    keys = tuple(_write_block(k, new_key, i == current, (0, 0, 0, column)) for i, k in enumerate(self.key))
    values = tuple(_write_block(v, new_value, i == current, (0, 0, column, 0)) for i, v in enumerate(self.value))
    ancestry = self.ancestry.at[:, :, index].set(jnp.arange(beams, dtype=jnp.int32)[None, :])
    updated = BeamSelfAttentionCache(ancestry=ancestry, key=keys, value=values, index=index + 1)

    q = jnp.transpose(per_source(query), (0, 2, 1, 3))  # [b, h, j, d]
    branches = [functools.partial(_attend_blocks, n, block) for n in range(1, len(keys) + 1)]
    out = jax.lax.switch(current, branches, q, keys, values, ancestry, index)  # [b, h, j, d]
    return jnp.transpose(out, (0, 2, 1, 3)).reshape(rows, 1, heads, head_dim), updated


def prefix_block(max_decode_len: int) -> int:
  """Positions per block of `BeamSelfAttentionCache`: 8, or more so that a cache has at most 8 blocks (a
  search compiles one attention per block count and layer)."""
  return max(8, -(-max_decode_len // 8))


def _write_block(cache: Array, update: Array, is_current: Array, start: tuple) -> Array:
  """`update` written at `start` of one block of a `BeamSelfAttentionCache` when it is the current block: a
  `lax.cond`, which XLA:CPU runs in place (writing every block, the others at a spare slot, cost a
  transpose-and-write per block, ~9% of a beam step)."""
  return jax.lax.cond(is_current, lambda c: jax.lax.dynamic_update_slice(c, update, start), lambda c: c, cache)


def _attend_blocks(n: int, block: int, q: Array, keys: tuple, values: tuple, ancestry: Array,
                   index: Array) -> Array:
  """Attention of the beam queries `q` `[b, h, j, d]` over the first `n` (static) blocks of a
  `BeamSelfAttentionCache` (`keys`, `values`, `ancestry` `[b, j, L]`), each query masked to the positions <=
  `index` its beam's ancestry points at; the softmax's max and sum are taken across the blocks; `[b, h, j, d]`."""
  batch, heads, beams, head_dim = q.shape
  length = ancestry.shape[-1]
  scale = jnp.float32(1.0 / np.sqrt(head_dim))
  logits = []
  for i in range(n):
    positions = jnp.arange(i * block, (i + 1) * block)  # [block]; past L: never written, masked
    owner = jnp.take(ancestry, jnp.minimum(positions, length - 1), axis=2)  # [b, j, block]
    # keep[b, j, s, m]: row m holds position i * block + s of beam j's history, and it has been written.
    keep = jnp.logical_and(owner[..., None] == jnp.arange(beams), (positions <= index)[None, None, :, None])
    x = jnp.einsum("bhjd,bhdk->bhjk", q, keys[i], preferred_element_type=jnp.float32) * scale
    logits.append(masked_logits(x, keep.reshape(batch, 1, beams, -1)))
  top = functools.reduce(jnp.maximum, [jnp.max(x, axis=-1, keepdims=True) for x in logits])  # [b, h, j, 1]
  weights = [jnp.exp(x - top) for x in logits]
  total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
  out = sum(jnp.einsum("bhjk,bhkd->bhjd", (w / total).astype(v.dtype), v, preferred_element_type=jnp.float32)
            for w, v in zip(weights, values))  # the blocks' partial sums added in float32, whatever the dtype
  return out.astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# The accessors the decoder calls: a model's whole `cache` collection, found by the entries' types
# ----------------------------------------------------------------------------------------------------------

def split(cache) -> tuple[dict, dict]:
  """A model's `cache` collection -> `(constant, changing)`, flat dicts `{path: entry or array}`.

  `constant`: the `CrossAttentionCache` entries (the same at every step: the decoder closes over them);
  `changing`: everything else (self-attention entries, position counters), the state a search carries.
  """
  flat = traverse_util.flatten_dict(nn.unbox(cache))
  constant = {path: x for path, x in flat.items() if isinstance(x, (CrossAttentionCache, BeamCrossAttentionCache))}
  return constant, {path: x for path, x in flat.items() if path not in constant}


def merge(constant: dict, changing: dict) -> dict:
  """The `cache` collection to apply the model with, from the two halves of `split`."""
  return traverse_util.unflatten_dict({**constant, **changing})


# The decoder self-attention schemes (`self_attention_scheme`) that the beam form computes exactly: an allow-list.
# `BeamSelfAttentionCache.attend` reads keys by slot under the causal mask and nothing else, which is the whole of
# attention where positions are added to the embeddings below the first layer and every earlier position is in
# reach. Relative positions (the query-key offsets) and an attention window (a ring buffer of slots) are not
# listed, nor is any scheme added later until tests/test_kvcache.py, which enumerates every scheme of
# `ModelConfig`, proves it equal: those decode with the gathered cache (`search.gather_beams`).
BEAM_FORM_SCHEMES = frozenset({("sinusoidal", "full"), ("learned", "full")})


def self_attention_scheme(config: ModelConfig) -> tuple[str, str]:
  """(positions, reach) of the decoder's self-attention: positions 'relative' where `max_relative_position` > 0,
  else `position_embedding` ('sinusoidal' | 'learned' | 'none'); reach 'window' where `attention_window` > 0,
  else 'full'."""
  return ("relative" if config.max_relative_position else config.position_embedding,
          "window" if config.attention_window else "full")


def beam_form_applies(config: ModelConfig, beams: int) -> bool:
  """Whether `to_beams` serves beam search: more than one beam, and a scheme of `BEAM_FORM_SCHEMES`; otherwise
  the caches are reordered per beam by gathering their rows."""
  return beams > 1 and self_attention_scheme(config) in BEAM_FORM_SCHEMES


def to_beams(changing: dict, batch: int, beams: int) -> dict:
  """Every `SelfAttentionCache` of `changing` (from `split`, rows `batch * beams`) in `BeamSelfAttentionCache`
  form. Raises ValueError when `changing` holds no self-attention entry, or per-row state that is not one
  (the beam reorder, `reorder_beams`, moves only the ancestry tables: such state would not follow its beam)."""
  if not any(isinstance(x, SelfAttentionCache) for x in changing.values()):
    raise ValueError("beam search's cache form needs attention.kvcache.SelfAttentionCache entries; the model's "
                     f"cache holds none (entries: {sorted('/'.join(p) for p in changing)})")
  for path, x in changing.items():
    if not isinstance(x, SelfAttentionCache) and any(jnp.ndim(leaf) for leaf in jax.tree_util.tree_leaves(x)):
      raise ValueError(f"cache entry {'/'.join(path)} holds per-row state that is not an attention.kvcache "
                       "entry: beam search's never-reordered cache could not reorder it")
  return {path: BeamSelfAttentionCache.from_self_attention(x, batch, beams) if isinstance(x, SelfAttentionCache)
          else x for path, x in changing.items()}


def share_across_beams(constant: dict, beams: int) -> dict:
  """Every `CrossAttentionCache` of `constant` (from `split`, rows = sources, not tiled) as a
  `BeamCrossAttentionCache` read by `beams` decoder rows each; other entries are left as they are."""
  return {path: BeamCrossAttentionCache.from_cross_attention(x, beams) if isinstance(x, CrossAttentionCache)
          else x for path, x in constant.items()}


def reorder_beams(changing: dict, parent: Array) -> dict:
  """The beam reorder of a `to_beams` cache (`parent` `[batch, beams]` int32): only the ancestry tables
  `[batch, beams, max_decode_len]` move."""
  return {path: x.reorder(parent) if isinstance(x, BeamSelfAttentionCache) else x for path, x in changing.items()}
