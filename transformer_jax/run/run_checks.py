"""A training run's refusals: the config against the model's tables and the mesh, before the workdir is touched;
each training batch against the model's tables, before its step.

Each check raises one line naming the config keys (or the step, row and values) involved, as the programs print
it (`launch.main.USER_ERRORS`). JAX fills out-of-bounds gathers with NaN, so an id or a position past a
table would otherwise train on NaN without an error.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import sharding
from transformer_jax.config import ModelConfig
from transformer_jax.model import Transformer
from transformer_jax.run.experiment_config import DataConfig, ExperimentConfig


def check_position_table(config: ExperimentConfig) -> None:
  """Raises ValueError (one line, naming both keys) unless every position training indexes is in the model's
  position table: a packed row holds examples of up to `data.max_len` tokens (positions 0 .. data.max_len - 1),
  the sinusoid or learned table has `model.max_len` rows, and a position past it would gather NaN (JAX fills
  out-of-bounds gathers with NaN). A model without absolute positions (`position_embedding='none'`, clipped
  relative distances only) has no such table. Checked after `config_for_workdir`, so an imported model's table
  is the one compared."""
  if config.model.position_embedding != "none" and config.data.max_len > config.model.max_len:
    raise ValueError(f"--config.data.max_len={config.data.max_len} exceeds --config.model.max_len="
                     f"{config.model.max_len}, the positions the model's table holds (a longer example would "
                     f"read positions past it); lower data.max_len or raise model.max_len")


def check_backend_dtype(model_config: ModelConfig) -> None:
  """Raises ValueError (one line, naming `model.dtype`, `model.attention_impl` and the backend) unless the
  backend runs a training step of the model's layers with them: a forward and backward pass of a 1+1-layer
  copy of the model (same dtype, attention implementation, heads) on a 1 x 4 batch. XLA:CPU has no float16
  attention ('F16_F16_F32' dot_general), so a float16 run on a CPU host would otherwise die at its first step,
  after the workdir was written. A probe, not a table: what the installed XLA runs is what counts; float32 with
  XLA's attention runs everywhere and is not probed.
  """
  if model_config.dtype == "float32" and model_config.attention_impl == "xla":
    return
  probe_config = model_config.replace(vocab_size=16, d_model=8 * model_config.num_heads,
                                      d_ff=8 * model_config.num_heads, num_encoder_layers=1, num_decoder_layers=1,
                                      max_len=8, max_relative_position=min(model_config.max_relative_position, 2))
  model = Transformer(probe_config)
  ids = jnp.ones((1, 4), jnp.int32)
  try:
    params = model.init(jax.random.PRNGKey(0), ids, ids)
    loss = lambda p: jnp.sum(model.apply(p, ids, ids).astype(jnp.float32))  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(loss))(params))
  except Exception as error:  # pylint: disable=broad-except (XLA's errors: XlaRuntimeError, NotImplementedError)
    reason = " ".join(str(error).split())[:200]
    raise ValueError(f"--config.model.dtype={model_config.dtype} with model.attention_impl="
                     f"{model_config.attention_impl}: the {jax.default_backend()} backend cannot run the model in "
                     f"them ({reason}); choose a dtype and attention_impl it runs (float32 and xla run "
                     "everywhere)") from None


def check_batch_rows(data_config: DataConfig, mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError (one line, naming `data.tokens_per_batch`) unless a packed batch's rows,
  `tokens_per_batch // max_len`, split evenly over the devices of the mesh's batch axes (data x fsdp)."""
  rows, ways = data_config.tokens_per_batch // data_config.max_len, sharding.batch_ways(mesh)
  if rows % ways:
    raise ValueError(f"--config.data.tokens_per_batch={data_config.tokens_per_batch} packs {rows} rows of "
                     f"data.max_len={data_config.max_len} slots, which do not split over the {ways} devices of the "
                     f"mesh {dict(mesh.shape)}: use a multiple of {ways * data_config.max_len} tokens")


class BatchOutOfTableError(ValueError):
  """A training batch holds a token id or a position outside the model's tables (the message names the step,
  the row and the offending values): a gather past a table reads NaN in JAX, so it is refused before the step."""


def check_batch_in_tables(batch: Mapping[str, np.ndarray], model_config: ModelConfig, step: int) -> None:
  """Raises BatchOutOfTableError unless every id of `inputs`/`targets` is in `[0, model.vocab_size)` and, for a
  model with a position table, every `*_position` is below `model.max_len`. Arrays `[rows, length]` or
  `[accum, rows, length]` (rows are numbered through the micro-batches); host NumPy, a few maxima per step."""
  limits = [("inputs", model_config.vocab_size, "token id", "model.vocab_size"),
            ("targets", model_config.vocab_size, "token id", "model.vocab_size")]
  if model_config.position_embedding != "none":
    limits += [("inputs_position", model_config.max_len, "position", "model.max_len"),
               ("targets_position", model_config.max_len, "position", "model.max_len")]
  for key, limit, what, name in limits:
    values = np.asarray(batch[key]).reshape(-1, np.shape(batch[key])[-1])
    bad = (values >= limit) | (values < 0)
    if bad.any():
      row = int(np.argmax(bad.any(axis=1)))
      offending = sorted({int(v) for v in values[row][bad[row]]})[:8]
      raise BatchOutOfTableError(
          f"training batch of step {step}, row {row}: {key} holds {what}s {offending} outside [0, {limit}) "
          f"({name}={limit}); refused before the step (it would read past the table and give NaN)")
