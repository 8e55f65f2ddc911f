"""Word alignment from the cross-attention (fairseq `--print-alignment`): one source position per target token.

For each decoded target token, the source position that the last decoder layer's cross-attention, averaged over
its heads (and over the models of an ensemble), weighs most when the model predicts that token (teacher
forced on the hypothesis: the cached decoder computes the same attention). The source's EOS and padding are
never chosen. Printed in the Pharaoh format `i-j` (source index i, target index j, 0-based, subword tokens).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig
from transformer_jax.model import attention_weights

Array = jax.Array


def cross_attention_alignment(params_list: Sequence, config: ModelConfig, inputs: Array,
                              targets: Array) -> Array:
  """Source position `[batch, tgt_len]` int32 of each target token (argmax of the last layer's attention).

  Args:
    params_list: the parameters of one model, or of each model of an ensemble (averaged attention).
    config: their `ModelConfig`.
    inputs: `[batch, src_len]` int32 source ids (pad = `config.pad_id`, ending with EOS).
    targets: `[batch, tgt_len]` int32 hypotheses (EOS then pad at the end).

  Positions after a target's last token hold arbitrary values; read them only for the real tokens.
  """
  weights = 0.0
  for params in params_list:
    cross = attention_weights(params, config, inputs, targets)["cross"][-1]  # [b, heads, T, S]
    weights = weights + jnp.mean(cross.astype(jnp.float32), axis=1)
  allowed = (inputs != config.pad_id) & (inputs != config.eos_id)  # [b, S]
  weights = jnp.where(allowed[:, None, :], weights, -1.0)
  return jnp.argmax(weights, axis=-1).astype(jnp.int32)


def pharaoh(source_positions: Sequence[int]) -> str:
  """`'i-j i-j ...'`: target token j aligned to source token i (one link per target token)."""
  return " ".join(f"{i}-{j}" for j, i in enumerate(source_positions))
