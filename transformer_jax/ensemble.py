"""Ensembles of step functions: several models decode as one, inside one compiled search.

`ensemble_step(steps)` wraps the `decode.TransformerStep`s of N models (or any step functions with the same
vocabulary) into one step function for the searches of `transformer_jax.decode`: at every step each model runs
its own step on its own cache (the cache carried by the search is the tuple of the N caches, reordered by each
model's own `gather_cache`), and the ensemble's next-token log-probabilities are the mean of the models'
log-probabilities (a log-linear, equal-weight combination, as OpenNMT-py's ensemble decoder averages log-probs);
the searches' log-softmax then renormalises it, so the ensemble is a proper distribution and its score of a
sequence is `sum_t [mean_m log p_m(y_t | .) - log sum_v exp(mean_m log p_m(v | .))]`. An ensemble of one model,
or of a model with itself, is that model (up to float rounding). Nothing here knows about the Transformer: a
user's own JAX model gets ensembles by passing its step functions.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from transformer_jax import decode

Array = jax.Array


def ensemble_step(steps: Sequence[decode.TransformerStep]) -> decode.TransformerStep:
  """One step function over N models: `(tokens_to_logits, cache, gather_cache)`.

  Args:
    steps: each model's `TransformerStep` (`decode.transformer_step_fn`) over the same rows and vocabulary.

  Returns a `TransformerStep` whose `tokens_to_logits` returns the mean of the models' log-softmaxed logits
  `[rows, vocab]` float32 and whose cache is the tuple of the models' caches. Raises ValueError for no steps.
  """
  steps = tuple(steps)
  if not steps:
    raise ValueError("an ensemble needs at least one model")
  if len(steps) == 1:
    return steps[0]

  def tokens_to_logits(state: decode.DecodingState):
    log_probs, caches = [], []
    for step, cache in zip(steps, state.cache):
      logits, new_cache = step.tokens_to_logits(state._replace(cache=cache))
      log_probs.append(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
      caches.append(new_cache)
    return sum(log_probs) / len(steps), tuple(caches)

  def gather_cache(cache, parent: Array):
    return tuple(step.gather_cache(c, parent) for step, c in zip(steps, cache))

  return decode.TransformerStep(tokens_to_logits, tuple(step.cache for step in steps), gather_cache)
