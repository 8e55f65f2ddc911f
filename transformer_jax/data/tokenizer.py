"""One shared SentencePiece vocabulary for source and target (section 5.1: shared BPE).

Ids: pad 0, unk 1, bos 2, eos 3 (the model's `PAD_ID`, `UNK_ID`, `BOS_ID`, `EOS_ID`). The rest of the library
reads them from the tokenizer (`pad_id`, `eos_id`) or the model (`ModelConfig.pad_id`, ...), never from these
constants, so another vocabulary (an imported Marian model's, `data.marian_vocab`, pad = its last id) works
the same way; `check_model_ids` refuses a model whose ids are not its tokenizer's.

Text normalisation (`transformer_jax.data.normalize`): every text is normalised here, before SentencePiece
sees it, both when the vocabulary is trained and at every `encode`: BOM and zero-width characters dropped,
Unicode spaces collapsed, NFC. SentencePiece itself runs the `identity` rule, so detokenisation reproduces
any normalised text the vocabulary covers exactly.

A case-folded vocabulary (`train_tokenizer(lowercase=True)`, `data.lowercase`) lowercases every text after
normalising it, in training and at every `encode`, so it only ever writes lowercase; its translations are scored
against lowercased references (`metrics.sacrebleu_scores(lowercase=...)`, `tokenizer.lowercase`). That is the
published Multi30k protocol (systems trained and scored on the lowercased `*.lc.norm.tok` files).

Which normalisation a vocabulary was trained with is stamped next to it: `vocab/spm.model` has
`vocab/spm.normalization.json` = {"normalization": 1, "lowercase": false, "signature": ..., "model_sha256": ...},
written before the model is moved into place (a stamp without "lowercase" is a cased vocabulary). `Tokenizer`
reads it and encodes with that version:
  * no stamp: a vocabulary trained before normalisation existed (version 0). Its text is encoded exactly as
    it was trained, unnormalised, so an old workdir translates and resumes as before; a warning says so.
  * a stamp whose `model_sha256` is not the model's, an unreadable stamp, or an unknown (newer) version:
    `VocabularyError` in one line; nothing is guessed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
import threading
from typing import Iterable, Protocol, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ModelConfig
from transformer_jax.data import normalize as normalize_lib
from transformer_jax.workdir import write_bytes_atomically

VOCAB_FILENAME = "spm.model"
STAMP_SUFFIX = ".normalization.json"
_SAMPLING_LOCK = threading.Lock()  # SentencePiece's sampling seed is process-wide: one seeded draw at a time
# Threads SentencePiece trains a vocabulary with, whatever the host: the unigram trainer's pieces and scores
# depend on how many threads split its E-step (4 of 2,000 pieces differ between 1 and 2 threads on 16k lines of
# Multi30k), so hosts with different core counts, or the processes of one multi-host run, would build different
# vocabularies from the same text. A fixed count makes the pieces and scores a function of the text and config.
TRAINING_THREADS = 16


class VocabularyError(ValueError):
  """The vocabulary file is missing, unreadable, or does not match the model."""


class TextTokenizer(Protocol):
  """What the data pipeline, inference and the programs use of a vocabulary: `Tokenizer` (ours, one shared
  SentencePiece model) or `marian_vocab.MarianVocabulary` (an imported Marian model's files)."""

  path: str             # the file or directory it was loaded from
  pad_id: int           # fills batches after the last token; never a real token
  eos_id: int           # appended by `encode`; ends a sequence
  normalization: int    # the text normalisation `encode` applies (`normalize` version; 0 = none)
  lowercase: bool       # `encode` lowercases (a case-folded vocabulary): score against lowercased references

  @property
  def vocab_size(self) -> int: ...
  def is_blank(self, text: str) -> bool: ...
  # `target=True`: text of the target language (Marian segments it with its target model; ours is shared).
  def encode(self, text: str, add_eos: bool = True, *, target: bool = False) -> list[int]: ...
  def encode_batch(self, texts: Sequence[str], add_eos: bool = True, *,
                   target: bool = False) -> list[list[int]]: ...
  def decode(self, ids: Iterable[int]) -> str: ...
  def pieces(self, ids: Iterable[int]) -> list[str]: ...
  def check_model_vocab(self, model_vocab_size: int) -> None: ...


def check_model_ids(tokenizer: TextTokenizer, config: ModelConfig) -> None:
  """Raises `VocabularyError` (one line) when the model's pad or EOS id is not the tokenizer's.

  The data pipeline pads and ends sequences with the tokenizer's ids; the model masks and the loss weights
  use the model's (`config.pad_id`), so the two must be the same ids. (The decoder start, `config.bos_id`, is
  the model's own: Marian's equals its pad id and has no piece of its own.)
  """
  for name, want, have in (("pad_id", tokenizer.pad_id, config.pad_id), ("eos_id", tokenizer.eos_id, config.eos_id)):
    if want != have:
      raise VocabularyError(f"{tokenizer.path}: the tokenizer's {name} is {want} but the model's (model.{name}) "
                            f"is {have}; they must be the same id")


def ids_until_eos(ids: Iterable[int], eos_id: int, skip: Sequence[int]) -> list[int]:
  """`ids` as Python ints up to (not including) the first `eos_id`, without the ids in `skip` (pad, BOS):
  what a tokenizer's `decode` turns into text."""
  out = []
  for i in map(int, ids):
    if i == eos_id:
      break
    if i not in skip:
      out.append(i)
  return out


def stamp_path(model_path: str) -> str:
  """Where the normalisation stamp of `model_path` lives: `vocab/spm.model` -> `vocab/spm.normalization.json`."""
  root, ext = os.path.splitext(model_path)
  return (root if ext == ".model" else model_path) + STAMP_SUFFIX


def _read_bytes(path: str) -> bytes:
  """The bytes of a local or `gs://` file; FileNotFoundError when it is missing (TensorFlow's GCS filesystem,
  which reads `gs://`, raises its own `tf.errors.NotFoundError`, not an OSError)."""
  path = epath.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no such file: {path}")
  return path.read_bytes()


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def write_normalization_stamp(model_path: str, model_bytes: bytes, lowercase: bool = False) -> None:
  """Records that the model `model_bytes` (to live at `model_path`) was trained on `normalize.VERSION` text,
  lowercased when `lowercase`."""
  stamp = {"normalization": normalize_lib.VERSION, "lowercase": bool(lowercase),
           "signature": normalize_lib.signature(lowercase=lowercase), "model_sha256": _sha256(model_bytes)}
  # One temporary file per writer: the processes of a run may write it at once.
  write_bytes_atomically(stamp_path(model_path), json.dumps(stamp, indent=2).encode("utf-8"))


def read_normalization(model_path: str, model_bytes: bytes) -> tuple[int, bool]:
  """The normalisation version the vocabulary `model_path` was trained with (0 when it has no stamp), and
  whether it is case-folded (False when the stamp does not say: stamps before `lowercase` existed).

  Raises:
    VocabularyError: the stamp is unreadable, names an unknown version or a non-boolean "lowercase", or
      belongs to another model file.
  """
  path = stamp_path(model_path)
  if not epath.Path(path).exists():
    return normalize_lib.LEGACY_VERSION, False
  try:
    stamp = json.loads(epath.Path(path).read_text(encoding="utf-8"))
    version = stamp["normalization"]
    normalize_lib.normalizer(version)
    lowercase = stamp.get("lowercase", False)
    if not isinstance(lowercase, bool):
      raise ValueError(f'"lowercase" must be true or false, got {lowercase!r}')
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise VocabularyError(f"{path}: not a usable normalisation stamp for {model_path} ({e})") from None
  if stamp.get("model_sha256") != _sha256(model_bytes):
    raise VocabularyError(f"{path} was written for another model than {model_path} (SHA-256 differs): "
                          f"the vocabulary was replaced; restore the pair or train a new workdir")
  return version, lowercase


class Tokenizer:
  """A loaded SentencePiece model: text <-> ids (EOS appended on encode, stripped on decode).

  Every text is normalised with the version the vocabulary was trained with (`normalization`: 1, or 0 for
  a vocabulary from before normalisation; see the module docstring) and lowercased when the vocabulary is
  case-folded (`lowercase`) before it is encoded.
  """

  pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID  # every vocabulary trained here has these

  def __init__(self, model_path: str):
    self.path = model_path
    self._sp = spm.SentencePieceProcessor()
    try:
      model_bytes = _read_bytes(model_path)
      self._sp.LoadFromSerializedProto(model_bytes)
    except (OSError, RuntimeError) as e:
      raise VocabularyError(f"{model_path}: not a readable SentencePiece model ({e})") from None
    special = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
    if special != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
      raise VocabularyError(f"{model_path}: special ids (pad, unk, bos, eos) = {special}, expected "
                            f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}")
    self.normalization, self.lowercase = read_normalization(model_path, model_bytes)
    self.normalize = normalize_lib.normalizer(self.normalization, self.lowercase)
    if self.normalization == normalize_lib.LEGACY_VERSION:
      logging.warning("%s has no %s: it was trained before text normalisation, so text is encoded "
                      "unnormalised, as it was trained (a byte-order mark or zero-width characters change "
                      "its ids); train a new workdir to normalise", model_path,
                      os.path.basename(stamp_path(model_path)))

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def is_blank(self, text: str) -> bool:
    """True when `text` has nothing to encode (after this vocabulary's normalisation; 0: whitespace only)."""
    return not self.normalize(text).strip()

  def encode(self, text: str, add_eos: bool = True, *, target: bool = False) -> list[int]:
    """Text -> ids (normalised first), `[..., EOS]` by default; one shared model, so `target` changes nothing."""
    del target
    ids = self._sp.encode(self.normalize(text))
    return ids + [self.eos_id] if add_eos else ids

  def encode_batch(self, texts: Sequence[str], add_eos: bool = True, *, target: bool = False) -> list[list[int]]:
    """Many texts at once (normalised, then encoded as a list in C++)."""
    del target  # one shared model
    batch = self._sp.encode([self.normalize(t) for t in texts])
    return [ids + [self.eos_id] for ids in batch] if add_eos else batch

  def sample_batch(self, texts: Sequence[str], alpha: float, seed: int, add_eos: bool = True) -> list[list[int]]:
    """Sampled segmentations of `texts` (normalised first), one per text: subword regularisation.

    For a BPE vocabulary every merge is skipped with probability `alpha` (BPE-dropout, Provilkov et al.,
    2020); for a unigram one a segmentation is drawn from the lattice with smoothing `alpha` (Kudo, 2018).
    Within one process the draw is a function of `(texts, alpha, seed)`: SentencePiece samples from a
    thread-local generator seeded from the process-wide seed when the thread first samples, and its batch
    encode runs in fresh worker threads, so the texts are encoded as one batch on one worker
    (`num_threads=1`: one generator, texts in order) after `set_random_generator_seed(seed)`. Another process
    with the same seed draws differently (SentencePiece 0.2; measured). `seed` is a uint32 other than 2**32 - 1 (which
    SentencePiece reads as "unseeded").
    """
    if not 0.0 < alpha < 1.0:
      raise ValueError(f"alpha={alpha}: must be in (0, 1)")
    if not 0 <= seed < 2**32 - 1:
      raise ValueError(f"seed={seed}: must be in [0, 2**32 - 1)")
    normalized = [self.normalize(t) for t in texts]
    with _SAMPLING_LOCK:
      spm.set_random_generator_seed(seed)
      batch = self._sp.encode(normalized, enable_sampling=True, alpha=alpha, nbest_size=-1, num_threads=1)
    return [ids + [self.eos_id] for ids in batch] if add_eos else batch

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text, stopping at the first EOS and skipping pad/bos."""
    return self._sp.decode(ids_until_eos(ids, self.eos_id, skip=(self.pad_id, self.bos_id)))

  def pieces(self, ids: Iterable[int]) -> list[str]:
    """The subword strings of `ids` (for attention-map axes)."""
    return [self._sp.id_to_piece(int(i)) for i in ids]

  def check_model_vocab(self, model_vocab_size: int) -> None:
    """Raises `VocabularyError` naming both sizes when the model was built for another vocabulary."""
    if model_vocab_size != self.vocab_size:
      raise VocabularyError(
          f"{self.path}: vocabulary has {self.vocab_size} pieces but the model/checkpoint expects "
          f"vocab_size={model_vocab_size}")


def train_tokenizer(texts: Iterable[str], output_path: str, vocab_size: int, *, model_type: str = "bpe",
                    max_sentences: int = 2_000_000, character_coverage: float = 1.0,
                    byte_fallback: bool = False, lowercase: bool = False, seed: int = 0) -> Tokenizer:
  """Trains one SentencePiece model on (a bounded random sample of) `texts` and writes it to `output_path`.

  `texts` should hold both sides of the training split; each is normalised (`normalize.normalize`), then
  lowercased when `lowercase` (a case-folded vocabulary, stamped so that `encode` lowercases too), and blank
  ones are skipped. The model file is written to a temporary directory and moved into place only when
  training succeeded, so an existing vocabulary is never left half-written; its normalisation stamp
  (`stamp_path`) is written just before.
  """
  rng = random.Random(seed)
  normalize_text = normalize_lib.normalizer(normalize_lib.VERSION, lowercase)
  sample: list[str] = []
  seen = 0
  for text in texts:  # reservoir sampling: a uniform sample of at most max_sentences lines
    text = normalize_text(text)
    if not text:
      continue
    seen += 1
    if len(sample) < max_sentences:
      sample.append(text)
    else:
      j = rng.randrange(seen)
      if j < max_sentences:
        sample[j] = text
  if not sample:
    raise ValueError(f"cannot train a vocabulary for {output_path}: no non-empty training sentences")

  with tempfile.TemporaryDirectory() as tmp:  # SentencePiece's trainer reads and writes local files only
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
      for text in sample:  # normalised: no line breaks inside
        f.write(text + "\n")
    prefix = os.path.join(tmp, "spm")
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        normalization_rule_name="identity", character_coverage=character_coverage,
        byte_fallback=byte_fallback, hard_vocab_limit=False, input_sentence_size=0,
        shuffle_input_sentence=False, num_threads=TRAINING_THREADS, minloglevel=2)
    with open(prefix + ".model", "rb") as f:
      model_bytes = f.read()
  write_normalization_stamp(output_path, model_bytes, lowercase)
  write_bytes_atomically(output_path, model_bytes)
  tokenizer = Tokenizer(output_path)
  logging.info("Trained a %s%s vocabulary of %d pieces on %d sentences -> %s", "lowercased " if lowercase else "",
               model_type, tokenizer.vocab_size, len(sample), output_path)
  return tokenizer


def load_or_train_tokenizer(path: str, texts_fn, vocab_size: int, **train_kwargs) -> Tokenizer:
  """Loads the vocabulary at `path` if present (resume, translate), else trains it from `texts_fn()`."""
  if epath.Path(path).exists():
    return Tokenizer(path)
  return train_tokenizer(texts_fn(), path, vocab_size, **train_kwargs)


def encode_pairs(tokenizer: TextTokenizer, pairs: Sequence[tuple[str, str]]):
  """(source, target) texts -> two lists of int32 arrays `[len]`, each ending with the tokenizer's EOS (targets
  encoded as target-language text, `target=True`)."""
  sources = tokenizer.encode_batch([p[0] for p in pairs])
  targets = tokenizer.encode_batch([p[1] for p in pairs], target=True)
  return ([np.asarray(s, np.int32) for s in sources], [np.asarray(t, np.int32) for t in targets])
