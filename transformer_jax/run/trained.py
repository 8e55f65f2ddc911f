"""A trained run directory, loaded for inference: its model config, parameters and tokenizer.

    model_config, params, tokenizer = trained.load(workdir)

What the translation programs (`experiments.translate`, `evaluate`, `score`, `attention_map`, `tune_decoding`,
`export`, `compare_ctranslate2`) decode with. The saved `config.json` is read through the experiment schema
(`ExperimentConfig.from_saved`): a key it predates runs with that key's default.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from etils import epath

from transformer_jax.config import ModelConfig
from transformer_jax.data import datasets
from transformer_jax.data.tokenizer import check_model_ids
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import DATA_KEYS, Workdir, config_diff, to_jsonable


class TrainedModel(NamedTuple):
  """What `load` returns (unpacks as `model_config, params, tokenizer`)."""
  model_config: ModelConfig
  params: Any  # the parameter tree (plain arrays), as `Transformer(model_config)` takes it
  tokenizer: Any  # `data.tokenizer.Tokenizer` of the run, or an imported model's Marian vocabulary


def workdir_config(workdir: str) -> ExperimentConfig:
  """The config a training run saved in `workdir`, the keys it predates at their defaults
  (`ExperimentConfig.from_saved`). FileNotFoundError when the workdir holds no run; ValueError for a
  `config.json` that is not a run's."""
  return ExperimentConfig.from_saved(Workdir(workdir).require_config())


def _checkpoint_directory(workdir: str, checkpoint: str | None) -> tuple[str, int | None]:
  """(directory, step): `checkpoint` is a step of the workdir's own checkpoints, a directory, or None (latest).
  FileNotFoundError when the directory or the step is missing."""
  directory, step = os.fspath(Workdir(workdir).checkpoints), None
  if checkpoint:
    if checkpoint.isdigit():
      step = int(checkpoint)
    else:
      directory = checkpoint
  if not epath.Path(directory).is_dir():
    raise FileNotFoundError(f"--checkpoint: {directory} is not a checkpoint directory")
  with checkpoint_lib.Checkpointer(directory, read_only=True) as checkpointer:
    saved = checkpointer.all_steps()
  if not saved or (step is not None and step not in saved):
    raise FileNotFoundError(f"--checkpoint: {directory} holds no step {step if step is not None else ''} "
                            f"(saved steps: {saved or 'none'})")
  return directory, step


def load(workdir: str, checkpoint: str | None = None, ema: bool | None = None) -> TrainedModel:
  """`(model_config, params, tokenizer)` of a trained workdir; `checkpoint` = a step or a checkpoint dir.

  `ema`: translate with the moving average of the parameters the run kept (`ema_decay` > 0) rather than the
  parameters; None = the run's own choice (`factories.inference_params`): the average for a run that kept
  one, read from its own checkpoints (another directory, e.g. averaged checkpoints, holds parameters only).
  Raises FileNotFoundError (no run, no such checkpoint),
  `checkpoint.CheckpointMismatchError` (the checkpoint's parameter tree is not the workdir's model),
  ValueError when `ema` asks for an average the checkpoint does not hold or a checkpoint directory outside
  the workdir was trained with another vocabulary (`check_checkpoint_vocabulary`).
  """
  config = workdir_config(workdir)
  tokenizer = datasets.open_tokenizer(config.data, workdir)  # ours, or an imported model's Marian files
  model_config = config.model
  tokenizer.check_model_vocab(model_config.vocab_size)
  check_model_ids(tokenizer, model_config)
  directory, step = _checkpoint_directory(workdir, checkpoint)
  other_directory = bool(checkpoint) and not checkpoint.isdigit()
  if ema is None:  # a step of the run's own checkpoints holds the average; another directory holds parameters
    ema = bool(config.ema_decay) and not other_directory
  if other_directory:
    check_checkpoint_vocabulary(config, workdir, tokenizer, directory)
  params = checkpoint_lib.restore_params(directory, model_config, step=step, ema=ema)
  return TrainedModel(model_config, params, tokenizer)


def check_checkpoint_vocabulary(config: ExperimentConfig, workdir: str, tokenizer: Any, directory: str) -> None:
  """A `--checkpoint` directory outside the workdir must have been trained with the workdir's vocabulary.

  Of another workdir (`<run>/checkpoints`, `<run>/averaged`): its tokenizer must give every id the same piece
  and normalise text the same way (`TextTokenizer.normalization`, `.lowercase`).
  Elsewhere: the data keys that fix the vocabulary (`workdir.DATA_KEYS`) in the checkpoint's saved config must
  equal the workdir's. Same parameter shapes, another vocabulary, would translate into the wrong pieces without
  any error; raises ValueError naming the first difference.
  """
  other = epath.Path(directory).parent
  if other.resolve() == epath.Path(workdir).resolve():
    return
  if (other / "config.json").exists():
    theirs = datasets.open_tokenizer(workdir_config(os.fspath(other)).data, os.fspath(other))
    ids = list(range(min(tokenizer.vocab_size, theirs.vocab_size)))
    ours_pieces, their_pieces = tokenizer.pieces(ids), theirs.pieces(ids)
    differing = next((i for i in ids if ours_pieces[i] != their_pieces[i]), None)
    rules = {"normalization": (theirs.normalization, tokenizer.normalization),
             "lowercase": (theirs.lowercase, tokenizer.lowercase)}
    text_rules = [f"{name} {there!r} there, {here!r} here" for name, (there, here) in rules.items() if there != here]
    if theirs.vocab_size != tokenizer.vocab_size or differing is not None or text_rules:
      where = (f"id {differing} is {their_pieces[differing]!r} there, {ours_pieces[differing]!r} here"
               if differing is not None else "; ".join(text_rules) if text_rules
               else f"{theirs.vocab_size} pieces there, {tokenizer.vocab_size} here")
      raise ValueError(f"--checkpoint={directory} was trained with another vocabulary than {workdir}'s ({where}); "
                       f"translate it with --workdir={other}")
    return
  saved = checkpoint_lib.read_config(directory) or {}
  differences = config_diff(saved, to_jsonable(config), DATA_KEYS) if saved.get("data") else []
  if differences:
    raise ValueError(f"--checkpoint={directory} was trained on other data or vocabulary settings than "
                     f"{workdir} ({'; '.join(differences)})")
