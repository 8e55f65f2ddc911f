"""Forced decoding: the model's log-probability of given target sequences (fairseq `--score-reference`,
CTranslate2 `score_batch`), for data filtering and quality estimation.

`token_log_probs` runs the decoder once, teacher forced, over the whole target (the same logits the cached
search computes step by step) and returns each target token's log-probability; `sequence_log_probs` is their
sum (an independent check of the searches' scores). Perplexity of a sentence is `exp(-sum / count)` over its
tokens, EOS included.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig
from transformer_jax.model import Transformer

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("config",))
def token_log_probs(params, config: ModelConfig, inputs: Array, targets: Array) -> Array:
  """Log-probability `[batch, tgt_len]` float32 (natural log) of each token of `targets`, 0 at pad.

  Args:
    params: the model's parameters; config: its `ModelConfig`.
    inputs: `[batch, src_len]` int32 source ids ending with EOS, padded with `config.pad_id`.
    targets: `[batch, tgt_len]` int32 target ids (BOS excluded) ending with EOS, padded.
  """
  logits = Transformer(config).apply({"params": nn.unbox(params)}, inputs, targets)  # [b, T, V]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  token_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(targets != config.pad_id, token_logp, 0.0)


@functools.partial(jax.jit, static_argnames=("config",))
def sequence_log_probs(params, config: ModelConfig, inputs: Array, targets: Array) -> Array:
  """Sum of the model's log-probs of `targets` [batch, tgt_len] (pad after EOS ignored), teacher forced."""
  logits = Transformer(config).apply({"params": nn.unbox(params)}, inputs, targets)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  token_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(targets != config.pad_id, token_logp, 0.0), axis=-1)
