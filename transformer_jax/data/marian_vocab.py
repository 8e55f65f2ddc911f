"""Marian's tokenizer files as a `Tokenizer`: two SentencePiece models and one shared vocabulary file.

A Marian (OPUS-MT) directory holds `source.spm` (segments source text), `target.spm` (segments target text
and joins target pieces back into text) and `vocab.json` (piece -> model id, shared by both sides; the SentencePiece models' own ids are not
the model's). This mirrors Hugging Face's `MarianTokenizer` (transformers 5.x, `tokenization_marian.py`):
encode = source pieces -> `vocab.json` ids (unknown pieces -> `<unk>`) + `</s>`; with `target=True` the pieces
of `target.spm` (what `MarianTokenizer(text_target=...)` does: training targets); decode = ids -> pieces ->
`target.spm`. Needs only `sentencepiece` (a core dependency), so loading or fine-tuning an imported workdir never
imports torch/transformers. It lives with the other tokenizers in `data` so the training pipeline can use it
(`config.data.tokenizer = "marian"`, `datasets.open_tokenizer`).

Special ids come from `vocab.json`, not from constants: OPUS-MT has `</s>` 0, `<unk>` 1 and `<pad>` = the last
id (e.g. 58100), and the model starts decoding from `<pad>`. Text is not normalised here (as in
`MarianTokenizer`): `source.spm` applies its own normalisation rules.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import sentencepiece as spm
from etils import epath

from transformer_jax.data import normalize as normalize_lib
from transformer_jax.data.tokenizer import VocabularyError, ids_until_eos

TOKENIZER_NAME = "marian"  # `config.data.tokenizer` of a run that uses these files (an imported model's)
SOURCE_SPM, TARGET_SPM, VOCAB_JSON = "source.spm", "target.spm", "vocab.json"
MARIAN_TOKENIZER_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB_JSON)
PAD_PIECE, UNK_PIECE, EOS_PIECE = "<pad>", "<unk>", "</s>"


def _load_spm(path: str) -> spm.SentencePieceProcessor:
  processor = spm.SentencePieceProcessor()
  try:
    processor.LoadFromSerializedProto(epath.Path(path).read_bytes())
  except (OSError, RuntimeError) as e:
    raise VocabularyError(f"{path}: not a readable SentencePiece model ({e})") from None
  return processor


def read_vocab_json(path: str) -> dict[str, int]:
  """`vocab.json` as {piece: id}; raises `VocabularyError` (naming the file) when unreadable or not a map."""
  try:
    vocab = json.loads(epath.Path(path).read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise VocabularyError(f"{path}: not a readable JSON vocabulary ({e})") from None
  if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
    raise VocabularyError(f"{path}: expected a JSON object mapping pieces to integer ids")
  return vocab


class MarianVocabulary:
  """Text <-> ids with a Marian directory's `source.spm`, `target.spm` and `vocab.json`.

  Same interface as `transformer_jax.data.tokenizer.Tokenizer` (`tokenizer.TextTokenizer`: `encode`,
  `encode_batch`, `decode`, `pieces`, `is_blank`, `vocab_size`, `check_model_vocab`, the special ids `pad_id`,
  `unk_id`, `eos_id`, read from `vocab.json`). Marian has no BOS piece: decoding starts from `<pad>` (the
  model's `decoder_start_token_id`, `ModelConfig.bos_id`). `normalization` is 0: no text normalisation of
  ours (`normalize.LEGACY_VERSION`), so a blank text is one of whitespace only.

  Raises:
    VocabularyError: a file is missing or unreadable, or `vocab.json` lacks `<unk>`, `</s>` or `<pad>`.
  """

  def __init__(self, directory: str):
    self.path = directory
    for name in MARIAN_TOKENIZER_FILES:
      if not (epath.Path(directory) / name).is_file():
        raise VocabularyError(f"{directory}: missing {name} (a Marian tokenizer needs "
                              f"{', '.join(MARIAN_TOKENIZER_FILES)})")
    self._source = _load_spm(str(epath.Path(directory) / SOURCE_SPM))
    self._target = _load_spm(str(epath.Path(directory) / TARGET_SPM))
    self.encoder = read_vocab_json(str(epath.Path(directory) / VOCAB_JSON))
    self.decoder = {i: piece for piece, i in self.encoder.items()}
    for piece in (UNK_PIECE, EOS_PIECE, PAD_PIECE):
      if piece not in self.encoder:
        raise VocabularyError(f"{epath.Path(directory) / VOCAB_JSON}: no {piece!r} entry")
    self.pad_id, self.unk_id, self.eos_id = (self.encoder[p] for p in (PAD_PIECE, UNK_PIECE, EOS_PIECE))
    self.normalization = normalize_lib.LEGACY_VERSION  # none of ours; source.spm has its own rules
    self.lowercase = False  # Marian models write cased text

  @property
  def vocab_size(self) -> int:
    """Ids run over `[0, vocab_size)`: one more than the largest id in `vocab.json`."""
    return max(self.encoder.values()) + 1

  def is_blank(self, text: str) -> bool:
    """True when `text` is empty or whitespace only (nothing for `source.spm` to encode)."""
    return not text.strip()

  def encode(self, text: str, add_eos: bool = True, *, target: bool = False) -> list[int]:
    """Text -> ids: `source.spm` pieces (`target.spm` pieces for target-language text) looked up in
    `vocab.json`, `[..., </s>]` by default."""
    processor = self._target if target else self._source
    ids = [self.encoder.get(p, self.unk_id) for p in processor.encode(text, out_type=str)]
    return ids + [self.eos_id] if add_eos else ids

  def encode_batch(self, texts: Sequence[str], add_eos: bool = True, *, target: bool = False) -> list[list[int]]:
    return [self.encode(t, add_eos, target=target) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text with `target.spm`, stopping at the first `</s>` and skipping `<pad>`."""
    return self._target.decode_pieces(self.pieces(ids_until_eos(ids, self.eos_id, skip=(self.pad_id,))))

  def pieces(self, ids: Iterable[int]) -> list[str]:
    """The subword strings of `ids` (for attention-map axes)."""
    return [self.decoder.get(int(i), UNK_PIECE) for i in ids]

  def check_model_vocab(self, model_vocab_size: int) -> None:
    """Raises `VocabularyError` when `vocab.json` has ids outside the model's vocabulary."""
    if self.vocab_size > model_vocab_size:
      raise VocabularyError(f"{self.path}: {VOCAB_JSON} has ids up to {self.vocab_size - 1} but the model "
                            f"expects vocab_size={model_vocab_size}")
