"""Text sources (tfds number words, local parallel text, WMT via mocked tfds) and the shared vocabulary."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax import config as C
from transformer_jax.data import datasets, parallel_text, records, sources, tokenizer as tok_lib
from transformer_jax.run.experiment_config import DataConfig


def _write(path, lines, raw=None):
  with open(path, "wb") as f:
    f.write(raw if raw is not None else ("\n".join(lines) + "\n").encode("utf-8"))


def _data_config(**kw):
  """`config.data` of experiments/configs/default.py (every key), for a small local corpus."""
  return DataConfig(**{**dict(dataset="parallel_text", builder_config="", vocab_size=64, eval_splits=("val",),
                              max_len=32, tokens_per_batch=256, vocab_max_sentences=1000), **kw})


@pytest.fixture
def small_corpus(tmp_path):
  d = tmp_path / "corpus"
  d.mkdir()
  en = [f"the {w} house number {i}" for i, w in enumerate(["red", "green", "big", "small"] * 10)]
  de = [f"das {w} haus nummer {i}" for i, w in enumerate(["rote", "grüne", "große", "kleine"] * 10)]
  en[3], de[3] = "   ", ""  # blank pair: skipped in training
  _write(d / "train.en", en)
  _write(d / "train.de", de)
  _write(d / "val.en", ["the red house", "", "the big house"])
  _write(d / "val.de", ["das rote haus", "", "das große haus"])
  return d


# -- vocabulary ----------------------------------------------------------------------------------------

def test_tokenizer_special_ids_and_exact_roundtrip(tmp_path):
  texts = [f"zweihundert{x}undzwanzig {y}" for x in ("ein", "drei", "vier") for y in ("Haus", "Straße!")] * 30
  tok = tok_lib.train_tokenizer(texts, str(tmp_path / "spm.model"), vocab_size=60)
  ids = tok.encode("zweihunderteinundzwanzig Straße!")
  assert ids[-1] == C.EOS_ID and C.PAD_ID not in ids
  assert tok.decode(ids) == "zweihunderteinundzwanzig Straße!"
  for text in set(texts):
    assert tok.decode(tok.encode(text)) == text
  assert tok.decode(ids + [5, 6, 7]) == tok.decode(ids)  # stops at EOS


def test_tokenizer_vocab_mismatch_is_reported(tmp_path):
  tok = tok_lib.train_tokenizer(["a b c d e f g"] * 10, str(tmp_path / "spm.model"), vocab_size=20)
  with pytest.raises(tok_lib.VocabularyError, match=f"vocabulary has {tok.vocab_size} pieces.*vocab_size=999"):
    tok.check_model_vocab(999)


def test_unreadable_vocabulary_names_the_file(tmp_path):
  bad = tmp_path / "spm.model"
  bad.write_bytes(b"not a model")
  with pytest.raises(tok_lib.VocabularyError, match="spm.model"):
    tok_lib.Tokenizer(str(bad))


def test_failed_vocab_training_leaves_existing_file_untouched(tmp_path):
  path = tmp_path / "spm.model"
  tok_lib.train_tokenizer(["hello world"] * 20, str(path), vocab_size=20)
  before = path.read_bytes()
  with pytest.raises(ValueError, match="no non-empty"):
    tok_lib.train_tokenizer(["", "  "], str(path), vocab_size=20)
  assert path.read_bytes() == before


# -- local parallel text ---------------------------------------------------------------------------------

def test_parallel_text_pipeline_skips_blank_in_training_keeps_in_eval(small_corpus, tmp_path):
  cfg = _data_config(dir=str(small_corpus))
  data = datasets.build_datasets(cfg, str(tmp_path / "work"), seed=0)
  assert data.stats["skipped_blank"] == 1 and data.stats["train_pairs"] == 39
  val = data.eval_sets["val"]
  assert [p for p in val.pairs] == [("the red house", "das rote haus"), ("", ""),
                                   ("the big house", "das große haus")]
  assert os.path.exists(tmp_path / "work" / "vocab" / "spm.model")
  batch = next(data.train)
  assert batch["inputs"].shape == (8, 32)


def test_training_ids_are_written_once_and_reused_only_for_the_same_data_and_vocabulary(small_corpus, tmp_path,
                                                                                        monkeypatch):
  from transformer_jax.data import id_shards
  cfg = _data_config(dir=str(small_corpus))
  work = str(tmp_path / "work")
  first = datasets.build_datasets(cfg, work, seed=0)
  shards = first.train.shards
  assert shards.directory.parent == tmp_path / "work" / "data" / "train.ids" and len(shards.paths) == 1

  # A restart reads the ids without reading the training text (reading it would fail here) ...
  real_read = records.read_pairs
  def read_eval_only(builder, split, *args, **kwargs):
    assert not split.startswith("train"), "the training text was read despite the stored ids"
    return real_read(builder, split, *args, **kwargs)
  monkeypatch.setattr(records, "read_pairs", read_eval_only)
  second = datasets.build_datasets(cfg, work, seed=0)
  assert second.stats == first.stats  # blank and over-long pairs counted the same way
  for a, b in zip(sum(shards.read_all(), []), sum(second.train.shards.read_all(), [])):
    np.testing.assert_array_equal(a, b)
  batch_a, batch_b = next(first.train), next(second.train)
  for k in batch_a:
    np.testing.assert_array_equal(batch_a[k], batch_b[k])  # so an exact resume replays the same batches
  assert second.eval_sets["val"].pairs == first.eval_sets["val"].pairs
  monkeypatch.setattr(records, "read_pairs", real_read)

  # ... and ignores them for another vocabulary (or dataset, split, languages): those would live elsewhere.
  key = {k: shards.manifest[k] for k in ("dataset", "split", "source", "target", "vocab_sha256", "normalization")}
  assert id_shards.IdShards.open(shards.directory, dict(key, vocab_sha256="0" * 64)) is None
  assert id_shards.key_directory(shards.directory.parent, dict(key, split="train[:10]")) != shards.directory
  (shards.directory / id_shards.shard_name("done", 0, 1, "json")).unlink()  # an interrupted preparation
  third = datasets.build_datasets(cfg, work, seed=0)  # the missing shard is encoded again
  assert third.stats == first.stats and id_shards.IdShards.open(shards.directory, key) is not None


def test_parallel_text_dataset_is_built_once_and_reused(small_corpus, tmp_path, monkeypatch):
  """A restart reads the prepared dataset: the files are hashed, not checked line by line again (at WMT scale
  the check read every line into memory on every start)."""
  args = (str(small_corpus), "en", "de", str(tmp_path / "tfds"))
  checked = []
  check = parallel_text.check_split
  monkeypatch.setattr(parallel_text, "check_split", lambda *a, **k: (checked.append(a[1]), check(*a, **k)))
  b1 = parallel_text.parallel_text_builder(*args)
  assert sorted(checked) == ["train", "val"]
  stamp = os.path.getmtime(os.path.join(b1.data_dir, "dataset_info.json"))
  b2 = parallel_text.parallel_text_builder(*args)
  assert sorted(checked) == ["train", "val"]  # not again
  assert b2.data_dir == b1.data_dir
  assert os.path.getmtime(os.path.join(b2.data_dir, "dataset_info.json")) == stamp
  assert sorted(b2.info.splits.keys()) == ["train", "val"]


def test_parallel_text_dataset_name_follows_the_files_contents_not_their_place_or_time(small_corpus, tmp_path):
  """A copied, moved or remounted corpus (new path, new mtimes) reuses the prepared data; one edited byte rebuilds."""
  first = parallel_text.parallel_text_builder(str(small_corpus), "en", "de", str(tmp_path / "tfds"))
  copy = tmp_path / "elsewhere" / "corpus"
  shutil.copytree(small_corpus, copy)
  for path in copy.iterdir():
    os.utime(path, (1e9, 1e9))
  assert parallel_text.parallel_text_builder(str(copy), "en", "de", str(tmp_path / "tfds")).data_dir == first.data_dir
  (copy / "val.de").write_text("das rote haus\n\ndas grosse haus\n", encoding="utf-8")
  edited = parallel_text.parallel_text_builder(str(copy), "en", "de", str(tmp_path / "tfds"))
  assert edited.data_dir != first.data_dir
  assert records.read_pairs(edited, "val", "en", "de")[2] == ("the big house", "das grosse haus")


def test_our_builders_write_array_record_and_are_read_without_tensorflow(small_corpus, tmp_path):
  """A training program's data path (prepare, read every split) never imports TensorFlow (5-9 s of a start)."""
  code = (f"import sys; from transformer_jax.data import number_words, parallel_text, records\n"
          f"b = parallel_text.parallel_text_builder({str(small_corpus)!r}, 'en', 'de', {str(tmp_path / 'tfds')!r})\n"
          f"assert b.info.file_format == records.tfds.core.FileFormat.ARRAY_RECORD, b.info.file_format\n"
          f"assert records.read_pairs(b, 'val', 'en', 'de')[0] == ('the red house', 'das rote haus')\n"
          f"assert len(number_words.load_pairs('test', 'tiny', {str(tmp_path / 'nw')!r})) == 200\n"
          f"print('tensorflow imported:', 'tensorflow' in sys.modules)")
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1] == "tensorflow imported: False"


def test_data_prepared_as_tfrecord_before_reads_the_same_pairs(small_corpus, tmp_path):
  """A workdir prepared by an earlier version (tfds' default TFRecord) keeps its files and reads through tf.data."""
  config = parallel_text.ParallelTextConfig(name="x", version="1.0.0", directory=str(small_corpus),
                                            source_lang="en", target_lang="de", splits=("train", "val"))
  old = parallel_text.ParallelText(config=config, data_dir=str(tmp_path / "old"))
  old.download_and_prepare()  # what the builders did before: TFRecord
  reopened = records.prepare(parallel_text.ParallelText, config=config, data_dir=str(tmp_path / "old"))
  new = records.prepare(parallel_text.ParallelText, config=config, data_dir=str(tmp_path / "new"))
  assert reopened.info.file_format == tfds.core.FileFormat.TFRECORD
  assert new.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
  for split in ("train", "val", "train[5:12]"):
    assert records.read_pairs(reopened, split, "en", "de") == records.read_pairs(new, split, "en", "de")
  assert len(records.read_pairs(new, "train", "en", "de", batch_size=7)) == 40


def test_line_count_mismatch_names_both_files_and_counts(small_corpus, tmp_path):
  _write(small_corpus / "val.de", ["eins", "zwei"])
  with pytest.raises(ValueError, match=r"val\.en has 3 lines but .*val\.de has 2 lines"):
    parallel_text.parallel_text_builder(str(small_corpus), "en", "de", str(tmp_path / "tfds"))
  assert not os.path.exists(tmp_path / "tfds" / "parallel_text")  # nothing written


def test_missing_split_file_is_named(small_corpus, tmp_path):
  os.remove(small_corpus / "val.de")
  with pytest.raises(ValueError, match=r"missing split file .*val\.de"):
    parallel_text.parallel_text_builder(str(small_corpus), "en", "de", str(tmp_path / "tfds"),
                                        required_splits=("train", "val"))


def test_invalid_utf8_names_file_and_line(small_corpus, tmp_path):
  _write(small_corpus / "val.en", None, raw=b"ok line\nbad \xff\xfe line\nthird\n")
  with pytest.raises(ValueError, match=r"val\.en:2: invalid UTF-8"):
    parallel_text.parallel_text_builder(str(small_corpus), "en", "de", str(tmp_path / "tfds"))


def test_empty_training_file_is_refused(small_corpus, tmp_path):
  _write(small_corpus / "train.en", None, raw=b"")
  _write(small_corpus / "train.de", None, raw=b"")
  with pytest.raises(ValueError, match="no non-blank pairs"):
    parallel_text.parallel_text_builder(str(small_corpus), "en", "de", str(tmp_path / "tfds"))


def test_multi30k_reads_through_tfds(multi30k_dir, tmp_path):
  cfg = _data_config(dir=multi30k_dir)
  pairs = sources.load_pairs(cfg, "val", str(tmp_path))
  assert len(pairs) == 1014
  with open(os.path.join(multi30k_dir, "val.de"), encoding="utf-8") as f:
    assert pairs[0][1] == f.readline().rstrip("\n")
  assert len(sources.load_pairs(cfg, "train", str(tmp_path))) == 29000


# -- WMT through tfds (mocked: no network) -------------------------------------------------------------

@pytest.mark.parametrize("name", ["wmt14_translate/de-en", "wmt14_translate/fr-en", "wmt17_translate/de-en",
                                  "wmt_t2t_translate/de-en"])
def test_wmt_builders_read_in_the_configured_direction(name, tmp_path):
  target = name.split("/")[1].split("-")[0]  # de or fr
  cfg = _data_config(dataset=name, source_lang="en", target_lang=target, download=True)
  with tfds.testing.mock_data(num_examples=12):
    pairs = sources.load_pairs(cfg, "train", str(tmp_path))
    builder, src_key, tgt_key = sources.get_builder(cfg, str(tmp_path))
    raw = next(iter(tfds.as_numpy(builder.as_dataset(split="train", shuffle_files=False))))
  assert (src_key, tgt_key) == ("en", target)
  assert len(pairs) == 12
  assert pairs[0] == (raw["en"].decode(), raw[target].decode())


def test_unprepared_wmt_is_refused_without_downloading(tmp_path):
  cfg = _data_config(dataset="wmt14_translate/de-en", target_lang="de")
  with pytest.raises(ValueError, match="not prepared"):
    sources.get_builder(cfg, str(tmp_path))


def test_wrong_direction_languages_are_refused(tmp_path):
  cfg = _data_config(dataset="wmt14_translate/de-en", target_lang="fr", download=True)
  with tfds.testing.mock_data(num_examples=2):
    with pytest.raises(ValueError, match="languages"):
      sources.get_builder(cfg, str(tmp_path))
