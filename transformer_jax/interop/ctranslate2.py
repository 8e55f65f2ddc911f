"""Export to CTranslate2 (the inference engine OPUS-MT users deploy with) through its converter API.

The route is ours -> Marian directory (`interop.marian.save_marian`) -> `ctranslate2.converters`
`TransformersConverter`, with one change to CTranslate2's stock `MarianMTLoader` (ctranslate2 4.x,
`converters/transformers.py`): that loader assumes an OPUS-MT vocabulary, where `<pad>` is the last id, its
embedding row is zero and it starts the decoder; it therefore starts decoding from a zero vector and drops the
last vocabulary row. A model trained here starts from a trained BOS embedding (`config.bos_id`) and its last
id is an ordinary piece, so `ExactMarianLoader` starts from `decoder_start_token_id`'s embedding (the BART
loader's behaviour) and keeps the whole vocabulary; for OPUS-MT models both give the same outputs. The
LayerNorm epsilon is written into the model's config (`layer_norm_epsilon`), so CTranslate2 uses ours.

The export's contract (docs/interop.md, "What the exported models add by themselves"): the model directory
holds what CTranslate2 must add to what its documentation feeds a Marian model (source pieces from the model's
`source.spm`, nothing appended), so that `translate_batch` gives our outputs:
* `add_source_eos`: CTranslate2 appends `</s>` to every source, as our tokenizer (and Marian's) does in training
  and translation; `add_source_bos` false; decoding starts from `decoder_start_token` (our BOS piece).
* `source.spm` / `target.spm` apply our text normalisation (and lowercasing) themselves
  (`data.spm_export`), so raw text encodes to our pieces.
* pad and BOS are never emitted: their output bias is `BANNED_LOGIT` (our searches ban them too), so no
  `suppress_sequences` is needed.
* relative positions (Shaw et al.) go into each self-attention's `relative_position_keys` / `_values`
  (zeros for `relative_values=False`) for models with `position_embedding='none'`; with absolute positions too
  they are refused, as CTranslate2 then builds no position encoder (`check_relative_positions`).
* the sinusoid tables hold `max(model.max_len, marian.EXPORT_POSITIONS)` positions (the same function
  extended, as the Marian export's), so no `max_decoding_length` or source up to that length runs past them. Outputs equal ours while
  they fit in `model.max_len` tokens (our decoder's own cap): give `max_decoding_length <= model.max_len`
  (written as `max_decoding_length` in `transformer_jax_export.json`) for identical output on every input.

Needs `ctranslate2`, `transformers` and `torch` (the `interop` extra), imported here only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Sequence

import ctranslate2
import numpy as np
import sentencepiece as spm
import torch
import transformers
from ctranslate2.converters import transformers as ct2_transformers
from ctranslate2.specs import attention_spec, transformer_spec

from transformer_jax.config import ModelConfig
from transformer_jax.data import normalize
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.interop import marian as marian_lib
from transformer_jax.model import sinusoid_table

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16", "int8_float16")
# The output bias of pad and BOS: exp(-1e9) is 0 in float32 and float16, and no -inf reaches a softmax.
BANNED_LOGIT = -1e9
EXPORT_INFO = "transformer_jax_export.json"


class ExactMarianLoader(ct2_transformers.MarianMTLoader):
  """`MarianMTLoader` that keeps the decoder start token's embedding and the full vocabulary; with `relative`
  (`relative_tables`), each self-attention gets Shaw et al.'s tables (CTranslate2's `relative_position_keys` /
  `relative_position_values`, OpenNMT-py's `max_relative_positions`)."""

  def __init__(self, relative: dict | None = None):
    super().__init__()
    self._relative = relative

  def get_model_spec(self, model):
    model.config.normalize_before = False
    model.config.normalize_embedding = False
    spec = ct2_transformers.BartLoader.get_model_spec(self, model)
    if self._relative:
      set_relative_positions(spec, self._relative)
    banned = sorted({model.config.pad_token_id, model.config.decoder_start_token_id})
    bias = torch.zeros(model.config.vocab_size) if spec.decoder.projection.bias is None or isinstance(
        spec.decoder.projection.bias, str) else torch.as_tensor(np.asarray(spec.decoder.projection.bias)).clone()
    bias[banned] = BANNED_LOGIT  # never emitted, as in our searches (`decode._log_probs`)
    spec.decoder.projection.bias = bias
    return spec

  def set_config(self, config: transformer_spec.TransformerConfig, model, tokenizer):
    ct2_transformers.BartLoader.set_config(self, config, model, tokenizer)
    if config.bos_token is None:  # MarianTokenizer has no BOS token; decoding starts from decoder_start_token
      config.bos_token = config.decoder_start_token
    config.add_source_bos = False
    config.add_source_eos = True  # every source ends with </s> in training and in our translation

  def set_position_encodings(self, spec, module):
    """The module's sinusoids extended to `marian.EXPORT_POSITIONS` rows with Marian's formula (sines, then
    cosines)."""
    table = np.asarray(module.weight.detach().cpu().numpy(), np.float32)
    rows = max(table.shape[0], marian_lib.EXPORT_POSITIONS)
    extended = sinusoid_table(rows, table.shape[1], "halves").astype(np.float32)
    if not np.allclose(extended[: table.shape[0]], table, atol=1e-5):
      raise ValueError("the model's position table is not Marian's sinusoids; cannot extend it")
    extended[: table.shape[0]] = table
    spec.encodings = extended

  def set_decoder(self, spec, decoder):
    ct2_transformers.BartLoader.set_decoder(self, spec, decoder)

  def get_vocabulary(self, model, tokenizer):
    return ct2_transformers.BartLoader.get_vocabulary(self, model, tokenizer)


def check_relative_positions(config: ModelConfig) -> None:
  """Raises `UnsupportedModelError` for relative positions with absolute ones: CTranslate2 builds no position
  encoder for a stack whose first self-attention has `relative_position_keys` (`has_positional_embeddings`), so
  only `position_embedding='none'` computes ours (measured: docs/interop.md)."""
  if config.max_relative_position and config.position_embedding != "none":
    raise marian_lib.UnsupportedModelError(
        f"cannot export relative positions with position_embedding={config.position_embedding!r} to CTranslate2: "
        "it drops the absolute positions of a model with relative ones; train with "
        "model.position_embedding='none' (or max_relative_position=0)")


def relative_tables(params, config: ModelConfig) -> dict:
  """`{("encoder"|"decoder", layer): (key, value)}` of a model with relative positions: our self-attention
  tables `relative_key` / `relative_value` `[2k+1, head_dim]` float32 (row `r` embeds the clipped distance
  key - query = r - k, CTranslate2's convention too); `value` is zeros `[2k+1, head_dim]` for
  `relative_values=False` (adds nothing: Σ_j p_ij · 0). Empty without relative positions."""
  if not config.max_relative_position:
    return {}
  out = {}
  for side, layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    for i in range(layers):
      attention = params[side][f"layer_{i}"]["self_attention"]
      key = np.asarray(attention["relative_key"], np.float32)
      value = np.asarray(attention.get("relative_value", np.zeros_like(key)), np.float32)
      out[(side, i)] = (key, value)
  return out


def without_relative(params, config: ModelConfig) -> tuple[dict, ModelConfig]:
  """(params, config) with the relative tables removed: what `save_marian` holds (the rest of the network)."""
  def strip(tree):
    if not isinstance(tree, collections.abc.Mapping):
      return tree
    return {k: strip(v) for k, v in tree.items() if k not in ("relative_key", "relative_value")}
  return strip(params), dataclasses.replace(config, max_relative_position=0, relative_values=False,
                                            position_embedding="sinusoidal")


def set_relative_positions(spec, relative: dict) -> None:
  """Puts `relative` (`relative_tables`) into every self-attention of `spec` (a `TransformerSpec`)."""
  for (side, i), (key, value) in relative.items():
    layer = getattr(spec, side).layer[i]
    attention = attention_spec.MultiHeadAttentionSpec(self_attention=True, relative_position=True)
    for name, field in vars(layer.self_attention).items():  # linear, layer_norm, queries_scale
      if not name.startswith("_"):
        setattr(attention, name, field)
    attention.relative_position_keys = key  # [2k+1, head_dim]
    attention.relative_position_values = value  # [2k+1, head_dim]
    layer.self_attention = attention
  for side in (spec.encoder, spec.decoder):  # CTranslate2 reads no absolute positions with relative ones
    if hasattr(side, "position_encodings"):
      del side.position_encodings


class MarianDirectoryConverter(ct2_transformers.TransformersConverter):
  """Converts a `save_pretrained` Marian directory with `ExactMarianLoader`, in float32 weights."""

  def __init__(self, model_dir: str, layer_norm_epsilon: float = marian_lib.MARIAN_LAYER_NORM_EPSILON,
               relative: dict | None = None):
    super().__init__(model_dir)
    self._layer_norm_epsilon = layer_norm_epsilon
    self._relative = relative

  def _load(self):
    with torch.no_grad():
      model = transformers.MarianMTModel.from_pretrained(self._model_name_or_path, dtype=torch.float32)
      tokenizer = transformers.MarianTokenizer.from_pretrained(self._model_name_or_path)
      spec = ExactMarianLoader(self._relative)(model, tokenizer)
    spec.config.layer_norm_epsilon = self._layer_norm_epsilon
    for name in marian_lib.MARIAN_TOKENIZER_FILES:  # SentencePiece models travel with the model
      spec.register_file(os.path.join(self._model_name_or_path, name))
    return spec


def convert_marian_directory(model_dir: str, output_dir: str, *, quantization: str | None = None,
                             layer_norm_epsilon: float = marian_lib.MARIAN_LAYER_NORM_EPSILON,
                             relative: dict | None = None) -> str:
  """A CTranslate2 model directory from a Marian directory (plus `relative`, `relative_tables`); returns
  `output_dir`.

  Raises:
    ValueError: an unknown `quantization` (allowed: `QUANTIZATIONS`).
    FileExistsError: `output_dir` exists and is not empty.
  """
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(f"{output_dir} exists and is not empty; choose a new --output")
  converter = MarianDirectoryConverter(model_dir, layer_norm_epsilon, relative)
  return converter.convert(output_dir, quantization=quantization, force=True)


def export_ctranslate2(params, config: ModelConfig, output_dir: str, *, tokenizer_path: str,
                       quantization: str | None = None) -> str:
  """Our model -> a CTranslate2 model directory (with source.spm, target.spm, vocab.json); nothing is left
  behind on failure. `tokenizer_path`: our `spm.model`, or a Marian tokenizer directory."""
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(f"{output_dir} exists and is not empty; choose a new --output")
  check_relative_positions(config)
  parent = os.path.dirname(os.path.abspath(output_dir))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".ct2-", dir=parent) as tmp:
    marian_dir = os.path.join(tmp, "marian")
    relative = relative_tables(params, config)
    marian_lib.save_marian(*without_relative(params, config), marian_dir, tokenizer_path=tokenizer_path)
    staged = os.path.join(tmp, "ct2")
    convert_marian_directory(marian_dir, staged, quantization=quantization,
                             layer_norm_epsilon=config.layer_norm_epsilon, relative=relative)
    with open(os.path.join(staged, EXPORT_INFO), "w", encoding="utf-8") as f:
      json.dump(export_info(config, tokenizer_path), f, indent=1)
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)
    shutil.move(staged, output_dir)
  return output_dir


def export_info(config: ModelConfig, tokenizer_path: str) -> dict:
  """What `transformer_jax_export.json` records of the export's contract (docs/interop.md)."""
  if os.path.isdir(tokenizer_path):  # an imported Marian model's own tokenizer files, copied as they are
    normalization = "the imported model's own source.spm rules"
  else:
    ours = Tokenizer(tokenizer_path)
    normalization = normalize.signature(ours.normalization, ours.lowercase)
  return {"source_eos": "added by CTranslate2 (config.json add_source_eos): feed source pieces without </s>",
          "decoder_start": "added by CTranslate2 (config.json decoder_start_token)",
          "normalization": f"{normalization}, applied by source.spm itself: encode raw text with it",
          "banned_outputs": "pad and BOS have output bias %g: never emitted, as in transformer_jax" % BANNED_LOGIT,
          "trained_positions": config.max_len,
          "position_table": (f"none: relative positions (max_relative_position={config.max_relative_position})"
                             if config.max_relative_position
                             else max(config.max_len, marian_lib.EXPORT_POSITIONS)),
          "max_decoding_length": config.max_len,
          "min_decoding_length": "CTranslate2's default 1 bars an empty output, which ours allows (0 matches ours)",
          "identical_outputs": "to transformer_jax's decoder for sources of up to max_decoding_length pieces with "
                               "max_decoding_length <= this value (our decoder's own cap)"}


def translator(model_dir: str, *, compute_type: str = "float32", threads: int = 1) -> ctranslate2.Translator:
  """A CPU `ctranslate2.Translator` with `threads` intra-op threads (one inter-op replica).

  Raises:
    ValueError: `model_dir` is not a CTranslate2 model directory (CTranslate2's own RuntimeError, e.g. an
      unsupported `model.bin` version, named in one line).
  """
  if not os.path.isfile(os.path.join(model_dir, "model.bin")):
    raise ValueError(f"{model_dir} is not a CTranslate2 model directory (no model.bin)")
  try:
    return ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type, inter_threads=1,
                                  intra_threads=threads)
  except (RuntimeError, ValueError) as error:
    raise ValueError(f"{model_dir} is not a CTranslate2 model this ctranslate2 {ctranslate2.__version__} can "
                     f"load: {error}") from None


def source_pieces(model_dir: str, lines: Sequence[str]) -> list[list[str]]:
  """The source pieces of `lines` as CTranslate2's documentation makes them for a Marian model: the model
  directory's `source.spm` applied to the raw text, nothing appended."""
  path = os.path.join(model_dir, marian_lib.SOURCE_SPM)
  try:
    processor = spm.SentencePieceProcessor(model_file=path)
  except (OSError, RuntimeError) as error:
    raise ValueError(f"{path}: not a SentencePiece model ({error})") from None
  return [processor.encode(line, out_type=str) for line in lines]


def translate_pieces(translator: ctranslate2.Translator, sources: Sequence[Sequence[str]], *, beam_size: int = 1,
                     length_penalty: float = 0.0, extra_len: int = 50, max_len: int | None = None,
                     min_decoding_length: int = 1, max_batch_size: int = 64) -> list[list[str]]:
  """CTranslate2 outputs (pieces, without EOS) in input order, capped like `inference.translate_ids`.

  `sources` are source pieces as CTranslate2's documentation gives them to a Marian model: the exported
  `source.spm`'s pieces of the text, nothing appended (the exported model appends `</s>` itself). Sources
  are grouped by length so that each gets our cap, `min(len(source) + extra_len, max_len)` tokens (EOS
  included; `max_len`: the model's `max_len`, our decoder's own cap; None = no such cap). CTranslate2's
  `length_penalty` divides by `|Y|^length_penalty` (GNMT's `((5+|Y|)/6)^alpha` in ours): equal at 0.
  `min_decoding_length`: CTranslate2's default 1 never gives an empty output (EOS is barred from the first
  step); ours allows one, so pass 0 to compare the two searches on a model that may end at once.
  """
  groups = collections.defaultdict(list)
  for i, p in enumerate(sources):
    groups[len(p)].append(i)
  out: list[list[str]] = [[] for _ in sources]
  for length, idx in groups.items():
    cap = length + extra_len if max_len is None else min(length + extra_len, max_len)
    results = translator.translate_batch(
        [list(sources[i]) for i in idx], beam_size=beam_size, length_penalty=length_penalty,
        max_decoding_length=max(cap, 1), min_decoding_length=min_decoding_length, max_batch_size=max_batch_size)
    for i, r in zip(idx, results):
      out[i] = r.hypotheses[0]
  return out
