"""Packing, token budgets, exact resume, and eval batching (transformer_jax/data/batching.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as C
from transformer_jax.data import batching
from transformer_jax.model import Transformer
from transformer_jax.training.loss import label_smoothed_cross_entropy


def _random_corpus(n, seed=0, vocab=40, src=(3, 14), tgt=(2, 10)):
  rs = np.random.RandomState(seed)
  sources = [np.append(rs.randint(4, vocab, rs.randint(*src)), C.EOS_ID).astype(np.int32) for _ in range(n)]
  targets = [np.append(rs.randint(4, vocab, rs.randint(*tgt)), C.EOS_ID).astype(np.int32) for _ in range(n)]
  return sources, targets


def test_filter_by_length_counts_drops():
  sources, targets = _random_corpus(200)
  kept_s, kept_t, dropped = batching.filter_by_length(sources, targets, max_len=10)
  expected = sum(1 for s, t in zip(sources, targets) if len(s) > 10 or len(t) > 10)
  assert dropped == expected > 0
  assert len(kept_s) == 200 - expected
  assert all(len(s) <= 10 and len(t) <= 10 for s, t in zip(kept_s, kept_t))


def test_packed_epoch_covers_every_example_once_and_respects_rows():
  sources, targets = _random_corpus(500)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=8 * 32, row_length=32, seed=3)
  plan = batches.plan(0)
  seen = sorted(i for batch in plan for row in batch for i in row)
  assert seen == list(range(500))
  for batch in plan:
    assert len(batch) <= 8
    for row in batch:
      assert sum(len(sources[i]) for i in row) <= 32 and sum(len(targets[i]) for i in row) <= 32
  src_eff, tgt_eff = batches.padding_efficiency()
  assert src_eff > 0.85  # the longer side packs tightly


def test_packed_batch_layout():
  sources, targets = _random_corpus(50)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=0)
  rows = batches.plan(0)[0]
  batch = next(batches)
  for r, row in enumerate(rows):
    offset = 0
    for segment, i in enumerate(row, start=1):
      n = len(sources[i])
      np.testing.assert_array_equal(batch["inputs"][r, offset:offset + n], sources[i])
      np.testing.assert_array_equal(batch["inputs_position"][r, offset:offset + n], np.arange(n))
      assert (batch["inputs_segmentation"][r, offset:offset + n] == segment).all()
      offset += n
    assert (batch["inputs"][r, offset:] == C.PAD_ID).all()
    assert (batch["inputs_segmentation"][r, offset:] == 0).all()


def test_packed_row_gives_the_same_per_example_loss_as_examples_alone():
  cfg = C.tiny(vocab_size=40, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4)
  model = Transformer(cfg)
  sources, targets = _random_corpus(6, seed=1)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=2 * 48, row_length=48, seed=0)
  rows = batches.plan(0)[0]
  batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
  params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["targets"])["params"])
  kwargs = {k: batch[k] for k in batching.BATCH_KEYS[2:]}
  packed_logits = model.apply({"params": params}, batch["inputs"], batch["targets"], **kwargs)
  packed_loss, _ = label_smoothed_cross_entropy(packed_logits, batch["targets"])
  checked = 0
  for r, row in enumerate(rows):
    offset = 0
    for i in row:
      n = len(targets[i])
      alone = model.apply({"params": params}, jnp.asarray(sources[i])[None], jnp.asarray(targets[i])[None])
      alone_loss, _ = label_smoothed_cross_entropy(alone, jnp.asarray(targets[i])[None])
      np.testing.assert_allclose(packed_loss[r, offset:offset + n], alone_loss[0], rtol=1e-5, atol=1e-5)
      offset += n
      checked += 1
  assert checked >= 2 and any(len(row) > 1 for row in rows)


def test_exact_resume_replays_the_same_batches():
  sources, targets = _random_corpus(300)
  make = lambda: batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=7)
  uninterrupted = make()
  reference = [next(uninterrupted) for _ in range(60)]  # crosses an epoch boundary
  assert uninterrupted.epoch >= 1

  first = make()
  for _ in range(37):
    next(first)
  state = first.get_state()
  resumed = make()
  resumed.set_state(dict(state))
  for expected in reference[37:]:
    got = next(resumed)
    for key in batching.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], expected[key])


def test_same_seed_same_batches_other_seed_differs():
  sources, targets = _random_corpus(100)
  a = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, seed=1))
  b = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, seed=1))
  c = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, seed=2))
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])


def test_resume_with_another_seed_is_refused():
  sources, targets = _random_corpus(20)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, seed=1)
  with pytest.raises(ValueError, match="seed 5"):
    batches.set_state({"epoch": 0, "index": 1, "seed": 5})


def test_hosts_split_rows():
  sources, targets = _random_corpus(100)
  whole = next(batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=0))
  parts = [next(batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=0,
                                       process_index=p, process_count=2)) for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])


def test_eval_batches_keep_every_example_untruncated():
  sources, targets = _random_corpus(100, src=(1, 60))
  seen = []
  for batch in batching.eval_batches(sources, targets, max_tokens=256):
    assert batch["inputs"].shape[1] % 16 == 0
    for row in batch["inputs"]:
      seen.append(tuple(row[row != C.PAD_ID]))
  assert sorted(seen) == sorted(tuple(s) for s in sources)


def test_length_sorted_batches_respect_budget_and_cover_all():
  lengths = [5, 100, 3, 17, 17, 40, 1, 64]
  batches = batching.length_sorted_batches(lengths, max_tokens=64, length_multiple=8)
  assert sorted(i for idx, _ in batches for i in idx) == list(range(len(lengths)))
  for idx, padded in batches:
    assert padded >= max(lengths[i] for i in idx)
    assert len(idx) == 1 or len(idx) * padded <= 64
