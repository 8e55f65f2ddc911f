"""Proposed library patches, applied as monkeypatches so the benchmark can A/B them in one process.

Merged into the library on 2026-11-29 (their variants now measure the library against itself, ~1.0x):
`no_argmax`, `fused_xent` (transformer_jax/training/loss.py) and the heads-major KV cache
(transformer_jax/attention.py). Still a proposal: `dropout_u16`.

Nothing here changes the library's files. Each variant is a context manager that swaps the patched function
in while the train step is *traced* (the first call of a fresh `jit_train_step`); the compiled step keeps it.

* `no_argmax`   - accuracy from `z_y >= max_v z_v` (a max-reduce XLA fuses with logsumexp's) instead of
                  `argmax(logits) == y` (a variadic (value, index) reduce over `[batch, length, vocab]`
                  that XLA:CPU does not vectorise). Ties count as correct (measure-zero for float logits).
* `fused_xent`  - `no_argmax` plus a `jax.custom_vjp` label-smoothed cross-entropy whose backward pass is
                  one fused elementwise pass `g·softmax(z) - g_y·[v == y] - g·ε/V` (an iota compare, no
                  scatter): autodiff of `take_along_axis` builds the target-logit gradient with a scatter into
                  a zero `[batch, length, vocab]` buffer and XLA then transposes that buffer for the weight
                  gradient; `logsumexp`'s backward adds two more full passes.
* `dropout_u16` - dropout masks from 16-bit uniform integers: one threefry draw (uint32) serves two
                  activations (`bits & 0xffff`, `bits >> 16`), keep iff `u16 >= round(rate · 2^16)`
                  (keep probability 0.9000 for rate 0.1, off by < 1e-5). flax's `nn.Dropout` draws a float32
                  uniform per activation: threefry-2x32 (20 rounds, lowered as a rolled loop on CPU) is
                  ~15% of a CPU-preset step.
* `patched`     - all of the above.
* `no_dropout`  - reference only (not a patch): P_drop = 0, the cost of dropout altogether.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import model as model_lib
from transformer_jax.model import Transformer
from transformer_jax.training import loss as loss_lib
from transformer_jax.training import steps

# ----------------------------------------------------------------------------------------------------------
# Loss: custom-vjp label-smoothed cross-entropy (+ accuracy without argmax)
# ----------------------------------------------------------------------------------------------------------


# Merged: the library's loss is this variant now (custom VJP + argmax-free accuracy).
smoothed_xent = loss_lib.smoothed_cross_entropy_and_correct


def _logits(params, batch, config, dropout_rng):
  deterministic = dropout_rng is None
  rngs = None if deterministic else {"dropout": dropout_rng}
  return Transformer(config).apply({"params": params}, batch["inputs"], batch["targets"],
                                   **steps._model_kwargs(batch), deterministic=deterministic, rngs=rngs)


def forward_sums_fused(params, batch, *, config, label_smoothing, dropout_rng):
  """Drop-in for `steps._forward_sums` with `smoothed_xent`."""
  logits = _logits(params, batch, config, dropout_rng)
  targets = batch["targets"]
  weights = steps.token_weights(targets, config.pad_id)
  loss, nll, correct = smoothed_xent(logits, targets, label_smoothing)
  return {"loss_sum": jnp.sum(loss * weights), "nll_sum": jnp.sum(nll * weights),
          "correct_sum": jnp.sum(correct * weights), "token_count": jnp.sum(weights)}


def forward_sums_no_argmax(params, batch, *, config, label_smoothing, dropout_rng):
  """Drop-in for `steps._forward_sums`: the library's loss, accuracy by comparison with the max logit."""
  logits = _logits(params, batch, config, dropout_rng)
  targets = batch["targets"]
  weights = steps.token_weights(targets, config.pad_id)
  loss, nll = steps.label_smoothed_cross_entropy(logits, targets, label_smoothing)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  return {"loss_sum": jnp.sum(loss * weights), "nll_sum": jnp.sum(nll * weights),
          "correct_sum": jnp.sum(correct * weights), "token_count": jnp.sum(weights)}


# ----------------------------------------------------------------------------------------------------------
# Dropout from 16-bit uniforms
# ----------------------------------------------------------------------------------------------------------


class Dropout16(nn.Dropout):
  """`nn.Dropout` with masks from 16-bit uniforms (two per threefry draw). Needs an even last dimension."""

  @nn.compact
  def __call__(self, inputs, deterministic=None, rng=None):
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    *lead, last = inputs.shape
    if last % 2:
      return super().__call__(inputs, deterministic, rng)
    bits = jax.random.bits(rng, (*lead, last // 2), jnp.uint32)
    uniform16 = jnp.concatenate([bits & 0xFFFF, bits >> 16], axis=-1)
    keep = uniform16 >= jnp.uint32(round(self.rate * 65536))
    return jnp.where(keep, inputs / (1.0 - self.rate), jnp.zeros_like(inputs))


# ----------------------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------------------


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
  """Applies variant `name` ('baseline', 'no_argmax', 'fused_xent', 'dropout_u16', 'patched', 'no_dropout'
  - the last changes the config instead, see `variant_config`) for the duration of the block."""
  with contextlib.ExitStack() as stack:
    if name in ("no_argmax",):
      stack.enter_context(_swap(steps, "_forward_sums", forward_sums_no_argmax))
    if name in ("fused_xent", "patched"):
      stack.enter_context(_swap(steps, "_forward_sums", forward_sums_fused))
    if name in ("dropout_u16", "patched"):
      stack.enter_context(_swap(model_lib.nn, "Dropout", Dropout16))
    yield


def variant_config(name: str, config):
  return config.replace(dropout_rate=0.0) if name == "no_dropout" else config


VARIANTS = ("baseline", "no_argmax", "fused_xent", "dropout_u16", "patched", "no_dropout")


def patched_step(config, name: str, **kwargs):
  """A jitted train step of variant `name`: call it like `jit_train_step(config)`'s result."""
  fn = steps.jit_train_step(variant_config(name, config), **kwargs)

  def call(*args):
    with variant(name):  # only the first call traces; later calls hit the compiled cache
      return fn(*args)
  call.lower = lambda *args: _lower(fn, name, *args)
  return call


def _lower(fn, name, *args):
  with variant(name):
    return fn.lower(*args)


# ----------------------------------------------------------------------------------------------------------
# Decoding: the self-attention KV cache kept heads-major, `[batch, heads, cache_len, head_dim]`
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def heads_major_cache():
  """No-op since the library's KV cache is heads-major itself (merged 2026-11-29, 1.38-1.51x faster
  decoding in this benchmark's A/B); kept so the decode section's column reads ~1.0x as a sanity check."""
  yield
