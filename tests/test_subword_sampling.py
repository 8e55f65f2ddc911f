"""Subword regularisation (BPE-dropout): sampled segmentations per epoch, reproducible within a process
(transformer_jax/data/subword_sampling.py, Tokenizer.sample_batch, PackedBatches(segmentations=...)).
SentencePiece's draw for a seed differs between processes, so on several hosts process 0 draws and sends its ids
(`sharding.ragged_from_first_process`): two jax.distributed processes must pack one plan between them."""

import numpy as np
import pytest

from experiments.configs import default
import distributed_workers
from transformer_jax import sharding
from transformer_jax.data import batching, datasets, subword_sampling
from transformer_jax.data import tokenizer as tok_lib

EN = [f"the {a} {b} walks past {c} houses near the river" for a in ("young", "old", "tall", "small")
      for b in ("man", "woman", "dog", "child") for c in ("three", "seven", "many")]
DE = [f"der {a} {b} geht an {c} häusern am fluss vorbei" for a in ("junge", "alte", "große", "kleine")
      for b in ("mann", "frau", "hund", "kind") for c in ("drei", "sieben", "vielen")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "spm.model"
  return tok_lib.train_tokenizer(EN + DE, str(path), vocab_size=120, model_type="bpe")


def test_sampling_is_a_function_of_the_seed_and_keeps_the_text(tok):
  a = tok.sample_batch(EN, 0.1, seed=11)
  assert a == tok.sample_batch(EN, 0.1, seed=11)          # the same draw, whatever ran before
  assert a != tok.sample_batch(EN, 0.1, seed=12)
  deterministic = tok.encode_batch(EN)
  assert a != deterministic
  assert sum(map(len, a)) > sum(map(len, deterministic))  # dropped merges leave more, shorter pieces
  assert [tok.decode(ids) for ids in a] == EN              # another segmentation of the same text
  assert all(ids[-1] == tok.eos_id for ids in a)


@pytest.mark.parametrize("alpha, seed", [(0.0, 1), (1.0, 1), (0.1, -1), (0.1, 2**32 - 1)])
def test_sampling_refuses_parameters_sentencepiece_would_misread(tok, alpha, seed):
  with pytest.raises(ValueError, match="alpha" if alpha in (0.0, 1.0) else "seed"):
    tok.sample_batch(EN[:2], alpha, seed=seed)


def _segmentations(tok, max_len=64, alpha=0.1, seed=0, from_epoch=0):
  pairs = list(zip(EN, DE))
  sources, targets = tok_lib.encode_pairs(tok, pairs)
  return subword_sampling.SampledSegmentations(tok, pairs, sources, targets, alpha=alpha, seed=seed,
                                               max_len=max_len, from_epoch=from_epoch)


def test_epochs_before_from_epoch_keep_the_deterministic_ids_and_later_ones_sample(tok):
  sources, targets = tok_lib.encode_pairs(tok, list(zip(EN, DE)))
  late, early = _segmentations(tok, from_epoch=2), _segmentations(tok)
  for epoch in (0, 1):
    got_sources, got_targets = late(epoch)
    for got, want in zip(got_sources + got_targets, sources + targets):
      np.testing.assert_array_equal(got, want)
  for got, want in zip(late(2)[0], early(2)[0]):  # from there on, the draw of a sampler that started at 0
    np.testing.assert_array_equal(got, want)
  assert any(not np.array_equal(x, y) for x, y in zip(late(2)[0], sources))
  with pytest.raises(ValueError, match="subword_from_epoch=-1"):
    _segmentations(tok, from_epoch=-1)


def test_every_epoch_has_its_own_segmentation_and_a_rerun_the_same(tok):
  first, again = _segmentations(tok), _segmentations(tok)
  e0, e1 = first(0), first(1)
  assert any(not np.array_equal(x, y) for x, y in zip(e0[0], e1[0]))
  for x, y in zip(e1[1], again(1)[1]):
    np.testing.assert_array_equal(x, y)
  assert all(x.dtype == np.int32 for x in e0[0] + e0[1])
  other_seed = _segmentations(tok, seed=1)(1)[0]
  assert any(not np.array_equal(x, y) for x, y in zip(other_seed, e1[0]))


def test_a_sampled_pair_over_max_len_keeps_its_deterministic_ids(tok):
  pairs = list(zip(EN, DE))
  sources, targets = tok_lib.encode_pairs(tok, pairs)
  max_len = max(max(map(len, sources)), max(map(len, targets)))  # every deterministic pair fits exactly
  sampler = _segmentations(tok, max_len=max_len, alpha=0.5)
  got_sources, got_targets = sampler(0)
  assert sampler.last_fallbacks > 0
  assert max(max(map(len, got_sources)), max(map(len, got_targets))) <= max_len
  fell_back = [i for i in range(len(pairs)) if np.array_equal(got_sources[i], sources[i])
               and np.array_equal(got_targets[i], targets[i])]
  assert len(fell_back) >= sampler.last_fallbacks


def test_packed_batches_resume_exactly_across_sampled_epochs_in_one_process(tok):
  pairs = list(zip(EN, DE))
  sources, targets = tok_lib.encode_pairs(tok, pairs)

  def make():
    return batching.PackedBatches(sources, targets, tokens_per_batch=4 * 64, row_length=64, pad_id=tok.pad_id,
                                  seed=3, segmentations=_segmentations(tok, seed=3))

  uninterrupted = make()
  reference = [next(uninterrupted) for _ in range(40)]
  assert uninterrupted.epoch >= 2
  interrupted = make()
  for _ in range(23):
    next(interrupted)
  resumed = make()
  resumed.set_state(interrupted.get_state())
  for expected in reference[23:]:
    got = next(resumed)
    for key in batching.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], expected[key])


def _corpus_config(tmp_path, alpha):
  corpus = tmp_path / "corpus"
  corpus.mkdir(exist_ok=True)
  for lang, lines in (("en", EN), ("de", DE)):
    (corpus / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
  cfg = default.get_config().data
  cfg.update(dict(dataset="parallel_text", builder_config="", dir=str(corpus), tfds_data_dir=str(tmp_path / "tfds"),
                  vocab_size=120, eval_splits=(), max_len=64, tokens_per_batch=512, subword_alpha=alpha))
  return cfg


def epoch_pairs(train, tokenizer, epoch):
  """The (source, target) texts and source ids of one epoch's batches (this process's rows), decoded from
  their packed rows, sorted."""
  train.set_state({"epoch": epoch, "index": 0, "seed": train.seed})
  texts, ids = [], []
  for _ in range(len(train.plan(epoch))):
    batch = next(train)
    for row_in, row_seg, row_tgt, row_tseg in zip(batch["inputs"], batch["inputs_segmentation"],
                                                  batch["targets"], batch["targets_segmentation"]):
      for segment in range(1, row_seg.max() + 1):
        source, target = row_in[row_seg == segment], row_tgt[row_tseg == segment]
        ids.append(tuple(int(i) for i in source))
        texts.append((tokenizer.decode(source), tokenizer.decode(target)))
  return sorted(texts), sorted(ids)


def _epoch_texts(data, epoch):
  return epoch_pairs(data.train, data.tokenizer, epoch)


def test_training_batches_sample_every_epoch_and_evaluation_does_not(tmp_path):
  cfg = _corpus_config(tmp_path, alpha=0.1)
  data = datasets.build_datasets(cfg, str(tmp_path / "w"), seed=0)
  texts0, ids0 = _epoch_texts(data, 0)
  texts1, ids1 = _epoch_texts(data, 1)
  assert texts0 == texts1 == sorted(zip(EN, DE))  # every pair once per epoch, whatever its segmentation
  assert ids0 != ids1
  plain = datasets.build_datasets(_corpus_config(tmp_path, alpha=0.0), str(tmp_path / "w"), seed=0)
  assert _epoch_texts(plain, 0)[1] == _epoch_texts(plain, 1)[1]  # off: the same ids every epoch
  assert _epoch_texts(plain, 0)[1] != ids0
  rebuilt = datasets.build_datasets(cfg, str(tmp_path / "w"), seed=0)  # from the token cache, same process
  assert _epoch_texts(rebuilt, 1) == (texts1, ids1)


@pytest.mark.parametrize("overrides, message", [
    (dict(subword_alpha=1.0), r"--config.data.subword_alpha=1.0: must be a finite number in \[0.0, 1.0\)"),
    (dict(subword_alpha=0.1, tokenizer="marian"), "subword_alpha=0.1: needs data.tokenizer='sentencepiece'"),
    (dict(subword_alpha=0.1, subword_from_epoch=-1), r"--config.data.subword_from_epoch=-1: must be an integer >= 0"),
    (dict(subword_from_epoch=10), r"--config.data.subword_from_epoch=10: needs data.subword_alpha > 0"),
])
def test_config_refuses_unusable_sampling(overrides, message):
  config = default.get_config()
  config.data.update(overrides)
  with pytest.raises(default.ConfigError, match=message):
    default.validate(config)


# ----------------------------------------------------------------------------------------------------------
# Several hosts: one draw (process 0's), one plan, each host its own rows
# ----------------------------------------------------------------------------------------------------------

_HOST = """
    import test_subword_sampling as T
    from transformer_jax.data import batching, subword_sampling, tokenizer as tok_lib
    tok = tok_lib.Tokenizer(sys.argv[3])
    pairs = list(zip(T.EN, T.DE))
    sources, targets = tok_lib.encode_pairs(tok, pairs)
    sampler = subword_sampling.SampledSegmentations(tok, pairs, sources, targets, alpha=0.1, seed=0, max_len=64,
                                                    share=sharding.ragged_from_first_process)
    train = batching.PackedBatches(sources, targets, tokens_per_batch=8 * 64, row_length=64, pad_id=tok.pad_id,
                                   seed=0, process_index=jax.process_index(), process_count=jax.process_count(),
                                   segmentations=sampler)
    epochs = [T.epoch_pairs(train, tok, e) for e in (0, 1)]
    print("RESULT " + json.dumps({"texts": [e[0] for e in epochs], "ids": [e[1] for e in epochs],
                                  "rows": int(train.rows_per_batch // jax.process_count())}), flush=True)
"""


def test_two_hosts_pack_process_0s_draw_and_take_complementary_rows(tok, tmp_path):
  hosts = distributed_workers.run_workers(_HOST, tmp_path, num_processes=2, args=(tok.path,))
  assert [h["rows"] for h in hosts] == [4, 4]
  for epoch in (0, 1):
    texts = sorted(tuple(t) for h in hosts for t in h["texts"][epoch])
    assert texts == sorted(zip(EN, DE))  # every pair exactly once across the two hosts' rows
    assert all(h["texts"][epoch] for h in hosts)
  ids = [sorted(tuple(i) for h in hosts for i in h["ids"][epoch]) for epoch in (0, 1)]
  assert ids[0] != ids[1]  # each epoch its own draw
  deterministic = sorted(tuple(int(i) for i in s) for s in tok_lib.encode_pairs(tok, list(zip(EN, DE)))[0])
  assert ids[0] != deterministic and ids[1] != deterministic  # the sampled ids, not the fallbacks


def test_ragged_from_first_process_is_the_draw_itself_on_one_host():
  arrays = sharding.ragged_from_first_process(lambda: [[1, 2, 3], [], [7]])
  assert [a.tolist() for a in arrays] == [[1, 2, 3], [], [7]] and all(a.dtype == np.int32 for a in arrays)
  assert sharding.ragged_from_first_process(lambda: []) == []


def test_sampling_on_several_processes_needs_the_shared_draw(tmp_path):
  with pytest.raises(ValueError, match="on 2 processes needs share_across_processes"):
    datasets.build_datasets(_corpus_config(tmp_path, alpha=0.1), str(tmp_path / "w"), seed=0, process_count=2)
