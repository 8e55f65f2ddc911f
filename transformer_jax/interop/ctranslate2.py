"""Export to CTranslate2 (the inference engine OPUS-MT users deploy with) through its converter API.

The route is ours -> Marian directory (`interop.marian.save_marian`) -> `ctranslate2.converters`
`TransformersConverter`, with one change to CTranslate2's stock `MarianMTLoader` (ctranslate2 4.x,
`converters/transformers.py`): that loader assumes an OPUS-MT vocabulary, where `<pad>` is the last id, its
embedding row is zero and it starts the decoder; it therefore starts decoding from a zero vector and drops the
last vocabulary row. A model trained here starts from a trained BOS embedding (`config.bos_id`) and its last
id is an ordinary piece, so `ExactMarianLoader` starts from `decoder_start_token_id`'s embedding (the BART
loader's behaviour) and keeps the whole vocabulary; for OPUS-MT models both give the same outputs. The
LayerNorm epsilon is written into the model's config (`layer_norm_epsilon`), so CTranslate2 uses ours.

Needs `ctranslate2`, `transformers` and `torch` (the `interop` extra), imported here only.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from typing import Sequence

import ctranslate2
import torch
import transformers
from ctranslate2.converters import transformers as ct2_transformers

from transformer_jax.interop import marian as marian_lib

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16", "int8_float16")


class ExactMarianLoader(ct2_transformers.MarianMTLoader):
  """`MarianMTLoader` that keeps the decoder start token's embedding and the full vocabulary."""

  def get_model_spec(self, model):
    model.config.normalize_before = False
    model.config.normalize_embedding = False
    return ct2_transformers.BartLoader.get_model_spec(self, model)

  def set_config(self, config, model, tokenizer):
    ct2_transformers.BartLoader.set_config(self, config, model, tokenizer)
    if config.bos_token is None:  # MarianTokenizer has no BOS token; decoding starts from decoder_start_token
      config.bos_token = config.decoder_start_token

  def set_decoder(self, spec, decoder):
    ct2_transformers.BartLoader.set_decoder(self, spec, decoder)

  def get_vocabulary(self, model, tokenizer):
    return ct2_transformers.BartLoader.get_vocabulary(self, model, tokenizer)


class MarianDirectoryConverter(ct2_transformers.TransformersConverter):
  """Converts a `save_pretrained` Marian directory with `ExactMarianLoader`, in float32 weights."""

  def __init__(self, model_dir: str, layer_norm_epsilon: float = marian_lib.MARIAN_LAYER_NORM_EPSILON):
    super().__init__(model_dir)
    self._layer_norm_epsilon = layer_norm_epsilon

  def _load(self):
    with torch.no_grad():
      model = transformers.MarianMTModel.from_pretrained(self._model_name_or_path, dtype=torch.float32)
      tokenizer = transformers.MarianTokenizer.from_pretrained(self._model_name_or_path)
      spec = ExactMarianLoader()(model, tokenizer)
    spec.config.layer_norm_epsilon = self._layer_norm_epsilon
    for name in marian_lib.MARIAN_TOKENIZER_FILES:  # SentencePiece models travel with the model
      spec.register_file(os.path.join(self._model_name_or_path, name))
    return spec


def convert_marian_directory(model_dir: str, output_dir: str, *, quantization: str | None = None,
                             layer_norm_epsilon: float = marian_lib.MARIAN_LAYER_NORM_EPSILON) -> str:
  """A CTranslate2 model directory from a Marian directory; returns `output_dir`.

  Raises:
    ValueError: an unknown `quantization` (allowed: `QUANTIZATIONS`).
    FileExistsError: `output_dir` exists and is not empty.
  """
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(f"{output_dir} exists and is not empty; choose a new --output")
  converter = MarianDirectoryConverter(model_dir, layer_norm_epsilon)
  return converter.convert(output_dir, quantization=quantization, force=True)


def export_ctranslate2(params, config, output_dir: str, *, tokenizer_path: str,
                       quantization: str | None = None) -> str:
  """Our model -> a CTranslate2 model directory (with source.spm, target.spm, vocab.json); nothing is left
  behind on failure. `tokenizer_path`: our `spm.model`, or a Marian tokenizer directory."""
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(f"{output_dir} exists and is not empty; choose a new --output")
  parent = os.path.dirname(os.path.abspath(output_dir))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".ct2-", dir=parent) as tmp:
    marian_dir = os.path.join(tmp, "marian")
    marian_lib.save_marian(params, config, marian_dir, tokenizer_path=tokenizer_path)
    staged = os.path.join(tmp, "ct2")
    convert_marian_directory(marian_dir, staged, quantization=quantization,
                             layer_norm_epsilon=config.layer_norm_epsilon)
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)
    shutil.move(staged, output_dir)
  return output_dir


def translator(model_dir: str, *, compute_type: str = "float32", threads: int = 1) -> ctranslate2.Translator:
  """A CPU `ctranslate2.Translator` with `threads` intra-op threads (one inter-op replica)."""
  return ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type, inter_threads=1,
                                intra_threads=threads)


def translate_pieces(translator: ctranslate2.Translator, sources: Sequence[Sequence[str]], *, beam_size: int = 1,
                     length_penalty: float = 0.0, extra_len: int = 50, banned: Sequence[str] = (),
                     max_batch_size: int = 64) -> list[list[str]]:
  """CTranslate2 outputs (pieces, without EOS) in input order, capped like `inference.translate_ids`.

  `sources` are source pieces ending with EOS (what our tokenizer's `pieces(encode(text))` gives). Sources
  are grouped by length so that each gets our cap, `len(source without EOS) + extra_len` tokens; `banned`
  pieces are never emitted (pass pad and BOS as our searches do). CTranslate2's `length_penalty` divides by
  `|Y|^length_penalty` (GNMT's `((5+|Y|)/6)^alpha` in ours): the two coincide at 0.
  """
  groups = collections.defaultdict(list)
  for i, p in enumerate(sources):
    groups[len(p)].append(i)
  out: list[list[str]] = [[] for _ in sources]
  for length, idx in groups.items():
    results = translator.translate_batch(
        [list(sources[i]) for i in idx], beam_size=beam_size, length_penalty=length_penalty,
        max_decoding_length=length - 1 + extra_len, max_batch_size=max_batch_size,
        suppress_sequences=[[b] for b in banned] or None)
    for i, r in zip(idx, results):
      out[i] = r.hypotheses[0]
  return out
