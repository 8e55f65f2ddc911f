"""Ablations: each variant undoes one of the library's speed-ups, so the benchmark measures what each buys.

The training section steps the library's train step ("baseline": the trainer's own compiled step,
`common.build_train_step`) and these variants in the same rounds; "library speed-up" = variant step time /
library step time. Nothing here changes the library's files: a variant builds that same step and swaps a
function in while it is *traced* (its `.lower` or first call); the compiled step keeps it.

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
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import common
from transformer_jax import model as model_lib
from transformer_jax.run.experiment_config import ExperimentConfig
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


def variant_config(name: str, config: ExperimentConfig) -> ExperimentConfig:
  """`config` for variant `name`: with P_drop = 0 for 'no_dropout'."""
  if name != "no_dropout":
    return config
  return dataclasses.replace(config, model=config.model.replace(dropout_rate=0.0))


class _VariantStep:
  """The trainer's compiled step, traced (called or lowered) inside `variant(name)`."""

  def __init__(self, step, name: str):
    self._step, self._name = step, name

  def __call__(self, *args):
    with variant(self._name):  # only the first call traces; later calls hit the compiled cache
      return self._step(*args)

  def lower(self, *args):
    with variant(self._name):
      return self._step.lower(*args)


def variant_step(config, name: str, mesh=None) -> common.TrainStep:
  """`common.build_train_step(config)` for variant `name` ('baseline' is the trainer's step unchanged)."""
  built = common.build_train_step(variant_config(name, config), mesh=mesh)
  return dataclasses.replace(built, step=_VariantStep(built.step, name))
