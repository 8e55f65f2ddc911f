"""A copy of our SentencePiece model that applies our text normalisation itself, for runtimes that feed it raw text.

Our `Tokenizer` normalises every text before SentencePiece sees it (`normalize.normalizer(version, lowercase)`:
invisible characters dropped, Unicode spaces collapsed, NFC, then lowercase for a case-folded vocabulary) and
trains SentencePiece with its `identity` rule. A runtime that only has the `.spm` file (CTranslate2's and
Hugging Face's `MarianTokenizer`, which call `SentencePieceProcessor.encode` on the user's text) would skip that
step, so `with_normalization` writes the model with SentencePiece's own normaliser doing it: a
`precompiled_charsmap` (longest-match replacement table, `normalizer_spec`) compiled from rules
"characters -> normalised characters" by SentencePiece's trainer (`normalization_rule_tsv`), the documented way
to give a model custom normalisation (SentencePiece `doc/normalization.md`). The pieces and ids are unchanged.

The rules: every code point our normaliser changes on its own (dropped characters -> nothing, Unicode spaces ->
U+0020, canonical singletons such as U+212B ANGSTROM SIGN -> U+00C5, capitals -> lowercase when lowercasing),
and every canonical decomposition (and its partly composed forms) -> the composed, normalised character, e.g.
"e" U+0301 -> "é", "A" U+0308 -> "ä" (lowercased). SentencePiece then collapses and strips spaces
(`remove_extra_whitespaces`). Not covered: combining marks in non-canonical order (NFC reorders them; the
table matches sequences as written), and a dropped character between a letter and its combining mark.
`tests/test_interop.py` checks the exported pieces against `Tokenizer` on such texts.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
import unicodedata

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from transformer_jax.data import normalize as normalize_lib

_SURROGATES = range(0xD800, 0xE000)


@functools.lru_cache(maxsize=4)
def normalization_rules(version: int, lowercase: bool) -> tuple[tuple[str, str], ...]:
  """`(source, target)` replacement rules that make SentencePiece's normaliser do `normalizer(version,
  lowercase)` on any text (see the module docstring for what is not covered); () for version 0 without
  lowercasing (nothing to do). ValueError for an unknown version."""
  norm = normalize_lib.normalizer(version, lowercase)
  if version == normalize_lib.LEGACY_VERSION and not lowercase:
    return ()
  rules: dict[str, str] = {}
  for code in range(0x110000):
    if code in _SURROGATES or code == 0:  # NUL ends a key in the compiled table
      continue
    char = chr(code)
    if version != normalize_lib.LEGACY_VERSION and char in normalize_lib.DROPPED:
      rules[char] = ""
    elif version != normalize_lib.LEGACY_VERSION and char != " " and not norm(char) and char.isspace():
      rules[char] = " "
    elif norm(char) != char and norm(char):
      rules[char] = norm(char)
    if version != normalize_lib.LEGACY_VERSION:
      decomposed = unicodedata.normalize("NFD", char)
      if len(decomposed) > 1 and unicodedata.normalize("NFC", decomposed) == char:
        for k in range(1, len(decomposed)):  # "e" U+0301, and for three-part characters the partly composed form
          source = unicodedata.normalize("NFC", decomposed[:k]) + decomposed[k:]
          if source != char:
            rules[source] = norm(char)
  return tuple(sorted(rules.items()))


def _compiled_charsmap(rules: tuple[tuple[str, str], ...]) -> bytes:
  """SentencePiece's `precompiled_charsmap` for `rules`, compiled by its trainer from a rule TSV."""
  with tempfile.TemporaryDirectory(prefix="spm-rules-") as tmp:
    tsv, corpus = os.path.join(tmp, "rules.tsv"), os.path.join(tmp, "corpus.txt")
    with open(tsv, "w", encoding="utf-8") as f:
      for source, target in rules:
        f.write(" ".join(f"{ord(c):X}" for c in source) + "\t" + " ".join(f"{ord(c):X}" for c in target) + "\n")
    with open(corpus, "w", encoding="utf-8") as f:
      f.write("a b c\n" * 8)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(input=corpus, model_writer=model, model_type="char", vocab_size=8,
                                   hard_vocab_limit=False, normalization_rule_tsv=tsv, minloglevel=2)
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model.getvalue())
  return proto.normalizer_spec.precompiled_charsmap


def with_normalization(model_path: str, output_path: str, *, version: int, lowercase: bool) -> None:
  """Writes `model_path` (a SentencePiece model trained with the `identity` rule on text normalised by
  `normalizer(version, lowercase)`) to `output_path` with that normalisation as its own normaliser.

  The vocabulary, scores and ids are unchanged; `SentencePieceProcessor(output_path).encode(text)` gives the
  pieces `Tokenizer.encode(text)` gives (without EOS). Raises OSError for an unreadable file,
  ValueError for an unknown normalisation version.
  """
  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_path, "rb") as f:
    proto.ParseFromString(f.read())
  rules = normalization_rules(version, lowercase)
  if rules:
    proto.normalizer_spec.name = f"transformer_jax_{normalize_lib.signature(version, lowercase)}"
    proto.normalizer_spec.precompiled_charsmap = _compiled_charsmap(rules)
    proto.normalizer_spec.normalization_rule_tsv = ""
  data = proto.SerializeToString()
  spm.SentencePieceProcessor(model_proto=data)  # loads: a model SentencePiece itself accepts
  with open(output_path, "wb") as f:
    f.write(data)
