"""The Transformer as a step function for the searches, and its familiar entry points (pure, jitted).

`transformer_step_fn` encodes the source once, creates the KV cache (`attention.kvcache`, reached only through
its accessors), and returns the cached one-token step (or the uncached teacher-forced step), tiled to `copies`
rows per source for beam search. `greedy_search(params, config, ...)`, `beam_search(...)` and `sample(...)` are
thin jitted wrappers: `transformer_step_fn` then the search of `decoding.search`, whose conventions hold here.
`config`, `beam_size`, `alpha`, `max_decode_len` (and the other switches) are static; `params`, `inputs`,
`max_lengths` and `rng` are traced.

The cached step encodes each source once and projects its cross-attention K/V once; those are
loop constants closed over by the step (not part of the loop state), so XLA keeps them in the layout the
attention wants instead of re-laying them out at every step, and a beam reorder gathers only the
self-attention K/V. The `cached=False` step recomputes the full teacher-forced decoder over the prefix
(padded to `max_decode_len`) at every step: O(L^2) work instead of O(L); it is the reference for tests and
the baseline of the cached-vs-uncached benchmark.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.attention import kvcache
from transformer_jax.config import ModelConfig
from transformer_jax.decoding.search import (DecodingState, TokensToLogits, beam_search_over, check_beam_options,
                                             gather_beams, greedy_search_over, repeat_rows, sample_over)
from transformer_jax.model import Transformer

Array = jax.Array


def _check_lengths(config: ModelConfig, inputs: Array, max_decode_len: int):
  if inputs.ndim != 2:
    raise ValueError(f"inputs must be [batch, src_len], got shape {inputs.shape}")
  if not 0 < max_decode_len <= config.max_len:
    raise ValueError(f"max_decode_len={max_decode_len} must be in [1, config.max_len={config.max_len}] "
                     "(the positional table covers config.max_len positions)")
  if inputs.shape[1] > config.max_len:
    raise ValueError(f"source length {inputs.shape[1]} exceeds config.max_len={config.max_len}")


def _cached_step_fn(model: Transformer, params, config: ModelConfig, encoded: Array, inputs: Array,
                    max_decode_len: int, copies: int) -> "TransformerStep":
  """The KV-cached decoder over `batch * copies` rows; with copies > 1 the K/V cache is never reordered."""
  # Create the cache on the un-tiled batch (cross-attention K/V projected once per source), then tile the
  # self-attention state to the decoder rows.
  bos = jnp.full((inputs.shape[0], 1), config.bos_id, jnp.int32)
  _, variables = model.apply({"params": params}, encoded, inputs, bos, use_cache=True,
                             max_decode_len=max_decode_len, method=Transformer.decode, mutable=["cache"])
  constant, changing = kvcache.split(variables["cache"])
  changing = repeat_rows(changing, copies)
  # The beams of a source read one copy of its cross-attention K/V (tiled, a step would read `copies` copies).
  constant = kvcache.share_across_beams(constant, copies) if copies > 1 else constant
  # Materialise the cross-attention K/V in their stored layout before the loop: otherwise XLA folds the
  # store/read transposes away and re-lays out the projections inside the loop, at every step.
  constant = lax.optimization_barrier(constant)
  beam_form = kvcache.beam_form_applies(config, copies)  # else the caches are gathered per beam (`gather_beams`)
  if beam_form:
    changing = kvcache.to_beams(changing, inputs.shape[0], copies)
  # The decoder reads only the cached cross-attention K/V and the source mask in decode mode.
  encoded_rows, inputs_rows = repeat_rows(encoded, copies), repeat_rows(inputs, copies)

  def tokens_to_logits(state: DecodingState):
    cache = kvcache.merge(constant, state.cache)
    logits, variables = model.apply({"params": params, "cache": cache}, encoded_rows, inputs_rows,
                                    state.cur_token[:, None], use_cache=True, method=Transformer.decode,
                                    mutable=["cache"])  # logits [rows, 1, vocab]
    _, changing = kvcache.split(variables["cache"])
    return logits[:, 0], changing

  return TransformerStep(tokens_to_logits, changing, kvcache.reorder_beams if beam_form else gather_beams)


def _uncached_step_fn(model: Transformer, params, config: ModelConfig, encoded: Array, inputs: Array,
                      max_decode_len: int, copies: int) -> "TransformerStep":
  """The teacher-forced decoder over the whole prefix at every step (cache `()`)."""
  encoded_rows, inputs_rows = repeat_rows(encoded, copies), repeat_rows(inputs, copies)
  positions = jnp.arange(max_decode_len)[None, :]

  def tokens_to_logits(state: DecodingState):
    # Teacher forcing on the prefix. Positions >= t hold a non-pad placeholder: the model masks *keys* by
    # `targets != pad`, and position t's key (input y_t) is flagged by targets[t]; the causal mask hides
    # everything after t, so the placeholder's value never matters.
    targets = jnp.where(positions < state.cur_index, state.sequences, config.eos_id)  # [rows, L]
    logits = model.apply({"params": params}, encoded_rows, inputs_rows, targets, method=Transformer.decode)
    return lax.dynamic_index_in_dim(logits, state.cur_index, axis=1, keepdims=False), state.cache

  return TransformerStep(tokens_to_logits, (), gather_beams)


class TransformerStep(NamedTuple):
  """The Transformer as the searches see it (what `transformer_step_fn` returns)."""
  tokens_to_logits: TokensToLogits
  cache: Any  # the initial cache, batch * copies rows
  gather_cache: Callable  # the beam reorder to pass to `beam_search_over`


def transformer_step_fn(params, config: ModelConfig, inputs: Array, max_decode_len: int, *,
                        copies: int = 1, cached: bool = True) -> TransformerStep:
  """The Transformer as a step function for the searches: `(tokens_to_logits, cache, gather_cache)`.

  Encodes `inputs` `[batch, src_len]` (pad = `config.pad_id`) once and returns a step over `batch * copies`
  decoder rows (row `i * copies + j` decodes source i; `copies` = the beam size for beam search).
  `cached=True`: the KV-cached one-token step (`Transformer.decode(..., use_cache=True)`); the cross-attention
  K/V are projected once and closed over, the cache carried between steps holds the self-attention K/V
  `[rows, heads, cache_len, head_dim]` and the position counters. With `copies > 1` the cross-attention K/V stay
  one copy per source, read by all its rows (`kvcache.BeamCrossAttentionCache`), and (with neither an
  attention window nor relative positions) the self-attention caches take the never-reordered beam form
  (`kvcache.BeamSelfAttentionCache`: K/V side by side per source plus an ancestry table) and
  `gather_cache` moves only the ancestry tables. `cached=False`: the teacher-forced decoder over the prefix
  padded to `max_decode_len` (cache `()`). Call it under `jax.jit`.

  Raises ValueError when `inputs` is not 2-D or a length exceeds `config.max_len`.
  """
  _check_lengths(config, inputs, max_decode_len)
  params = nn.unbox(params)
  model = Transformer(config)
  encoded = model.apply({"params": params}, inputs, method=Transformer.encode)  # [batch, src_len, d_model]
  make = _cached_step_fn if cached else _uncached_step_fn
  return make(model, params, config, encoded, inputs, max_decode_len, copies)


def _ids(config: ModelConfig) -> dict:
  return dict(bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id)


@functools.partial(jax.jit, static_argnames=("config", "max_decode_len", "cached"))
def greedy_search(params, config: ModelConfig, inputs: Array, max_decode_len: int, *,
                  max_lengths: Optional[Array] = None, cached: bool = True):
  """Greedy decoding of the Transformer: `(tokens [batch, max_decode_len] int32, log_probs [batch] float32)`.

  `tokens` exclude BOS and end with EOS then pad; `log_probs` sums the emitted tokens' log-probabilities,
  EOS included. `transformer_step_fn` + `greedy_search_over`; the conventions are `decoding.search`'s.
  """
  step, cache, _ = transformer_step_fn(params, config, inputs, max_decode_len, cached=cached)
  return greedy_search_over(step, cache, batch_size=inputs.shape[0], max_decode_len=max_decode_len,
                            max_lengths=max_lengths, **_ids(config))


def greedy_search_uncached(params, config: ModelConfig, inputs: Array, max_decode_len: int, *,
                           max_lengths: Optional[Array] = None):
  """Reference greedy search that recomputes the teacher-forced decoder over the prefix at every step."""
  return greedy_search(params, config, inputs, max_decode_len, max_lengths=max_lengths, cached=False)


@functools.partial(jax.jit, static_argnames=("config", "max_decode_len", "temperature", "top_k", "cached"))
def sample(params, config: ModelConfig, inputs: Array, rng: Array, max_decode_len: int,
           temperature: float = 1.0, top_k: int = 0, *, max_lengths: Optional[Array] = None,
           cached: bool = True):
  """Ancestral sampling from the Transformer: `transformer_step_fn` + `sample_over` (see there).

  Returns `(tokens [batch, max_decode_len], log_probs [batch])`; `log_probs` are the *model's* log-probs of
  the sampled tokens (untempered, untruncated). `top_k=1` is greedy search. Step t uses
  `jax.random.fold_in(rng, t)`.
  """
  step, cache, _ = transformer_step_fn(params, config, inputs, max_decode_len, cached=cached)
  return sample_over(step, cache, rng, batch_size=inputs.shape[0], max_decode_len=max_decode_len,
                     temperature=temperature, top_k=top_k, max_lengths=max_lengths, **_ids(config))


@functools.partial(jax.jit, static_argnames=("config", "beam_size", "alpha", "max_decode_len", "cached",
                                             "early_stop", "full_output", "nbest"))
def beam_search(params, config: ModelConfig, inputs: Array, beam_size: int = 4, alpha: float = 0.6,
                max_decode_len: int = 64, *, max_lengths: Optional[Array] = None, cached: bool = True,
                early_stop: str = "best", full_output: bool = False, nbest: int = 1):
  """Beam search of the Transformer with the GNMT length penalty (`transformer_step_fn` + `beam_search_over`).

  Returns `(tokens [batch, beam, max_decode_len], scores [batch, beam])`, best first; with `full_output`, a
  `BeamSearchOutput` that adds `log_probs [batch, beam]` (the raw sum of token log-probs, EOS included),
  `steps` (decoder steps run) and `token_log_probs [batch, beam, max_decode_len]` (each token's log-prob).
  `scores = log_probs / ((5 + |Y|) / 6) ** alpha` with `|Y|` the number of emitted tokens INCLUDING EOS
  (excluding BOS). Slots without any hypothesis have score -inf and pad tokens.
  `early_stop`: 'best' (default), 'all' or 'none', see the module docstring; with 'best', the search goes on
  until `nbest` (in [1, beam_size]) have finished, where the length limit leaves room.
  """
  check_beam_options(beam_size, early_stop)
  step, cache, gather_cache = transformer_step_fn(params, config, inputs, max_decode_len, copies=beam_size,
                                                  cached=cached)
  out = beam_search_over(step, cache, batch_size=inputs.shape[0], beam_size=beam_size, alpha=alpha,
                         max_decode_len=max_decode_len, max_lengths=max_lengths, early_stop=early_stop,
                         gather_cache=gather_cache, per_token=full_output, nbest=nbest, **_ids(config))
  return out if full_output else (out.tokens, out.scores)


def beam_search_uncached(params, config: ModelConfig, inputs: Array, beam_size: int = 4, alpha: float = 0.6,
                         max_decode_len: int = 64, **kwargs):
  """Reference beam search that recomputes the teacher-forced decoder over the prefix at every step."""
  return beam_search(params, config, inputs, beam_size, alpha, max_decode_len, cached=False, **kwargs)

