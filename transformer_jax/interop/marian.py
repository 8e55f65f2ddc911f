"""Hugging Face Marian (OPUS-MT) checkpoints <-> this library's parameters, both ways, exactly.

`MarianMTModel` (transformers 5.x, `models/marian/modeling_marian.py`) is the paper's base architecture with
four conventions the paper preset does not use; the `ModelConfig` options that express them:

| Marian                                               | ModelConfig                                     |
|------------------------------------------------------|-------------------------------------------------|
| `activation_function` swish (SiLU)                   | `activation="swish"`                            |
| sinusoids as [all sines, all cosines]                | `position_layout="halves"`                      |
| `final_logits_bias` `[1, vocab]`                     | `logits_bias=True` (`decoder/logits_bias`)      |
| `nn.LayerNorm` epsilon 1e-5 (fixed in the code)      | `layer_norm_epsilon=1e-5`                       |
| `pad_token_id`, `decoder_start_token_id` (= pad), `eos_token_id` | `pad_id`, `bos_id`, `eos_id`        |

Weights: PyTorch `nn.Linear` stores `[out, in]`; our kernels are `[in, heads, head_dim]` (Q/K/V),
`[heads, head_dim, out]` (W^O) and `[in, out]` (FFN). Supported: shared source/target/output embeddings,
post-LN, sinusoidal positions, equal encoder/decoder FFN sizes and head counts; anything else raises
`UnsupportedModelError` naming the variant.

Export of a model trained with the paper's interleaved sinusoids permutes the hidden dimension (`[0, 2, 4, ...,
1, 3, 5, ...]`) of every parameter: the network computes the same function (LayerNorm statistics and all
matmuls are invariant under a consistent permutation) and its position table becomes Marian's.

The array conversions need only NumPy; reading/writing weights needs `safetensors` (or `torch` for
`pytorch_model.bin`), both from the `interop` extra, which this module needs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
import sentencepiece as spm
import torch
import transformers
from safetensors.numpy import load_file, save_file

from transformer_jax.config import ModelConfig
from transformer_jax.data import spm_export
from transformer_jax.data.marian_vocab import (EOS_PIECE, MARIAN_TOKENIZER_FILES, PAD_PIECE, SOURCE_SPM,
                                              TARGET_SPM, TOKENIZER_NAME, VOCAB_JSON, MarianVocabulary)
from transformer_jax.data.tokenizer import Tokenizer, VocabularyError
from transformer_jax.model import sinusoid_table
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.training import optimizer, steps
from transformer_jax.training.steps import init_params
from transformer_jax.workdir import IMPORTED_DATASET, Workdir

MARIAN_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default; MarianMTModel does not make it configurable
# Positions an exported model's sinusoid tables hold at least: CTranslate2's default `max_input_length` (1024,
# which also covers its default `max_decoding_length`, 256) and more than `generate`'s defaults; the same function
# extended, so no runtime cap up to this reads past the table. The trained length is kept beside it.
EXPORT_POSITIONS = 1024
TRAINED_MAX_LEN_KEY = "transformer_jax_max_len"  # config.json: our model.max_len, restored by the importer
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu"}


class UnsupportedModelError(ValueError):
  """The directory is not a Marian model, or a Marian variant this library cannot represent."""


# ----------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------------------------------------

def read_marian_config(model_dir: str) -> dict:
  """`config.json` of a `save_pretrained` directory; raises `UnsupportedModelError` if it is not Marian's."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.isdir(model_dir):
    raise NotADirectoryError(f"{model_dir}: not a directory")
  if not os.path.isfile(path):
    raise UnsupportedModelError(f"{model_dir}: no config.json; not a save_pretrained Marian directory")
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except ValueError as e:
    raise UnsupportedModelError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(hf, dict) or hf.get("model_type") != "marian":
    kind = hf.get("model_type") if isinstance(hf, dict) else None
    raise UnsupportedModelError(f"{path}: model_type={kind!r}, expected 'marian' (MarianMTModel)")
  return hf


def _unsupported_variant(hf: Mapping[str, Any]) -> str | None:
  """A description of the first Marian variant we cannot represent, or None."""
  checks = [
      (not hf.get("share_encoder_decoder_embeddings", True),
       "separate source/target embeddings (share_encoder_decoder_embeddings=false)"),
      (hf.get("decoder_vocab_size") not in (None, hf.get("vocab_size")),
       f"a separate target vocabulary (decoder_vocab_size={hf.get('decoder_vocab_size')} != "
       f"vocab_size={hf.get('vocab_size')})"),
      (not hf.get("tie_word_embeddings", True), "an untied output projection (tie_word_embeddings=false)"),
      (bool(hf.get("normalize_before", False)), "pre-LN layers (normalize_before=true)"),
      (bool(hf.get("normalize_embedding", False)) or bool(hf.get("add_final_layer_norm", False)),
       "a LayerNorm on the embeddings or after the stacks (normalize_embedding/add_final_layer_norm)"),
      (not hf.get("static_position_embeddings", True), "learned position embeddings"),
      (hf.get("encoder_ffn_dim") != hf.get("decoder_ffn_dim"),
       f"different encoder/decoder FFN sizes ({hf.get('encoder_ffn_dim')} vs {hf.get('decoder_ffn_dim')})"),
      (hf.get("encoder_attention_heads") != hf.get("decoder_attention_heads"),
       f"different encoder/decoder head counts ({hf.get('encoder_attention_heads')} vs "
       f"{hf.get('decoder_attention_heads')})"),
      (hf.get("activation_function", "swish") not in _ACTIVATIONS,
       f"activation_function={hf.get('activation_function')!r} (supported: {', '.join(_ACTIVATIONS)})"),
  ]
  return next((what for bad, what in checks if bad), None)


def model_config_from_marian(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
  """`ModelConfig` computing what `MarianMTModel(MarianConfig(**hf))` computes.

  Raises:
    UnsupportedModelError: a variant we do not support (the message says which).
  """
  problem = _unsupported_variant(hf)
  if problem:
    raise UnsupportedModelError(f"{source}: unsupported Marian variant: {problem}")
  try:
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), num_encoder_layers=int(hf["encoder_layers"]),
        num_decoder_layers=int(hf["decoder_layers"]), d_model=int(hf["d_model"]),
        d_ff=int(hf["encoder_ffn_dim"]), num_heads=int(hf["encoder_attention_heads"]),
        dropout_rate=float(hf.get("dropout", 0.1)), attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        relu_dropout_rate=float(hf.get("activation_dropout", 0.0)),
        max_len=int(hf.get(TRAINED_MAX_LEN_KEY, hf.get("max_position_embeddings", 512))),
        position_embedding="sinusoidal", pre_ln=False,
        share_embeddings=True, scale_embeddings=bool(hf.get("scale_embedding", True)),
        layer_norm_epsilon=MARIAN_LAYER_NORM_EPSILON,
        pad_id=int(hf["pad_token_id"]), bos_id=int(hf.get("decoder_start_token_id", hf["pad_token_id"])),
        eos_id=int(hf["eos_token_id"]), activation=_ACTIVATIONS[hf.get("activation_function", "swish")],
        position_layout="halves", logits_bias=True)
  except KeyError as e:
    raise UnsupportedModelError(f"{source}: missing key {e.args[0]!r}") from None


def marian_config_from_model(config: ModelConfig) -> dict:
  """The `config.json` of a `MarianMTModel` computing what `Transformer(config)` computes.

  Raises:
    UnsupportedModelError: learned or no absolute positions, relative positions, a local attention window,
      pre-LN, separate embeddings or a gated FFN (MarianMTModel has none of them).
  """
  if config.position_embedding != "sinusoidal":
    raise UnsupportedModelError(f"cannot export position_embedding={config.position_embedding!r}: MarianMTModel "
                                "has sinusoids only")
  if config.max_relative_position:
    raise UnsupportedModelError(f"cannot export relative positions (max_relative_position="
                                f"{config.max_relative_position}) to Marian: MarianMTModel has none (the CTranslate2 "
                                "export holds them with position_embedding='none'); train with max_relative_position=0")
  if config.attention_window:
    raise UnsupportedModelError(f"cannot export local attention (attention_window={config.attention_window}): "
                                "MarianMTModel attends to every position")
  if config.pre_ln:
    raise UnsupportedModelError("cannot export a pre-LN model: MarianMTModel is post-LN")
  if not config.share_embeddings:
    raise UnsupportedModelError("cannot export separate embeddings: export supports the shared embedding only")
  if config.ffn_glu:
    raise UnsupportedModelError("cannot export a gated feed-forward (ffn_glu): MarianMTModel's FFN has no gate")
  return {
      "architectures": ["MarianMTModel"], "model_type": "marian", "is_encoder_decoder": True,
      "vocab_size": config.vocab_size, "decoder_vocab_size": config.vocab_size, "d_model": config.d_model,
      "encoder_layers": config.num_encoder_layers, "decoder_layers": config.num_decoder_layers,
      "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
      "encoder_attention_heads": config.num_heads, "decoder_attention_heads": config.num_heads,
      "activation_function": config.activation,
      "max_position_embeddings": max(config.max_len, EXPORT_POSITIONS), TRAINED_MAX_LEN_KEY: config.max_len,
      "scale_embedding": config.scale_embeddings, "dropout": config.dropout_rate,
      "attention_dropout": config.attention_dropout_rate, "activation_dropout": config.relu_dropout_rate,
      "pad_token_id": config.pad_id, "eos_token_id": config.eos_id, "forced_eos_token_id": None,
      "decoder_start_token_id": config.bos_id, "share_encoder_decoder_embeddings": True,
      "tie_word_embeddings": True, "static_position_embeddings": True, "normalize_before": False,
      "dtype": "float32",
  }


def generation_config(config: ModelConfig, max_length: int | None = None) -> dict:
  """`generation_config.json`: what `generate` must do by itself to search as ours does.

  Our search's start/stop ids; pad and BOS never emitted (`bad_words_ids`); no EOS forced at the cap (ours
  stops there without one); at most `config.max_len` output tokens (`max_length` counts the decoder start
  too), so no default run reads a position past the table; beam search without a length penalty that stops
  only when no live beam can beat the best finished one (`length_penalty` 0, `early_stopping` "never"): ours
  at alpha 0. Greedy by default (`num_beams` 1), as `experiments.translate`.
  """
  banned = sorted({config.pad_id, config.bos_id})
  return {"decoder_start_token_id": config.bos_id, "eos_token_id": config.eos_id, "pad_token_id": config.pad_id,
          "forced_eos_token_id": None, "bad_words_ids": [[i] for i in banned],
          "max_length": (max_length or config.max_len) + 1, "num_beams": 1, "length_penalty": 0.0,
          "early_stopping": "never"}


# ----------------------------------------------------------------------------------------------------------
# Weights: HF state dict (numpy) <-> our params
# ----------------------------------------------------------------------------------------------------------

def _linear_to_heads(w: np.ndarray, config: ModelConfig) -> np.ndarray:
  """torch `[heads*head_dim, d_model]` -> our Q/K/V kernel `[d_model, heads, head_dim]`."""
  return w.T.reshape(config.d_model, config.num_heads, config.head_dim)


def _linear_from_heads(w: np.ndarray) -> np.ndarray:
  """Our Q/K/V kernel `[d_model, heads, head_dim]` -> torch `[heads*head_dim, d_model]`."""
  return w.reshape(w.shape[0], -1).T


def _attention_to_ours(state, prefix: str, config: ModelConfig) -> dict:
  out = {}
  for hf_name, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
    out[ours] = {"kernel": _linear_to_heads(state[f"{prefix}.{hf_name}.weight"], config),
                 "bias": state[f"{prefix}.{hf_name}.bias"].reshape(config.num_heads, config.head_dim)}
  w_o = state[f"{prefix}.out_proj.weight"]  # [d_model, heads*head_dim]
  out["out"] = {"kernel": w_o.T.reshape(config.num_heads, config.head_dim, config.d_model),
                "bias": state[f"{prefix}.out_proj.bias"]}
  return out


def _attention_to_hf(p: Mapping, prefix: str) -> dict:
  out = {}
  for hf_name, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
    out[f"{prefix}.{hf_name}.weight"] = _linear_from_heads(p[ours]["kernel"])
    out[f"{prefix}.{hf_name}.bias"] = p[ours]["bias"].reshape(-1)
  kernel = p["out"]["kernel"]  # [heads, head_dim, d_model]
  out[f"{prefix}.out_proj.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
  out[f"{prefix}.out_proj.bias"] = p["out"]["bias"]
  return out


def _norm_to_ours(state, prefix: str) -> dict:
  return {"layer_norm": {"scale": state[f"{prefix}.weight"], "bias": state[f"{prefix}.bias"]}}


def _ffn_to_ours(state, prefix: str) -> dict:
  return {"wi": {"kernel": state[f"{prefix}.fc1.weight"].T, "bias": state[f"{prefix}.fc1.bias"]},
          "wo": {"kernel": state[f"{prefix}.fc2.weight"].T, "bias": state[f"{prefix}.fc2.bias"]}}


# (our block name, HF LayerNorm name) per layer type
_ENCODER_NORMS = (("attention_block", "self_attn_layer_norm"), ("ffn_block", "final_layer_norm"))
_DECODER_NORMS = (("self_attention_block", "self_attn_layer_norm"),
                  ("cross_attention_block", "encoder_attn_layer_norm"), ("ffn_block", "final_layer_norm"))


def _embedding(state: Mapping[str, np.ndarray]) -> np.ndarray:
  for key in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
    if key in state:
      return state[key]
  raise UnsupportedModelError("no shared embedding (model.shared.weight) in the weights")


def _check_tied_and_positions(state: Mapping[str, np.ndarray], config: ModelConfig, embedding: np.ndarray):
  for key in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
    if key in state and not np.array_equal(state[key], embedding):
      raise UnsupportedModelError(f"unsupported Marian variant: {key} differs from the shared embedding "
                                  "(untied embeddings)")
  for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
    if key in state and not np.allclose(state[key], sinusoid_table(len(state[key]), config.d_model, "halves"),
                                        atol=1e-5):
      raise UnsupportedModelError(f"unsupported Marian variant: {key} is not the sinusoid table")


def params_from_marian(state: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
  """Our params tree (float32 NumPy) from a `MarianMTModel` state dict (`{name: array}`).

  Raises:
    UnsupportedModelError: untied embeddings, a non-sinusoidal position table, or missing weights.
  """
  state = {k: np.asarray(v, np.float32) for k, v in state.items()}
  embedding = _embedding(state)
  _check_tied_and_positions(state, config, embedding)
  try:
    params: dict[str, Any] = {"shared_embedding": {"embedding": embedding}, "encoder": {}, "decoder": {}}
    for i in range(config.num_encoder_layers):
      hf = f"model.encoder.layers.{i}"
      layer = {"self_attention": _attention_to_ours(state, f"{hf}.self_attn", config), "ffn": _ffn_to_ours(state, hf)}
      layer.update({ours: _norm_to_ours(state, f"{hf}.{name}") for ours, name in _ENCODER_NORMS})
      params["encoder"][f"layer_{i}"] = layer
    for i in range(config.num_decoder_layers):
      hf = f"model.decoder.layers.{i}"
      layer = {"self_attention": _attention_to_ours(state, f"{hf}.self_attn", config),
               "cross_attention": _attention_to_ours(state, f"{hf}.encoder_attn", config),
               "ffn": _ffn_to_ours(state, hf)}
      layer.update({ours: _norm_to_ours(state, f"{hf}.{name}") for ours, name in _DECODER_NORMS})
      params["decoder"][f"layer_{i}"] = layer
  except KeyError as e:
    raise UnsupportedModelError(f"weight {e.args[0]!r} missing: not a {config.num_encoder_layers}+"
                                f"{config.num_decoder_layers}-layer MarianMTModel") from None
  if config.logits_bias:
    bias = state.get("final_logits_bias", np.zeros((1, config.vocab_size), np.float32))
    params["decoder"]["logits_bias"] = bias.reshape(-1)
  return params


def _layer_to_hf(p: Mapping, prefix: str, attentions, norms) -> dict:
  out = {}
  for ours, hf in attentions:
    out.update(_attention_to_hf(p[ours], f"{prefix}.{hf}"))
  for ours, hf in norms:
    out[f"{prefix}.{hf}.weight"] = p[ours]["layer_norm"]["scale"]
    out[f"{prefix}.{hf}.bias"] = p[ours]["layer_norm"]["bias"]
  out[f"{prefix}.fc1.weight"], out[f"{prefix}.fc1.bias"] = p["ffn"]["wi"]["kernel"].T, p["ffn"]["wi"]["bias"]
  out[f"{prefix}.fc2.weight"], out[f"{prefix}.fc2.bias"] = p["ffn"]["wo"]["kernel"].T, p["ffn"]["wo"]["bias"]
  return out


def marian_state_from_params(params: Mapping, config: ModelConfig) -> dict[str, np.ndarray]:
  """A `MarianMTModel` state dict (contiguous float32 NumPy) from our params (positions Marian's layout).

  A model with `position_layout="interleaved"` is first permuted to the halves layout (`to_halves_layout`).
  """
  marian_config_from_model(config)  # raises for what Marian cannot hold
  params = _to_numpy(params)
  if config.position_layout == "interleaved":
    params = to_halves_layout(params, config)
  state = {"model.shared.weight": params["shared_embedding"]["embedding"]}
  for i in range(config.num_encoder_layers):
    state.update(_layer_to_hf(params["encoder"][f"layer_{i}"], f"model.encoder.layers.{i}",
                              (("self_attention", "self_attn"),), _ENCODER_NORMS))
  for i in range(config.num_decoder_layers):
    state.update(_layer_to_hf(params["decoder"][f"layer_{i}"], f"model.decoder.layers.{i}",
                              (("self_attention", "self_attn"), ("cross_attention", "encoder_attn")),
                              _DECODER_NORMS))
  bias = params["decoder"].get("logits_bias", np.zeros((config.vocab_size,), np.float32))
  state["final_logits_bias"] = bias.reshape(1, -1)
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


def _to_numpy(params: Mapping) -> dict:
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), nn.unbox(params))


def halves_permutation(d_model: int) -> np.ndarray:
  """Hidden-unit order `[0, 2, 4, ..., 1, 3, 5, ...]`: interleaved table[:, perm] == halves table."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def to_halves_layout(params: Mapping, config: ModelConfig) -> dict:
  """Params of an interleaved-sinusoid model permuted along every `embed` (d_model) axis so that the same
  network, with `position_layout="halves"`, computes the same outputs (up to float summation order)."""
  perm = halves_permutation(config.d_model)
  boxed = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  names = jax.tree_util.tree_map(lambda b: tuple(getattr(b, "names", ())), boxed,
                                 is_leaf=lambda x: isinstance(x, nn.Partitioned))

  def permute(x, axis_names):
    for axis, name in enumerate(axis_names):
      if name == "embed":
        x = np.take(x, perm, axis=axis)
    return x

  return jax.tree_util.tree_map(permute, _to_numpy(params), names,
                                is_leaf=lambda x: isinstance(x, tuple))


# ----------------------------------------------------------------------------------------------------------
# Directories
# ----------------------------------------------------------------------------------------------------------

def load_marian_state(model_dir: str) -> dict[str, np.ndarray]:
  """The weights of a `save_pretrained` directory as NumPy arrays (safetensors first, else pytorch_model.bin)."""
  safetensors_path, bin_path = (os.path.join(model_dir, f) for f in WEIGHT_FILES)
  if os.path.isfile(safetensors_path):
    return load_file(safetensors_path)
  if os.path.isfile(bin_path):
    return {k: v.float().numpy() for k, v in torch.load(bin_path, map_location="cpu", weights_only=True).items()}
  raise UnsupportedModelError(f"{model_dir}: no weights ({' or '.join(WEIGHT_FILES)}); sharded checkpoints "
                              "are not supported")


def check_marian_tokenizer(model_dir: str, config: ModelConfig) -> MarianVocabulary:
  """Loads the tokenizer files and checks them against the model's ids and vocabulary size.

  Raises:
    UnsupportedModelError: separate source/target vocabularies (`target_vocab.json`).
    VocabularyError: missing files, or `vocab.json` disagreeing with config.json (size, `</s>`, `<pad>` ids).
  """
  if os.path.exists(os.path.join(model_dir, "target_vocab.json")):
    raise UnsupportedModelError(f"{model_dir}: unsupported Marian variant: separate source/target "
                                "vocabularies (target_vocab.json)")
  vocab = MarianVocabulary(model_dir)
  path = os.path.join(model_dir, VOCAB_JSON)
  if vocab.vocab_size != config.vocab_size:
    raise VocabularyError(f"{path}: ids run to {vocab.vocab_size - 1} but config.json has "
                          f"vocab_size={config.vocab_size}")
  for piece, want, key in ((EOS_PIECE, config.eos_id, "eos_token_id"), (PAD_PIECE, config.pad_id, "pad_token_id")):
    if vocab.encoder[piece] != want:
      raise VocabularyError(f"{path}: {piece!r} has id {vocab.encoder[piece]} but config.json {key}={want}")
  return vocab


def load_marian(model_dir: str) -> tuple[ModelConfig, dict, MarianVocabulary]:
  """`(ModelConfig, params, tokenizer)` of a `save_pretrained` Marian directory; validated, nothing written."""
  config = model_config_from_marian(read_marian_config(model_dir), os.path.join(model_dir, "config.json"))
  vocab = check_marian_tokenizer(model_dir, config)
  params = params_from_marian(load_marian_state(model_dir), config)
  return config, params, vocab


def shared_spm_tokenizer_files(spm_path: str, directory: str) -> None:
  """Marian tokenizer files for our one shared SentencePiece model: source.spm = target.spm = it, with our
  text normalisation (and lowercasing, for a case-folded vocabulary) as its own normaliser
  (`spm_export.with_normalization`), so a runtime that feeds raw text to it (`MarianTokenizer`, CTranslate2
  users) gets the pieces our `Tokenizer` gives; `vocab.json` = its own piece ids (model ids unchanged)."""
  ours = Tokenizer(spm_path)
  processor = spm.SentencePieceProcessor(model_file=spm_path)
  vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
  for name in (SOURCE_SPM, TARGET_SPM):
    spm_export.with_normalization(spm_path, os.path.join(directory, name), version=ours.normalization,
                                  lowercase=ours.lowercase)
  with open(os.path.join(directory, VOCAB_JSON), "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False, indent=1)


def copy_marian_tokenizer_files(source_dir: str, directory: str) -> None:
  for name in MARIAN_TOKENIZER_FILES:
    shutil.copyfile(os.path.join(source_dir, name), os.path.join(directory, name))


def save_marian(params: Mapping, config: ModelConfig, output_dir: str, *, tokenizer_path: str,
                source_lang: str | None = None, target_lang: str | None = None) -> None:
  """Writes a directory that `MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load.

  `tokenizer_path` is our `spm.model` (shared vocabulary) or a directory with Marian's three tokenizer files.
  The directory is assembled in a temporary sibling and renamed into place, so a failure writes nothing.

  Raises:
    UnsupportedModelError: what Marian cannot represent (learned positions, pre-LN, separate embeddings, a
      gated FFN). A lowercased vocabulary is exported with lowercasing in its SentencePiece normaliser.
    FileExistsError: `output_dir` exists and is not empty.
  """
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(f"{output_dir} exists and is not empty; choose a new --output")
  hf_config = marian_config_from_model(config)
  if config.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON:
    logging.info("layer_norm_epsilon=%g; MarianMTModel's LayerNorm uses %g (logits differ by ~1e-5; the "
                 "CTranslate2 export keeps ours)", config.layer_norm_epsilon, MARIAN_LAYER_NORM_EPSILON)
  state = marian_state_from_params(params, config)
  parent = os.path.dirname(os.path.abspath(output_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".marian-", dir=parent)
  try:
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(tmp, "config.json"), hf_config)
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(config))
    if os.path.isdir(tokenizer_path):
      copy_marian_tokenizer_files(tokenizer_path, tmp)
    else:
      shared_spm_tokenizer_files(tokenizer_path, tmp)
    _write_json(os.path.join(tmp, "tokenizer_config.json"), {
        "tokenizer_class": "MarianTokenizer", "source_lang": source_lang, "target_lang": target_lang,
        "model_max_length": config.max_len, "separate_vocabs": False})
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)
    os.replace(tmp, output_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _write_json(path: str, value: Mapping) -> None:
  """A Hugging Face directory's JSON file (`save_pretrained`'s layout: indented, keys in their order, UTF-8)."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------
# Workdirs: an imported model as if trained here
# ----------------------------------------------------------------------------------------------------------

MARIAN_TOKENIZER = TOKENIZER_NAME  # `config.data.tokenizer` of an imported workdir; its files are in <workdir>/vocab


def workdir_config(config: ModelConfig, model_dir: str) -> dict:
  """The `config.json` of an imported workdir: the model, and a data section naming the Marian tokenizer and
  no dataset yet (`workdir.IMPORTED_DATASET`, until `experiments.train` fine-tunes it)."""
  return {"seed": 0, "model": dataclasses.asdict(config),
          "data": {"dataset": IMPORTED_DATASET, "tokenizer": MARIAN_TOKENIZER, "vocab_path": "",
                   "vocab_size": config.vocab_size, "max_len": config.max_len},
          "imported_from": os.path.abspath(model_dir)}


def import_to_workdir(model_dir: str, workdir: str) -> dict:
  """Converts a Marian directory into a workdir (config.json, vocab/, checkpoints/0) for `translate`,
  `evaluate`, `attention_map` and fine-tuning with `experiments.train`; returns the workdir config. Validates
  everything before writing anything. Checkpoint 0 holds the parameters (its Adam state is a fresh one that
  fine-tuning does not read: `imported_workdir.restore_import` starts a fresh optimizer at the imported step).

  Raises:
    UnsupportedModelError, VocabularyError: see `load_marian`.
    FileExistsError: `workdir` exists and is not empty.
  """
  if os.path.isdir(workdir) and os.listdir(workdir):
    raise FileExistsError(f"{workdir} exists and is not empty; choose a new --workdir")
  config, params, _ = load_marian(model_dir)
  value = workdir_config(config, model_dir)
  parent = os.path.dirname(os.path.abspath(workdir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".import-", dir=parent)
  staged = Workdir(tmp)  # the workdir's layout, assembled in a temporary sibling
  try:
    staged.vocab_dir.mkdir()
    copy_marian_tokenizer_files(model_dir, os.fspath(staged.vocab_dir))
    staged.write_config(value)
    state = steps.TrainState.create(apply_fn=None, params=jax.tree_util.tree_map(jax.numpy.asarray, params),
                                    tx=optimizer.adam_with_schedule(config.d_model))
    with checkpoint_lib.Checkpointer(os.fspath(staged.checkpoints), enable_async_checkpointing=False) as ckpt:
      saved = ckpt.save(0, state, jax.random.key(0), None, value, force=True)
    checkpoint_lib.require_saved(saved, os.fspath(staged.checkpoints), 0)
    if os.path.isdir(workdir):
      os.rmdir(workdir)
    os.replace(tmp, workdir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return value


def generate_ids(model_dir: str, lines: Sequence[str], *, beam_size: int = 1, extra_len: int = 50,
                 max_len: int | None = None, batch_size: int = 32) -> list[list[int]]:
  """Output ids (without the decoder start and EOS) of an exported directory used as Hugging Face documents a
  Marian model: `MarianTokenizer(lines)` (raw text; it appends `</s>`), then `MarianMTModel.generate` with the
  directory's generation config and `num_beams=beam_size`. Each output is capped at `min(len(source) + extra_len,
  max_len)` new tokens like `inference.translate_ids` (`len(source)` without EOS; `max_len` None: no such cap).
  Lines are grouped by cap and padded into batches of `batch_size`."""
  tokenizer = transformers.MarianTokenizer.from_pretrained(model_dir)
  model = transformers.MarianMTModel.from_pretrained(model_dir).eval()
  lengths = [len(tokenizer(line)["input_ids"]) - 1 for line in lines]
  caps = [n + extra_len if max_len is None else min(n + extra_len, max_len) for n in lengths]
  out: list[list[int]] = [[] for _ in lines]
  eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
  for cap in sorted(set(caps)):
    idx = [i for i, c in enumerate(caps) if c == cap]
    for start in range(0, len(idx), batch_size):
      chunk = idx[start:start + batch_size]
      batch = tokenizer([lines[i] for i in chunk], return_tensors="pt", padding=True)
      with torch.no_grad():
        generated = model.generate(**batch, num_beams=beam_size, max_length=max(cap, 1) + 1)  # + the start
      for i, row in zip(chunk, generated[:, 1:].tolist()):
        row = row[: row.index(eos)] if eos in row else row
        out[i] = [t for t in row if t != pad]
  return out
