"""Ablations: each variant undoes one of the library's speed-ups, so the benchmark measures what each buys.

The training section steps the library's train step ("baseline") and these variants in the same rounds;
"library speed-up" = variant step time / library step time. Nothing here changes the library's files: a
variant swaps a function in while the train step is *traced* (the first call of a fresh `jit_train_step`);
the compiled step keeps it.

* `flax_dropout`     - `flax.linen.Dropout` instead of `transformer_jax.dropout.Dropout`: the same masks,
                       drawn through `jax.random.bernoulli`, whose Threefry hash XLA:CPU runs as a rolled
                       loop per dropout site with a `uint32` buffer in between (ours: unrolled and fused).
* `autodiff_logits`  - the tied output projection differentiated by autodiff: the embedding gradient
                       `gᵀx` makes XLA:CPU copy the `[tokens, vocab]` logits gradient into a transposed
                       buffer (ours: `(xᵀg)ᵀ`, `model.tied_logits`).
* `autodiff_loss`    - label-smoothed cross-entropy by autodiff and accuracy by `argmax(logits) == y`: a
                       scatter of the target-logit gradient into a zero `[tokens, vocab]` buffer, logsumexp's
                       extra backward passes, and a (value, index) reduce XLA:CPU runs as a scalar loop
                       (ours: `loss.smoothed_cross_entropy_and_correct`, one fused backward pass).
* `unoptimized`      - all three undone: the library as it stood before this work.
* `no_dropout`       - reference only, not an ablation: P_drop = 0, what dropout costs altogether.

Not an in-process ablation: glibc huge pages for XLA's host buffers (`experiments/__init__.py`), a process
setting; the suite's `hugepages_off` section reruns the CPU-preset step without them.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import model as model_lib
from transformer_jax.training import steps

VARIANTS = ("baseline", "flax_dropout", "autodiff_logits", "autodiff_loss", "unoptimized", "no_dropout")


def _autodiff_attend(self, x):
  emb = self.embedding.astype(self.config.compute_dtype)
  return jnp.einsum("bld,vd->blv", x, emb, preferred_element_type=jnp.float32)


def _autodiff_smoothed_xent(logits, targets, eps):
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_z - target_logit
  loss = log_z - (1.0 - eps) * target_logit - eps * jnp.mean(logits, axis=-1)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return loss, nll, correct


@contextlib.contextmanager
def _swap(obj, name, value):
  old = getattr(obj, name)
  setattr(obj, name, value)
  try:
    yield
  finally:
    setattr(obj, name, old)


@contextlib.contextmanager
def variant(name: str):
  """Undoes what variant `name` names for the duration of the block ('no_dropout' changes the config
  instead, see `variant_config`)."""
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; one of {VARIANTS}")
  with contextlib.ExitStack() as stack:
    if name in ("flax_dropout", "unoptimized"):
      stack.enter_context(_swap(model_lib, "Dropout", nn.Dropout))
    if name in ("autodiff_logits", "unoptimized"):
      stack.enter_context(_swap(model_lib.Embed, "attend", _autodiff_attend))
    if name in ("autodiff_loss", "unoptimized"):
      stack.enter_context(_swap(steps, "smoothed_cross_entropy_and_correct", _autodiff_smoothed_xent))
    yield


def variant_config(name: str, config):
  return config.replace(dropout_rate=0.0) if name == "no_dropout" else config


def variant_step(config, name: str, **kwargs):
  """A jitted train step of variant `name`: call it like `jit_train_step(config)`'s result."""
  fn = steps.jit_train_step(variant_config(name, config), **kwargs)

  def call(*args):
    with variant(name):  # only the first call traces; later calls hit the compiled cache
      return fn(*args)

  def lower(*args):
    with variant(name):
      return fn.lower(*args)

  call.lower = lower
  return call
