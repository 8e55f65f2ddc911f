"""Greedy, beam and sampled decoding over the KV-cached decoder (pure, jit-compiled).

Every search encodes the source once, then runs the whole decoding as one `lax.while_loop` inside one jitted
function: no Python work per token. `config`, `beam_size`, `alpha`, `max_decode_len` (and the other
switches) are static; `params`, `inputs`, `max_lengths` and `rng` are traced.

Conventions (shared by every search here):

* `inputs` `[batch, src_len]` int32 source ids, padded with `config.pad_id`; the source should end with EOS,
  as in training (`ids + [EOS]`).
* Outputs `tokens` `[..., max_decode_len]` int32 exclude BOS; a finished hypothesis ends with EOS followed by
  pad (0). A hypothesis that reaches its maximum length without EOS is returned as it is (no EOS); beam search
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

Beam search: at every step the `beam_size` best one-token extensions of the live beams are taken; those that
end in EOS join the finished list (its `beam_size` best are kept) and the others are the new live beams (so an
EOS pick leaves its slot empty for one step; unlike tensor2tensor's variant, which keeps `beam_size` live beams
besides, this makes `beam_size=1` exactly greedy search). The encoder runs once per source, the cache is then
tiled to the beams, and only the self-attention K/V rows are gathered when beams are reordered (cross-attention
K/V are the same for every beam of a source). Early termination: a source stops (its results freeze) when no
live beam can beat its best finished hypothesis (`early_stop='best'`, the default, as tensor2tensor's
stop_early), or its worst kept one (`'all'`: the whole n-best list is then exact; `'none'` never stops early),
using `score(any completion) <= log_probs(live) / max(lp(len + 1), lp(max_len))` (log-probs only fall as a
hypothesis grows). The loop ends when every source has stopped or after `max_decode_len` tokens.

The `cached=False` variants recompute the full teacher-forced decoder over the prefix (padded to
`max_decode_len`) at every step: O(L^2) work instead of O(L); they are the reference for tests and the
baseline of the cached-vs-uncached benchmark.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.config import ModelConfig
from transformer_jax.model import Transformer

Array = jax.Array

NEG_INF = float("-inf")


def length_penalty(length, alpha: float):
  """GNMT length penalty `((5 + length) / 6) ** alpha`; `length` counts EOS (works on ints and arrays)."""
  if isinstance(length, (int, float)):
    return ((5.0 + length) / 6.0) ** alpha
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ----------------------------------------------------------------------------------------------------------
# Model plumbing: encode once, then one decoder step at a time (cached) or the full prefix (uncached)
# ----------------------------------------------------------------------------------------------------------

class _Stepper(NamedTuple):
  """How to get next-token logits. `state` is the KV cache (cached) or `()` (uncached)."""
  state: Any
  # (state, seqs [B, L] tokens so far, t, prev [B] last token) -> (logits [B, vocab] float32, state)
  step: Callable
  # (state, index [B]) -> state with its rows gathered (beams reordered)
  reorder: Callable


def _check_lengths(config: ModelConfig, inputs: Array, max_decode_len: int):
  if inputs.ndim != 2:
    raise ValueError(f"inputs must be [batch, src_len], got shape {inputs.shape}")
  if not 0 < max_decode_len <= config.max_len:
    raise ValueError(f"max_decode_len={max_decode_len} must be in [1, config.max_len={config.max_len}] "
                     "(the positional table covers config.max_len positions)")
  if inputs.shape[1] > config.max_len:
    raise ValueError(f"source length {inputs.shape[1]} exceeds config.max_len={config.max_len}")


def _is_cross_attention(path) -> bool:
  return any(getattr(k, "key", None) == "cross_attention" for k in path)


def _repeat_rows(x: Array, n: int) -> Array:
  """[b, ...] -> [b * n, ...], the n copies of each row adjacent (row i*n + j = beam j of item i)."""
  return x if n == 1 or x.ndim == 0 else jnp.repeat(x, n, axis=0)


def _make_stepper(model: Transformer, params, config: ModelConfig, inputs: Array, max_decode_len: int,
                  copies: int, cached: bool) -> _Stepper:
  """Encodes `inputs` [b, src] once and returns a stepper over b * copies decoder rows."""
  encoded = model.apply({"params": params}, inputs, method=Transformer.encode)
  batch = inputs.shape[0]

  if cached:
    # Create the cache on the un-tiled batch (cross-attention K/V projected once per source), then tile it.
    bos = jnp.full((batch, 1), config.bos_id, jnp.int32)
    _, variables = model.apply({"params": params}, encoded, inputs, bos, use_cache=True,
                               max_decode_len=max_decode_len, method=Transformer.decode, mutable=["cache"])
    cache = jax.tree_util.tree_map(lambda x: _repeat_rows(x, copies), variables["cache"])
    # The decoder reads only the cached cross-attention K/V and the source mask in decode mode.
    encoded_rows, inputs_rows = _repeat_rows(encoded, copies), _repeat_rows(inputs, copies)

    def step(cache, seqs, t, prev):
      del seqs, t
      logits, variables = model.apply({"params": params, "cache": cache}, encoded_rows, inputs_rows,
                                      prev[:, None], use_cache=True, method=Transformer.decode,
                                      mutable=["cache"])
      return logits[:, 0], variables["cache"]

    def reorder(cache, index):
      # Self-attention K/V follow their beam; cross-attention K/V are identical for every beam of a source
      # (reordering only happens within a source) and the scalar indices are shared: no copies for those.
      def gather(path, x):
        if x.ndim == 0 or _is_cross_attention(path):
          return x
        return jnp.take(x, index, axis=0)
      return jax.tree_util.tree_map_with_path(gather, cache)

    return _Stepper(cache, step, reorder)

  encoded_rows, inputs_rows = _repeat_rows(encoded, copies), _repeat_rows(inputs, copies)
  positions = jnp.arange(max_decode_len)[None, :]

  def step_uncached(state, seqs, t, prev):
    del prev
    # Teacher forcing on the prefix. Positions >= t hold a non-pad placeholder: the model masks *keys* by
    # `targets != pad`, and position t's key (input y_t) is flagged by targets[t]; the causal mask hides
    # everything after t, so the placeholder's value never matters.
    targets = jnp.where(positions < t, seqs, config.eos_id)
    logits = model.apply({"params": params}, encoded_rows, inputs_rows, targets, method=Transformer.decode)
    return lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), state

  return _Stepper((), step_uncached, lambda state, index: state)


def _log_probs(logits: Array, config: ModelConfig) -> Array:
  """log-softmax in float32, with pad and BOS made impossible (not renormalised)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  banned = jnp.zeros((logits.shape[-1],), bool).at[config.pad_id].set(True).at[config.bos_id].set(True)
  return jnp.where(banned, NEG_INF, logp)


def _row_limits(max_lengths: Optional[Array], batch: int, max_decode_len: int) -> Array:
  if max_lengths is None:
    return jnp.full((batch,), max_decode_len, jnp.int32)
  return jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_decode_len)


def _prev_tokens(seqs: Array, t: Array, bos_id: int) -> Array:
  """seqs [B, L] -> the token emitted at step t - 1 (BOS at t = 0): [B]."""
  last = lax.dynamic_index_in_dim(seqs, jnp.maximum(t - 1, 0), axis=1, keepdims=False)
  return jnp.where(t > 0, last, bos_id)


# ----------------------------------------------------------------------------------------------------------
# One hypothesis per source: greedy search and sampling
# ----------------------------------------------------------------------------------------------------------

class _SeqState(NamedTuple):
  t: Array  # scalar int32: tokens emitted so far
  tokens: Array  # [b, L]
  log_probs: Array  # [b]
  done: Array  # [b]
  state: Any


def _sequential_search(params, config: ModelConfig, inputs: Array, max_decode_len: int,
                       choose: Callable[[Array, Array], Array], cached: bool,
                       max_lengths: Optional[Array]):
  """Shared loop of greedy search and sampling; `choose(log_probs [b, V], t) -> tokens [b]`."""
  _check_lengths(config, inputs, max_decode_len)
  params = nn.unbox(params)
  model = Transformer(config)
  batch, length = inputs.shape[0], max_decode_len
  limits = _row_limits(max_lengths, batch, length)
  stepper = _make_stepper(model, params, config, inputs, length, 1, cached)

  def cond(s: _SeqState):
    return jnp.logical_and(s.t < length, jnp.logical_not(jnp.all(s.done)))

  def body(s: _SeqState):
    prev = _prev_tokens(s.tokens, s.t, config.bos_id)
    logits, state = stepper.step(s.state, s.tokens, s.t, prev)
    logp = _log_probs(logits, config)
    token = jnp.where(s.done, config.pad_id, choose(logp, s.t)).astype(jnp.int32)
    token_logp = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
    log_probs = jnp.where(s.done, s.log_probs, s.log_probs + token_logp)
    tokens = lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.t))
    done = s.done | (token == config.eos_id) | (s.t + 1 >= limits)
    return _SeqState(s.t + 1, tokens, log_probs, done, state)

  init = _SeqState(jnp.array(0, jnp.int32), jnp.full((batch, length), config.pad_id, jnp.int32),
                   jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), bool), stepper.state)
  final = lax.while_loop(cond, body, init)
  return final.tokens, final.log_probs


@functools.partial(jax.jit, static_argnames=("config", "max_decode_len", "cached"))
def greedy_search(params, config: ModelConfig, inputs: Array, max_decode_len: int, *,
                  max_lengths: Optional[Array] = None, cached: bool = True):
  """Greedy decoding: `(tokens [batch, max_decode_len] int32, log_probs [batch] float32)`.

  `tokens` exclude BOS and end with EOS then pad; `log_probs` sums the emitted tokens' log-probabilities,
  EOS included. See the module docstring for the conventions.
  """
  return _sequential_search(params, config, inputs, max_decode_len,
                            lambda logp, t: jnp.argmax(logp, axis=-1), cached, max_lengths)


def greedy_search_uncached(params, config: ModelConfig, inputs: Array, max_decode_len: int, *,
                           max_lengths: Optional[Array] = None):
  """Reference greedy search that recomputes the teacher-forced decoder over the prefix at every step."""
  return greedy_search(params, config, inputs, max_decode_len, max_lengths=max_lengths, cached=False)


@functools.partial(jax.jit, static_argnames=("config", "max_decode_len", "temperature", "top_k", "cached"))
def sample(params, config: ModelConfig, inputs: Array, rng: Array, max_decode_len: int,
           temperature: float = 1.0, top_k: int = 0, *, max_lengths: Optional[Array] = None,
           cached: bool = True):
  """Ancestral sampling from `softmax(logits / temperature)`, restricted to the `top_k` best tokens if > 0.

  Returns `(tokens [batch, max_decode_len], log_probs [batch])`; `log_probs` are the *model's* log-probs of
  the sampled tokens (untempered, untruncated). `top_k=1` is greedy search. Step t uses
  `jax.random.fold_in(rng, t)`.
  """
  if temperature <= 0.0:
    raise ValueError(f"temperature={temperature} must be > 0 (use greedy_search or top_k=1 for argmax)")
  if top_k < 0:
    raise ValueError(f"top_k={top_k} must be >= 0")

  def choose(logp, t):
    scaled = logp / temperature  # = logits / T up to a per-row constant; banned tokens stay -inf
    if top_k > 0:
      kth = lax.top_k(scaled, min(top_k, scaled.shape[-1]))[0][:, -1:]
      scaled = jnp.where(scaled < kth, NEG_INF, scaled)
    return jax.random.categorical(jax.random.fold_in(rng, t), scaled, axis=-1)

  return _sequential_search(params, config, inputs, max_decode_len, choose, cached, max_lengths)


# ----------------------------------------------------------------------------------------------------------
# Beam search
# ----------------------------------------------------------------------------------------------------------

class _BeamState(NamedTuple):
  t: Array  # scalar int32: tokens emitted so far by every live beam
  alive_seqs: Array  # [b, k, L]
  alive_log_probs: Array  # [b, k]; -inf = empty slot
  fin_seqs: Array  # [b, k, L], best first
  fin_scores: Array  # [b, k]; -inf = empty slot
  fin_log_probs: Array  # [b, k]
  done: Array  # [b]
  state: Any  # the decoder cache, rows b * k


class BeamSearchOutput(NamedTuple):
  """What `beam_search(..., full_output=True)` returns."""
  tokens: Array  # [batch, beam, max_decode_len] int32, best first
  scores: Array  # [batch, beam] float32: log_probs / lp(|Y|); -inf for empty slots
  log_probs: Array  # [batch, beam] float32: sum of token log-probs (EOS included)
  steps: Array  # scalar int32: decoder steps run (< max_decode_len when every source stopped early)


def _gather_beams(x: Array, index: Array) -> Array:
  """x [b, n, ...], index [b, m] -> [b, m, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _beam_search(params, config: ModelConfig, inputs: Array, beam_size: int, alpha: float,
                 max_decode_len: int, max_lengths: Optional[Array], cached: bool,
                 early_stop: str) -> BeamSearchOutput:
  _check_lengths(config, inputs, max_decode_len)
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1")
  if early_stop not in ("best", "all", "none"):
    raise ValueError(f"early_stop={early_stop!r}; expected 'best', 'all' or 'none'")
  params = nn.unbox(params)
  model = Transformer(config)
  batch, k, length, vocab = inputs.shape[0], beam_size, max_decode_len, config.vocab_size
  limits = _row_limits(max_lengths, batch, length)
  stepper = _make_stepper(model, params, config, inputs, length, k, cached)
  # Best possible score of a live beam's completion: log_probs / max over the remaining lengths of lp.
  lp_at_limit = length_penalty(limits, alpha)  # [b]
  # Flat row of (item, beam) in the stepper's batch.
  row_base = (jnp.arange(batch, dtype=jnp.int32) * k)[:, None]

  def cond(s: _BeamState):
    return jnp.logical_and(s.t < length, jnp.logical_not(jnp.all(s.done)))

  def body(s: _BeamState):
    t = s.t
    flat_seqs = s.alive_seqs.reshape(batch * k, length)
    logits, state = stepper.step(s.state, flat_seqs, t, _prev_tokens(flat_seqs, t, config.bos_id))
    logp = _log_probs(logits, config).reshape(batch, k, vocab)
    candidates = (s.alive_log_probs[:, :, None] + logp).reshape(batch, k * vocab)
    top_log_probs, top_index = lax.top_k(candidates, k)  # [b, k]
    parent, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
    seqs = _gather_beams(s.alive_seqs, parent)
    seqs = lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, t))
    is_eos = token == config.eos_id
    new_len = t + 1

    # Extensions ending in EOS join the finished list; the rest stay live (an EOS slot is empty this step).
    eos_scores = jnp.where(is_eos, top_log_probs / length_penalty(new_len, alpha), NEG_INF)
    merged_scores = jnp.concatenate([s.fin_scores, eos_scores], axis=1)
    fin_scores, fin_index = lax.top_k(merged_scores, k)
    fin_seqs = _gather_beams(jnp.concatenate([s.fin_seqs, seqs], axis=1), fin_index)
    fin_log_probs = _gather_beams(
        jnp.concatenate([s.fin_log_probs, jnp.where(is_eos, top_log_probs, NEG_INF)], axis=1), fin_index)
    alive_log_probs = jnp.where(is_eos, NEG_INF, top_log_probs)

    # Sources that had stopped keep their results.
    keep = s.done
    fin_scores = jnp.where(keep[:, None], s.fin_scores, fin_scores)
    fin_log_probs = jnp.where(keep[:, None], s.fin_log_probs, fin_log_probs)
    fin_seqs = jnp.where(keep[:, None, None], s.fin_seqs, fin_seqs)
    alive_seqs = jnp.where(keep[:, None, None], s.alive_seqs, seqs)
    alive_log_probs = jnp.where(keep[:, None], s.alive_log_probs, alive_log_probs)

    state = stepper.reorder(state, (row_base + parent).reshape(-1))

    # Stop a source once no live beam can beat its best (or worst kept) finished hypothesis.
    best_alive = jnp.max(alive_log_probs, axis=1)
    bound = best_alive / jnp.maximum(length_penalty(new_len + 1, alpha), lp_at_limit)
    done = keep | (new_len >= limits)
    if early_stop != "none":
      reference = fin_scores[:, 0] if early_stop == "best" else fin_scores[:, -1]
      done = done | (reference >= bound)
    return _BeamState(new_len, alive_seqs, alive_log_probs, fin_seqs, fin_scores, fin_log_probs, done, state)

  # Only beam 0 is live at the start (all beams would be identical).
  alive_log_probs = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF)
  init = _BeamState(
      t=jnp.array(0, jnp.int32),
      alive_seqs=jnp.full((batch, k, length), config.pad_id, jnp.int32),
      alive_log_probs=jnp.broadcast_to(alive_log_probs, (batch, k)).astype(jnp.float32),
      fin_seqs=jnp.full((batch, k, length), config.pad_id, jnp.int32),
      fin_scores=jnp.full((batch, k), NEG_INF, jnp.float32),
      fin_log_probs=jnp.full((batch, k), NEG_INF, jnp.float32),
      done=jnp.zeros((batch,), bool),
      state=stepper.state)
  s = lax.while_loop(cond, body, init)

  # Fill the slots no finished hypothesis took with live (unfinished) ones, ranked after every finished one.
  alive_len = jnp.sum(s.alive_seqs != config.pad_id, axis=-1)
  alive_scores = jnp.where(s.alive_log_probs > NEG_INF,
                           s.alive_log_probs / length_penalty(jnp.maximum(alive_len, 1), alpha), NEG_INF)
  scores = jnp.concatenate([s.fin_scores, alive_scores], axis=1)
  unfinished = jnp.concatenate([jnp.zeros((batch, k), bool), jnp.ones((batch, k), bool)], axis=1)
  unfinished = unfinished | (scores == NEG_INF)
  order = jnp.lexsort((-scores, unfinished), axis=-1)[:, :k]
  scores = jnp.take_along_axis(scores, order, axis=1)
  log_probs = jnp.take_along_axis(
      jnp.concatenate([s.fin_log_probs, s.alive_log_probs], axis=1), order, axis=1)
  tokens = _gather_beams(jnp.concatenate([s.fin_seqs, s.alive_seqs], axis=1), order)
  tokens = jnp.where((scores > NEG_INF)[:, :, None], tokens, config.pad_id)
  return BeamSearchOutput(tokens, scores, log_probs, s.t)


@functools.partial(jax.jit, static_argnames=("config", "beam_size", "alpha", "max_decode_len", "cached",
                                             "early_stop", "full_output"))
def beam_search(params, config: ModelConfig, inputs: Array, beam_size: int = 4, alpha: float = 0.6,
                max_decode_len: int = 64, *, max_lengths: Optional[Array] = None, cached: bool = True,
                early_stop: str = "best", full_output: bool = False):
  """Beam search with the GNMT length penalty.

  Returns `(tokens [batch, beam, max_decode_len], scores [batch, beam])`, best first; with `full_output`, a
  `BeamSearchOutput` that adds `log_probs [batch, beam]` (the raw sum of token log-probs, EOS included) and
  `steps` (decoder steps run). `scores = log_probs / ((5 + |Y|) / 6) ** alpha` with `|Y|` the number of
  emitted tokens INCLUDING EOS (excluding BOS). Slots without any hypothesis have score -inf and pad tokens.
  `early_stop`: 'best' (default), 'all' or 'none', see the module docstring.
  """
  out = _beam_search(params, config, inputs, beam_size, alpha, max_decode_len, max_lengths, cached,
                     early_stop)
  return out if full_output else (out.tokens, out.scores)


def beam_search_uncached(params, config: ModelConfig, inputs: Array, beam_size: int = 4, alpha: float = 0.6,
                         max_decode_len: int = 64, **kwargs):
  """Reference beam search that recomputes the teacher-forced decoder over the prefix at every step."""
  return beam_search(params, config, inputs, beam_size, alpha, max_decode_len, cached=False, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Scoring a given target (teacher forcing): an independent check of the searches
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config",))
def sequence_log_probs(params, config: ModelConfig, inputs: Array, targets: Array) -> Array:
  """Sum of the model's log-probs of `targets` [batch, tgt_len] (pad after EOS ignored), teacher forced."""
  logits = Transformer(config).apply({"params": nn.unbox(params)}, inputs, targets)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  token_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(targets != config.pad_id, token_logp, 0.0), axis=-1)
