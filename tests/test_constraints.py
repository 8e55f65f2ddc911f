"""Lexically constrained beam search (`decoding/constraints.py`): the hypothesis bookkeeping against a plain-Python
reference (sockeye's ConstrainedHypothesis), and the search on a random model: every phrase in every output,
sources without constraints decoded as plain beam search, an impossible constraint reported."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decoding import constraints, generate, inference

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_decode import CFG, PARAMS, _random_sources  # noqa: E402


class Reference:
  """sockeye's ConstrainedHypothesis, in plain Python."""

  def __init__(self, phrases):
    self.tokens = [t for p in phrases for t in p]
    self.next = [i + 1 < len(p) for p in phrases for i in range(len(p))]
    self.met, self.last = [False] * len(self.tokens), -1

  def advance(self, token):
    if self.last != -1 and self.next[self.last]:
      if self.tokens[self.last + 1] == token:
        self.met[self.last + 1] = True
        self.last += 1
        return
      i = self.last  # undo the broken phrase
      while True:
        self.met[i] = False
        if i == 0 or not self.next[i - 1]:
          break
        i -= 1
    self.last = -1
    for i, t in enumerate(self.tokens):
      if not self.met[i] and t == token and (i == 0 or not self.next[i - 1]):
        self.met[i], self.last = True, i
        break


def test_advance_matches_the_reference_bookkeeping():
  rng = np.random.default_rng(0)
  for _ in range(40):
    phrases = [list(rng.integers(4, 8, size=rng.integers(1, 4))) for _ in range(rng.integers(1, 4))]
    row = constraints.Constraints(*(jnp.asarray(x[0]) for x in constraints.pack([phrases], 9)))
    ref = Reference(phrases)
    met, last = jnp.zeros((9,), bool), jnp.int32(-1)
    for token in rng.integers(4, 8, size=12):
      ref.advance(int(token))
      met, last = constraints._advance(met, last, jnp.int32(token), row)
      assert np.asarray(met)[: len(ref.met)].tolist() == ref.met and int(last) == ref.last, (phrases, token)


def test_every_phrase_appears_and_unconstrained_sources_decode_as_plain_beam():
  sources = _random_sources(7, 10, CFG.vocab_size, 3, 10)
  rng = np.random.default_rng(1)
  phrases = [[[int(t) for t in rng.integers(4, CFG.vocab_size, size=rng.integers(1, 3))]
              for _ in range(rng.integers(0, 3))] for _ in sources]
  options = generate.DecodeOptions(beam_size=4, nbest=4)
  plain = inference.decode_ids(PARAMS, CFG, sources, options, extra_len=12, batch_size=4)
  out = inference.decode_ids(PARAMS, CFG, sources, options, constraints=phrases, extra_len=12, batch_size=4)
  assert sum(bool(p) for p in phrases) >= 5
  for wanted, free, hyps in zip(phrases, plain, out):
    if not wanted:
      assert [h.ids for h in hyps] == [h.ids for h in free]
      continue
    assert all(constraints.satisfied(h.ids, wanted) for h in hyps)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
  changed = sum(hyps[0].ids != free[0].ids for wanted, free, hyps in zip(phrases, plain, out) if wanted)
  assert changed >= 3  # the constraints were not already in the free outputs


def test_an_impossible_constraint_is_reported_not_hidden():
  sources = _random_sources(3, 2, CFG.vocab_size, 3, 5)
  too_long = [[[5] * 8], []]  # 8 tokens + EOS do not fit an output limit of len(source) + 2
  out = inference.decode_ids(PARAMS, CFG, sources, generate.DecodeOptions(beam_size=3), constraints=too_long,
                             extra_len=2)
  assert not constraints.satisfied(out[0][0].ids, too_long[0])


def test_constraints_need_beam_search():
  with pytest.raises(ValueError, match="lexical constraints need beam search"):
    inference.decode_ids(PARAMS, CFG, [[4, 5]], generate.DecodeOptions(strategy="greedy"), constraints=[[[4]]])
