"""Lexically constrained beam search with dynamic beam allocation (Post & Vilar, 2018, NAACL; sockeye).

Each source has target phrases that must appear in its output. Their tokens are laid end to end in
`tokens [batch, C]` (pad after), with `phrase_next [batch, C]` (True where the next position continues the
same phrase) and `phrase_start [batch, C]` (the position where each token's phrase starts). A hypothesis
tracks which constraint tokens it has met (`met [C]`) and the last one it met (`last`, -1 for none): while a
phrase is under way only its next token advances it (another token undoes the partial phrase); otherwise any
unmet phrase may start. EOS is impossible until every constraint is met.

At every step `DynamicBeamAllocation.select` (a `search.BeamSelector`, so any model's step function gets it)
collects candidates: the plain 2k best extensions, for every live beam each token that would advance one of its
constraints, and each beam's single best token; it drops duplicates, puts each candidate in the bank of its
number of met constraint tokens, and gives each bank `k // banks` slots (the rest to the bank that met the
most; slots a bank cannot fill pass to the bank below, as sockeye's `get_bank_sizes`), then fills any slot
left with the best remaining candidates. All of it has fixed shapes and runs
inside the compiled search. A hypothesis that reaches the length limit ends unfinished; among unfinished
results those that met every constraint rank first (as sockeye prefers them at the limit); one that could not
meet them is reported by `satisfied`, on the host.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.decoding import search

Array = jax.Array


class Constraints(NamedTuple):
  """Per source, its phrases' tokens end to end: all `[batch, C]`."""
  tokens: Array  # int32 token ids (anything where not `valid`)
  phrase_next: Array  # bool: the next position continues this token's phrase
  phrase_start: Array  # int32: the position where this token's phrase starts
  valid: Array  # bool


def pack(phrases: Sequence[Sequence[Sequence[int]]], width: int) -> Constraints:
  """Host-side: per source a list of phrases (token ids) -> `Constraints` (NumPy) of `width` positions.
  Raises ValueError when a source's phrases hold more than `width` tokens."""
  batch = len(phrases)
  tokens, phrase_next = np.zeros((batch, width), np.int32), np.zeros((batch, width), bool)
  phrase_start, valid = np.zeros((batch, width), np.int32), np.zeros((batch, width), bool)
  for b, source in enumerate(phrases):
    c = 0
    for phrase in source:
      if c + len(phrase) > width:
        raise ValueError(f"constraints of source {b + 1} hold more than {width} tokens")
      for i, token in enumerate(phrase):
        tokens[b, c + i], phrase_next[b, c + i] = token, i + 1 < len(phrase)
        phrase_start[b, c + i], valid[b, c + i] = c, True
      c += len(phrase)
  return Constraints(tokens, phrase_next, phrase_start, valid)


def _allowed(met: Array, last: Array, cons: Constraints) -> Array:
  """`[C]` bool: the constraint positions whose token would advance a hypothesis (one source's row)."""
  width = met.shape[0]
  position = jnp.arange(width)
  in_progress = (last >= 0) & cons.phrase_next[jnp.maximum(last, 0)]
  continuation = position == last + 1
  starts = cons.valid & ~met & (cons.phrase_start == position)
  return jnp.where(in_progress, continuation, starts)


def _advance(met: Array, last: Array, token: Array, cons: Constraints) -> "tuple[Array, Array]":
  """One hypothesis of one source emits `token`: its new `(met [C], last)` (sockeye's ConstrainedHypothesis)."""
  position = jnp.arange(met.shape[0])
  in_progress = (last >= 0) & cons.phrase_next[jnp.maximum(last, 0)]
  continues = in_progress & (cons.tokens[jnp.minimum(last + 1, met.shape[0] - 1)] == token)
  # A broken phrase is undone: its met positions up to `last` are unmet again.
  broken = in_progress & ~continues
  undo = broken & (cons.phrase_start == cons.phrase_start[jnp.maximum(last, 0)]) & (position <= last)
  met = met & ~undo
  starts = cons.valid & ~met & (cons.phrase_start == position) & (cons.tokens == token)
  first_start = jnp.argmax(starts)
  new_last = jnp.where(continues, last + 1, jnp.where(jnp.any(starts), first_start, -1))
  met = met | ((position == new_last) & (continues | jnp.any(starts)))
  return met, new_last.astype(jnp.int32)


class _State(NamedTuple):
  met: Array  # [b, k, C] bool
  last: Array  # [b, k] int32


class DynamicBeamAllocation:
  """The `search.BeamSelector` of lexically constrained beam search (module docstring); `eos_id` is banned
  until every constraint is met."""

  def __init__(self, constraints: Constraints, eos_id: int):
    self.cons = jax.tree_util.tree_map(jnp.asarray, constraints)
    self.eos_id = eos_id
    self.needed = jnp.sum(self.cons.valid, axis=-1)  # [b]

  def init(self, batch: int, beam_size: int) -> _State:
    width = self.cons.tokens.shape[1]
    return _State(jnp.zeros((batch, beam_size, width), bool), jnp.full((batch, beam_size), -1, jnp.int32))

  def complete(self, state: _State) -> Array:
    """`[b, k]` bool: beams that met every constraint (unfinished results rank them first)."""
    return jnp.sum(state.met, axis=-1) >= self.needed[:, None]

  def select(self, alive_log_probs: Array, log_probs: Array, state: _State):
    return jax.vmap(self._select_one)(alive_log_probs, log_probs, state, self.cons, self.needed)

  def _select_one(self, alive: Array, logp: Array, state: _State, cons: Constraints, needed: Array):
    """One source: alive [k], logp [k, V], state rows [k, ...] -> the k chosen extensions and their state."""
    k, vocab = logp.shape
    complete = jnp.sum(state.met, axis=-1) >= needed  # [k]
    logp = logp.at[:, self.eos_id].set(jnp.where(complete, logp[:, self.eos_id], search.NEG_INF))
    scores = alive[:, None] + logp  # [k, V]
    top = lax.top_k(scores.reshape(-1), min(2 * k, k * vocab))[1]
    allowed = jax.vmap(_allowed, in_axes=(0, 0, None))(state.met, state.last, cons)  # [k, C]
    width = allowed.shape[1]
    parent = jnp.concatenate([top // vocab, jnp.repeat(jnp.arange(k), width), jnp.arange(k)])
    token = jnp.concatenate([top % vocab, jnp.tile(cons.tokens, k), jnp.argmax(scores, axis=-1)])
    ok = jnp.concatenate([jnp.ones_like(top, bool), allowed.reshape(-1), jnp.ones((k,), bool)])
    score = jnp.where(ok, scores[parent, token], search.NEG_INF)
    key = parent * vocab + token  # a candidate seen earlier in the list is dropped
    earlier = jnp.tril(key[:, None] == key[None, :], k=-1) & ok[None, :]
    score = jnp.where(jnp.any(earlier, axis=1), search.NEG_INF, score)
    met, last = jax.vmap(_advance, in_axes=(0, 0, 0, None))(state.met[parent], state.last[parent], token, cons)
    chosen = self._allocate(score, jnp.sum(met, axis=-1), needed, k, width)
    return (score[chosen], parent[chosen].astype(jnp.int32), token[chosen].astype(jnp.int32),
            _State(met[chosen], last[chosen]))

  @staticmethod
  def _allocate(score: Array, bank: Array, needed: Array, k: int, width: int) -> Array:
    """Indices `[k]` of the chosen candidates: each bank's best up to its share (sockeye's bank sizes: an even
    split, the remainder to the top bank, the slots a bank cannot fill passed down to the bank below), then the
    best of the rest."""
    live = score > search.NEG_INF  # bank: met constraint tokens, in [0, width]
    count = jnp.sum((bank[None, :] == jnp.arange(width + 1)[:, None]) & live[None, :], axis=1)  # [banks]
    banks = jnp.arange(width + 1)
    share = jnp.where(banks <= needed, k // (needed + 1), 0)
    share = share + jnp.where(banks == needed, k - (k // (needed + 1)) * (needed + 1), 0)
    for i in reversed(range(width + 1)):  # static: one pass from the top bank down
      over = jnp.maximum(share[i] - count[i], 0)
      share = share.at[i].add(-over)
      share = share.at[i - 1 if i > 0 else needed].add(over)
    index = jnp.arange(score.shape[0])
    better = ((score[None, :] > score[:, None])
              | ((score[None, :] == score[:, None]) & (index[None, :] < index[:, None])))
    rank = jnp.sum((bank[:, None] == bank[None, :]) & better, axis=1)  # rank of each candidate inside its bank
    reserved = (rank < share[bank]) & live
    return jnp.lexsort((-score, ~reserved))[:k]


def satisfied(output: Sequence[int], phrases: Sequence[Sequence[int]]) -> bool:
  """Host-side: whether every phrase occurs in `output` as a contiguous run of tokens."""
  def occurs(phrase):
    n = len(phrase)
    return any(list(output[i:i + n]) == list(phrase) for i in range(len(output) - n + 1))
  return all(occurs(p) for p in phrases if len(p))
