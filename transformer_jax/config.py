"""Model hyperparameters and the paper's presets (Vaswani et al., 2017, Table 3).

`ModelConfig` is a frozen dataclass so it can be a static argument of `jax.jit` and a field of a
`flax.linen.Module`. Training hyperparameters (schedule, batch size, steps) live in the experiment schema
(`experiment_config.py`, which nests `ModelConfig` as its `model` section), the recipes under
`experiments/configs/`, not here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp

from transformer_jax import accelerators

PositionKind = Literal["sinusoidal", "learned", "none"]
AttentionImpl = Literal["xla", "cudnn"]
Activation = Literal["relu", "swish"]
PositionLayout = Literal["interleaved", "halves"]

# Token ids shared by the tokenizer and the model (SentencePiece is trained with these ids).
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

INT32_MAX = 2**31 - 1  # counts, sizes and ids reach JAX as int32 (shapes, indices, step counters)
FLOAT32_MAX = 3.4028234663852886e38  # rates, epsilons and exponents reach JAX as float32

def is_int32(value: Any, low: int = 0) -> bool:
  """An integer (not a bool) in [low, INT32_MAX]: what a JAX shape, index or step counter holds. With
  `experiment_config`'s rules, the one test of an integer config value."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= INT32_MAX


def is_float32(value: Any) -> bool:
  """A finite real number (not a bool) of magnitude <= FLOAT32_MAX: what reaches JAX as a float32 finite.
  With `experiment_config`'s rules, the one test of a number config value."""
  return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
          and abs(value) <= FLOAT32_MAX)


# Integer fields and their smallest value (the largest is INT32_MAX); ids are also checked against vocab_size.
_INTEGER_FIELDS = (("vocab_size", 1), ("num_encoder_layers", 1), ("num_decoder_layers", 1), ("d_model", 1),
                   ("d_ff", 1), ("num_heads", 1), ("max_len", 1), ("max_relative_position", 0),
                   ("attention_window", 0), ("query_chunk_size", 0), ("pad_id", 0), ("bos_id", 0), ("eos_id", 0))


# ModelConfig fields that change how the model runs (regularisation, precision, memory, kernels), not its
# parameters or the function a trained model computes: fine-tuning an imported model may set them; every
# other field is its architecture, fixed by the checkpoint (`imported_workdir.config_for_workdir`).
RUNTIME_FIELDS = ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate", "attention_impl", "dtype", "remat",
                  "query_chunk_size")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and switches of the encoder-decoder Transformer.

  Defaults are the paper's base model (Table 3, row "base") with a 37k shared vocabulary (section 5.1).
  """

  vocab_size: int = 37000
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  # P_drop: on every sublayer output before the residual add and on embedding+position sums (section 5.4).
  dropout_rate: float = 0.1
  # Not in the paper (tensor2tensor added them later); 0 in the paper presets. Attention dropout works with
  # max_relative_position; ValueError with attention_window or query_chunk_size (the blocked path has none).
  attention_dropout_rate: float = 0.0
  relu_dropout_rate: float = 0.0
  # Longest position the positional table covers (sinusoids are computed, learned ones are a parameter).
  max_len: int = 512
  position_embedding: PositionKind = "sinusoidal"
  # Post-LN `LayerNorm(x + Dropout(Sublayer(x)))` as in the paper; pre-LN adds final LayerNorms.
  pre_ln: bool = False
  # One embedding matrix for source, target and the pre-softmax projection (section 3.4).
  share_embeddings: bool = True
  # Multiply embeddings by sqrt(d_model) (section 3.4).
  scale_embeddings: bool = True
  layer_norm_epsilon: float = 1e-6
  attention_impl: AttentionImpl = "xla"
  # Activation / matmul dtype; parameters are always float32, softmax and loss run in float32. 'auto': the
  # backend's rule (`accelerators.BACKEND_CHOICES`: bfloat16 on TPU and GPU, float32 on CPU), resolved by
  # `factories.model_config_from` for the run's devices (config.json records the resolved dtype).
  dtype: str = "float32"
  # Rematerialise each layer's activations in the backward pass (saves memory for long sequences).
  remat: bool = False
  # Long inputs (see attention/core.py; 0 = off). Relative position representations (Shaw et al., 2018): learned
  # key (and, with relative_values, value) embeddings of the distance clipped to +-max_relative_position, per
  # self-attention layer; with position_embedding='none' they replace the absolute sinusoids.
  max_relative_position: int = 0
  relative_values: bool = True
  # Local self-attention: query i sees keys j with |i - j| < attention_window (decoder: i - w < j <= i); the
  # decoder's KV cache then keeps only the last attention_window positions.
  attention_window: int = 0
  # Memory-bounded exact attention (Rabe & Staats, 2021): this many queries (and keys) per block.
  query_chunk_size: int = 0
  pad_id: int = PAD_ID
  bos_id: int = BOS_ID
  eos_id: int = EOS_ID
  # FFN nonlinearity: the paper's ReLU (section 3.3); Marian/OPUS-MT uses swish (= SiLU, x * sigmoid(x)).
  activation: Activation = "relu"
  # Gated FFN (Shazeer, 2020, "GLU Variants Improve Transformer"): FFN(x) = (act(x W) * x V) W2, a second input
  # projection V `[d_model, d_ff]` multiplying the activation elementwise; with activation="swish" it is SwiGLU,
  # with "relu" ReGLU. 3 x d_model x d_ff weights instead of 2, so d_ff x 2/3 keeps the count (Shazeer; t5x's
  # `mlp_activations=("swish", "linear")`). Not in the paper; MarianMTModel has no gated FFN, so no export.
  ffn_glu: bool = False
  # Sinusoid layout: the paper interleaves sin/cos (dims 2i, 2i+1); tensor2tensor, fairseq and Marian put
  # all sines in the first half and all cosines in the second ("halves"). Same frequencies either way.
  position_layout: PositionLayout = "interleaved"
  # A learned bias `[vocab]` added to the output logits (Marian's `final_logits_bias`); not in the paper.
  logits_bias: bool = False

  def __post_init__(self):
    if self.activation == "silu":  # SiLU and swish are one function (x * sigmoid(x))
      object.__setattr__(self, "activation", "swish")
    if self.activation not in ("relu", "swish"):
      raise ValueError(f"activation={self.activation!r}; expected 'relu' or 'swish' (alias 'silu')")
    if not isinstance(self.ffn_glu, bool):
      raise ValueError(f"ffn_glu={self.ffn_glu!r} must be True or False")
    if self.position_layout not in ("interleaved", "halves"):
      raise ValueError(f"position_layout={self.position_layout!r}; expected 'interleaved' or 'halves'")
    self._validate_numbers()
    if self.d_model % self.num_heads:
      raise ValueError(
          f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
    if self.position_embedding not in ("sinusoidal", "learned", "none"):
      raise ValueError(
          f"position_embedding={self.position_embedding!r}; expected 'sinusoidal', 'learned' or 'none'")
    if self.attention_impl not in ("xla", "cudnn"):
      raise ValueError(f"attention_impl={self.attention_impl!r}; expected 'xla' or 'cudnn'")
    if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
      raise ValueError(f"dtype={self.dtype!r}; expected 'float32', 'bfloat16', 'float16' or 'auto'")
    self._validate_long_input_options()

  def _validate_numbers(self):
    """One-line errors for a number field outside its range or its type's (int32 sizes and ids, float32
    rates), or of another type: before any arithmetic on it (num_heads=0 was a ZeroDivisionError)."""
    for name, low in _INTEGER_FIELDS:
      value = getattr(self, name)
      if not is_int32(value, low):
        off = " (0 = off)" if name in ("max_relative_position", "attention_window", "query_chunk_size") else ""
        raise ValueError(f"{name}={value!r} must be an integer in [{low}, {INT32_MAX}]{off}")
    for name in ("pad_id", "bos_id", "eos_id"):
      if getattr(self, name) >= self.vocab_size:
        raise ValueError(f"{name}={getattr(self, name)} must be < vocab_size={self.vocab_size}")
    if self.eos_id in (self.pad_id, self.bos_id):  # BOS may equal pad (Marian starts decoding from <pad>)
      raise ValueError(f"eos_id={self.eos_id} must differ from pad_id={self.pad_id} and bos_id={self.bos_id}")
    for name in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate", "layer_norm_epsilon"):
      value = getattr(self, name)
      if not is_float32(value):
        raise ValueError(f"{name}={value!r} must be a finite number (float32)")
    for name in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
    if not 0.0 < self.layer_norm_epsilon <= FLOAT32_MAX:
      raise ValueError(f"layer_norm_epsilon={self.layer_norm_epsilon} must be in (0, {FLOAT32_MAX:g}] (float32)")

  def _validate_long_input_options(self):
    """One-line errors for max_relative_position, attention_window and query_chunk_size."""
    if self.position_embedding == "none" and not self.max_relative_position:
      raise ValueError("position_embedding='none' needs max_relative_position > 0 (no position signal at all)")
    # Dropout on the attention weights needs them whole: relative positions have it (one exact block), the
    # blocked options (a window, query chunks) do not.
    options = [n for n in ("attention_window", "query_chunk_size") if getattr(self, n)]
    if options and self.attention_dropout_rate > 0.0:
      raise ValueError(f"attention_dropout_rate={self.attention_dropout_rate} is not supported with "
                       f"{', '.join(options)}; set it to 0")

  @property
  def head_dim(self) -> int:
    """d_k = d_v = d_model / h (section 3.2.2)."""
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    """`dtype`; 'auto' (unresolved) is the rule of the default backend (`accelerators.resolve_dtype`)."""
    return jnp.dtype(accelerators.resolve_dtype(self.dtype, jax.default_backend()))

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any], **overrides) -> "ModelConfig":
    """A `ModelConfig` from a mapping of its fields (a run config's `config.model` ConfigDict, or the `model`
    section of a saved `config.json`), with `overrides` (e.g. `vocab_size=` the tokenizer's) on top; fields
    the mapping lacks keep their defaults.

    Raises ValueError naming the unknown fields (and `ModelConfig`'s own range errors).
    """
    values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - fields
    if unknown:
      raise ValueError(f"config.model has unknown fields {sorted(unknown)}; ModelConfig fields are {sorted(fields)}")
    return cls(**{**values, **overrides})


def base(vocab_size: int = 37000, **overrides) -> ModelConfig:
  """Transformer (base): N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1 (Table 3); ~63M params at 37k vocab."""
  return ModelConfig(vocab_size=vocab_size, **overrides)


def big(vocab_size: int = 37000, dropout_rate: float = 0.3, **overrides) -> ModelConfig:
  """Transformer (big): N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 for EN-DE (0.1 for EN-FR) (Table 3)."""
  return ModelConfig(vocab_size=vocab_size, d_model=1024, d_ff=4096, num_heads=16,
                     dropout_rate=dropout_rate, **overrides)


def tiny(vocab_size: int = 1000, **overrides) -> ModelConfig:
  """A small CPU preset (3+3 layers, d_model 128, 4 heads) that trains in minutes on a laptop."""
  values = dict(vocab_size=vocab_size, num_encoder_layers=3, num_decoder_layers=3, d_model=128,
                d_ff=512, num_heads=4, dropout_rate=0.1, max_len=256)
  values.update(overrides)
  return ModelConfig(**values)
