"""Forced target prefixes (fairseq `--prefix-size`, CTranslate2 `target_prefix`) for any search.

`forced_prefix(prefix, prefix_lengths)` is a `search.LogProbsFn`: while a row has emitted fewer tokens than its
prefix, every token but the prefix's next one is made impossible (-inf); the forced token keeps the model's own
log-probability, so scores and per-token log-probs of the prefix are the model's (nothing is renormalised).
After the prefix the search continues as usual. Model-agnostic: it sees only the log-probs and the step index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.decoding import search

Array = jax.Array


def forced_prefix(prefix: Array, prefix_lengths: Array) -> search.LogProbsFn:
  """The `LogProbsFn` that forces row r to start with `prefix[r, :prefix_lengths[r]]`.

  Args:
    prefix: `[rows, prefix_len]` int32 token ids (rows as the search calls the step: `batch * copies`,
      `search.repeat_rows`); anything after a row's length is ignored.
    prefix_lengths: `[rows]` int32, 0 = no prefix for that row.

  Returns `(log_probs [rows, vocab], DecodingState) -> log_probs [rows, vocab]`.
  """
  width = prefix.shape[1]

  def log_probs_fn(log_probs: Array, state: search.DecodingState) -> Array:
    if width == 0:
      return log_probs
    forced = state.cur_index < prefix_lengths  # [rows]
    token = lax.dynamic_index_in_dim(prefix, jnp.minimum(state.cur_index, width - 1), axis=1,
                                     keepdims=True)  # [rows, 1]
    only = jnp.arange(log_probs.shape[-1])[None, :] == token  # [rows, vocab]
    return jnp.where(forced[:, None] & ~only, search.NEG_INF, log_probs)

  return log_probs_fn
