"""Subword regularisation (BPE-dropout): a sampled segmentation for every pair the pipeline reads, reproducible
within a process (transformer_jax/data/subword_sampling.py, Tokenizer.sample_batch, pipeline.TrainStream).
SentencePiece's draw for a seed differs between processes; each process samples only its own share."""

import numpy as np
import pytest

from experiments.configs import default
from transformer_jax.data import datasets, packing, subword_sampling
from transformer_jax.data import tokenizer as tok_lib
from transformer_jax.run.experiment_config import ConfigError, DataConfig, ExperimentConfig

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


def _sampler(tok, max_len=64, alpha=0.1, seed=0, from_epoch=0, share=10):
  return subword_sampling.PairSampler(tok, alpha=alpha, seed=seed, process_index=0, share=share,
                                      from_epoch=from_epoch, max_len=max_len)


def _pair(tok, i):
  source, target = tok_lib.encode_pairs(tok, [(EN[i], DE[i])])
  return {"inputs": source[0], "targets": target[0], "texts": (EN[i], DE[i])}


def test_epochs_before_from_epoch_keep_the_deterministic_ids_and_later_ones_sample(tok):
  late, early = _sampler(tok, from_epoch=2), _sampler(tok)
  for k in range(20):  # epochs 0 and 1 (share 10)
    got, want = late(k, _pair(tok, k)), _pair(tok, k)
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])
    assert "texts" not in got
  sampled = [late(k, _pair(tok, k % 48)) for k in range(20, 40)]
  for k, got in zip(range(20, 40), sampled):  # from there on, the draw of a sampler that started at 0
    np.testing.assert_array_equal(got["inputs"], early(k, _pair(tok, k % 48))["inputs"])
  assert any(not np.array_equal(g["inputs"], _pair(tok, k % 48)["inputs"]) for k, g in zip(range(20, 40), sampled))
  with pytest.raises(ValueError, match="subword_from_epoch=-1"):
    _sampler(tok, from_epoch=-1)


def test_every_element_has_its_own_draw_and_a_rerun_the_same(tok):
  first, again, other_seed = _sampler(tok), _sampler(tok), _sampler(tok, seed=1)
  draws = [first(k, _pair(tok, 3))["inputs"] for k in range(12)]
  assert len({tuple(d) for d in draws}) > 1  # the same pair read again (e.g. next epoch): another segmentation
  for k in (0, 5, 11):
    np.testing.assert_array_equal(again(k, _pair(tok, 3))["inputs"], draws[k])
    assert again(k, _pair(tok, 3))["inputs"].dtype == np.int32
  assert any(not np.array_equal(other_seed(k, _pair(tok, 3))["inputs"], draws[k]) for k in range(12))
  assert all(tok.decode(d) == EN[3] for d in draws)


def test_a_sampled_pair_over_max_len_keeps_its_deterministic_ids(tok):
  pairs = [_pair(tok, i) for i in range(48)]
  max_len = max(max(len(p["inputs"]), len(p["targets"])) for p in pairs)  # every deterministic pair fits exactly
  sampler = _sampler(tok, max_len=max_len, alpha=0.5)
  got = [sampler(k, p) for k, p in enumerate(pairs)]
  kept = [i for i, g in enumerate(got) if np.array_equal(g["inputs"], pairs[i]["inputs"])
          and np.array_equal(g["targets"], pairs[i]["targets"])]
  assert kept and max(max(len(g["inputs"]), len(g["targets"])) for g in got) <= max_len


def _corpus_config(tmp_path, alpha):
  corpus = tmp_path / "corpus"
  corpus.mkdir(exist_ok=True)
  for lang, lines in (("en", EN), ("de", DE)):
    (corpus / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return DataConfig(dataset="parallel_text", builder_config="", dir=str(corpus), tfds_data_dir=str(tmp_path / "tfds"),
                    vocab_size=120, eval_splits=(), max_len=64, tokens_per_batch=512, subword_alpha=alpha)


def read_pairs(batches):
  """The (source text, target text, source ids) of every example of `batches`, decoded from the packed rows."""
  out = []
  for batch in batches:
    for row_in, row_seg, row_tgt, row_tseg in zip(batch["inputs"], batch["inputs_segmentation"],
                                                  batch["targets"], batch["targets_segmentation"]):
      for segment in range(1, row_seg.max() + 1):
        source, target = row_in[row_seg == segment], row_tgt[row_tseg == segment]
        out.append((source, target))
  return out


def test_training_batches_sample_and_resume_exactly_and_evaluation_does_not(tmp_path):
  cfg = _corpus_config(tmp_path, alpha=0.1)
  data = datasets.build_datasets(cfg, str(tmp_path / "w"), seed=0)
  reference = [next(data.train) for _ in range(30)]  # ~7 epochs of the 48 pairs
  pairs = read_pairs(reference)
  texts = [(data.tokenizer.decode(s), data.tokenizer.decode(t)) for s, t in pairs]
  assert set(texts) == set(zip(EN, DE))  # the texts, whatever their segmentation
  deterministic = dict(zip(EN, (tuple(s) for s in tok_lib.encode_pairs(data.tokenizer, list(zip(EN, DE)))[0])))
  resegmented = sum(tuple(int(i) for i in s) != deterministic[text[0]] for (s, _), text in zip(pairs, texts))
  assert resegmented > len(pairs) // 4
  plain = datasets.build_datasets(_corpus_config(tmp_path, alpha=0.0), str(tmp_path / "w"), seed=0)
  assert all(tuple(int(i) for i in s) == deterministic[plain.tokenizer.decode(s)]
             for s, _ in read_pairs([next(plain.train) for _ in range(10)]))  # off: the deterministic ids
  resumed = datasets.build_datasets(cfg, str(tmp_path / "w"), seed=0)  # from the stored ids, same process
  interrupted = datasets.build_datasets(cfg, str(tmp_path / "w"), seed=0)
  for _ in range(13):
    next(interrupted.train)
  resumed.train.set_state({"processes": [interrupted.train.get_state()]})
  for expected in reference[13:]:
    got = next(resumed.train)
    for key in packing.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("overrides, message", [
    (dict(subword_alpha=1.0), r"--config.data.subword_alpha=1.0: must be a finite number in \[0.0, 1.0\)"),
    (dict(subword_alpha=0.1, tokenizer="marian"), "subword_alpha=0.1: needs data.tokenizer='sentencepiece'"),
    (dict(subword_alpha=0.1, subword_from_epoch=-1), r"--config.data.subword_from_epoch=-1: must be an integer >= 0"),
    (dict(subword_from_epoch=10), r"--config.data.subword_from_epoch=10: needs data.subword_alpha > 0"),
])
def test_config_refuses_unusable_sampling(overrides, message):
  config = default.get_config()
  config.data.update(overrides)
  with pytest.raises(ConfigError, match=message):
    ExperimentConfig.from_config_dict(config)
