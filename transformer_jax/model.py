"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017, section 3).

Reads top to bottom: positions and embeddings, masks, the feed-forward and the two layer types, the two
stacks, and `Transformer` with `encode`, `decode` and `__call__` (teacher forcing).

Shapes: token ids `[batch, length]`; activations `[batch, length, d_model]`; logits `[batch, length, vocab]`
(float32). Packed rows carry `*_position` (position of each token inside its own example) and
`*_segmentation` (1, 2, ... per example, 0 for padding); attention never crosses examples and positional
encodings restart at every example, so a packed row computes exactly what its examples compute alone.

Initialisation follows the reference implementations (tensor2tensor / fairseq): Xavier-uniform projection
and FFN kernels, zero biases, LayerNorm scale 1 and bias 0, the shared embedding ~ N(0, d_model^-0.5)
(so that after the √d_model scaling the embedded tokens have unit variance).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.attention import SOWN_WEIGHTS, AttentionMask, MultiHeadAttention
from transformer_jax.config import ModelConfig
from transformer_jax.dropout import Dropout

Array = jax.Array

_xavier = nn.initializers.xavier_uniform()

# Submodule names: paths of the parameter tree, and where `attention_weights` finds what the attention layers sow
# (read here, by the module that names them, so nothing else matches these strings).
ENCODER, DECODER = "encoder", "decoder"
SELF_ATTENTION, CROSS_ATTENTION = "self_attention", "cross_attention"


def layer_name(index: int) -> str:
  """The name of layer `index` (0-based) of a stack."""
  return f"layer_{index}"


# ----------------------------------------------------------------------------------------------------------
# Positions (section 3.5) and masks
# ----------------------------------------------------------------------------------------------------------

def sinusoid_table(max_len: int, d_model: int, layout: str = "interleaved") -> np.ndarray:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)): `[max_len, d_model]`.

  `layout="halves"` puts the same sines in columns `[0, ceil(d/2))` and the cosines after them, as
  tensor2tensor, fairseq and Marian (Hugging Face `MarianSinusoidalPositionalEmbedding`) do.
  """
  position = np.arange(max_len, dtype=np.float64)[:, None]
  inv_freq = np.exp(-math.log(10000.0) * np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  table = np.zeros((max_len, d_model), dtype=np.float64)
  if layout == "halves":
    sines = (d_model + 1) // 2
    table[:, :sines] = np.sin(position * inv_freq)
    table[:, sines:] = np.cos(position * inv_freq)[:, : d_model // 2]
    return table.astype(np.float32)
  if layout != "interleaved":
    raise ValueError(f"layout={layout!r}; expected 'interleaved' or 'halves'")
  table[:, 0::2] = np.sin(position * inv_freq)
  table[:, 1::2] = np.cos(position * inv_freq)[:, : d_model // 2]
  return table.astype(np.float32)


def shift_right(targets: Array, bos_id: int, positions: Optional[Array] = None) -> Array:
  """Decoder inputs for teacher forcing: `[bos, y_1, ..., y_{n-1}]`, restarting at every packed example."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
  if positions is not None:
    shifted = jnp.where(positions == 0, bos_id, shifted)
  return shifted


def attention_mask(key_valid: Array, query_segments: Optional[Array] = None,
                   key_segments: Optional[Array] = None, causal: bool = False) -> Array:
  """Boolean mask `[batch, 1, q_len, kv_len]` (True = attend) from key validity `[batch, kv_len]`.

  Padding queries are not masked (their outputs are never used); segments keep packed examples apart.
  """
  mask = key_valid[:, None, None, :]
  if key_segments is not None:
    mask = jnp.logical_and(mask, query_segments[:, None, :, None] == key_segments[:, None, None, :])
  if causal:  # self-attention only: q_len == kv_len
    length = key_valid.shape[-1]
    mask = jnp.logical_and(mask, jnp.tril(jnp.ones((length, length), dtype=bool))[None, None])
  return mask


def self_attention_mask(valid: Array, positions: Optional[Array], segments: Optional[Array], *,
                        causal: bool, window: int) -> AttentionMask:
  """Factorised self-attention mask over `[batch, length]` tokens (same rule as `attention_mask`).

  `positions` (default 0..length-1) are the positions inside each packed example: the local window and
  relative distances are measured in them, so neither crosses or depends on packing.
  """
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32), valid.shape)
  return AttentionMask(valid, positions, positions, segments, segments, causal=causal, window=window)


def cross_attention_mask(source_valid: Array, target_length: int, target_segments: Optional[Array],
                         source_segments: Optional[Array]) -> AttentionMask:
  """Factorised encoder-decoder mask: target queries `[batch, tgt_len]` over source keys `[batch, src_len]`."""
  mask = AttentionMask.from_dense(None, source_valid.shape[0], target_length, source_valid.shape[1])
  return mask.replace(key_valid=source_valid, query_segments=target_segments, key_segments=source_segments)


# ----------------------------------------------------------------------------------------------------------
# Embeddings (section 3.4)
# ----------------------------------------------------------------------------------------------------------

@jax.custom_vjp
def tied_logits(x: Array, embedding: Array) -> Array:
  """Logits `[batch, length, vocab]` (float32) = x `[batch, length, d]` · embedding `[vocab, d]`ᵀ.

  The backward pass is autodiff's, except that the embedding gradient is formed as `(xᵀ g)ᵀ`: autodiff's
  `gᵀ x` contracts the logits gradient g `[batch·length, vocab]` over its major dimension, and XLA:CPU
  first copies g into a transposed `[vocab, batch·length]` buffer (the largest tensor of the step).
  """
  return jnp.einsum("bld,vd->blv", x, embedding, preferred_element_type=jnp.float32)


def _tied_logits_forward(x, embedding):
  return tied_logits(x, embedding), (x, embedding)


def _tied_logits_backward(residuals, g):
  x, embedding = residuals
  g = g.astype(x.dtype)  # [batch, length, vocab], in the compute dtype like autodiff's cotangents
  dx = jnp.einsum("blv,vd->bld", g, embedding)
  d_embedding_t = jnp.einsum("bld,blv->dv", x, g)  # [d, vocab]
  return dx, d_embedding_t.T


tied_logits.defvjp(_tied_logits_forward, _tied_logits_backward)


class Embed(nn.Module):
  """Token embedding `[vocab, d_model]` ~ N(0, d_model^-0.5); `attend` reuses it as the pre-softmax projection."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model ** -0.5), ("vocab", "embed")),
        (cfg.vocab_size, cfg.d_model), jnp.float32)

  def __call__(self, ids: Array) -> Array:
    """ids `[batch, length]` -> `[batch, length, d_model]`, scaled by √d_model when configured."""
    cfg = self.config
    x = jnp.take(self.embedding, ids, axis=0)
    if cfg.scale_embeddings:
      x = x * jnp.sqrt(jnp.float32(cfg.d_model))
    return x.astype(cfg.compute_dtype)

  def attend(self, x: Array) -> Array:
    """x `[batch, length, d_model]` -> logits `[batch, length, vocab]` in float32."""
    return tied_logits(x, self.embedding.astype(self.config.compute_dtype))


class AddPositions(nn.Module):
  """Adds sinusoidal (default) or learned position encodings, then dropout (section 3.5, 5.4).

  With `use_cache` the position is the number of tokens decoded so far, kept in the `cache` collection.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Optional[Array] = None, *, deterministic: bool = True,
               use_cache: bool = False) -> Array:
    cfg = self.config
    batch, length, _ = x.shape
    if use_cache:
      is_initialized = self.has_variable("cache", "position")
      position = self.variable("cache", "position", lambda: jnp.array(0, dtype=jnp.int32))
      positions = jnp.broadcast_to(position.value, (batch, length))
      if is_initialized:
        position.value = position.value + 1
    elif positions is None:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    if cfg.position_embedding == "none":  # relative positions only (max_relative_position > 0)
      return Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
    if cfg.position_embedding == "learned":
      table = self.param("position_embedding",
                         nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, "embed")),
                         (cfg.max_len, cfg.d_model), jnp.float32)
    else:
      table = jnp.asarray(sinusoid_table(cfg.max_len, cfg.d_model, cfg.position_layout))
    x = x + jnp.take(table, positions, axis=0).astype(x.dtype)
    return Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)


# ----------------------------------------------------------------------------------------------------------
# Layers (section 3.1, 3.3)
# ----------------------------------------------------------------------------------------------------------

class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 (section 3.3), inner size d_ff; swish instead of max(0, .) if set.

  With `ffn_glu`, the gated form of Shazeer (2020): (act(x W + b) * (x V + c)) W2 + b2, `V` named `wi_linear`.
  `x` `[batch, length, d_model]` -> `[batch, length, d_model]`; the inner activations `[batch, length, d_ff]`.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    cfg = self.config

    def inner(name):  # x [batch, length, d_model] -> [batch, length, d_ff]
      return nn.Dense(cfg.d_ff, dtype=cfg.compute_dtype, name=name,
                      kernel_init=nn.with_logical_partitioning(_xavier, ("embed", "mlp")),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)

    h = inner("wi")
    h = nn.silu(h) if cfg.activation == "swish" else nn.relu(h)
    if cfg.ffn_glu:
      h = h * inner("wi_linear")
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    if cfg.relu_dropout_rate > 0.0:
      h = Dropout(rate=cfg.relu_dropout_rate)(h, deterministic=deterministic)
    return nn.Dense(cfg.d_model, dtype=cfg.compute_dtype, name="wo",
                    kernel_init=nn.with_logical_partitioning(_xavier, ("mlp", "embed")),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(h)


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.compute_dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class SublayerConnection(nn.Module):
  """Add & Norm around one sublayer.

  post-LN (paper): `LayerNorm(x + Dropout(Sublayer(x)))`; pre-LN: `x + Dropout(Sublayer(LayerNorm(x)))`.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, sublayer, *, deterministic: bool) -> Array:
    cfg = self.config
    norm = _layer_norm(cfg, "layer_norm")
    dropout = Dropout(rate=cfg.dropout_rate)
    if cfg.pre_ln:
      return x + dropout(sublayer(norm(x)), deterministic=deterministic)
    return norm(x + dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  """Self-attention then FFN, each wrapped in Add & Norm (section 3.1)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array, deterministic: bool = True,
               sow_attention_weights: bool = False) -> Array:
    cfg = self.config
    attn = MultiHeadAttention(cfg, name=SELF_ATTENTION)
    x = SublayerConnection(cfg, name="attention_block")(
        x, lambda h: attn(h, h, mask, deterministic=deterministic, sow_attention_weights=sow_attention_weights),
        deterministic=deterministic)
    ffn = FeedForward(cfg, name="ffn")
    x = SublayerConnection(cfg, name="ffn_block")(
        x, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, FFN; each wrapped in Add & Norm (section 3.1)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, y: Array, memory: Array, self_mask: Optional[Array], cross_mask: Array,
               deterministic: bool = True, use_cache: bool = False, max_decode_len: Optional[int] = None,
               sow_attention_weights: bool = False) -> Array:
    cfg = self.config
    self_attn = MultiHeadAttention(cfg, name=SELF_ATTENTION)
    y = SublayerConnection(cfg, name="self_attention_block")(
        y, lambda h: self_attn(h, h, self_mask, deterministic=deterministic, use_cache=use_cache,
                               max_decode_len=max_decode_len, sow_attention_weights=sow_attention_weights),
        deterministic=deterministic)
    cross_attn = MultiHeadAttention(cfg, is_cross=True, name=CROSS_ATTENTION)
    y = SublayerConnection(cfg, name="cross_attention_block")(
        y, lambda h: cross_attn(h, memory, cross_mask, deterministic=deterministic, use_cache=use_cache,
                                sow_attention_weights=sow_attention_weights),
        deterministic=deterministic)
    ffn = FeedForward(cfg, name="ffn")
    y = SublayerConnection(cfg, name="ffn_block")(
        y, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic)
    return nn.with_logical_constraint(y, ("batch", "length", "embed"))


# ----------------------------------------------------------------------------------------------------------
# Stacks and the model
# ----------------------------------------------------------------------------------------------------------

class Encoder(nn.Module):
  """Embedding + positions, then N encoder layers (a final LayerNorm in pre-LN mode)."""

  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, inputs: Array, mask: Array, inputs_position: Optional[Array] = None, *,
               deterministic: bool = True, sow_attention_weights: bool = False) -> Array:
    """inputs `[batch, src_len]` ids, mask `[batch, 1, src_len, src_len]` or an `AttentionMask` ->
    `[batch, src_len, d_model]`."""
    cfg = self.config
    x = self.embed(inputs)
    x = AddPositions(cfg, name="positions")(x, inputs_position, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    layer_cls = nn.remat(EncoderLayer, static_argnums=(3, 4)) if cfg.remat else EncoderLayer
    for i in range(cfg.num_encoder_layers):
      x = layer_cls(cfg, name=layer_name(i))(x, mask, deterministic, sow_attention_weights)
    if cfg.pre_ln:
      x = _layer_norm(cfg, "final_layer_norm")(x)
    return x


class Decoder(nn.Module):
  """Embedding + positions, N decoder layers (final LayerNorm in pre-LN mode), pre-softmax projection."""

  config: ModelConfig
  embed: nn.Module
  output_embed: Optional[nn.Module] = None

  @nn.compact
  def __call__(self, decoder_inputs: Array, memory: Array, self_mask: Optional[Array], cross_mask: Array,
               targets_position: Optional[Array] = None, *, deterministic: bool = True,
               use_cache: bool = False, max_decode_len: Optional[int] = None,
               sow_attention_weights: bool = False) -> Array:
    """decoder_inputs `[batch, tgt_len]` (shifted right) -> logits `[batch, tgt_len, vocab]` (float32)."""
    cfg = self.config
    y = self.embed(decoder_inputs)
    y = AddPositions(cfg, name="positions")(y, targets_position, deterministic=deterministic, use_cache=use_cache)
    y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
    layer_cls = nn.remat(DecoderLayer, static_argnums=(5, 6, 7, 8)) if cfg.remat else DecoderLayer
    for i in range(cfg.num_decoder_layers):
      y = layer_cls(cfg, name=layer_name(i))(y, memory, self_mask, cross_mask, deterministic, use_cache,
                                             max_decode_len, sow_attention_weights)
    if cfg.pre_ln:
      y = _layer_norm(cfg, "final_layer_norm")(y)
    if self.output_embed is not None:
      logits = self.output_embed.attend(y)
    else:
      logits = nn.DenseGeneral(cfg.vocab_size, dtype=cfg.compute_dtype, name="logits",
                               kernel_init=nn.with_logical_partitioning(_xavier, ("embed", "vocab")),
                               bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)))(
                                   y).astype(jnp.float32)
    if cfg.logits_bias:  # Marian's final_logits_bias `[vocab]`, float32
      logits = logits + self.param("logits_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                                   (cfg.vocab_size,), jnp.float32)
    return logits


class Transformer(nn.Module):
  """The encoder-decoder Transformer (section 3, Figure 1) as a pure `flax.linen` module.

  `__call__(inputs, targets)` runs teacher forcing and returns logits `[batch, tgt_len, vocab]` for
  predicting `targets` from `targets` shifted right (BOS first). `encode` and `decode` expose the two halves
  for inference; `decode(..., use_cache=True)` takes one target position per call against a KV cache
  (`cache` collection). Pass `rngs={'dropout': key}` and `deterministic=False` to train.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      self.shared_embed = Embed(cfg, name="shared_embedding")
      source_embed = target_embed = output_embed = self.shared_embed
    else:
      source_embed = Embed(cfg, name="source_embedding")
      target_embed = Embed(cfg, name="target_embedding")
      output_embed = None
    self.encoder = Encoder(cfg, source_embed, name=ENCODER)
    self.decoder = Decoder(cfg, target_embed, output_embed, name=DECODER)

  def encode(self, inputs: Array, inputs_position: Optional[Array] = None,
             inputs_segmentation: Optional[Array] = None, *, deterministic: bool = True,
             sow_attention_weights: bool = False) -> Array:
    """Source ids `[batch, src_len]` (pad = config.pad_id) -> memory `[batch, src_len, d_model]`."""
    mask = self_attention_mask(inputs != self.config.pad_id, inputs_position, inputs_segmentation,
                               causal=False, window=self.config.attention_window)
    return self.encoder(inputs, mask, inputs_position, deterministic=deterministic,
                        sow_attention_weights=sow_attention_weights)

  def decode(self, encoded: Array, inputs: Array, targets: Array, targets_position: Optional[Array] = None,
             inputs_segmentation: Optional[Array] = None, targets_segmentation: Optional[Array] = None, *,
             deterministic: bool = True, use_cache: bool = False, max_decode_len: Optional[int] = None,
             sow_attention_weights: bool = False) -> Array:
    """Logits `[batch, tgt_len, vocab]` (float32) for the targets, given the memory `encoded`.

    Teacher forcing (`use_cache=False`): `targets` `[batch, tgt_len]` are the gold ids, shifted right here.
    Cached decoding (`use_cache=True`): `targets` `[batch, 1]` is the previously emitted token (BOS first);
    `max_decode_len` sizes the self-attention cache on the call that creates it.
    """
    cfg = self.config
    source_valid = inputs != cfg.pad_id
    if use_cache:
      decoder_inputs = targets
      self_mask = None  # causal masking over the cache is done by the attention module
      cross_mask = attention_mask(source_valid)
    else:
      decoder_inputs = shift_right(targets, cfg.bos_id, targets_position)
      target_valid = targets != cfg.pad_id
      self_mask = self_attention_mask(target_valid, targets_position, targets_segmentation, causal=True,
                                      window=cfg.attention_window)
      cross_mask = cross_attention_mask(source_valid, targets.shape[1], targets_segmentation,
                                        inputs_segmentation)
    return self.decoder(decoder_inputs, encoded, self_mask, cross_mask, targets_position,
                        deterministic=deterministic, use_cache=use_cache, max_decode_len=max_decode_len,
                        sow_attention_weights=sow_attention_weights)

  def __call__(self, inputs: Array, targets: Array, inputs_position: Optional[Array] = None,
               targets_position: Optional[Array] = None, inputs_segmentation: Optional[Array] = None,
               targets_segmentation: Optional[Array] = None, *, deterministic: bool = True,
               sow_attention_weights: bool = False) -> Array:
    """Teacher-forced logits `[batch, tgt_len, vocab]` for source `[batch, src_len]`, targets `[batch, tgt_len]`."""
    encoded = self.encode(inputs, inputs_position, inputs_segmentation, deterministic=deterministic,
                          sow_attention_weights=sow_attention_weights)
    return self.decode(encoded, inputs, targets, targets_position, inputs_segmentation,
                       targets_segmentation, deterministic=deterministic,
                       sow_attention_weights=sow_attention_weights)


# ----------------------------------------------------------------------------------------------------------
# The attention weights the layers sow (diagnostics, attention maps, alignment)
# ----------------------------------------------------------------------------------------------------------

ATTENTION_KINDS = ("encoder_self", "decoder_self", "cross")


def sown_attention_weights(intermediates: Mapping, config: ModelConfig) -> dict[str, list[Array]]:
  """The attention weights in the `intermediates` of `Transformer(config).apply(..., sow_attention_weights=True,
  mutable=["intermediates"])`: kind (`ATTENTION_KINDS`) -> one `[batch, heads, q_len, kv_len]` array per layer,
  the first layer first (`encoder_self` `[.., src, src]`, `decoder_self` `[.., tgt, tgt]`, `cross` `[.., tgt, src]`).

  The paths are built from the names this module gives its submodules (`ENCODER`, `layer_name`, ...), so a
  renamed submodule is found under its new name. Raises ValueError naming the first path that holds no sown
  weights (not sown, or sown by a model whose submodules are named otherwise).
  """
  places = {"encoder_self": (ENCODER, SELF_ATTENTION, config.num_encoder_layers),
            "decoder_self": (DECODER, SELF_ATTENTION, config.num_decoder_layers),
            "cross": (DECODER, CROSS_ATTENTION, config.num_decoder_layers)}
  weights = {}
  for kind, (stack, module, layers) in places.items():
    weights[kind] = [_sown(intermediates, (stack, layer_name(i), module, SOWN_WEIGHTS)) for i in range(layers)]
  return weights


def _sown(tree: Mapping, path: tuple[str, ...]) -> Array:
  node = tree
  for depth, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      found = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise ValueError(f"no attention weights sown at {'/'.join(path)}: {'/'.join(path[:depth]) or 'the top'} "
                       f"holds {found}")
    node = node[key]
  return node[0]


def attention_weights(params, config: ModelConfig, inputs: Array, targets: Array) -> dict[str, list[Array]]:
  """Teacher-forced attention weights of `Transformer(config)` with `params` for source `inputs`
  `[batch, src_len]` and `targets` `[batch, tgt_len]` (int32 ids): kind -> one `[batch, heads, q_len, kv_len]`
  float array per layer (`sown_attention_weights`); decoder query t is the position predicting `targets[:, t]`."""
  _, variables = Transformer(config).apply({"params": params}, inputs, targets, sow_attention_weights=True,
                                           mutable=["intermediates"])
  return sown_attention_weights(variables["intermediates"], config)
