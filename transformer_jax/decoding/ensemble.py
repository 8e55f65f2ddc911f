"""Ensembles of step functions: several models decode as one, inside one compiled search.

`ensemble_step(steps)` wraps the `step.TransformerStep`s of N models (or any step functions with the same
vocabulary) into one step function for the searches of `decoding.search`: at every step each model runs
its own step on its own cache (the cache carried by the search is the tuple of the N caches, reordered by each
model's own `gather_cache`), and the ensemble's next-token distribution is the renormalised mean of the models'
log-probabilities (a log-linear, equal-weight combination, as OpenNMT-py's ensemble decoder averages log-probs),
so its score of a sequence is `sum_t [mean_m log p_m(y_t | .) - log sum_v exp(mean_m log p_m(v | .))]`. Since
`log p_m = z_m - logsumexp(z_m)` differs from the logits `z_m` by one constant per row, that renormalised mean
is `log_softmax(mean_m z_m)`: the step returns the mean of the logits and the searches' one log-softmax does the
rest (no log-softmax per model). An ensemble of one model,
or of a model with itself, is that model (up to float rounding). Nothing here knows about the Transformer: a
user's own JAX model gets ensembles by passing its step functions.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from transformer_jax.decoding import search, step as step_lib

Array = jax.Array


def ensemble_step(steps: Sequence[step_lib.TransformerStep]) -> step_lib.TransformerStep:
  """One step function over N models: `(tokens_to_logits, cache, gather_cache)`.

  Args:
    steps: each model's `TransformerStep` (`step.transformer_step_fn`) over the same rows and vocabulary.

  Returns a `TransformerStep` whose `tokens_to_logits` returns the mean of the models' logits `[rows, vocab]`
  float32 (whose log-softmax is the renormalised mean of their log-probs) and whose cache is the tuple of the
  models' caches. Raises ValueError for no steps.
  """
  steps = tuple(steps)
  if not steps:
    raise ValueError("an ensemble needs at least one model")
  if len(steps) == 1:
    return steps[0]

  def tokens_to_logits(state: search.DecodingState):
    logits, caches = [], []
    for step, cache in zip(steps, state.cache):
      model_logits, new_cache = step.tokens_to_logits(state._replace(cache=cache))
      logits.append(model_logits.astype(jnp.float32))
      caches.append(new_cache)
    return sum(logits) / len(steps), tuple(caches)

  def gather_cache(cache, parent: Array):
    return tuple(step.gather_cache(c, parent) for step, c in zip(steps, cache))

  return step_lib.TransformerStep(tokens_to_logits, tuple(step.cache for step in steps), gather_cache)
