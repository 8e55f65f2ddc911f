"""Greedy, beam and sampled decoding over any step function: model-agnostic, pure, one `lax.while_loop`.

As in flax `examples/wmt/decode.py` and t5x `decoding.py`, the searches (`greedy_search_over`, `sample_over`,
`beam_search_over`) know nothing about the model. They call
`tokens_to_logits(DecodingState(cur_index, sequences, cur_token, cache))`, which returns next-token logits
`[rows, vocab]` and the new cache, and run the whole decoding as one `lax.while_loop`: no Python work per token.
Beam search reorders the cache with `gather_cache(cache, parent)` (default: `gather_beams`, every non-scalar
leaf). The Transformer's step function is `transformer_jax.decoding.step`.

Conventions (shared by every search here):

* `inputs` `[batch, src_len]` int32 source ids, padded with `config.pad_id`; the source should end with EOS,
  as in training (`ids + [EOS]`).
* Outputs `tokens` `[..., max_decode_len]` int32 exclude BOS; a finished hypothesis ends with EOS followed by
  pad. A hypothesis that reaches its maximum length without EOS is returned as it is (no EOS); beam search
  ranks such "unfinished" hypotheses after every finished one (it only returns them where fewer than
  `beam_size` hypotheses finished).
* Decoding never emits pad or BOS: their log-probabilities are set to -inf *after* the log-softmax, so the
  log-probabilities that are summed are the model's own (nothing is renormalised).
* `log_probs` is the sum of the model's log-probabilities of every emitted token, EOS included.
* Length penalty (GNMT, Wu et al. 2016, used by the paper with alpha = 0.6): `lp(Y) = ((5 + |Y|) / 6)^alpha`,
  where `|Y|` counts the emitted tokens INCLUDING the final EOS (not BOS); `score = log_probs / lp(Y)`.
* `max_decode_len` (static) is the length of the output buffers and of the self-attention cache (the paper:
  source length + 50); the optional `max_lengths` `[batch]` (traced, each <= max_decode_len) caps each row's
  output length (EOS included), so sources of mixed lengths can share one compiled shape.
* Rows: a search over `batch` sources with `n` hypotheses each (`n` = beam_size for beam search, else 1) calls
  the step function on `batch * n` rows, the `n` rows of source i adjacent (row `i * n + j`); the initial
  cache has those rows already (`repeat_rows` tiles a per-source cache).

Beam search: at every step the `beam_size` best one-token extensions of the live beams are taken; those that
end in EOS join the finished list (its `beam_size` best are kept) and the others are the new live beams (so an
EOS pick leaves its slot empty for one step; unlike tensor2tensor's variant, which keeps `beam_size` live beams
besides, this makes `beam_size=1` exactly greedy search). Early termination: a source stops (its results
freeze) when no live beam can beat its best finished hypothesis and `nbest` have finished (`early_stop='best'`,
the default; with `nbest=1` tensor2tensor's stop_early; with `nbest=n` the search goes on until n have finished,
as fairseq and CTranslate2 return n: the best is exact, the others the best the beam found), or when none can
beat its worst kept one (`'all'`: the whole n-best list is then exact; `'none'` never stops early),
using `score(any completion) <= log_probs(live) / max(lp(len + 1), lp(max_len))`
(log-probs only fall as a hypothesis grows). The loop ends when every source has stopped or after
`max_decode_len` tokens.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.config import FLOAT32_MAX

Array = jax.Array

NEG_INF = float("-inf")


def length_penalty(length, alpha: float):
  """GNMT length penalty `((5 + length) / 6) ** alpha`; `length` counts EOS (works on ints and arrays)."""
  if isinstance(length, (int, float)):
    return ((5.0 + length) / 6.0) ** alpha
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ----------------------------------------------------------------------------------------------------------
# The step-function interface (model-agnostic; t5x `decoding.DecodingState`)
# ----------------------------------------------------------------------------------------------------------

class DecodingState(NamedTuple):
  """What a search hands to `tokens_to_logits` at every step.

  `cur_index`: scalar int32, tokens emitted so far (= the output position being predicted).
  `sequences`: `[rows, max_decode_len]` int32, the tokens emitted so far (BOS excluded), pad after.
  `cur_token`: `[rows]` int32, the last emitted token (BOS at step 0): the cached decoder's input.
  `cache`: the model's decoding state, as the previous call returned it (rows first in every non-scalar leaf).
  """
  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any


# (DecodingState) -> (logits [rows, vocab] float32, new cache)
TokensToLogits = Callable[[DecodingState], "tuple[Array, Any]"]
# (log_probs [rows, vocab] float32, DecodingState) -> log_probs [rows, vocab]: applied after the log-softmax,
# before the choice (forced prefixes: `decoding.prefix`); -inf makes a token impossible, and the
# log-probabilities that are summed are the ones it returns (nothing is renormalised).
LogProbsFn = Callable[[Array, DecodingState], Array]


def repeat_rows(tree, n: int):
  """Every non-scalar leaf `[b, ...]` -> `[b * n, ...]`, the n copies of each row adjacent (row i*n + j)."""
  if n == 1:
    return tree
  return jax.tree_util.tree_map(lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(x, n, axis=0), tree)


def gather_beams(tree, parent: Array):
  """The default beam reorder (t5x `cache_gather_beams`): row `i * k + j` of every non-scalar leaf
  `[batch * k, ...]` becomes the old row `i * k + parent[i, j]`; `parent` `[batch, k]` int32 in [0, k)."""
  batch, k = parent.shape
  index = (jnp.arange(batch, dtype=jnp.int32)[:, None] * k + parent).reshape(-1)  # [batch * k]
  return jax.tree_util.tree_map(
      lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, index, axis=0, mode="clip"), tree)


def _log_probs(logits: Array, banned_ids: tuple) -> Array:
  """log-softmax in float32, with `banned_ids` (pad, BOS) made impossible (not renormalised)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  banned = jnp.zeros((logits.shape[-1],), bool)
  for token in banned_ids:
    banned = banned.at[token].set(True)
  return jnp.where(banned, NEG_INF, logp)


def _row_limits(max_lengths: Optional[Array], batch: int, max_decode_len: int) -> Array:
  if max_lengths is None:
    return jnp.full((batch,), max_decode_len, jnp.int32)
  return jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_decode_len)


def _prev_tokens(seqs: Array, t: Array, bos_id: int) -> Array:
  """seqs [B, L] -> the token emitted at step t - 1 (BOS at t = 0): [B]."""
  last = lax.dynamic_index_in_dim(seqs, jnp.maximum(t - 1, 0), axis=1, keepdims=False)
  return jnp.where(t > 0, last, bos_id)


def _check_ids(bos_id: int, eos_id: int, pad_id: int):
  """EOS must differ from BOS and pad; BOS may equal pad (Marian starts decoding from `<pad>`)."""
  if eos_id in (bos_id, pad_id):
    raise ValueError(f"eos_id={eos_id} must differ from bos_id={bos_id} and pad_id={pad_id}")


# ----------------------------------------------------------------------------------------------------------
# One hypothesis per source: greedy search and sampling
# ----------------------------------------------------------------------------------------------------------

class _SeqState(NamedTuple):
  t: Array  # scalar int32: tokens emitted so far
  tokens: Array  # [b, L]
  log_probs: Array  # [b]
  token_log_probs: Any  # [b, L] float32: the log-prob of each emitted token, 0 after the last; () untracked
  done: Array  # [b]
  cache: Any


class SequenceOutput(NamedTuple):
  """What the one-hypothesis searches return with `full_output=True`."""
  tokens: Array  # [batch, max_decode_len] int32
  log_probs: Array  # [batch] float32: sum of the token log-probs (EOS included)
  token_log_probs: Optional[Array]  # [batch, max_decode_len] float32: each token's log-prob, 0 after the last


def _sequential_search(tokens_to_logits: TokensToLogits, cache, choose: Callable[[Array, Array], Array], *,
                       batch_size: int, max_decode_len: int, bos_id: int, eos_id: int, pad_id: int,
                       max_lengths: Optional[Array], log_probs_fn: Optional[LogProbsFn] = None,
                       per_token: bool = True) -> SequenceOutput:
  """Shared loop of greedy search and sampling; `choose(log_probs [b, V], t) -> tokens [b]`. Without
  `per_token` (static) the loop carries no per-token buffer and `token_log_probs` is None."""
  _check_ids(bos_id, eos_id, pad_id)
  batch, length = batch_size, max_decode_len
  limits = _row_limits(max_lengths, batch, length)

  def cond(s: _SeqState):
    return jnp.logical_and(s.t < length, jnp.logical_not(jnp.all(s.done)))

  def body(s: _SeqState):
    state = DecodingState(s.t, s.tokens, _prev_tokens(s.tokens, s.t, bos_id), s.cache)
    logits, cache = tokens_to_logits(state)  # [b, V]
    logp = _log_probs(logits, (pad_id, bos_id))
    if log_probs_fn is not None:
      logp = log_probs_fn(logp, state)
    token = jnp.where(s.done, pad_id, choose(logp, s.t)).astype(jnp.int32)
    token_logp = jnp.where(s.done, 0.0, jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0])
    log_probs = s.log_probs + token_logp
    tokens = lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.t))
    token_log_probs = (lax.dynamic_update_slice(s.token_log_probs, token_logp[:, None], (0, s.t))
                       if per_token else ())
    done = s.done | (token == eos_id) | (s.t + 1 >= limits)
    return _SeqState(s.t + 1, tokens, log_probs, token_log_probs, done, cache)

  init = _SeqState(jnp.array(0, jnp.int32), jnp.full((batch, length), pad_id, jnp.int32),
                   jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, length), jnp.float32) if per_token else (),
                   jnp.zeros((batch,), bool), cache)
  final = lax.while_loop(cond, body, init)
  return SequenceOutput(final.tokens, final.log_probs, final.token_log_probs if per_token else None)


def greedy_search_over(tokens_to_logits: TokensToLogits, cache, *, batch_size: int, max_decode_len: int,
                       bos_id: int, eos_id: int, pad_id: int, max_lengths: Optional[Array] = None,
                       log_probs_fn: Optional[LogProbsFn] = None, full_output: bool = False):
  """Greedy decoding over any step function: `(tokens [batch, max_decode_len] int32, log_probs [batch] f32)`.

  Args:
    tokens_to_logits: `(DecodingState) -> (logits [batch, vocab], new cache)`, see `DecodingState`.
    cache: the step function's initial cache, `batch_size` rows.
    batch_size, max_decode_len: static sizes of the outputs.
    bos_id, eos_id, pad_id: the first input token, the token that ends a row, the filler after it (pad and BOS
      are never emitted).
    max_lengths: optional `[batch]` int32 caps on each row's output length (EOS included).
    log_probs_fn: optional `LogProbsFn` applied to each step's log-probs before the choice.
    full_output: return a `SequenceOutput` (adds the per-token log-probs `[batch, max_decode_len]`).

  Raises ValueError if the three ids are not distinct. Trace it under `jax.jit`.
  """
  out = _sequential_search(tokens_to_logits, cache, lambda logp, t: jnp.argmax(logp, axis=-1),
                           batch_size=batch_size, max_decode_len=max_decode_len, bos_id=bos_id,
                           eos_id=eos_id, pad_id=pad_id, max_lengths=max_lengths, log_probs_fn=log_probs_fn,
                           per_token=full_output)
  return out if full_output else (out.tokens, out.log_probs)


def truncate(scaled: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
  """Top-k, then nucleus (top-p, Holtzman et al., 2020) truncation of log-weights `[rows, vocab]`: the tokens
  outside the k largest, or outside the smallest set whose probability reaches `top_p` (the most probable
  token is always kept), become -inf. `top_k=0` and `top_p >= 1` (static) leave `scaled` as it is."""
  if top_k > 0:
    kth = lax.top_k(scaled, min(top_k, scaled.shape[-1]))[0][:, -1:]
    scaled = jnp.where(scaled < kth, NEG_INF, scaled)
  if top_p < 1.0:
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each one
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    smallest = jnp.min(kept, axis=-1, keepdims=True)  # the least probable kept token (rank 0 always kept)
    scaled = jnp.where(scaled < smallest, NEG_INF, scaled)
  return scaled


def tempered(log_probs: Array, temperature: float) -> Array:
  """`(log_probs - max) / temperature` `[rows, vocab]` (= logits / T up to a per-row constant), -inf kept: the
  most probable token stays at 0, so a tiny T (float32 underflow: every other token -inf) is argmax and a huge
  T is uniform over the possible tokens, never a row of -inf or NaN from which nothing can be drawn."""
  top = jnp.max(log_probs, axis=-1, keepdims=True)
  return jnp.where(log_probs > NEG_INF, (log_probs - top) / temperature, NEG_INF)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Raises ValueError for a `temperature` that is not a finite float32 > 0, `top_k < 0` or `top_p` outside
  (0, 1]: the one check of sampling's ranges (`sample_over` and `generate.DecodeOptions.check` call it)."""
  if not 0.0 < temperature <= FLOAT32_MAX:
    raise ValueError(f"temperature={temperature} must be a finite number > 0 (use greedy search or top_k=1 for "
                     "argmax)")
  if top_k < 0:
    raise ValueError(f"top_k={top_k} must be >= 0")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")


def sample_over(tokens_to_logits: TokensToLogits, cache, rng: Array, *, batch_size: int, max_decode_len: int,
                bos_id: int, eos_id: int, pad_id: int, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, max_lengths: Optional[Array] = None,
                log_probs_fn: Optional[LogProbsFn] = None, full_output: bool = False):
  """Ancestral sampling over any step function from `softmax(logits / temperature)`, truncated by `truncate`
  (top-k if > 0, then nucleus if `top_p` < 1).

  Same arguments and outputs as `greedy_search_over`, plus `rng`: one key (step t uses
  `jax.random.fold_in(rng, t)`) or one key per row `[batch, 2]` (row r at step t uses `fold_in(rng[r], t)`, so
  a row's sample does not depend on the other rows: the same outputs whatever the batching). `log_probs` are
  the *model's* log-probs of the sampled tokens (untempered, untruncated); `top_k=1` is greedy search, as is
  `top_p` -> 0. Raises ValueError for a `temperature` that is not finite and > 0, `top_k < 0` or `top_p` outside
  (0, 1].
  """
  check_sampling(temperature, top_k, top_p)
  per_row = jnp.ndim(rng) == 2

  def choose(logp, t):
    scaled = truncate(tempered(logp, temperature), top_k, top_p)
    if per_row:
      draw = lambda key, row: jax.random.categorical(jax.random.fold_in(key, t), row)  # noqa: E731
      return jax.vmap(draw)(rng, scaled)
    return jax.random.categorical(jax.random.fold_in(rng, t), scaled, axis=-1)

  out = _sequential_search(tokens_to_logits, cache, choose, batch_size=batch_size,
                           max_decode_len=max_decode_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                           max_lengths=max_lengths, log_probs_fn=log_probs_fn, per_token=full_output)
  return out if full_output else (out.tokens, out.log_probs)


# ----------------------------------------------------------------------------------------------------------
# Beam search
# ----------------------------------------------------------------------------------------------------------

class _BeamState(NamedTuple):
  t: Array  # scalar int32: tokens emitted so far by every live beam
  alive_seqs: Array  # [b, k, L]
  alive_log_probs: Array  # [b, k]; -inf = empty slot
  alive_token_log_probs: Any  # [b, k, L]: each emitted token's log-prob, 0 after the last; () untracked
  fin_seqs: Array  # [b, k, L], best first
  fin_scores: Array  # [b, k]; -inf = empty slot
  fin_log_probs: Array  # [b, k]
  fin_token_log_probs: Any  # [b, k, L]; () untracked
  done: Array  # [b]
  cache: Any  # the step function's cache, rows b * k
  selection: Any = ()  # a `BeamSelector`'s state (rows [b, k] first), () without one


class BeamSelector(Protocol):
  """Replaces beam search's plain top-k choice of the next beams (lexical constraints: `constraints.py`).

  `init(batch, beam_size)` returns the selector's state (leaves `[batch, beam_size, ...]`); `select(alive_log_probs
  [b, k], log_probs [b, k, vocab], state)` returns `(log_probs [b, k], parent [b, k], token [b, k], new state)`
  of the chosen one-token extensions (-inf log-probs for empty slots), the state following its beams;
  `complete(state)` says which live beams may end, so that unfinished results rank those first.
  """

  def init(self, batch: int, beam_size: int) -> Any: ...

  def select(self, alive_log_probs: Array, log_probs: Array, state: Any) -> "tuple[Array, Array, Array, Any]": ...

  def complete(self, state: Any) -> Array:
    """`[batch, beam_size]` bool: live beams that may end (unfinished ones that may not rank after the rest)."""


class BeamSearchOutput(NamedTuple):
  """What `beam_search(..., full_output=True)` and `beam_search_over` return."""
  tokens: Array  # [batch, beam, max_decode_len] int32, best first
  scores: Array  # [batch, beam] float32: log_probs / lp(|Y|); -inf for empty slots
  log_probs: Array  # [batch, beam] float32: sum of token log-probs (EOS included)
  steps: Array  # scalar int32: decoder steps run (< max_decode_len when every source stopped early)
  token_log_probs: Optional[Array]  # [batch, beam, max_decode_len] f32: each token's log-prob (None untracked)


def _gather_beams(x: Array, index: Array) -> Array:
  """x [b, n, ...], index [b, m] -> [b, m, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def check_beam_options(beam_size: int, early_stop: str):
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1")
  if early_stop not in ("best", "all", "none"):
    raise ValueError(f"early_stop={early_stop!r}; expected 'best', 'all' or 'none'")


def _beam_init(batch: int, k: int, length: int, pad_id: int, cache, per_token: bool) -> _BeamState:
  alive_log_probs = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF)  # only beam 0 is live at the start
  per_token_zeros = jnp.zeros((batch, k, length), jnp.float32) if per_token else ()
  return _BeamState(
      t=jnp.array(0, jnp.int32),
      alive_seqs=jnp.full((batch, k, length), pad_id, jnp.int32),
      alive_log_probs=jnp.broadcast_to(alive_log_probs, (batch, k)).astype(jnp.float32),
      alive_token_log_probs=per_token_zeros,
      fin_seqs=jnp.full((batch, k, length), pad_id, jnp.int32),
      fin_scores=jnp.full((batch, k), NEG_INF, jnp.float32),
      fin_log_probs=jnp.full((batch, k), NEG_INF, jnp.float32),
      fin_token_log_probs=per_token_zeros,
      done=jnp.zeros((batch,), bool),
      cache=cache)


def _beam_finalize(s: _BeamState, alpha: float, pad_id: int, alive_ok: Optional[Array] = None) -> BeamSearchOutput:
  """Fills the slots no finished hypothesis took with live (unfinished) ones, ranked after every finished one
  (and, with `alive_ok` [b, k], those that are not ok after those that are)."""
  batch, k = s.fin_scores.shape
  alive_len = jnp.sum(s.alive_seqs != pad_id, axis=-1)
  alive_scores = jnp.where(s.alive_log_probs > NEG_INF,
                           s.alive_log_probs / length_penalty(jnp.maximum(alive_len, 1), alpha), NEG_INF)
  scores = jnp.concatenate([s.fin_scores, alive_scores], axis=1)  # [b, 2k]
  unfinished = jnp.concatenate([jnp.zeros((batch, k), bool), jnp.ones((batch, k), bool)], axis=1)
  unfinished = unfinished | (scores == NEG_INF)
  if alive_ok is not None:  # 0 finished, 1 unfinished and ok, 2 unfinished, 3 empty
    not_ok = jnp.concatenate([jnp.zeros((batch, k), bool), ~alive_ok], axis=1)
    unfinished = jnp.where(scores == NEG_INF, 3, unfinished.astype(jnp.int32) + not_ok)
  order = jnp.lexsort((-scores, unfinished), axis=-1)[:, :k]
  scores = jnp.take_along_axis(scores, order, axis=1)
  log_probs = jnp.take_along_axis(
      jnp.concatenate([s.fin_log_probs, s.alive_log_probs], axis=1), order, axis=1)
  tokens = _gather_beams(jnp.concatenate([s.fin_seqs, s.alive_seqs], axis=1), order)
  tokens = jnp.where((scores > NEG_INF)[:, :, None], tokens, pad_id)
  token_log_probs = None
  if not isinstance(s.alive_token_log_probs, tuple):  # tracked
    token_log_probs = _gather_beams(
        jnp.concatenate([s.fin_token_log_probs, s.alive_token_log_probs], axis=1), order)
    token_log_probs = jnp.where((scores > NEG_INF)[:, :, None], token_log_probs, 0.0)
  return BeamSearchOutput(tokens, scores, log_probs, s.t, token_log_probs)


def _extend_beams(s: _BeamState, seqs: Array, token: Array, top_log_probs: Array, alpha: float,
                  eos_id: int, token_logps: Array) -> _BeamState:
  """One step's `beam_size` best extensions (`seqs` [b, k, L] ending in `token` [b, k], with their log-probs
  [b, k] and per-token log-probs `token_logps` [b, k, L], or () untracked): those ending in EOS join the
  finished list, the rest are the live beams (an EOS slot is empty for this step). Sources that had stopped
  keep their results. `t` advances; `cache` is left to the caller."""
  k = token.shape[1]
  is_eos = token == eos_id
  new_len = s.t + 1
  eos_scores = jnp.where(is_eos, top_log_probs / length_penalty(new_len, alpha), NEG_INF)
  fin_scores, fin_index = lax.top_k(jnp.concatenate([s.fin_scores, eos_scores], axis=1), k)
  fin_seqs = _gather_beams(jnp.concatenate([s.fin_seqs, seqs], axis=1), fin_index)
  fin_log_probs = _gather_beams(
      jnp.concatenate([s.fin_log_probs, jnp.where(is_eos, top_log_probs, NEG_INF)], axis=1), fin_index)
  alive_log_probs = jnp.where(is_eos, NEG_INF, top_log_probs)
  keep = s.done
  alive_token_logps, fin_token_logps = (), ()
  if not isinstance(token_logps, tuple):  # tracked
    fin_token_logps = _gather_beams(jnp.concatenate([s.fin_token_log_probs, token_logps], axis=1), fin_index)
    fin_token_logps = jnp.where(keep[:, None, None], s.fin_token_log_probs, fin_token_logps)
    alive_token_logps = jnp.where(keep[:, None, None], s.alive_token_log_probs, token_logps)
  return _BeamState(
      t=new_len,
      alive_seqs=jnp.where(keep[:, None, None], s.alive_seqs, seqs),
      alive_log_probs=jnp.where(keep[:, None], s.alive_log_probs, alive_log_probs),
      alive_token_log_probs=alive_token_logps,
      fin_seqs=jnp.where(keep[:, None, None], s.fin_seqs, fin_seqs),
      fin_scores=jnp.where(keep[:, None], s.fin_scores, fin_scores),
      fin_log_probs=jnp.where(keep[:, None], s.fin_log_probs, fin_log_probs),
      fin_token_log_probs=fin_token_logps,
      done=keep, cache=s.cache)


def _append(rows: Array, parent: Array, values: Array, t: Array) -> Array:
  """rows [b, k, L] reordered by `parent` [b, k], then `values` [b, k] written at position t."""
  return lax.dynamic_update_slice(_gather_beams(rows, parent), values[:, :, None].astype(rows.dtype), (0, 0, t))


def _select(selector: Optional[BeamSelector], alive_log_probs: Array, logp: Array, selection):
  """The next beams `(log_probs, parent, token [b, k], selection)`: plain top-k over `alive + logp [b, k, V]`,
  or the selector's choice."""
  if selector is not None:
    return selector.select(alive_log_probs, logp, selection)
  batch, k, vocab = logp.shape
  candidates = (alive_log_probs[:, :, None] + logp).reshape(batch, k * vocab)
  top_log_probs, top_index = lax.top_k(candidates, k)  # [b, k]
  return top_log_probs, top_index // vocab, (top_index % vocab).astype(jnp.int32), selection


def beam_search_over(tokens_to_logits: TokensToLogits, cache, *, batch_size: int, beam_size: int,
                     alpha: float, max_decode_len: int, bos_id: int, eos_id: int, pad_id: int,
                     max_lengths: Optional[Array] = None, early_stop: str = "best",
                     gather_cache: Callable = gather_beams, log_probs_fn: Optional[LogProbsFn] = None,
                     selector: Optional[BeamSelector] = None, per_token: bool = False,
                     nbest: int = 1) -> BeamSearchOutput:
  """Beam search with the GNMT length penalty over any step function (flax wmt / t5x `beam_search`).

  Args:
    tokens_to_logits: `(DecodingState) -> (logits [batch * beam_size, vocab], new cache)`.
    cache: the initial cache with `batch * beam_size` rows (beam j of source i in row `i * beam_size + j`;
      `repeat_rows` tiles a per-source cache).
    batch_size, beam_size, max_decode_len: static sizes; alpha: the length-penalty exponent.
    bos_id, eos_id, pad_id: as in `greedy_search_over`.
    max_lengths: optional `[batch]` caps on each source's output length (EOS included).
    early_stop: 'best' (default), 'all' or 'none', see the module docstring.
    gather_cache: `(cache, parent [batch, beam_size]) -> cache` where row `i * beam_size + j` takes the old row
      `i * beam_size + parent[i, j]`; the default `gather_beams` reorders every non-scalar leaf.
    log_probs_fn: optional `LogProbsFn` applied to each step's log-probs `[batch * beam_size, vocab]`.
    selector: optional `BeamSelector` that chooses the next beams instead of the plain top-k.
    per_token: also track each token's log-prob (static; `BeamSearchOutput.token_log_probs`, else None):
      two more `[batch, beam_size, max_decode_len]` buffers reordered at every step.
    nbest: how many hypotheses the caller keeps (static, in [1, beam_size]): `early_stop='best'` stops a source
      only once `nbest` hypotheses have finished (and the best is exact), so n-best lists are `nbest` long
      wherever the length limit leaves room.

  Returns a `BeamSearchOutput`. Raises ValueError for `beam_size < 1`, `nbest` outside [1, beam_size], an
  unknown `early_stop` or equal ids.
  """
  _check_ids(bos_id, eos_id, pad_id)
  check_beam_options(beam_size, early_stop)
  if not 1 <= nbest <= beam_size:
    raise ValueError(f"nbest={nbest} must be in [1, beam_size={beam_size}]")
  batch, k, length = batch_size, beam_size, max_decode_len
  limits = _row_limits(max_lengths, batch, length)
  # Best possible score of a live beam's completion: log_probs / max over the remaining lengths of lp.
  lp_at_limit = length_penalty(limits, alpha)  # [b]

  def cond(s: _BeamState):
    return jnp.logical_and(s.t < length, jnp.logical_not(jnp.all(s.done)))

  def body(s: _BeamState):
    t = s.t
    flat_seqs = s.alive_seqs.reshape(batch * k, length)
    state = DecodingState(t, flat_seqs, _prev_tokens(flat_seqs, t, bos_id), s.cache)
    logits, cache = tokens_to_logits(state)
    logp = _log_probs(logits, (pad_id, bos_id))
    if log_probs_fn is not None:
      logp = log_probs_fn(logp, state)
    vocab = logp.shape[-1]
    top_log_probs, parent, token, selection = _select(selector, s.alive_log_probs, logp.reshape(batch, k, vocab),
                                                      s.selection)
    seqs = _append(s.alive_seqs, parent, token, t)
    token_logps = () if not per_token else _append(  # each chosen token's own log-prob, after its beam's
        s.alive_token_log_probs, parent,
        jnp.take_along_axis(logp.reshape(batch, k * vocab), parent * vocab + token, axis=1), t)
    s = _extend_beams(s, seqs, token, top_log_probs, alpha, eos_id, token_logps)._replace(
        cache=gather_cache(cache, parent), selection=selection)

    # Stop a source once no live beam can beat its best (or worst kept) finished hypothesis.
    best_alive = jnp.max(s.alive_log_probs, axis=1)
    bound = best_alive / jnp.maximum(length_penalty(s.t + 1, alpha), lp_at_limit)
    done = s.done | (s.t >= limits)
    if early_stop == "best":  # the best is exact, and `nbest` have finished (or nothing more can finish)
      enough = (s.fin_scores[:, nbest - 1] > NEG_INF) | (best_alive == NEG_INF)
      done = done | (enough & (s.fin_scores[:, 0] >= bound))
    elif early_stop == "all":
      done = done | (s.fin_scores[:, -1] >= bound)
    return s._replace(done=done)

  init = _beam_init(batch, k, length, pad_id, cache, per_token)._replace(
      selection=selector.init(batch, k) if selector else ())
  s = lax.while_loop(cond, body, init)
  return _beam_finalize(s, alpha, pad_id, None if selector is None else selector.complete(s.selection))

