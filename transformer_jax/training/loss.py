"""Label-smoothed cross-entropy (Vaswani et al., 2017, section 5.4; Szegedy et al., 2016)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.1):
  """Per-token cross-entropy against the smoothed target distribution `(1-ε)·onehot(y) + ε/V`.

  Computed as `logsumexp(z) - (1-ε)·z_y - (ε/V)·Σ_v z_v`, so no `[batch, length, vocab]` one-hot is built.

  Args:
    logits: `[batch, length, vocab]`, float32.
    targets: `[batch, length]` int ids.
    label_smoothing: ε_ls (0.1 in the paper).

  Returns:
    `(loss, nll)`, each `[batch, length]`: the smoothed loss that is optimised and the plain negative
    log-likelihood `-log p(y)` (for perplexity).
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_z - target_logit
  if label_smoothing == 0.0:
    return nll, nll
  mean_logit = jnp.mean(logits, axis=-1)
  loss = log_z - (1.0 - label_smoothing) * target_logit - label_smoothing * mean_logit
  return loss, nll


def token_weights(targets: jax.Array, pad_id: int = 0) -> jax.Array:
  """1.0 at real (non-pad) target tokens, 0.0 at padding: `[batch, length]` float32."""
  return (targets != pad_id).astype(jnp.float32)


def normalized_loss(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.1,
                    pad_id: int = 0) -> jax.Array:
  """Mean label-smoothed loss over the real (non-pad) target tokens: a scalar."""
  loss, _ = label_smoothed_cross_entropy(logits, targets, label_smoothing)
  weights = token_weights(targets, pad_id)
  return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)
