"""Text normalisation (`transformer_jax.data.normalize`) and where it is applied: the vocabulary and its stamp,
the training pairs, the token-id cache, translation input and the metrics."""

import json
import os
import random
import threading
import unicodedata

import numpy as np
import pytest
import regex
import sacrebleu
import sentencepiece as spm

from transformer_jax import config as C
from transformer_jax.data import datasets, id_shards, normalize, parallel_text, token_cache, tokenizer as tok_lib
from transformer_jax.evaluation import metrics
from transformer_jax.run.experiment_config import DataConfig

GERMAN = ["fünf Äpfel für Müller", "die Straße ist größer", "ein Café am Fluss", "zwölf Öfen über Nacht",
          "déjà vu im Büro", "naïve Ideen, schöne Grüße"]


# Every Unicode scalar value (surrogates are not text), and the sets the `regex` module's own Unicode
# database puts them in: an implementation independent of `unicodedata` and of our lists.
ALL_CHARS = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp < 0xE000)


def _chars(unicode_set: str) -> set:
  return set(regex.findall(unicode_set, ALL_CHARS, flags=regex.V1))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "spm.model"
  return tok_lib.train_tokenizer(GERMAN * 20, str(path), vocab_size=80)


# -- the normalisation itself ----------------------------------------------------------------------------

def test_every_code_point_is_dropped_spaced_or_nfc_as_the_unicode_database_says():
  white_space = _chars(r"\p{White_Space}")
  ignorable_or_control = _chars(r"[\p{Cc}\p{Default_Ignorable_Code_Point}]")
  for c in ALL_CHARS:
    got = normalize.normalize(f"a{c}b")
    if c in white_space:
      assert got == "a b", hex(ord(c))
    elif c in normalize.DROPPED:
      assert c in ignorable_or_control and got == "ab", hex(ord(c))
    else:
      assert got == unicodedata.normalize("NFC", f"a{c}b"), hex(ord(c))
  assert _chars(r"[\p{Cc}--\p{White_Space}]") <= normalize.DROPPED  # every non-space control goes
  # Every assigned default-ignorable character is dropped, except the documented ones that change how a
  # visible neighbour is drawn or ordered (variation selectors, tags, CGJ, Hangul/Khmer syllable parts).
  kept = {ord(c) for c in _chars(r"[\p{Default_Ignorable_Code_Point}--\p{Cn}]") - normalize.DROPPED}
  assert kept == {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180F, *range(0xFE00, 0xFE10),
                  0xE0001, *range(0xE0020, 0xE0080), *range(0xE0100, 0xE01F0)}, sorted(map(hex, kept))
  for name in ("ZERO WIDTH SPACE", "ZERO WIDTH NON-JOINER", "ZERO WIDTH JOINER", "WORD JOINER", "SOFT HYPHEN",
               "ZERO WIDTH NO-BREAK SPACE", "LEFT-TO-RIGHT MARK", "RIGHT-TO-LEFT ISOLATE", "HANGUL FILLER"):
    assert unicodedata.lookup(name) in normalize.DROPPED, name


def test_normalize_is_idempotent_and_nfc_on_mixed_input():
  pool = [*"ae -", "\u0301", "\u0308", "\u0323", "\u200b", "\ufeff", "\u00a0", "\u2000", "\u3000", "\t", "\r",
          "\u2028", "\u00ad", "\u212b", "\u1e9b", "\x00", "\x1c", "\x85", "\ufb01", "\u0f73", "\U0001F600"]
  rng = random.Random(0)
  for _ in range(20_000):
    text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))
    once = normalize.normalize(text)
    assert normalize.normalize(once) == once, repr(text)
    assert unicodedata.is_normalized("NFC", once) and once == once.strip() and "  " not in once


def test_examples_of_each_rule():
  assert normalize.normalize("\ufefftwenty-one") == "twenty-one"  # byte-order mark
  assert normalize.normalize("twenty\u200b-one\u2060") == "twenty-one"  # zero width space, word joiner
  assert normalize.normalize("Stra\u00adße") == "Straße"  # soft hyphen
  assert normalize.normalize(" a\u00a0\u00a0b\u3000c\r\n") == "a b c"  # NBSP, ideographic space, CR LF
  assert normalize.normalize("e\u200b\u0301") == "\u00e9"  # dropped before NFC, so the accent composes
  assert normalize.normalize("\ufb01") == "\ufb01"  # NFC, not NFKC: the ligature stays
  for blank in ("", "   ", "\ufeff", "\u200b\u200d", "\u00a0\u2003\t", "\u00ad\u2028"):
    assert normalize.is_blank(blank), repr(blank)
  assert not normalize.is_blank("\u0301") and not normalize.is_blank(".")


def test_unknown_version_is_refused():
  assert normalize.normalizer(0)("\ufeff x ") == "\ufeff x "
  with pytest.raises(ValueError, match="version 7 is unknown.*upgrade"):
    normalize.normalizer(7)
  assert normalize.signature(0) == "none" and normalize.signature().startswith("nfc-v1/unicode-")


# -- the vocabulary ---------------------------------------------------------------------------------------

def test_composed_and_decomposed_accents_give_the_same_ids(tokenizer):
  for text in GERMAN:
    nfd = unicodedata.normalize("NFD", text)
    assert nfd != text
    assert tokenizer.encode(nfd) == tokenizer.encode(text)
    assert tokenizer.encode_batch([nfd, text])[0] == tokenizer.encode(text)
    assert C.UNK_ID not in tokenizer.encode(nfd)
    assert tokenizer.decode(tokenizer.encode(nfd)) == text


def test_a_vocabulary_trained_on_decomposed_text_is_the_same_vocabulary(tokenizer, tmp_path):
  nfd = tok_lib.train_tokenizer([unicodedata.normalize("NFD", t) for t in GERMAN * 20],
                                str(tmp_path / "spm.model"), vocab_size=80)
  assert nfd.pieces(range(nfd.vocab_size)) == tokenizer.pieces(range(tokenizer.vocab_size))


def test_a_unigram_vocabulary_does_not_depend_on_the_hosts_core_count(tmp_path, monkeypatch):
  """SentencePiece's unigram scores depend on its thread count: the vocabulary is trained with a fixed one, so
  hosts with 1 or 4 cores (or the processes of one multi-host run) train the same pieces and scores."""
  rng = random.Random(0)
  words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]
  weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf: frequent short pieces, a long tail
  lines = [" ".join(rng.choices(words, weights, k=rng.randint(4, 14))) for _ in range(2000)]
  models = []
  for cores in (1, 4):
    monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
    path = tmp_path / f"{cores}" / "spm.model"
    tok_lib.train_tokenizer(lines, str(path), vocab_size=300, model_type="unigram")
    models.append(path.read_bytes())
  protos = [spm.SentencePieceProcessor(model_proto=m) for m in models]
  pieces = [[(p.id_to_piece(i), p.get_score(i)) for i in range(p.get_piece_size())] for p in protos]
  assert pieces[0] == pieces[1]


def test_processes_that_write_one_vocabulary_at_once_all_succeed(tmp_path):
  """Every process of a multi-host run trains the vocabulary into a shared workdir (the same bytes since the
  thread count is fixed) and puts it in place as `train_tokenizer` does: the stamp through a temporary file, then
  the model by a rename. With one shared temporary name for the stamp, one writer renamed another's file away
  (FileNotFoundError) or a reader met a missing stamp; each writer now has its own, so all of them finish, every
  load in between succeeds and no temporary file is left."""
  lines = [f"line {i} with some words {i % 7} and more {i % 13}" for i in range(300)]
  path = str(tmp_path / "vocab" / "spm.model")
  model = tok_lib.train_tokenizer(lines, path, vocab_size=60)
  model_bytes = (tmp_path / "vocab" / "spm.model").read_bytes()
  errors = []

  def writer(index):  # a process that trained the same vocabulary, putting it in place again and loading it
    try:
      for round_ in range(100):
        tok_lib.write_normalization_stamp(path, model_bytes)
        staged = f"{path}.{index}.{round_}"
        with open(staged, "wb") as f:
          f.write(model_bytes)
        os.replace(staged, path)
        assert tok_lib.Tokenizer(path).vocab_size == model.vocab_size
    except Exception as error:  # noqa: BLE001 (what a writer raised is the result)
      errors.append(repr(error))

  writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
  for thread in writers:
    thread.start()
  for thread in writers:
    thread.join()
  assert errors == []
  assert sorted(os.listdir(tmp_path / "vocab")) == ["spm.model", "spm.normalization.json"]  # no temporary left


def test_invisible_characters_do_not_change_ids(tokenizer):
  plain = tokenizer.encode("die Straße ist größer")
  for variant in ("\ufeffdie Straße ist größer", "die Stra\u00adße ist\u00a0größer",
                  "die\u200b Straße  ist größer ", "die Straße ist gr\u200dößer\u2060",
                  "\u200edie Straße ist größer\r"):
    assert tokenizer.encode(variant) == plain, repr(variant)
  assert tokenizer.is_blank("\ufeff\u200b \u00a0") and tokenizer.encode("\ufeff\u200b") == [C.EOS_ID]


def test_vocabulary_is_stamped_with_its_normalisation(tokenizer):
  stamp_file = tok_lib.stamp_path(tokenizer.path)
  assert stamp_file == os.path.join(os.path.dirname(tokenizer.path), "spm.normalization.json")
  with open(stamp_file, encoding="utf-8") as f:
    stamp = json.load(f)
  assert stamp["normalization"] == normalize.VERSION == tokenizer.normalization
  assert stamp["model_sha256"] == token_cache.file_sha256(tokenizer.path)
  assert stamp["signature"] == normalize.signature()


def _copy_vocab(tokenizer, directory):
  os.makedirs(directory, exist_ok=True)
  model = os.path.join(directory, "spm.model")
  with open(tokenizer.path, "rb") as src, open(model, "wb") as dst:
    dst.write(src.read())
  return model


def test_vocabulary_without_a_stamp_encodes_as_before_normalisation(tokenizer, tmp_path, caplog):
  model = _copy_vocab(tokenizer, tmp_path / "old")  # a vocabulary written before stamps existed
  with caplog.at_level("WARNING"):
    legacy = tok_lib.Tokenizer(model)
  assert legacy.normalization == normalize.LEGACY_VERSION
  assert "no spm.normalization.json" in caplog.text and "unnormalised" in caplog.text
  raw = spm.SentencePieceProcessor(model_file=model)  # what Tokenizer.encode did before normalisation
  texts = ["\ufeffdie Straße", unicodedata.normalize("NFD", GERMAN[0]), "ein\u200bCafé", "  zwölf  Öfen "]
  for text in texts:
    assert legacy.encode(text) == raw.encode(text) + [C.EOS_ID]
  assert legacy.encode_batch(texts) == [ids + [C.EOS_ID] for ids in raw.encode(texts)]
  assert legacy.is_blank("  \t") and not legacy.is_blank("\u200b")  # blank = whitespace only, as before
  assert not os.path.exists(tok_lib.stamp_path(model))  # loading never writes a stamp


def test_bad_stamps_are_refused_in_one_line(tokenizer, tmp_path):
  model = _copy_vocab(tokenizer, tmp_path / "v")
  stamp = tok_lib.stamp_path(model)
  with open(tok_lib.stamp_path(tokenizer.path), encoding="utf-8") as f:
    good = json.load(f)
  cases = {"not json": "not a usable normalisation stamp",
           json.dumps(dict(good, normalization=99)): "version 99 is unknown",
           json.dumps({"signature": "x"}): "not a usable normalisation stamp",
           json.dumps(dict(good, model_sha256="0" * 64)): "written for another model"}
  for content, message in cases.items():
    with open(stamp, "w", encoding="utf-8") as f:
      f.write(content)
    with pytest.raises(tok_lib.VocabularyError, match=message) as error:
      tok_lib.Tokenizer(model)
    assert "\n" not in str(error.value) and "spm.normalization.json" in str(error.value)


# -- training pairs and the token-id cache ----------------------------------------------------------------

def _write_corpus(directory, en, de):
  directory.mkdir()
  for lang, lines in (("en", en), ("de", de)):
    (directory / f"train.{lang}").write_bytes(("\n".join(lines) + "\n").encode("utf-8"))


def _data_config(directory, tmp_path):
  return DataConfig(dataset="parallel_text", builder_config="", dir=str(directory),
                    tfds_data_dir=str(tmp_path / "tfds"), vocab_size=64, eval_splits=(), max_len=32,
                    tokens_per_batch=256, vocab_max_sentences=1000)


def test_invisible_only_training_lines_are_blank_and_variants_encode_alike(tmp_path):
  en = [f"the {w} house number {i}" for i, w in enumerate(["red", "green", "big", "small"] * 10)]
  de = [f"das {w} haus nummer {i}" for i, w in enumerate(["rote", "grüne", "große", "kleine"] * 10)]
  en[0] = "\ufeff" + en[0]  # a file that starts with a byte-order mark
  en[1], de[2], en[3] = "\u200b", "\ufeff \u00a0", "\u2060\t"  # nothing visible: three blank pairs
  de[4] = unicodedata.normalize("NFD", de[4])  # "das small haus" is ASCII; make one with an umlaut
  de[5] = unicodedata.normalize("NFD", "das grüne haus nummer 5")
  _write_corpus(tmp_path / "corpus", en, de)
  data = datasets.build_datasets(_data_config(tmp_path / "corpus", tmp_path), str(tmp_path / "w"), seed=0)
  assert data.stats["skipped_blank"] == 3 and data.stats["train_pairs"] == 37
  tok = data.tokenizer
  assert tok.normalization == normalize.VERSION
  srcs, tgts = data.train.shards.read_all()
  np.testing.assert_array_equal(srcs[0], tok.encode("the red house number 0"))
  np.testing.assert_array_equal(tgts[2], tok.encode("das grüne haus nummer 5"))
  assert all(C.UNK_ID not in t for t in tgts)  # the vocabulary saw the same NFC text


def test_training_files_with_only_invisible_pairs_are_refused(tmp_path):
  _write_corpus(tmp_path / "corpus", ["\ufeff", "\u200b", " "], ["a", "\u00a0", "b"])
  with pytest.raises(parallel_text.ParallelTextError, match="no non-blank pairs"):
    parallel_text.parallel_text_builder(str(tmp_path / "corpus"), "en", "de", str(tmp_path / "tfds"))
  assert not os.path.exists(tmp_path / "tfds")  # refused before anything was written


def test_token_ids_are_keyed_by_the_normalisation(tmp_path):
  en = [f"the house number {i}" for i in range(30)]
  de = [f"das haus nummer {i}" for i in range(30)]
  _write_corpus(tmp_path / "corpus", en, de)
  cfg, work = _data_config(tmp_path / "corpus", tmp_path), str(tmp_path / "w")
  shards = datasets.build_datasets(cfg, work, seed=0).train.shards
  meta = shards.manifest
  assert meta["normalization"] == normalize.signature()
  key = {k: meta[k] for k in ("dataset", "split", "source", "target", "vocab_sha256", "normalization")}
  assert id_shards.IdShards.open(shards.directory, key) is not None
  assert id_shards.IdShards.open(shards.directory, dict(key, normalization="none")) is None
  other = id_shards.key_directory(shards.directory.parent, dict(key, normalization="none"))
  assert other != shards.directory  # ids of another normalisation would live elsewhere, never be read here
  rebuilt = datasets.build_datasets(cfg, work, seed=0)
  assert rebuilt.train.shards.read_all()[0][0].tolist() == rebuilt.tokenizer.encode(en[0])


def test_old_workdir_resumes_with_unnormalised_ids(tmp_path):
  """A workdir whose vocabulary has no stamp keeps encoding its training text raw, and re-caches it."""
  en = [f"\ufeffthe house number {i}" if i == 0 else f"the house number {i}" for i in range(30)]
  de = [f"das haus nummer {i}" for i in range(30)]
  _write_corpus(tmp_path / "corpus", en, de)
  cfg, work = _data_config(tmp_path / "corpus", tmp_path), str(tmp_path / "w")
  first = datasets.build_datasets(cfg, work, seed=0)
  os.remove(tok_lib.stamp_path(first.tokenizer.path))  # now it looks like a workdir from before the change
  again = datasets.build_datasets(cfg, work, seed=0)
  assert again.tokenizer.normalization == normalize.LEGACY_VERSION
  raw = spm.SentencePieceProcessor(model_file=first.tokenizer.path)
  assert again.train.shards.read_all()[0][0].tolist() == raw.encode(en[0]) + [C.EOS_ID]
  assert again.train.shards.read_all()[0][0].tolist() != first.train.shards.read_all()[0][0].tolist()  # BOM: a token
  assert again.train.shards.manifest["normalization"] == "none"


# -- scoring ------------------------------------------------------------------------------------------------

def test_scores_compare_normalised_text():
  hyps = ["die Straße ist größer", "fünf Äpfel", "ein Café"]
  refs = ["\ufeffdie Stra\u00adße ist größer", unicodedata.normalize("NFD", "fünf Äpfel"), "ein\u00a0Café "]
  scores = metrics.sacrebleu_scores(hyps, refs)
  assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [hyps]).score) == pytest.approx(100.0)
  assert scores["chrf"] == pytest.approx(100.0)
  assert sacrebleu.corpus_chrf(hyps, [refs]).score < 100  # sacreBLEU alone sees different strings
  assert metrics.exact_match(hyps, refs) == 1.0 and metrics.exact_match(hyps, ["x", *refs[1:]]) == pytest.approx(2 / 3)
  assert metrics.tokenized_bleu(hyps, refs) == pytest.approx(100.0)


def test_number_words_are_already_normalised():
  """The built-in task's builder emits normalised text, so its vocabulary and references need no change."""
  from transformer_jax.data import number_words
  for n in range(0, number_words.MAX_NUMBER + 1, 37):
    for text in (number_words.english(n), number_words.german(n)):
      assert normalize.normalize(text) == text, n


def test_reader_refuses_cr_only_line_endings_and_utf16_by_name():
  import io
  assert parallel_text.decode_lines(io.BytesIO(b"\xef\xbb\xbfone\r\ntwo\r\n\r\n"), "f") == ["\ufeffone", "two", ""]
  with pytest.raises(parallel_text.ParallelTextError, match=r"^f:2: carriage return inside the line"):
    parallel_text.decode_lines(io.BytesIO(b"one\ntwo\rthree\r\n"), "f")
  for encoding in ("utf-16", "utf-16-be", "utf-32"):
    text = "one\n".encode(encoding)
    if encoding == "utf-16-be":
      text = b"\xfe\xff" + text
    with pytest.raises(parallel_text.ParallelTextError, match=r"^f:1: UTF-16 or UTF-32 text"):
      parallel_text.decode_lines(io.BytesIO(text), "f")
