"""Attention (Vaswani et al., 2017, section 3.2) in three rooms, each importing only the ones before it:

  core.py      the math: scaled dot-product attention, factorised masks, relative positions, blocked attention
  kvcache.py   the decoding caches (typed entries) and the accessors the decoder calls
  layer.py     `MultiHeadAttention`: projections, dispatch, the cache entry of each layer

The names below are the public API; `transformer_jax.attention.kvcache` is imported as a module.
"""

from transformer_jax.attention.core import (AttentionMask, RelativePositions, blocked_attention,
                                            dot_product_attention, full_attention_weights)
from transformer_jax.attention.layer import SOWN_WEIGHTS, HeadProjection, MultiHeadAttention, OutputProjection

__all__ = ["SOWN_WEIGHTS", "AttentionMask", "HeadProjection", "MultiHeadAttention", "OutputProjection",
           "RelativePositions", "blocked_attention", "dot_product_attention", "full_attention_weights"]
