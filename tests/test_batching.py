"""Packing, token budgets, exact resume, and eval batching (transformer_jax/data/batching.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as C
from transformer_jax.data import batching
from transformer_jax.model import Transformer
from transformer_jax.training import eval_step
from transformer_jax.training.loss import label_smoothed_cross_entropy, token_weights

PAD = C.PAD_ID
# Special ids as in our vocabularies, and as in an OPUS-MT (Marian) one: </s> 0, <pad> the last id, which is
# also the decoder start. With Marian's ids, code that pads with 0 pads with EOS, a real token.
IDS = {"ours": dict(pad_id=C.PAD_ID, bos_id=C.BOS_ID, eos_id=C.EOS_ID),
       "marian": dict(pad_id=39, bos_id=39, eos_id=0)}


def _random_corpus(n, seed=0, vocab=40, src=(3, 14), tgt=(2, 10), eos=C.EOS_ID, low=4):
  """Token ids in [low, vocab - 1) (never a special id of `IDS`) ending with `eos`."""
  rs = np.random.RandomState(seed)
  sources = [np.append(rs.randint(low, vocab - 1, rs.randint(*src)), eos).astype(np.int32) for _ in range(n)]
  targets = [np.append(rs.randint(low, vocab - 1, rs.randint(*tgt)), eos).astype(np.int32) for _ in range(n)]
  return sources, targets



def _one_per_row(sequences, pad_id):
  """`[n, longest]` ids, sequence i alone in row i, padded after it: the unpacked batch packing must match."""
  rows = np.full((len(sequences), max(map(len, sequences))), pad_id, np.int32)
  for i, seq in enumerate(sequences):
    rows[i, :len(seq)] = seq
  return jnp.asarray(rows)

def test_within_length_keeps_the_pairs_that_fit_both_sides():
  sources, targets = _random_corpus(200)
  keep = batching.within_length(sources, targets, max_len=10)
  expected = [i for i, (s, t) in enumerate(zip(sources, targets)) if len(s) <= 10 and len(t) <= 10]
  assert keep == expected and 0 < len(keep) < 200


def test_filter_by_length_counts_drops():
  sources, targets = _random_corpus(200)
  kept_s, kept_t, dropped = batching.filter_by_length(sources, targets, max_len=10)
  expected = sum(1 for s, t in zip(sources, targets) if len(s) > 10 or len(t) > 10)
  assert dropped == expected > 0
  assert len(kept_s) == 200 - expected
  assert all(len(s) <= 10 and len(t) <= 10 for s, t in zip(kept_s, kept_t))


def test_packed_epoch_covers_every_example_once_and_respects_rows():
  sources, targets = _random_corpus(500)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=8 * 32, row_length=32, pad_id=PAD, seed=3)
  plan = batches.plan(0)
  seen = sorted(i for batch in plan for row in batch for i in row)
  assert seen == list(range(500))
  for batch in plan:
    assert len(batch) <= 8
    for row in batch:
      assert sum(len(sources[i]) for i in row) <= 32 and sum(len(targets[i]) for i in row) <= 32
  src_eff, tgt_eff = batches.padding_efficiency()
  assert src_eff > 0.85  # the longer side packs tightly


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_packed_batch_layout(ids):
  sources, targets = _random_corpus(50, eos=ids["eos_id"])
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=0,
                                   pad_id=ids["pad_id"])
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
    assert (batch["inputs"][r, offset:] == ids["pad_id"]).all()
    assert (batch["inputs_segmentation"][r, offset:] == 0).all()
  for side in ("inputs", "targets"):  # every slot outside an example is padding, and only those
    np.testing.assert_array_equal(batch[side] == ids["pad_id"], batch[f"{side}_segmentation"] == 0)


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_packed_row_gives_the_same_per_example_loss_as_examples_alone(ids):
  cfg = C.tiny(vocab_size=40, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4,
               **ids)
  model = Transformer(cfg)
  sources, targets = _random_corpus(6, seed=1, eos=cfg.eos_id)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=2 * 48, row_length=48, seed=0,
                                   pad_id=cfg.pad_id)
  rows = batches.plan(0)[0]
  batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
  params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["targets"])["params"])
  kwargs = {k: batch[k] for k in batching.BATCH_KEYS[2:]}
  packed_logits = model.apply({"params": params}, batch["inputs"], batch["targets"], **kwargs)
  packed_loss, _ = label_smoothed_cross_entropy(packed_logits, batch["targets"])
  # The same examples unpacked, each alone in its row (one call: each row its own padded example).
  order = [i for row in rows for i in row]
  alone_targets = _one_per_row([targets[i] for i in order], cfg.pad_id)
  alone_logits = model.apply({"params": params}, _one_per_row([sources[i] for i in order], cfg.pad_id),
                             alone_targets)
  alone_loss, _ = label_smoothed_cross_entropy(alone_logits, alone_targets)  # [examples, longest target]
  k = 0
  for r, row in enumerate(rows):
    offset = 0
    for i in row:
      n = len(targets[i])
      np.testing.assert_allclose(packed_loss[r, offset:offset + n], alone_loss[k, :n], rtol=1e-5, atol=1e-5)
      offset += n
      k += 1
  assert k >= 2 and any(len(row) > 1 for row in rows)


def test_marian_ids_padding_has_loss_weight_zero_and_eos_counts():
  """Marian's ids (pad 39 = last id, EOS 0): the train/eval sums weigh exactly the examples' tokens."""
  cfg = C.tiny(vocab_size=40, num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4,
               dropout_rate=0.0, **IDS["marian"])
  sources, targets = _random_corpus(40, seed=2, eos=cfg.eos_id)
  batch = next(batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, seed=0,
                                      pad_id=cfg.pad_id))
  real = batch["targets_segmentation"] != 0
  assert (~real).any() and (batch["targets"][real] == cfg.eos_id).any()
  np.testing.assert_array_equal(np.asarray(token_weights(jnp.asarray(batch["targets"]), cfg.pad_id)), real)
  # An assumed pad id of 0 would weigh the padding and drop every EOS.
  assert float(token_weights(jnp.asarray(batch["targets"]), 0).sum()) != real.sum()
  params = nn.unbox(Transformer(cfg).init(jax.random.key(0), jnp.asarray(batch["inputs"]),
                                          jnp.asarray(batch["targets"]))["params"])
  sums = eval_step(params, {k: jnp.asarray(v) for k, v in batch.items()}, config=cfg, label_smoothing=0.1)
  assert float(sums["token_count"]) == real.sum()
  # The same sum over the same examples with nothing packed around them: each alone in its row, padded with
  # Marian's pad id, whose loss weight is 0 (so the padding adds nothing and the EOS counts once per example).
  alone_sources, alone_targets = [], []
  for r, start in zip(*np.nonzero((batch["targets_position"] == 0) & real)):
    segment = batch["targets_segmentation"][r, start]
    alone_sources.append(batch["inputs"][r][batch["inputs_segmentation"][r] == segment])
    alone_targets.append(batch["targets"][r][batch["targets_segmentation"][r] == segment])
  alone_targets = _one_per_row(alone_targets, cfg.pad_id)
  logits = Transformer(cfg).apply({"params": params}, _one_per_row(alone_sources, cfg.pad_id), alone_targets)
  loss, _ = label_smoothed_cross_entropy(logits, alone_targets)  # [examples, longest target]
  expected = float((loss * token_weights(alone_targets, cfg.pad_id)).sum())
  np.testing.assert_allclose(float(sums["loss_sum"]), expected, rtol=1e-4)


def test_exact_resume_replays_the_same_batches():
  sources, targets = _random_corpus(300)
  make = lambda: batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32,  # noqa: E731
                                        pad_id=PAD, seed=7)
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


def test_the_position_after_an_epochs_last_batch_is_the_next_epochs_start():
  """A run checkpointed right after an epoch's last batch resumes (and plans, samples, logs) the next epoch
  only; a position saved at the epoch's end by earlier versions (`index` == its batches) still resumes there."""
  sources, targets = _random_corpus(300)
  planned = []

  def segmentations(epoch):  # the same ids every epoch; counts which epochs get planned
    planned.append(epoch)
    return sources, targets

  make = lambda: batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32,  # noqa: E731
                                        pad_id=PAD, seed=7, segmentations=segmentations)
  uninterrupted = make()
  epoch_batches = len(uninterrupted.plan(0))
  reference = [next(uninterrupted) for _ in range(epoch_batches + 2)]
  assert planned == [0, 1]

  first = make()
  for _ in range(epoch_batches):
    next(first)
  assert {k: v for k, v in first.get_state().items() if k != "plan"} == {"epoch": 1, "index": 0, "seed": 7}
  for state in (first.get_state(), {"epoch": 0, "index": epoch_batches, "seed": 7}):
    planned.clear()
    resumed = make()
    resumed.set_state(state)
    for expected in reference[epoch_batches:]:
      got = next(resumed)
      for key in batching.BATCH_KEYS:
        np.testing.assert_array_equal(got[key], expected[key])
    assert planned == ([1] if state["epoch"] == 1 else [0, 1])


def test_same_seed_same_batches_other_seed_differs():
  sources, targets = _random_corpus(100)
  a = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, pad_id=PAD, seed=1))
  b = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, pad_id=PAD, seed=1))
  c = next(batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, pad_id=PAD, seed=2))
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])


def test_resume_with_another_seed_is_refused():
  sources, targets = _random_corpus(20)
  batches = batching.PackedBatches(sources, targets, tokens_per_batch=64, row_length=32, pad_id=PAD, seed=1)
  with pytest.raises(ValueError, match="seed 5"):
    batches.set_state({"epoch": 0, "index": 1, "seed": 5})


def test_hosts_split_rows():
  sources, targets = _random_corpus(100)
  whole = next(batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, pad_id=PAD,
                                      seed=0))
  parts = [next(batching.PackedBatches(sources, targets, tokens_per_batch=4 * 32, row_length=32, pad_id=PAD,
                                       seed=0, process_index=p, process_count=2)) for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_eval_batches_keep_every_example_untruncated(ids):
  sources, targets = _random_corpus(100, src=(1, 60), eos=ids["eos_id"])
  seen = []
  for batch in batching.eval_batches(sources, targets, max_tokens=256, pad_id=ids["pad_id"]):
    assert batch["inputs"].shape[1] % 16 == 0
    for row in batch["inputs"]:
      seen.append(tuple(row[row != ids["pad_id"]]))
  assert sorted(seen) == sorted(tuple(s) for s in sources)


def test_length_sorted_batches_respect_budget_and_cover_all():
  lengths = [5, 100, 3, 17, 17, 40, 1, 64]
  batches = batching.length_sorted_batches(lengths, max_tokens=64, length_multiple=8)
  assert sorted(i for idx, _ in batches for i in idx) == list(range(len(lengths)))
  for idx, padded in batches:
    assert padded >= max(lengths[i] for i in idx)
    assert len(idx) == 1 or len(idx) * padded <= 64
