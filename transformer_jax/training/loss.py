"""Label-smoothed cross-entropy (Vaswani et al., 2017, section 5.4; Szegedy et al., 2016)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.1):
  """Per-token cross-entropy against the smoothed target distribution `(1-ε)·onehot(y) + ε/V`.

  Computed as `logsumexp(z) - (1-ε)·z_y - (ε/V)·Σ_v z_v`, so no `[batch, length, vocab]` one-hot is built,
  with a hand-written backward pass `g·softmax(z) - g·(1-ε)·[v=y] - g·ε/V` (one fused elementwise pass;
  autodiff of the target gather would scatter into a zero `[batch, length, vocab]` buffer instead).

  Args:
    logits: `[batch, length, vocab]`, float32.
    targets: `[batch, length]` int ids.
    label_smoothing: ε_ls (0.1 in the paper).

  Returns:
    `(loss, nll)`, each `[batch, length]`: the smoothed loss that is optimised and the plain negative
    log-likelihood `-log p(y)` (for perplexity).
  """
  loss, nll, _ = smoothed_cross_entropy_and_correct(logits, targets, float(label_smoothing))
  return loss, nll


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def smoothed_cross_entropy_and_correct(logits: jax.Array, targets: jax.Array, label_smoothing: float):
  """`(loss, nll, correct)` per token; `correct` is 1.0 where the target has the highest logit.

  `correct` compares `z_y` with `max_v z_v` (ties count as correct) rather than `argmax(z) == y`: XLA:CPU
  runs the (value, index) argmax reduce over `[batch, length, vocab]` as a scalar loop.
  """
  return _xent_forward(logits, targets, label_smoothing)[0]


def _xent_forward(logits, targets, eps):
  logits = logits.astype(jnp.float32)
  top = jnp.max(logits, axis=-1)
  log_z = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_z - target_logit
  loss = nll if eps == 0.0 else log_z - (1.0 - eps) * target_logit - eps * jnp.mean(logits, axis=-1)
  correct = (target_logit >= top).astype(jnp.float32)
  return (loss, nll, correct), (logits, log_z, targets)


def _xent_backward(eps, residuals, cotangents):
  logits, log_z, targets = residuals
  g_loss, g_nll, _ = cotangents
  vocab = logits.shape[-1]
  is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
  g_target = (g_loss * (1.0 - eps) + g_nll)[..., None]
  grad = ((g_loss + g_nll)[..., None] * jnp.exp(logits - log_z[..., None])
          - jnp.where(is_target, g_target, 0.0) - (g_loss * (eps / vocab))[..., None])
  return grad, None


smoothed_cross_entropy_and_correct.defvjp(_xent_forward, _xent_backward)


def token_weights(targets: jax.Array, pad_id: int) -> jax.Array:
  """1.0 at real (non-pad) target tokens, 0.0 at padding: `[batch, length]` float32.

  `pad_id` is the model's (`ModelConfig.pad_id`: 0 for vocabularies trained here, the last id of an imported
  Marian model, whose EOS is 0); there is no default, so no caller can silently weigh EOS as padding.
  """
  return (targets != pad_id).astype(jnp.float32)


def normalized_loss(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.1, *,
                    pad_id: int) -> jax.Array:
  """Mean label-smoothed loss over the real (`!= pad_id`) target tokens: a float32 scalar.

  `logits` `[batch, length, vocab]`, `targets` `[batch, length]` int ids.
  """
  loss, _ = label_smoothed_cross_entropy(logits, targets, label_smoothing)
  weights = token_weights(targets, pad_id)
  return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)
