"""Attention diagnostics: what a person debugging attention looks at first.

Per layer and head, the mean entropy of the attention distribution (nats) and its normalised entropy
H / log(n), where n is the number of keys the query could attend to (1 = uniform over them, 0 = one key). A
head whose mean normalised entropy is at least `NEAR_UNIFORM` is "near-uniform": it averages its inputs
instead of selecting among them, the usual sign of an untrained, dead or diffuse head (see docs/
attention.md, "When attention misbehaves"). Weights come from the model itself (`model.attention_weights`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig
from transformer_jax.model import ATTENTION_KINDS, attention_weights

Array = jax.Array

NEAR_UNIFORM = 0.9  # mean normalised entropy at or above which a head counts as near-uniform
KINDS = ATTENTION_KINDS


def head_entropy(weights: Array, query_valid: Optional[Array] = None) -> tuple[Array, Array]:
  """Mean entropy and mean normalised entropy per head of weights `[batch, heads, q_len, kv_len]`.

  The support of a query is the keys with non-zero weight (masked keys get exactly 0); queries with a
  support of one key (e.g. the first decoder position) have no meaningful normalised entropy and are left
  out, as are invalid (padding) queries, `query_valid` `[batch, q_len]` bool.

  Returns:
    (entropy `[heads]` in nats, normalised entropy `[heads]` in [0, 1]), float32.
  """
  weights = weights.astype(jnp.float32)
  entropy = -jnp.sum(jnp.where(weights > 0, weights * jnp.log(jnp.where(weights > 0, weights, 1.0)), 0.0),
                     axis=-1)  # [batch, heads, q_len]
  support = jnp.sum(weights > 0, axis=-1)  # [batch, heads, q_len]
  counted = support > 1
  if query_valid is not None:
    counted = counted & query_valid[:, None, :]
  normalised = entropy / jnp.log(jnp.maximum(support, 2).astype(jnp.float32))
  count = jnp.maximum(jnp.sum(counted, axis=(0, 2)), 1)
  mean = lambda x: jnp.sum(jnp.where(counted, x, 0.0), axis=(0, 2)) / count
  return mean(entropy), mean(normalised)


def attention_statistics(params, config: ModelConfig, inputs: Array, targets: Array) -> dict[str, dict]:
  """kind -> {"entropy", "normalised_entropy": `[layers, heads]` float32, "near_uniform_share": float}.

  inputs `[batch, src_len]`, targets `[batch, tgt_len]` token ids (pad = config.pad_id).
  """
  query_valid = {"encoder_self": inputs != config.pad_id, "decoder_self": targets != config.pad_id,
                 "cross": targets != config.pad_id}
  result = {}
  for kind, per_layer in attention_weights(params, config, inputs, targets).items():
    pairs = [head_entropy(w, query_valid[kind]) for w in per_layer]
    normalised = jnp.stack([n for _, n in pairs])  # [layers, heads]
    result[kind] = {"entropy": jnp.stack([e for e, _ in pairs]), "normalised_entropy": normalised,
                    "near_uniform_share": jnp.mean(normalised >= NEAR_UNIFORM)}
  return result


def summary_scalars(statistics: dict[str, dict], prefix: str = "attention") -> dict[str, float]:
  """Flat TensorBoard scalars.

  Keys: `{prefix}/{kind}/layer_{i}/head_{h}/entropy` (nats) and `{prefix}/{kind}/near_uniform_share`.
  """
  scalars = {}
  for kind, stats in statistics.items():
    entropy = np.asarray(stats["entropy"])
    for layer, head in np.ndindex(*entropy.shape):
      scalars[f"{prefix}/{kind}/layer_{layer}/head_{head}/entropy"] = float(entropy[layer, head])
    scalars[f"{prefix}/{kind}/near_uniform_share"] = float(stats["near_uniform_share"])
  return scalars


def format_table(statistics: dict[str, dict]) -> str:
  """A text table: one line per (kind, layer), entropy (normalised) per head, near-uniform heads starred."""
  lines = [f"attention entropy in nats (normalised); * = near-uniform (normalised >= {NEAR_UNIFORM})"]
  for kind, stats in statistics.items():
    entropy, normalised = np.asarray(stats["entropy"]), np.asarray(stats["normalised_entropy"])
    for layer in range(entropy.shape[0]):
      cells = [f"{e:5.2f} ({n:.2f}){'*' if n >= NEAR_UNIFORM else ' '}"
               for e, n in zip(entropy[layer], normalised[layer])]
      lines.append(f"{kind:>12} layer {layer}: " + "  ".join(cells))
    lines.append(f"{kind:>12} near-uniform heads: {100 * float(stats['near_uniform_share']):.0f}%")
  return "\n".join(lines)
