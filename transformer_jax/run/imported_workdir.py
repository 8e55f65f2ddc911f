"""The imported-workdir policy: what a training run does in a workdir that holds an imported model.

`experiments.import_marian` converts a Marian (Hugging Face) model into a workdir: `config.json` (its
architecture, `data.tokenizer` "marian", `data.dataset` `workdir.IMPORTED_DATASET`), the vocabulary and one
checkpoint of parameters. Training there fine-tunes that model:

- `config_for_workdir`: the model's architecture and tokenizer come from the workdir, whatever the recipe says;
  a flag the user set that contradicts them is refused (its run-time fields, e.g. dropout, stay the user's);
- `check_adopted`: a config that did not go through `config_for_workdir` is refused;
- the first fine-tune may choose its dataset and the model's run-time fields: only `workdir.IMPORTED_DATA_KEYS`
  and `workdir.IMPORTED_MODEL_KEYS` of the saved config must match (any other workdir: all of the data and model);
- `restore_import`: the imported parameters with a fresh optimizer state, at the imported step;
- `with_provenance`: the import's `imported_from` is kept in `config.json` through its fine-tunes.

A workdir holding no import: every function here leaves the run as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import jax
import numpy as np

from transformer_jax import sharding
from transformer_jax.config import RUNTIME_FIELDS, ModelConfig
from transformer_jax.data.marian_vocab import TOKENIZER_NAME as MARIAN_TOKENIZER
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import steps
from transformer_jax.workdir import IMPORTED_DATASET, Workdir, config_diff, to_jsonable


def holds_imported_model(saved: Mapping | None) -> bool:
  """True for the `config.json` of a workdir whose model was imported (`data.tokenizer` "marian"), whether
  or not a fine-tune has run in it since."""
  return bool(saved) and (saved.get("data") or {}).get("tokenizer") == MARIAN_TOKENIZER


def is_untrained_import(saved: Mapping | None) -> bool:
  """True for the config (`config.json`, or a checkpoint's config item) of an imported model that no training
  run has used yet (`data.dataset` is `workdir.IMPORTED_DATASET`)."""
  return bool(saved) and (saved.get("data") or {}).get("dataset") == IMPORTED_DATASET


def config_for_workdir(config: ExperimentConfig, workdir: str, explicit: Iterable[str] = ()) -> ExperimentConfig:
  """`config` as a run in `workdir` must use it: for an imported model, its architecture and tokenizer.

  A workdir holding an imported model (`holds_imported_model`: written by `experiments.import_marian`, or a
  fine-tune of one) fixes `config.model`, `data.tokenizer` and `data.vocab_size`: they are taken from its
  `config.json`, whatever the defaults and the recipe say (model fields the saved config predates keep
  `ModelConfig`'s defaults). `explicit` names the dotted keys the user set on purpose (a program's
  `--config.*` flags, e.g. `{"model.d_model", "data.dir"}`): one of those fixed keys with another value than
  the workdir's is refused, except the model's run-time fields (`config.RUNTIME_FIELDS`: dropout rates,
  dtype, remat, attention kernel, query chunks), which keep the requested value. Any other workdir (ours, or
  none yet): `config` itself; otherwise a new config (`config` is frozen).

  Raises:
    ValueError: one line naming each explicit key that contradicts the imported model (nothing is written).
  """
  saved = Workdir(workdir).read_config()
  if not holds_imported_model(saved):
    return config
  fixed = {"model": {**to_jsonable(ModelConfig()), **saved["model"]},
           "data": {"tokenizer": saved["data"]["tokenizer"], "vocab_size": saved["data"]["vocab_size"]}}
  explicit = set(explicit)
  adopted, conflicts = {"model": {}, "data": {}}, []
  for section, values in fixed.items():
    for name, value in values.items():
      key, requested = f"{section}.{name}", getattr(getattr(config, section), name)
      if key in explicit and section == "model" and name in RUNTIME_FIELDS:
        continue
      if key in explicit and config_diff({key: value}, {key: requested}, keys=None):
        conflicts.append(f"--config.{key}={requested!r} (the model has {value!r})")
      adopted[section][name] = value
  if conflicts:
    raise ValueError(f"{'; '.join(conflicts)}: contradicts the imported model in {workdir}, whose architecture "
                     f"and tokenizer are fixed; drop the flag")
  return dataclasses.replace(config, model=config.model.replace(**adopted["model"]),
                             data=dataclasses.replace(config.data, **adopted["data"]))


def check_adopted(config: ExperimentConfig, saved: Mapping | None, root: Any) -> None:
  """Raises ValueError (one line) when the workdir at `root`, whose saved config is `saved`, holds an imported
  model and `config` was not built by `config_for_workdir` (its `data.tokenizer` is not the import's)."""
  if holds_imported_model(saved) and config.data.tokenizer != saved["data"]["tokenizer"]:
    raise ValueError(f"{root} holds an imported model (data.tokenizer={saved['data']['tokenizer']!r}): build the "
                     "config with imported_workdir.config_for_workdir(config, workdir), as experiments.train does")


def with_provenance(resolved: dict, saved: Mapping | None) -> dict:
  """`resolved` (a run's config as `config.json` holds it) with the `imported_from` of the `saved` config, if
  any: the provenance of an imported model, kept through its fine-tunes. Modifies and returns `resolved`."""
  if saved and "imported_from" in saved:
    resolved["imported_from"] = saved["imported_from"]
  return resolved


def restore_import(directory: str, step: int, state: steps.TrainState) -> steps.TrainState:
  """`state` with the imported checkpoint's parameters (checkpoint `step` in `directory`, read straight into
  their shards), its step, and a fresh optimizer state built for them (zero Adam moments; a moving average
  that starts at the imported parameters, not at the random ones `state` was drawn with).

  An import has no optimizer state worth restoring (Adam's moments of a model trained elsewhere are not in a
  Hugging Face checkpoint), so Adam starts from zero moments and its count from 0: the learning-rate schedule
  (indexed by Adam's count) starts again with its warm-up. The step counter continues from the imported step
  (0 for `experiments.import_marian`); the data start from the first epoch and dropout from `config.seed` (the
  caller's fresh run). The first checkpoint the run saves is a normal one, so a restart resumes exactly.
  Raises `checkpoint.CheckpointMismatchError` for parameters of another architecture than `state`'s.
  """
  params = checkpoint_lib.restore_params(directory, step=step, abstract=sharding.abstract_state(state.params))
  step_array = jax.device_put(np.asarray(step, state.step.dtype), state.step.sharding)
  opt_state = jax.jit(state.tx.init, out_shardings=sharding.shardings_of(state.opt_state))(params)
  return state.replace(params=params, opt_state=opt_state, step=step_array)
