"""The streaming training input pipeline (transformer_jax/data/pipeline.py): id shards, packing, sharding, resume.

Examples carry their index in their first two source tokens, so every packed row can be read back as the list of
examples it holds and compared with a first-fit reference written here in NumPy.
"""

import json
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

import grain
from benchmarks import scale_probe
from transformer_jax import config as C
from transformer_jax.data import id_shards, packing, pipeline
from transformer_jax.model import Transformer
from transformer_jax.training import eval_step
from transformer_jax.training.loss import label_smoothed_cross_entropy, token_weights

PAD = C.PAD_ID
IDS = {"ours": dict(pad_id=C.PAD_ID, bos_id=C.BOS_ID, eos_id=C.EOS_ID),
       "marian": dict(pad_id=39, bos_id=39, eos_id=0)}
BASE = 4  # example i's source starts with BASE + i // 35, BASE + i % 35 (ids in [4, 39): never a special id)


def _corpus(n, seed=0, src=(3, 14), tgt=(2, 10), eos=C.EOS_ID, long_every=0):
  rs = np.random.RandomState(seed)
  sources, targets = [], []
  for i in range(n):
    length = 40 if long_every and i % long_every == 0 else rs.randint(*src)
    sources.append(np.asarray([BASE + i // 35, BASE + i % 35, *rs.randint(4, 39, length), eos], np.int32))
    targets.append(np.append(rs.randint(4, 39, rs.randint(*tgt)), eos).astype(np.int32))
  return sources, targets


def _shards(tmp_path, sources, targets, shard_pairs=97):
  return id_shards.write_id_arrays(epath.Path(tmp_path) / "ids", {"test": 1}, sources, targets, vocab_size=40,
                                  shard_pairs=shard_pairs)


def _stream(shards, rows=8, row=32, **kwargs):
  kwargs.setdefault("pad_id", PAD)
  kwargs.setdefault("seed", 3)
  return pipeline.TrainStream(shards, tokens_per_batch=rows * row, row_length=row, **kwargs)


def _examples(batch):
  """The example indices of every row of a packed batch, in row order."""
  out = []
  for r in range(batch["inputs"].shape[0]):
    seg, ids = batch["inputs_segmentation"][r], batch["inputs"][r]
    starts = np.flatnonzero((seg > 0) & (batch["inputs_position"][r] == 0))
    out.append([int((ids[s] - BASE) * 35 + ids[s + 1] - BASE) for s in starts])
  return out


def _first_fit(order, sources, targets, rows, row):
  """Reference: first-fit of `order` into batches of `rows` rows; a batch closes when an example fits no row."""
  batches, current, used = [], [], []
  for i in order:
    need = (len(sources[i]), len(targets[i]))
    fit = next((r for r, u in enumerate(used) if u[0] + need[0] <= row and u[1] + need[1] <= row), None)
    if fit is None and len(current) == rows:
      batches.append(current)
      current, used, fit = [], [], None
    if fit is None:
      current.append([])
      used.append([0, 0])
      fit = len(current) - 1
    current[fit].append(int(i))
    used[fit][0] += need[0]
    used[fit][1] += need[1]
  return batches


def test_shards_round_trip_ids_lengths_and_counts(tmp_path):
  sources, targets = _corpus(300)
  shards = _shards(tmp_path, sources, targets)
  assert len(shards.paths) == 4 and shards.dtype == np.uint16
  got_s, got_t = shards.read_all()
  for a, b in zip(got_s + got_t, sources + targets):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(shards.lengths, [[len(s), len(t)] for s, t in zip(sources, targets)])
  assert id_shards.IdShards.open(shards.directory, {"test": 2}) is None  # another key: not these ids
  (shards.directory / id_shards.shard_name("done", 2, 4, "json")).unlink()  # an interrupted preparation
  assert id_shards.IdShards.open(shards.directory, {"test": 1}) is None


def test_a_reader_never_sees_a_half_written_file_while_another_process_rewrites_them(tmp_path):
  """Every process of a multi-host run rewrites the manifest (and may write a shard) while the others open the
  directory (`datasets.prepare_ids`): each file appears whole or not at all (the CI failure of 2026-12-06: a
  process read a manifest another one was writing and found no shards)."""
  sources, targets = _corpus(200)
  shards = _shards(tmp_path, sources, targets, shard_pairs=100)
  dtype, stop = shards.dtype, threading.Event()

  def rewrite():
    while not stop.is_set():
      id_shards.write_manifest(shards.directory, {"test": 1}, 2, vocab_size=40)
      id_shards.write_shard(shards.directory, 1, 2, [("", "")] * 100, sources[100:], targets[100:], dtype)

  writer = threading.Thread(target=rewrite)
  writer.start()
  try:
    opened = [id_shards.IdShards.open(shards.directory, {"test": 1}) for _ in range(300)]
  finally:
    stop.set()
    writer.join()
  assert all(o is not None and len(o.lengths) == 200 for o in opened)
  assert not list(shards.directory.glob("*.tmp*"))  # no writer's temporary file is left behind


def test_record_keeps_texts_and_large_vocabulary_ids():
  raw = id_shards.encode_record([70000, 1], [5, 1], "häus", "maison", np.int32)
  out = id_shards.decode_record(raw, np.int32, texts=True)
  np.testing.assert_array_equal(out["inputs"], [70000, 1])
  np.testing.assert_array_equal(out["targets"], [5, 1])
  assert out["texts"] == ("häus", "maison")


def test_batches_are_first_fit_of_the_seeded_order_and_every_epoch_covers_every_kept_pair(tmp_path):
  sources, targets = _corpus(500, long_every=50)  # 10 pairs longer than a row: dropped, counted
  shards = _shards(tmp_path, sources, targets)
  stream = _stream(shards)
  kept = [i for i in range(500) if len(sources[i]) <= 32 and len(targets[i]) <= 32]
  assert len(stream.kept) == len(kept) == 490
  orders = [[kept[j] for j in grain.MapDataset.range(490).shuffle(seed=3 + e)] for e in range(2)]
  for order in orders:
    assert sorted(order) == kept  # the epoch's order: a permutation of the kept pairs
  reference = _first_fit(orders[0] + orders[1], sources, targets, rows=8, row=32)
  for expected in reference[:40]:  # past the first epoch's end (~25 batches)
    batch = next(stream)
    assert _examples(batch)[:len(expected)] == expected
    assert all(row == [] for row in _examples(batch)[len(expected):])
  assert stream.epoch == 1


@pytest.mark.parametrize("examples,seed,process_index,process_count", [(490, 3, 0, 1), (1000, 2**32 - 2, 1, 3),
                                                                      (7, 0, 1, 2), (1, 5, 0, 1)])
def test_epoch_order_is_grains_index_shuffle_chain(examples, seed, process_index, process_count):
  """EpochOrder computes grain's `range.shuffle(seed)[p::n].repeat()` positions without its per-element calls:
  equal over several epochs (the per-epoch seed wraps at 2**32 as grain's does)."""
  order = pipeline.EpochOrder(examples, seed, process_index, process_count)
  chain = grain.MapDataset.range(examples).shuffle(seed=seed)[process_index::process_count].repeat()
  stop = 4 * order.share + 3
  assert order(0, stop).tolist() == [chain[k] for k in range(stop)]
  assert order(order.share - 2, order.share + 5).tolist() == [chain[k] for k in range(order.share - 2, order.share + 5)]


@pytest.mark.parametrize("rows,row", [(8, 32), (3, 20), (16, 64)])
def test_first_fit_batches_equal_grains_first_fit_packer(tmp_path, rows, row):
  """FirstFitBatches replaces grain's FirstFitPackIterDataset + batch for speed (docs/performance.md): the
  same batches, every key and value, across epoch boundaries, and from a restored state."""
  sources, targets = _corpus(400, seed=rows, long_every=40)
  stream = _stream(_shards(tmp_path, sources, targets), rows=rows, row=row)
  chunks = pipeline.ReadChunk(stream.shards, stream.kept, stream.order)
  ours, reference = iter(packing.FirstFitBatches(chunks, rows, row, PAD)), scale_probe.grain_first_fit(chunks, rows, row, PAD)
  states = []
  for _ in range(60):  # several epochs
    states.append(ours.get_state())
    mine, theirs = next(ours), next(reference)
    assert mine.keys() == theirs.keys()
    for key in mine:
      np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)
  again = iter(packing.FirstFitBatches(chunks, rows, row, PAD))
  again.set_state(states[37])
  replay = iter(packing.FirstFitBatches(chunks, rows, row, PAD))
  for _ in range(37):
    next(replay)
  resumed, uninterrupted = next(again), next(replay)
  for key in packing.BATCH_KEYS:
    np.testing.assert_array_equal(resumed[key], uninterrupted[key], err_msg=key)


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_packed_batch_layout(tmp_path, ids):
  sources, targets = _corpus(50, eos=ids["eos_id"])
  batch = next(_stream(_shards(tmp_path, sources, targets), rows=4, pad_id=ids["pad_id"]))
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: ((4, 32), np.int32) for k in packing.BATCH_KEYS}
  for r, row in enumerate(_examples(batch)):
    for side, seqs in (("inputs", sources), ("targets", targets)):
      offset = 0
      for segment, i in enumerate(row, start=1):
        n = len(seqs[i])
        np.testing.assert_array_equal(batch[side][r, offset:offset + n], seqs[i])
        np.testing.assert_array_equal(batch[f"{side}_position"][r, offset:offset + n], np.arange(n))
        assert (batch[f"{side}_segmentation"][r, offset:offset + n] == segment).all()
        offset += n
      assert (batch[side][r, offset:] == ids["pad_id"]).all()
      assert (batch[f"{side}_segmentation"][r, offset:] == 0).all() and (batch[f"{side}_position"][r, offset:] == 0).all()


def _one_per_row(sequences, pad_id):
  rows = np.full((len(sequences), max(map(len, sequences))), pad_id, np.int32)
  for i, seq in enumerate(sequences):
    rows[i, :len(seq)] = seq
  return jnp.asarray(rows)


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_packed_row_gives_the_same_per_example_loss_as_examples_alone(tmp_path, ids):
  cfg = C.tiny(vocab_size=40, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4,
               **ids)
  model = Transformer(cfg)
  sources, targets = _corpus(6, seed=1, eos=cfg.eos_id)
  batch = next(_stream(_shards(tmp_path, sources, targets), rows=2, row=48, pad_id=cfg.pad_id, seed=0))
  rows = _examples(batch)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["targets"])["params"])
  kwargs = {k: batch[k] for k in packing.BATCH_KEYS[2:]}
  packed_loss, _ = label_smoothed_cross_entropy(
      model.apply({"params": params}, batch["inputs"], batch["targets"], **kwargs), batch["targets"])
  order = [i for row in rows for i in row]
  alone_targets = _one_per_row([targets[i] for i in order], cfg.pad_id)
  alone_logits = model.apply({"params": params}, _one_per_row([sources[i] for i in order], cfg.pad_id),
                             alone_targets)
  alone_loss, _ = label_smoothed_cross_entropy(alone_logits, alone_targets)
  k = 0
  for r, row in enumerate(rows):
    offset = 0
    for i in row:
      n = len(targets[i])
      np.testing.assert_allclose(packed_loss[r, offset:offset + n], alone_loss[k, :n], rtol=1e-5, atol=1e-5)
      offset += n
      k += 1
  assert k >= 2 and any(len(row) > 1 for row in rows)


def test_marian_ids_padding_has_loss_weight_zero_and_eos_counts(tmp_path):
  cfg = C.tiny(vocab_size=40, num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4,
               dropout_rate=0.0, **IDS["marian"])
  sources, targets = _corpus(40, seed=2, eos=cfg.eos_id)
  batch = next(_stream(_shards(tmp_path, sources, targets), rows=4, pad_id=cfg.pad_id, seed=0))
  real = batch["targets_segmentation"] != 0
  assert (~real).any() and (batch["targets"][real] == cfg.eos_id).any()
  np.testing.assert_array_equal(np.asarray(token_weights(jnp.asarray(batch["targets"]), cfg.pad_id)), real)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(0), jnp.asarray(batch["inputs"]),
                                          jnp.asarray(batch["targets"]))["params"])
  sums = eval_step(params, {k: jnp.asarray(v) for k, v in batch.items()}, config=cfg, label_smoothing=0.1)
  assert float(sums["token_count"]) == real.sum() == sum(len(targets[i]) for row in _examples(batch) for i in row)


def test_exact_resume_replays_the_same_batches_across_an_epoch_boundary(tmp_path):
  shards = _shards(tmp_path, *_corpus(300))
  uninterrupted = _stream(shards, rows=4, seed=7)
  reference = [next(uninterrupted) for _ in range(60)]
  assert uninterrupted.epoch >= 1
  first = _stream(shards, rows=4, seed=7)
  for _ in range(37):
    next(first)
  state = json.loads(json.dumps({"processes": [first.get_state()]}))  # as a checkpoint stores it
  resumed = _stream(shards, rows=4, seed=7)
  resumed.set_state(state)
  for expected in reference[37:]:
    got = next(resumed)
    for key in packing.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], expected[key])


def test_same_seed_same_batches_other_seed_differs(tmp_path):
  shards = _shards(tmp_path, *_corpus(100))
  a, b, c = (next(_stream(shards, rows=2, seed=s)) for s in (1, 1, 2))
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])


def test_resume_under_another_seed_plan_or_process_count_is_refused(tmp_path):
  shards = _shards(tmp_path, *_corpus(100))
  state = _stream(shards, rows=2, seed=1).get_state()
  with pytest.raises(ValueError, match="seed 1"):
    _stream(shards, rows=2, seed=5).set_state(state)
  with pytest.raises(ValueError, match="rows_per_batch 2 -> 4"):
    _stream(shards, rows=4, seed=1).set_state(state)
  with pytest.raises(ValueError, match="saved by 1 processes, this run has 2"):
    _stream(shards, rows=2, seed=1, process_index=0, process_count=2).set_state({"processes": [state]})


def test_processes_read_disjoint_halves_of_every_epoch(tmp_path):
  sources, targets = _corpus(301, src=(15, 28))  # longer than half a row: one pair a row, rows in stream order
  shards = _shards(tmp_path, sources, targets)
  streams = [_stream(shards, rows=4, seed=5, process_index=p, process_count=2) for p in range(2)]
  assert [s.share for s in streams] == [151, 150]
  seen = []
  for s in streams:
    examples = []
    while s.epoch == 0:
      examples += [i for row in _examples(next(s)) for i in row]
    seen.append(examples[:s.share])  # the first epoch's share, counted
  assert len(set(seen[0])) == 151 and len(set(seen[1])) == 150 and not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == list(range(301))
  assert next(streams[0])["inputs"].shape == (2, 32)  # each process builds its rows of the global batch only


def test_rows_that_do_not_divide_among_processes_are_refused(tmp_path):
  shards = _shards(tmp_path, *_corpus(20))
  with pytest.raises(ValueError, match="not a positive multiple of the 2 processes"):
    _stream(shards, rows=3, process_count=2)


def test_epoch_pairs_name_what_the_batches_hold(tmp_path):
  sources, targets = _corpus(301)
  stream = _stream(_shards(tmp_path, sources, targets), rows=4, seed=5, process_index=1, process_count=2)
  read = [i for _ in range(60) for row in _examples(next(stream)) for i in row]
  expected = np.concatenate([stream.epoch_pairs(e) for e in range(3)])[:stream.consumed]
  assert stream.consumed > stream.share and sorted(read) == sorted(expected.tolist())


def test_scale_probe_finds_the_batches_that_cross_an_epoch_boundary(tmp_path):
  """The probe's boundary steps, against the pairs counted in the batches themselves (each epoch holds every
  kept pair once, so a boundary falls after every `kept` pairs)."""
  sources, targets = _corpus(300)
  shards = _shards(tmp_path, sources, targets)
  found = scale_probe.epoch_boundaries(shards, tokens=4 * 32, row_length=32, steps=80)
  stream = _stream(shards, rows=4, seed=0, pad_id=scale_probe.tok_lib.PAD_ID)
  kept, consumed, expected = len(stream.kept), 0, set()
  for step in range(1, 81):
    pairs = sum(map(len, _examples(next(stream))))
    last = consumed + pairs - 1
    if last // kept > consumed // kept or (consumed and consumed % kept == 0):
      expected.add(step)
    consumed += pairs
  assert consumed > 2 * kept and len(expected) >= 2
  assert found == expected


def test_scale_probe_reads_step_seconds_from_the_training_log():
  log = ("I1206 23:59:59.500000 1 trainer.py:676] step 1/3 | loss 1\n"
         "I1206 23:59:59.900000 1 checkpoint.py:9] saved\n"
         "I1207 00:00:00.250000 1 trainer.py:676] step 2/3 | loss 1\n"
         "I1207 00:00:01.000000 1 trainer.py:676] step 3/3 | loss 1\n")
  seconds = scale_probe.step_seconds(log)
  assert seconds.keys() == {2, 3}
  np.testing.assert_allclose([seconds[2], seconds[3]], [0.75, 0.75])
