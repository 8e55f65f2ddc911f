"""Numerical tests of greedy, beam and sampled decoding (`decoding/search.py`, `decoding/step.py`) and batched
translation (`decoding/inference.py`).

Random-weight models are edited to decode like trained ones (see `make_params`): peaked distributions, no pad
or BOS, and EOS becoming likely after a few tokens, so that hypotheses end at various lengths, every source
stops early, and beam search disagrees with greedy search (checked by `test_models_are_not_degenerate`).
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import decoding
from transformer_jax.decoding import generate, inference
from transformer_jax.config import tiny
from transformer_jax.model import Transformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def small(vocab_size=20, **overrides):
  values = dict(vocab_size=vocab_size, num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64,
                num_heads=2, max_len=64, share_embeddings=False)
  values.update(overrides)
  return tiny(**values)


def make_params(cfg, seed=0, logit_scale=2.0, eos_bias=-4.0, eos_weight=1.0, eos_ramp=0.0):
  """Random weights, edited so that decoding looks like a trained model's.

  The output projection is scaled by `logit_scale` (peaked distributions); pad and BOS get a -10 bias (never
  predicted); EOS gets bias `eos_bias` and its projection column is scaled by `eos_weight`. With
  `eos_ramp` (learned positions only) the decoder's position table grows along feature 0 and EOS reads that
  feature, so EOS becomes likely after a few tokens, as in a translation model.
  """
  ids = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(seed), ids, ids)["params"])
  decoder = dict(params["decoder"])
  kernel = (decoder["logits"]["kernel"] * logit_scale).at[:, EOS].multiply(eos_weight)
  bias = decoder["logits"]["bias"].at[EOS].set(eos_bias).at[PAD].set(-10.0).at[BOS].set(-10.0)
  if eos_ramp:
    table = decoder["positions"]["position_embedding"]
    table = table.at[:, 0].add(eos_ramp * jnp.arange(table.shape[0], dtype=table.dtype))
    decoder["positions"] = {"position_embedding": table}
    kernel = kernel.at[0, EOS].set(3.0)
  decoder["logits"] = {"kernel": kernel, "bias": bias}
  return dict(params, decoder=decoder)


def make_sources(seed, batch, vocab, max_len=9, min_len=2):
  """[batch, max_len + 1] sources `ids + [EOS]`, padded, of random lengths."""
  rng = np.random.default_rng(seed)
  src = np.zeros((batch, max_len + 1), np.int32)
  for i in range(batch):
    n = int(rng.integers(min_len, max_len + 1))
    src[i, :n] = rng.integers(4, vocab, size=n)
    src[i, n] = EOS
  return jnp.asarray(src)


@functools.partial(jax.jit, static_argnums=0)
def teacher_forced_log_probs(cfg, params, src, tgt):
  """Sum of log p(tgt) (pad positions ignored), straight from the model's teacher-forced logits."""
  logits = Transformer(cfg).apply({"params": params}, src, tgt)
  logp = jax.nn.log_softmax(logits, axis=-1)
  tok = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(tgt != PAD, tok, 0.0), axis=-1)


def lengths(tokens):
  return (np.asarray(tokens) != PAD).sum(-1)


CFG = small(position_embedding="learned")
PARAMS = make_params(CFG, seed=0, logit_scale=2.0, eos_bias=-4.0, eos_weight=0.0, eos_ramp=1.0)
SRC = make_sources(0, 8, CFG.vocab_size)
L = 16


def beam(src, beam_size=4, alpha=0.6, **kwargs):
  """The shared beam-search setting (one compilation for most tests)."""
  return decoding.beam_search(PARAMS, CFG, src, beam_size, alpha, L, full_output=True, **kwargs)


def test_models_are_not_degenerate():
  tokens, _ = decoding.greedy_search(PARAMS, CFG, SRC, L)
  out = beam(SRC)
  finished = (np.asarray(tokens) == EOS).any(-1)
  assert finished.sum() >= 6 and len(set(lengths(tokens).tolist())) >= 3  # EOS at various lengths
  assert len(set(lengths(out.tokens[:, 0]).tolist())) >= 3
  assert (np.asarray(out.tokens[:, 0]) != np.asarray(tokens)).any(axis=-1).sum() >= 2  # beam != greedy
  assert int(out.steps) < L  # every source stopped early


def test_greedy_tokens_end_with_eos_then_pad_and_log_prob_is_teacher_forced():
  tokens, log_probs = decoding.greedy_search(PARAMS, CFG, SRC, L)
  tokens = np.asarray(tokens)
  for row in tokens:
    if EOS in row.tolist():
      end = row.tolist().index(EOS)
      assert (row[end + 1:] == PAD).all() and (row[:end] != PAD).all()
    assert BOS not in row.tolist()
  np.testing.assert_allclose(log_probs, teacher_forced_log_probs(CFG, PARAMS, SRC, jnp.asarray(tokens)),
                             rtol=1e-5, atol=1e-5)


def test_beam_size_one_is_greedy():
  tokens, log_probs = decoding.greedy_search(PARAMS, CFG, SRC, L)
  out = beam(SRC, beam_size=1)
  np.testing.assert_array_equal(out.tokens[:, 0], tokens)
  np.testing.assert_allclose(out.log_probs[:, 0], log_probs, rtol=1e-6, atol=1e-6)
  penalty = ((5.0 + lengths(tokens)) / 6.0) ** 0.6
  np.testing.assert_allclose(out.scores[:, 0], np.asarray(log_probs) / penalty, rtol=1e-6, atol=1e-6)


def test_cached_equals_uncached_greedy():
  tokens, log_probs = decoding.greedy_search(PARAMS, CFG, SRC, L)
  ref_tokens, ref_log_probs = decoding.greedy_search_uncached(PARAMS, CFG, SRC, L)
  np.testing.assert_array_equal(tokens, ref_tokens)
  np.testing.assert_allclose(log_probs, ref_log_probs, rtol=1e-5, atol=1e-5)


def test_cached_equals_uncached_beam():
  out = beam(SRC)
  ref = decoding.beam_search_uncached(PARAMS, CFG, SRC, 4, 0.6, L, full_output=True)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.scores, ref.scores, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
  assert int(out.steps) == int(ref.steps)


def test_beam_scores_are_penalised_teacher_forced_log_probs_best_first():
  alpha = 0.6
  out = beam(SRC, alpha=alpha)
  tokens, scores, log_probs = np.asarray(out.tokens), np.asarray(out.scores), np.asarray(out.log_probs)
  b, k, _ = tokens.shape
  ref = np.asarray(teacher_forced_log_probs(CFG, PARAMS, jnp.repeat(SRC, k, axis=0),
                                            jnp.asarray(tokens.reshape(b * k, -1)))).reshape(b, k)
  np.testing.assert_allclose(log_probs, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(scores, log_probs / ((5.0 + lengths(tokens)) / 6.0) ** alpha,
                             rtol=1e-5, atol=1e-5)
  finished = (tokens == EOS).any(-1)
  for i in range(b):  # finished hypotheses first, each group best first
    n = finished[i].sum()
    assert finished[i, :n].all() and not finished[i, n:].any()
    assert (np.diff(scores[i, :n]) <= 1e-6).all() and (np.diff(scores[i, n:]) <= 1e-6).all()


def test_early_stopping_keeps_the_best_hypothesis():
  early = beam(SRC)
  full = beam(SRC, early_stop="none")
  assert int(early.steps) < int(full.steps) == L
  np.testing.assert_array_equal(early.tokens[:, 0], full.tokens[:, 0])
  np.testing.assert_allclose(early.scores[:, 0], full.scores[:, 0], rtol=1e-6)
  exact = beam(SRC, early_stop="all")  # stops only once the whole n-best list is settled
  assert int(early.steps) <= int(exact.steps)
  np.testing.assert_array_equal(exact.tokens, full.tokens)
  np.testing.assert_allclose(exact.scores, full.scores, rtol=1e-6)


def test_beam_search_finds_the_brute_force_optimum():
  # Vocabulary pad, unk, bos, eos, 4, 5: outputs over {unk, 4, 5} then EOS, at most 4 tokens -> 40 sequences.
  cfg = small(vocab_size=6)
  # EOS has a constant logit, the other tokens are peaked: the best length varies and depends on alpha.
  params = make_params(cfg, seed=4, logit_scale=3.0, eos_bias=-1.5, eos_weight=0.0)
  src = make_sources(1, 4, cfg.vocab_size, max_len=5)
  max_len, alpha = 4, 0.6
  candidates = [list(body) + [EOS] for n in range(max_len)
                for body in itertools.product([UNK, 4, 5], repeat=n)]
  assert len(candidates) == 40
  targets = np.array([c + [PAD] * (max_len - len(c)) for c in candidates], np.int32)
  penalty = np.array([((5.0 + len(c)) / 6.0) ** alpha for c in candidates])

  # Beam 108 = 4 candidate tokens x 27 live beams: nothing is ever pruned.
  out = decoding.beam_search(params, cfg, src, 108, alpha, max_len, full_output=True)
  tokens, scores, log_probs = np.asarray(out.tokens), np.asarray(out.scores), np.asarray(out.log_probs)
  all_tokens, all_scores = decoding.beam_search(params, cfg, src, 108, alpha, max_len, early_stop="all")
  best_lengths, penalty_changed_winner = [], []
  for i in range(src.shape[0]):
    ref_log_probs = np.asarray(teacher_forced_log_probs(
        cfg, params, jnp.repeat(src[i:i + 1], len(candidates), axis=0), jnp.asarray(targets)))
    ref_scores = ref_log_probs / penalty
    best = int(np.argmax(ref_scores))
    np.testing.assert_array_equal(tokens[i, 0], targets[best])
    np.testing.assert_allclose(log_probs[i, 0], ref_log_probs[best], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scores[i, 0], ref_scores[best], rtol=1e-5, atol=1e-5)
    # Without early stopping the 40 finished hypotheses come first, exactly sorted.
    order = np.argsort(-ref_scores, kind="stable")
    np.testing.assert_allclose(all_scores[i, :40], ref_scores[order], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(all_tokens[i, :40], targets[order])
    assert not (np.asarray(all_tokens[i, 40:]) == EOS).any()
    best_lengths.append(len(candidates[best]))
    penalty_changed_winner.append(best != int(np.argmax(ref_log_probs)))
  assert len(set(best_lengths)) >= 2, best_lengths
  assert any(penalty_changed_winner)


def test_max_lengths_cap_each_row():
  limits = jnp.array([1, 3, 5, L, 2, 7, L, 4], jnp.int32)
  tokens, _ = decoding.greedy_search(PARAMS, CFG, SRC, L, max_lengths=limits)
  assert (lengths(tokens) <= np.asarray(limits)).all()
  beam_tokens = beam(SRC, max_lengths=limits).tokens
  assert (lengths(beam_tokens) <= np.asarray(limits)[:, None]).all()
  # Rows capped at the full length decode as without a cap.
  free = beam(SRC).tokens
  np.testing.assert_array_equal(beam_tokens[3], free[3])
  np.testing.assert_array_equal(beam_tokens[6], free[6])


def test_sampling_top_k_one_is_greedy():
  tokens, log_probs = decoding.greedy_search(PARAMS, CFG, SRC, L)
  sampled, sampled_log_probs = decoding.sample(PARAMS, CFG, SRC, jax.random.key(7), L, temperature=0.7, top_k=1)
  np.testing.assert_array_equal(sampled, tokens)
  np.testing.assert_allclose(sampled_log_probs, log_probs, rtol=1e-6, atol=1e-6)


def test_sampling_is_random_and_scores_model_log_probs():
  a, log_probs = decoding.sample(PARAMS, CFG, SRC, jax.random.key(0), L, temperature=1.5, top_k=3)
  b, _ = decoding.sample(PARAMS, CFG, SRC, jax.random.key(1), L, temperature=1.5, top_k=3)
  assert (np.asarray(a) != np.asarray(b)).any()
  assert not np.isin(np.asarray(a), [BOS]).any()
  np.testing.assert_allclose(log_probs, teacher_forced_log_probs(CFG, PARAMS, SRC, a), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# translate_ids
# ----------------------------------------------------------------------------------------------------------

def _random_sources(seed, n, vocab, lo, hi):
  rng = np.random.default_rng(seed)
  return [rng.integers(4, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _reference(params, cfg, sources, beam_size, extra_len):
  """All sources in input order as one batch, no sorting or bucketing (rows are independent)."""
  width = max(len(s) for s in sources) + 1
  ids = np.zeros((len(sources), width), np.int32)
  for i, src in enumerate(sources):
    ids[i, :len(src) + 1] = src + [EOS]
  limits = jnp.asarray([len(s) + extra_len for s in sources], jnp.int32)
  max_len = width - 1 + extra_len
  if beam_size == 1:
    tokens, _ = decoding.greedy_search(params, cfg, jnp.asarray(ids), max_len, max_lengths=limits)
  else:
    tokens, _ = decoding.beam_search(params, cfg, jnp.asarray(ids), beam_size, 0.6, max_len, max_lengths=limits)
    tokens = tokens[:, 0]
  return [[t for t in row if t not in (PAD, EOS)] for row in np.asarray(tokens).tolist()]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translate_ids_returns_input_order(beam_size):
  sources = _random_sources(5, 9, CFG.vocab_size, 1, 12)  # buckets 8 and 16
  sources[3] = []
  sources[6] = sources[6] + [EOS]  # already terminated (Tokenizer.encode output): not doubled
  done = []
  out = inference.translate_ids(PARAMS, CFG, sources, beam_size=beam_size, extra_len=4, batch_size=3,
                                progress=done.append)
  assert len(out) == len(sources) and out[3] == []
  assert sum(done) == len(sources) - 1
  stripped = [src[:-1] if src and src[-1] == EOS else src for src in sources]
  nonempty = [i for i, src in enumerate(stripped) if src]
  ref = _reference(PARAMS, CFG, [stripped[i] for i in nonempty], beam_size, 4)
  assert [out[i] for i in nonempty] == ref
  assert len({len(h) for h in ref}) >= 2


def test_translate_ids_reuses_compiled_shapes():
  sources = _random_sources(11, 12, CFG.vocab_size, 9, 14)  # all in the 16-token bucket (EOS included)
  before = inference.compilation_count()
  inference.translate_ids(PARAMS, CFG, sources, beam_size=2, extra_len=5, batch_size=4)  # 3 full batches
  assert inference.compilation_count() - before == 1
  more = _random_sources(12, 8, CFG.vocab_size, 9, 14)
  inference.translate_ids(PARAMS, CFG, more, beam_size=2, extra_len=5, batch_size=4)
  assert inference.compilation_count() - before == 1


def test_translate_ids_empty_inputs_do_not_run_the_model():
  before = inference.compilation_count()
  assert inference.translate_ids(PARAMS, CFG, [[], []], beam_size=2) == [[], []]
  assert inference.translate_ids(PARAMS, CFG, []) == []
  assert inference.compilation_count() == before


def test_decode_groups_fills_batches_across_groups_and_equals_decode_ids(monkeypatch):
  sizes, real = [], inference._run_batch  # noqa: SLF001
  monkeypatch.setattr(inference, "_run_batch", lambda *a, **kw: (sizes.append(len(a[2])), real(*a, **kw))[1])
  groups = [(k, _random_sources(30 + k, n, CFG.vocab_size, 1, 6), first)  # one bucket (8), 4 rows a batch
            for k, (n, first) in enumerate([(5, 0), (0, 5), (7, 5), (6, 12), (3, 18)])]
  groups[2][1][4] = []
  options = generate.DecodeOptions(strategy="sample", top_k=5, token_log_probs=False)
  out = dict(inference.decode_groups(PARAMS, CFG, iter(groups), options, seed=3, extra_len=4,
                                     max_tokens_per_batch=32, max_open_groups=2))
  assert sorted(out) == [0, 1, 2, 3, 4] and out[1] == [] and out[2][4] == []
  assert sizes[:-1] == [4] * (len(sizes) - 1) and sum(sizes) == 20  # full batches across group boundaries
  for key, sources, first in groups:  # per-line seeds (first + i): the outputs of one decode_ids call per group
    expected = inference.decode_ids(PARAMS, CFG, sources, options, seed=3, extra_len=4, first_index=first)
    assert [[h.ids for h in hyps] for hyps in out[key]] == [[h.ids for h in hyps] for hyps in expected]


def test_decode_ids_lists_the_whole_beam_with_teacher_forced_log_probs():
  sources = _random_sources(7, 6, CFG.vocab_size, 1, 12)
  sources[2] = []
  options = generate.DecodeOptions(beam_size=3, nbest=3, token_log_probs=False)
  lists = inference.decode_ids(PARAMS, CFG, sources, options, extra_len=4, batch_size=4)
  best = inference.translate_ids(PARAMS, CFG, sources, beam_size=3, extra_len=4, batch_size=4)
  assert lists[2] == [] and all(1 <= len(c) <= 3 for i, c in enumerate(lists) if i != 2)
  assert sum(len(c) for c in lists) >= 12  # mostly full lists
  for i, candidates in enumerate(lists):
    if not candidates:
      continue
    assert candidates[0].ids == best[i]  # best first, as translate_ids
    assert len({tuple(h.ids) for h in candidates}) == len(candidates)
    for h in candidates:  # finished hypotheses: the model's own log p(ids + EOS | source)
      src = jnp.asarray([sources[i] + [EOS]], jnp.int32)
      tgt = jnp.asarray([h.ids + ([EOS] if len(candidates) > 1 else [])], jnp.int32)
      assert h.log_prob == pytest.approx(float(teacher_forced_log_probs(CFG, PARAMS, src, tgt)[0]), abs=1e-4)


def test_an_n_best_list_needs_a_beam():
  with pytest.raises(ValueError, match=r"nbest=2 must be in \[1, 1\]"):
    inference.decode_ids(PARAMS, CFG, [[4, 5]], generate.DecodeOptions(beam_size=1, nbest=2))


def test_an_mbr_choice_needs_texts_and_a_beam():
  with pytest.raises(ValueError, match="mbr_utility='chrf' chooses among texts: decode with decode_texts"):
    inference.decode_ids(PARAMS, CFG, [[4, 5]], generate.DecodeOptions(beam_size=2, mbr_utility="chrf"))
  with pytest.raises(ValueError, match="mbr_utility='chrf' chooses from beam search's n-best list"):
    generate.DecodeOptions(strategy="greedy", mbr_utility="chrf").check()


# ----------------------------------------------------------------------------------------------------------
# The searches over a step function that is not a Transformer
# ----------------------------------------------------------------------------------------------------------

TOY_VOCAB, TOY_BUCKETS = 7, 11  # pad, unk, bos, eos, 4, 5, 6
TOY_TABLE = (np.random.default_rng(3).normal(size=(TOY_VOCAB, TOY_VOCAB)) * 2).astype(np.float32)
TOY_BONUS = np.random.default_rng(4).normal(size=(TOY_BUCKETS, TOY_VOCAB)).astype(np.float32)


def toy_step(state: decoding.DecodingState):
  """Logits depend on the last token and on a hash of the whole history kept in the cache `[rows]` int32,
  so a wrong beam reorder of the cache changes the result."""
  history = (3 * state.cache + state.cur_token) % TOY_BUCKETS
  return jnp.asarray(TOY_TABLE)[state.cur_token] + jnp.asarray(TOY_BONUS)[history], history


def toy_log_probs(start: int, tokens) -> np.ndarray:
  """NumPy: the log-probs `[len(tokens) + 1, vocab]` the toy model gives after each prefix of `tokens`."""
  out, history, prev = [], start, BOS
  for token in [None] + list(tokens):
    if token is not None:
      prev = token
    history = (3 * history + prev) % TOY_BUCKETS
    logits = (TOY_TABLE[prev] + TOY_BONUS[history]).astype(np.float64)
    out.append(logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
  return np.array(out)


def test_greedy_search_over_a_toy_step_function_matches_numpy():
  starts, length = np.array([0, 5, 9]), 6
  tokens, log_probs = jax.jit(lambda cache: decoding.greedy_search_over(
      toy_step, cache, batch_size=3, max_decode_len=length, bos_id=BOS, eos_id=EOS, pad_id=PAD))(
          jnp.asarray(starts, jnp.int32))
  for i, start in enumerate(starts):
    ref, total = [], 0.0
    while len(ref) < length and EOS not in ref:
      logp = toy_log_probs(start, ref)[-1]
      logp[[PAD, BOS]] = -np.inf
      ref.append(int(np.argmax(logp)))
      total += logp[ref[-1]]
    np.testing.assert_array_equal(np.asarray(tokens[i]), ref + [PAD] * (length - len(ref)))
    np.testing.assert_allclose(log_probs[i], total, rtol=1e-5)


def test_beam_search_over_a_toy_step_function_ranks_every_hypothesis():
  # Outputs of at most 3 tokens: 21 finished ones (0-2 of unk, 4, 5, 6, then EOS). Beam 80 never prunes.
  starts, length, alpha, beam_size = np.array([0, 7]), 3, 0.6, 80
  cache = decoding.repeat_rows(jnp.asarray(starts, jnp.int32), beam_size)
  out = jax.jit(lambda cache: decoding.beam_search_over(
      toy_step, cache, batch_size=2, beam_size=beam_size, alpha=alpha, max_decode_len=length, bos_id=BOS,
      eos_id=EOS, pad_id=PAD, early_stop="none"))(cache)
  bodies = [list(b) for n in range(length) for b in itertools.product([UNK, 4, 5, 6], repeat=n)]
  for i, start in enumerate(starts):
    scores = []
    for body in bodies:
      logp = toy_log_probs(start, body)
      total = sum(logp[t, tok] for t, tok in enumerate(body + [EOS]))
      scores.append(total / ((5.0 + len(body) + 1) / 6.0) ** alpha)
    order = np.argsort(-np.array(scores), kind="stable")
    np.testing.assert_allclose(out.scores[i, :len(bodies)], np.array(scores)[order], rtol=1e-5)
    expected = [bodies[j] + [EOS] + [PAD] * (length - len(bodies[j]) - 1) for j in order]
    np.testing.assert_array_equal(np.asarray(out.tokens[i, :len(bodies)]), expected)
    assert not (np.asarray(out.tokens[i, len(bodies):]) == EOS).any()  # then the unfinished ones


def _while_carry(fn, *args) -> list:
  """The loop-carried values (avals) of the one `while` in `fn`'s jaxpr."""
  loops = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "while"]
  assert len(loops) == 1
  return loops[0].params["body_jaxpr"].in_avals


def test_beam_per_token_log_probs_match_numpy_and_cost_nothing_when_not_asked_for():
  starts, length, beam_size = np.array([0, 7, 3]), 5, 3
  cache = decoding.repeat_rows(jnp.asarray(starts, jnp.int32), beam_size)
  search = lambda per_token: (lambda cache: decoding.beam_search_over(  # noqa: E731
      toy_step, cache, batch_size=3, beam_size=beam_size, alpha=0.6, max_decode_len=length, bos_id=BOS,
      eos_id=EOS, pad_id=PAD, per_token=per_token))
  tracked, plain = jax.jit(search(True))(cache), jax.jit(search(False))(cache)
  for i, start in enumerate(starts):
    for j in range(beam_size):
      tokens = [int(t) for t in tracked.tokens[i, j] if t != PAD]
      logp = toy_log_probs(start, tokens[:-1])
      expected = [logp[t, tok] for t, tok in enumerate(tokens)] + [0.0] * (length - len(tokens))
      np.testing.assert_allclose(tracked.token_log_probs[i, j], expected, rtol=1e-5, atol=1e-5)
  for field in ("tokens", "scores", "log_probs"):
    np.testing.assert_array_equal(getattr(plain, field), getattr(tracked, field))
  assert plain.token_log_probs is None
  per_token_buffer = lambda aval: aval.shape == (3, beam_size, length) and aval.dtype == jnp.float32  # noqa: E731
  assert sum(map(per_token_buffer, _while_carry(search(True), cache))) == 2  # alive and finished
  assert not any(map(per_token_buffer, _while_carry(search(False), cache)))
