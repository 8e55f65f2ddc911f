r"""The Flax peer: the Flax example's WMT model (flax `examples/wmt/models.py`), trained by a plain `jax.jit` step.

    python -m benchmarks.flax_peer     # download + extract the example (what `make bench` runs)

The example is not copied into this repository: `ensure_example` downloads the sdist of the installed flax
version from PyPI (`pip download --no-deps --no-binary :all: flax==<version>`) into the bench cache
(`runs/benchmarks/cache/`, git-ignored), extracts `examples/wmt/models.py` next to it, and `load_models`
imports it from there at bench time. Without network and without a cached copy the bench stops with one line.

Configuration (`example_config`): the same sizes as our `ModelConfig` (d_model, d_ff, heads, layers, max_len,
our vocabulary), one embedding shared by source, target and the pre-softmax projection
(`share_embeddings`, `logits_via_embedding`), the same dropout rates (`dropout_rate` on sublayer outputs and
embeddings, `attention_dropout_rate` = ours). Loss and optimizer (`make_train_step`): the example's
label-smoothed cross-entropy (soft one-hot targets, on 1-ε, off ε/(V-1), weighted by `targets > 0`, divided
by the real target tokens; the example's constant normaliser is left out: it changes no gradient) and the
example's metrics (loss, accuracy); our optimizer (`factories.optimizer`: Adam(0.9, 0.98, 1e-9) with the
paper's rsqrt schedule), which is the example's `optax.adamw` at weight decay 0 with another schedule shape.
The step is `jax.jit(train_step, donate_argnums=0)`; dropout keys are `fold_in(rng, step)` as in the example.

What differs and cannot be avoided without editing the example: it is pre-LN with a final LayerNorm per
stack (ours: post-LN, the paper's), it does not scale embeddings by √d_model but divides the tied logits by
√d_model, and it always builds padding masks from `ids > 0` (with packing also the segment masks).
Packed batches use `inputs_positions` / `targets_positions` / `*_segmentation`; plain batches pass none.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import flax
import jax
import jax.numpy as jnp
from flax.training import train_state

import launch
from benchmarks import common
from transformer_jax.config import ModelConfig
from transformer_jax.run import factories

MODELS_MEMBER = "examples/wmt/models.py"
PACKING_KEYS = {"inputs_position": "inputs_positions", "targets_position": "targets_positions",
                "inputs_segmentation": "inputs_segmentation", "targets_segmentation": "targets_segmentation"}


class ExampleUnavailableError(RuntimeError):
  """The Flax example's models.py is neither cached nor downloadable."""


def example_path(cache: Path = common.CACHE, version: str = flax.__version__) -> Path:
  """Where the extracted `examples/wmt/models.py` of flax `version` lives in the bench cache."""
  return Path(cache) / f"flax-{version}" / MODELS_MEMBER


def _download_sdist(cache: Path, version: str) -> Path:
  sdist = cache / f"flax-{version}.tar.gz"
  if sdist.exists():
    return sdist
  cache.mkdir(parents=True, exist_ok=True)
  proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                         f"flax=={version}", "--dest", str(cache)], capture_output=True, text=True)
  if proc.returncode != 0 or not sdist.exists():
    reason = (proc.stderr.strip().splitlines() or ["no sdist written"])[-1]
    raise ExampleUnavailableError(f"cannot download the flax {version} sdist from PyPI into {cache} "
                                  f"(pip exit {proc.returncode}: {reason}); the Flax peer needs its {MODELS_MEMBER}")
  return sdist


def ensure_example(cache: Path = common.CACHE, version: str = flax.__version__) -> Path:
  """The path of the Flax example's `models.py` for flax `version`, downloaded and extracted if absent.

  Raises ExampleUnavailableError (one line: what failed, where) when PyPI cannot be reached or the sdist
  lacks the file.
  """
  path = example_path(cache, version)
  if path.exists():
    return path
  sdist = _download_sdist(Path(cache), version)
  member = f"flax-{version}/{MODELS_MEMBER}"
  with tarfile.open(sdist) as tar:
    try:
      data = tar.extractfile(member).read()
    except (KeyError, AttributeError):
      raise ExampleUnavailableError(f"{sdist} has no {member}") from None
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_bytes(data)
  tmp.replace(path)
  return path


def load_models(path: Path) -> ModuleType:
  """Imports the example's `models.py` from `path` (as module `flax_wmt_models`)."""
  spec = importlib.util.spec_from_file_location("flax_wmt_models", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def example_config(models: ModuleType, cfg: ModelConfig, deterministic: bool = False):
  """The example's `TransformerConfig` with our sizes; ValueError if encoder and decoder depths differ."""
  if cfg.num_encoder_layers != cfg.num_decoder_layers:
    raise ValueError(f"the Flax example has one num_layers; got {cfg.num_encoder_layers} encoder and "
                     f"{cfg.num_decoder_layers} decoder layers")
  return models.TransformerConfig(
      vocab_size=cfg.vocab_size, output_vocab_size=cfg.vocab_size, share_embeddings=True,
      logits_via_embedding=True, dtype=jnp.float32, emb_dim=cfg.d_model, num_heads=cfg.num_heads,
      num_layers=cfg.num_encoder_layers, qkv_dim=cfg.d_model, mlp_dim=cfg.d_ff, max_len=cfg.max_len,
      dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
      deterministic=deterministic)


def smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> jax.Array:
  """Per-token cross-entropy against soft one-hot targets (on 1-ε, off ε/(V-1)), the example's formulation.

  logits `[batch, length, vocab]` float32, targets `[batch, length]` int32 -> `[batch, length]` float32.
  """
  vocab_size = logits.shape[-1]
  on, off = 1.0 - label_smoothing, label_smoothing / (vocab_size - 1)
  soft_targets = jax.nn.one_hot(targets, vocab_size) * (on - off) + off   # [batch, length, vocab]
  return -jnp.sum(soft_targets * jax.nn.log_softmax(logits), axis=-1)


def model_inputs(batch: dict) -> dict:
  """Our batch keys -> the example's keyword arguments (packing keys only where the batch has them)."""
  out = {"inputs": batch["inputs"], "targets": batch["targets"]}
  out.update({theirs: batch[ours] for ours, theirs in PACKING_KEYS.items() if ours in batch})
  return out


def create_state(models: ModuleType, cfg: ModelConfig, config, rng: jax.Array) -> train_state.TrainState:
  """The example model's parameters (initialised as the example does: deterministic, ones) and our optimizer."""
  model = models.Transformer(example_config(models, cfg, deterministic=True))
  ones = jnp.ones((1, 8), jnp.int32)
  params = jax.jit(model.init)(rng, ones, ones)["params"]
  tx, _ = factories.optimizer(config, cfg.d_model)
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def make_train_step(models: ModuleType, cfg: ModelConfig, config):
  """`jax.jit(train_step, donate_argnums=0)`: `(state, batch, rng) -> (state, {loss, accuracy})`."""
  model = models.Transformer(example_config(models, cfg))

  def train_step(state, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state.step)
    targets = batch["targets"]
    weights = (targets > 0).astype(jnp.float32)                                   # [batch, length]

    def loss_fn(params):
      logits = model.apply({"params": params}, **model_inputs(batch), rngs={"dropout": dropout_rng})
      loss = jnp.sum(smoothed_cross_entropy(logits, targets, config.label_smoothing) * weights)
      return loss / jnp.sum(weights), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * weights) / jnp.sum(weights)
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}

  return jax.jit(train_step, donate_argnums=(0,))


@launch.program
def main() -> None:
  """Downloads and extracts the example (no flags); ExampleUnavailableError is one line, exit status 1."""
  try:
    path = ensure_example()
  except ExampleUnavailableError as e:
    raise ValueError(str(e)) from None
  print(f"Flax example model: {path}")


if __name__ == "__main__":
  launch.run(main)
