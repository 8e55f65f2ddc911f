"""The training orchestration: one config and one workdir in, a trained state and a typed result out.

    result = trainer.train_and_evaluate(config, workdir)    # what `python -m experiments.train` runs

`config` is an `ml_collections.ConfigDict` built on `experiments/configs/default.py` (every key present; the
config is never modified here) and `workdir` a run directory (`transformer_jax.workdir`). The run is cut into
named steps, each small enough to read at once:

1. `prepare`: refuse an incompatible workdir before touching it, build the datasets and the model config,
   write `config.json`.
2. `init_or_restore`: the train state born sharded on the config's mesh, or the latest complete checkpoint
   (state, dropout rng, data position) read straight into that layout, or, in a workdir that holds an
   imported model no run has trained yet, its parameters with a fresh optimizer state (fine-tuning).
3. `train`: the compiled step (`make_train_step`, the same one the benchmarks time) in a loop whose periodic
   actions (logging, evaluators, checkpoints, stop signals) are each decided by `itstime`. With
   `config.train_budget_minutes`, the run's length is planned after the warm-up from its measured rate and
   revised before and during the cool-down (`fit_to_budget`, `training/budget.py`). With
   `config.dropout_schedule`, the step is recompiled at each stage with its dropout rate (`compile_train_step`).
   Scalars, the config (HParams) and BLEU's sample translations go to `metrics.jsonl` and `config.trackers`
   (`trackers.py`); `config.profile_steps` traces chosen steps (`profiling.py`); `config.early_stopping` stops
   on a validation metric that no longer improves (`early_stopping.py`).

Fine-tuning an imported model (`experiments.import_marian`): the workdir's `config.json` fixes the model's
architecture and tokenizer; `config_for_workdir(config, workdir, explicit)` takes them from there (and refuses
a key the user set that contradicts them) before `train_and_evaluate` runs as for any other workdir.

Periodic decisions follow big_vision's `itstime(step, every, total)`; evaluators are small objects listed by
`config.evals` (`loss`, `attention`, `bleu`), each with its own `every_steps`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import signal
import time
from typing import Any, Iterable, Iterator, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import checkpoint as checkpoint_lib
from transformer_jax import diagnostics, early_stopping as early_stopping_lib, metrics as metrics_lib
from transformer_jax.decoding import inference
from transformer_jax import multihost, profiling, sharding
from transformer_jax.config import RUNTIME_FIELDS, ModelConfig
from transformer_jax.data import batching, datasets as datasets_lib, pipeline, tokenizer as tokenizer_lib
from transformer_jax.data.marian_vocab import TOKENIZER_NAME as MARIAN_TOKENIZER
from transformer_jax.owner_lock import OwnerLock
from transformer_jax.training import budget as budget_lib
from transformer_jax.training import optimizer as optimizer_lib
from transformer_jax.training import partitioned
from transformer_jax.training import schedule as schedule_lib
from transformer_jax.training import state as state_lib
from transformer_jax.training import steps
from transformer_jax.trackers import MetricWriter
from transformer_jax.workdir import (DATA_KEYS, IMPORTED_DATASET, Workdir, config_diff, to_jsonable,
                                    write_json_atomically)

# Keys of the saved config that must match to reuse a workdir: the data and vocabulary first (DATA_KEYS, checked
# before the datasets are built), then the model (checked once the vocabulary fixes its size). A config
# saved before `data.tokenizer` existed used SentencePiece.
DATA_DEFAULTS = {"data": {"tokenizer": "sentencepiece", "lowercase": False}}
MODEL_KEYS = ("model",)
# In a workdir that holds an imported model no run has trained yet, the first fine-tune may choose its
# dataset and the model's run-time fields (`config.RUNTIME_FIELDS`, e.g. dropout); these must match.
IMPORT_DATA_KEYS = ("data.vocab_size", "data.tokenizer")
IMPORT_MODEL_KEYS = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_FIELDS)


class NonFiniteLossError(FloatingPointError):
  """The training loss (or another training quantity) became NaN or Inf; the message names the first one,
  the step and the data position of its batch."""


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


def model_config_from(config: Any, vocab_size: int) -> ModelConfig:
  """`ModelConfig` from `config.model` with the vocabulary size of the run's tokenizer.

  Raises ValueError naming unknown `config.model` fields (and ModelConfig's own range errors).
  """
  return ModelConfig.from_mapping(config.model, vocab_size=vocab_size)


def holds_imported_model(saved: Mapping | None) -> bool:
  """True for the `config.json` of a workdir whose model was imported (`data.tokenizer` "marian"), whether
  or not a fine-tune has run in it since."""
  return bool(saved) and (saved.get("data") or {}).get("tokenizer") == MARIAN_TOKENIZER


def is_untrained_import(saved: Mapping | None) -> bool:
  """True for the config (`config.json`, or a checkpoint's config item) of an imported model that no training
  run has used yet (`data.dataset` is `workdir.IMPORTED_DATASET`)."""
  return bool(saved) and (saved.get("data") or {}).get("dataset") == IMPORTED_DATASET


def config_for_workdir(config: Any, workdir: str, explicit: Iterable[str] = ()) -> Any:
  """`config` as a run in `workdir` must use it: for an imported model, its architecture and tokenizer.

  A workdir holding an imported model (`holds_imported_model`: written by `experiments.import_marian`, or a
  fine-tune of one) fixes `config.model`, `data.tokenizer` and `data.vocab_size`: they are taken from its
  `config.json`, whatever the defaults and the recipe say (model fields the saved config predates keep
  `ModelConfig`'s defaults). `explicit` names the dotted keys the user set on purpose (a program's
  `--config.*` flags, e.g. `{"model.d_model", "data.dir"}`): one of those fixed keys with another value than
  the workdir's is refused, except the model's run-time fields (`config.RUNTIME_FIELDS`: dropout rates,
  dtype, remat, attention kernel, query chunks), which keep the requested value. Any other workdir (ours, or
  none yet): `config` itself. `config` is never modified; a changed config is a copy.

  Raises:
    ValueError: one line naming each explicit key that contradicts the imported model (nothing is written).
  """
  saved = Workdir(workdir).read_config()
  if not holds_imported_model(saved):
    return config
  fixed = {"model": {**to_jsonable(ModelConfig()), **saved["model"]},
           "data": {"tokenizer": saved["data"]["tokenizer"], "vocab_size": saved["data"]["vocab_size"]}}
  explicit = set(explicit)
  adopted, conflicts = copy.deepcopy(config), []
  for section, values in fixed.items():
    for name, value in values.items():
      key, requested = f"{section}.{name}", config[section][name]
      if key in explicit and section == "model" and name in RUNTIME_FIELDS:
        continue
      if key in explicit and config_diff({key: value}, {key: requested}, keys=None):
        conflicts.append(f"--config.{key}={requested!r} (the model has {value!r})")
      adopted[section][name] = value
  if conflicts:
    raise ValueError(f"{'; '.join(conflicts)}: contradicts the imported model in {workdir}, whose architecture "
                     f"and tokenizer are fixed; drop the flag")
  return adopted


def itstime(step: int, every_steps: int, total_steps: int, *, last: bool = True) -> bool:
  """True every `every_steps` steps and (with `last`) at the final step; `every_steps <= 0` means never.

  The one helper for every "every N steps" decision (big_vision's `itstime`).
  """
  if every_steps <= 0:
    return False
  return step % every_steps == 0 or (last and step == total_steps)


def optimizer(config: Any, d_model: int) -> tuple[optax.GradientTransformation, Any]:
  """Adam with the paper's schedule (section 5.3), cooled down over the last `config.cooldown_steps` (0 = the
  paper's schedule as is), decoupled weight decay `config.weight_decay` (0 = the paper's Adam), a moving
  average of the parameters when `config.ema_decay` > 0 (`optimizer.param_ema`), and the schedule itself."""
  learning_rate_fn = schedule_lib.cooldown(
      schedule_lib.rsqrt_schedule(d_model, config.warmup_steps, config.learning_rate),
      config.num_train_steps, config.cooldown_steps, config.cooldown_shape, config.cooldown_knots)
  tx = optimizer_lib.adam(learning_rate_fn, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                         weight_decay=config.weight_decay)
  if config.ema_decay:
    tx = optax.chain(tx, optimizer_lib.param_ema(config.ema_decay))
  return tx, learning_rate_fn


def inference_params(config: Any, state: steps.TrainState) -> Any:
  """The parameters a finished run is evaluated and translated with: the moving average when
  `config.ema_decay` > 0 (`optimizer.ema_params`), else `state.params`. Periodic validation during training
  evaluates `state.params`, the iterate being trained, so learning curves compare across runs with and
  without the average."""
  return optimizer_lib.ema_params(state.opt_state) if config.ema_decay else state.params


def make_train_step(config: Any, model_config: ModelConfig, mesh: jax.sharding.Mesh, state: steps.TrainState,
                    rules=sharding.LOGICAL_AXIS_RULES) -> sharding.PartitionedFunction:
  """The compiled train step of a run: `(state, batch, rng) -> (state, metrics)`.

  The trainer runs exactly this; `experiments/benchmarks` time it (a test compares the two programs).
  """
  _, learning_rate_fn = optimizer(config, model_config.d_model)
  return partitioned.jit_train_step(model_config, mesh, sharding.shardings_of(state), rules,
                                    label_smoothing=config.label_smoothing,
                                    grad_accum_steps=config.grad_accum_steps, learning_rate_fn=learning_rate_fn)


def train_model_config(config: Any, model_config: ModelConfig, step: int) -> ModelConfig:
  """The model config update `step` (counted from 1) trains with: `model_config` with the residual dropout rate
  `config.dropout_schedule` sets for that step (`schedule.dropout_rate`)."""
  rate = schedule_lib.dropout_rate(config.dropout_schedule, model_config.dropout_rate, step)
  return model_config if rate == model_config.dropout_rate else model_config.replace(dropout_rate=rate)


def compile_train_step(run: "Run", step: int) -> None:
  """Compiles `run.train_step` for update `step` onwards: the config's schedule and its dropout rate there."""
  model_config = train_model_config(run.config, run.model_config, step)
  run.train_step = make_train_step(run.config, model_config, run.mesh, run.state, run.rules)
  run.train_dropout_rate = model_config.dropout_rate


def create_state(config: Any, model_config: ModelConfig, mesh: jax.sharding.Mesh, rng: jax.Array,
                 rules=sharding.LOGICAL_AXIS_RULES) -> steps.TrainState:
  """A fresh train state of the run, born sharded on `mesh` with the config's optimizer."""
  tx, _ = optimizer(config, model_config.d_model)
  return state_lib.create_train_state(model_config, tx, rng, mesh, rules)


def next_batch(batches: Iterator[dict], accum: int) -> dict:
  """One batch, or `accum` consecutive batches stacked to `[accum, rows, length]` for accumulation."""
  if accum == 1:
    return next(batches)
  parts = [next(batches) for _ in range(accum)]
  return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


# ------------------------------------------------------------------------------------------------------------
# Signals and evaluators (the writer: `transformer_jax.trackers.MetricWriter`)
# ------------------------------------------------------------------------------------------------------------

class StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes the current step, saves a checkpoint and stops.

  On multi-host runs JAX's preemption sync point (`jax.distributed` with the preemption service) is also
  consulted, so every host stops at the same step.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. in a notebook worker): no handler
        pass

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    if self.signal_name is None and multihost.reached_preemption_sync_point(step):
      self.signal_name = "preemption notice"
    return self.signal_name is not None

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class Evaluator(Protocol):
  """Scores the current params on one eval split; returns `{metric: value}` (logged as `<split>/<metric>`)."""

  name: str
  every_steps: int

  def __call__(self, run: "Run", params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    ...


def within_position_table(eval_set: datasets_lib.EvalSet, model_config: ModelConfig,
                          split: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """The eval pairs' (sources, targets) that fit the model's position table (`model.max_len` tokens a side,
  EOS included; all of them for a model without one); a warning counts the rest, which teacher forcing
  could not score (their positions would read past the table and give NaN)."""
  if model_config.position_embedding == "none":
    return eval_set.sources, eval_set.targets
  keep = batching.within_length(eval_set.sources, eval_set.targets, model_config.max_len)
  if len(keep) < len(eval_set.sources):
    logging.warning("eval %s: %d of %d pairs are longer than model.max_len=%d tokens and are not scored",
                    split, len(eval_set.sources) - len(keep), len(eval_set.sources), model_config.max_len)
  return [eval_set.sources[i] for i in keep], [eval_set.targets[i] for i in keep]


@dataclasses.dataclass
class LossEvaluator:
  """Token-weighted loss, NLL, perplexity and accuracy over a whole eval split (teacher forcing)."""

  every_steps: int
  tokens_per_batch: int
  name: str = "loss"

  def __call__(self, run: "Run", params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    totals = None
    pad_id = run.model_config.pad_id
    sources, targets = within_position_table(eval_set, run.model_config, split)
    if not sources:
      return {}
    for batch in batching.eval_batches(sources, targets, self.tokens_per_batch, pad_id=pad_id):
      sums = run.eval_step(params, sharding.shard_batch(batch, run.mesh, run.rules, process_local=False,
                                                        pad_rows=True, pad_id=pad_id))
      totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    metrics = {k: float(v) for k, v in steps.metrics_from_sums(totals).items()}
    metrics["perplexity"] = float(math.exp(min(metrics["nll"], 50.0)))
    logging.info("eval %s: loss %.3f | nll %.3f | ppl %.2f | acc %.3f", split, metrics["loss"], metrics["nll"],
                 metrics["perplexity"], metrics["accuracy"])
    return metrics


@dataclasses.dataclass
class BleuEvaluator:
  """sacreBLEU and chrF of translations of the first `max_examples` pairs of an eval split; the first `samples`
  (source, reference, hypothesis) of each split wait in `samples_by_split` for the trackers."""

  every_steps: int
  max_examples: int
  beam_size: int
  alpha: float
  samples: int = 0
  target_lang: str = ""  # BLEU's tokenizer follows it as sacreBLEU's does (`metrics.bleu_metric`)
  name: str = "bleu"
  samples_by_split: dict = dataclasses.field(default_factory=dict)

  def __call__(self, run: "Run", params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    pairs = eval_set.pairs[: self.max_examples or None]
    hyps = inference.translate_texts(params, run.model_config, run.data.tokenizer, [s for s, _ in pairs],
                                     beam_size=self.beam_size, alpha=self.alpha)
    scores = metrics_lib.sacrebleu_scores(hyps, [t for _, t in pairs], lowercase=run.data.tokenizer.lowercase,
                                           target_lang=self.target_lang)
    logging.info("BLEU %s: %.2f (chrF %.2f) %s", split, scores["bleu"], scores["chrf"], scores["bleu_signature"])
    self.samples_by_split[split] = [(s, t, h) for (s, t), h in zip(pairs[:self.samples], hyps)]
    return {"bleu": scores["bleu"], "chrf": scores["chrf"]}


@dataclasses.dataclass
class AttentionEvaluator:
  """Per layer and head, the mean entropy of the attention distributions and the share of near-uniform heads.

  On the first `rows` pairs of an eval split, teacher-forced (`transformer_jax.diagnostics`); logged as
  `<split>/attention/<kind>/layer_<l>/head_<h>/entropy` and `<split>/attention/<kind>/near_uniform_share`.
  """

  every_steps: int
  rows: int
  name: str = "attention"

  def __call__(self, run: "Run", params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    sources, targets = within_position_table(eval_set, run.model_config, split)
    if not self.rows or not sources:
      return {}
    batch = next(batching.eval_batches(sources[:self.rows], targets[:self.rows],
                                       max_tokens=1 << 30, pad_id=run.model_config.pad_id))
    statistics = _attention_statistics(params, run.model_config, jnp.asarray(batch["inputs"]),
                                       jnp.asarray(batch["targets"]))
    return diagnostics.summary_scalars(statistics)


_attention_statistics = jax.jit(diagnostics.attention_statistics, static_argnums=1)


def make_evaluators(config: Any) -> list[Evaluator]:
  """The evaluators `config.evals` lists (each runs every `every_steps` steps and at the end; 0 = off)."""
  return [LossEvaluator(config.evals.loss.every_steps, config.evals.loss.tokens_per_batch),
          AttentionEvaluator(config.evals.attention.every_steps, config.evals.attention.rows),
          BleuEvaluator(config.evals.bleu.every_steps, config.evals.bleu.max_examples,
                        config.evals.bleu.beam_size, config.decode.alpha, config.evals.bleu.samples,
                        config.data.target_lang)]


def logged_eval_metrics(config: Any) -> list[str]:
  """The `<split>/<metric>` tags the evaluators of `config` log (the HParams tab's metrics)."""
  names = (["loss", "nll", "perplexity", "accuracy"] if config.evals.loss.every_steps else []) + (
      ["bleu", "chrf"] if config.evals.bleu.every_steps else [])
  return [f"{split}/{name}" for split in config.data.eval_splits for name in names]


# ------------------------------------------------------------------------------------------------------------
# The run: prepare, init-or-restore, train
# ------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """Everything one training run holds between its steps (built by `prepare` and `init_or_restore`)."""

  config: Any
  workdir: Workdir
  resolved_config: dict          # `config` as a dict, `model.vocab_size` set; what config.json holds
  model_config: ModelConfig
  data: datasets_lib.Datasets
  mesh: jax.sharding.Mesh
  rules: tuple
  state: steps.TrainState | None = None
  rng: jax.Array | None = None   # the typed dropout key (`jax.random.key`), saved with every checkpoint
  start_step: int = 0
  train_step: sharding.PartitionedFunction | None = None
  train_dropout_rate: float | None = None  # the residual dropout rate `train_step` was compiled with
  eval_step: sharding.PartitionedFunction | None = None
  checkpointer: checkpoint_lib.Checkpointer | None = None
  writer: MetricWriter | None = None  # metrics.jsonl and the trackers (`config.trackers`), opened by `prepare`

  @property
  def is_chief(self) -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What `train_and_evaluate` returns."""

  state: steps.TrainState
  model_config: ModelConfig
  datasets: datasets_lib.Datasets
  config: Any                      # the config trained with: `num_train_steps` as a time budget set it, if any
  final_step: int
  train_minutes: float
  stopped_early: bool              # a signal stopped the run before `num_train_steps`
  train_metrics: dict[str, float]  # the last logged training scalars (loss, accuracy, tokens/s, ...)
  eval_metrics: dict[str, float]   # the last value of every `<split>/<metric>` the evaluators produced
  early_stopping: dict = dataclasses.field(default_factory=dict)  # `EarlyStopping.summary`; {} when off


def prepare(config: Any, workdir: str) -> Run:
  """Checks the workdir and the config, builds the datasets and the model config. `config.json` is written by
  `write_run_config` once the checkpoint restored (`init_or_restore`): a refused resume rewrites nothing.

  A workdir holding an imported model needs `config` from `config_for_workdir` (ValueError otherwise). The
  model's pad/EOS ids must be the tokenizer's (`tokenizer.check_model_ids`, VocabularyError). The trackers
  of `config.trackers` start before anything is written (`trackers.TrackerError` if one cannot).
  """
  multihost.maybe_initialize_distributed(config.distributed)
  run_dir = Workdir(workdir)
  saved = run_dir.read_config()
  config = with_budget_decision(
      config, budget_lib.from_json(run_dir.read_train_budget()) if config.train_budget_minutes > 0 else None)
  if holds_imported_model(saved) and config.data.tokenizer != saved["data"]["tokenizer"]:
    raise ValueError(f"{run_dir.root} holds an imported model (data.tokenizer={saved['data']['tokenizer']!r}): "
                     "build the config with trainer.config_for_workdir(config, workdir), as experiments.train does")
  untrained_import = is_untrained_import(saved)
  # Before anything in the workdir is touched:
  run_dir.check_compatible(config.to_dict(), keys=IMPORT_DATA_KEYS if untrained_import else DATA_KEYS,
                           defaults=DATA_DEFAULTS)
  check_position_table(config)
  check_best_metric(config)
  mesh = sharding.mesh_from_config(config.mesh)
  check_batch_rows(config.data, mesh)
  # A tracker that cannot start is refused (trackers.TrackerError) before we write anything.
  writer = MetricWriter.open(config.trackers, run_dir, config.wandb, enabled=jax.process_index() == 0)
  try:
    return _prepare_run(config, run_dir, saved, untrained_import, mesh, writer)
  except BaseException:
    writer.close()
    raise


def _prepare_run(config: Any, run_dir: Workdir, saved: dict | None, untrained_import: bool,
                 mesh: jax.sharding.Mesh, writer: MetricWriter) -> Run:
  """`prepare` once the workdir is accepted and the trackers run: datasets, model config, config.json."""
  run_dir.create()
  data = datasets_lib.build_datasets(config.data, str(run_dir.root), seed=config.seed,
                                     process_index=jax.process_index(), process_count=jax.process_count(),
                                     barrier=multihost.sync_processes)
  model_config = model_config_from(config, data.tokenizer.vocab_size)
  tokenizer_lib.check_model_ids(data.tokenizer, model_config)
  resolved = to_jsonable(config)
  resolved["model"] = to_jsonable(model_config)
  if saved and "imported_from" in saved:  # provenance of an imported model, kept through its fine-tunes
    resolved["imported_from"] = saved["imported_from"]
  run_dir.check_compatible(resolved, keys=IMPORT_MODEL_KEYS if untrained_import else MODEL_KEYS,
                           defaults={"model": ModelConfig()})
  rules = sharding.validate_model_for_mesh(model_config, mesh)
  logging.info("Model: %s", model_config)
  return Run(config=config, workdir=run_dir, resolved_config=resolved, model_config=model_config, data=data,
             mesh=mesh, rules=rules, writer=writer)


def check_position_table(config: Any) -> None:
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


def write_run_config(run: Run) -> None:
  """Writes `config.json` (process 0): the resolved config of the run that now owns the workdir."""
  if run.is_chief:
    write_json_atomically(run.workdir.config_json, run.resolved_config)


def check_batch_rows(data_config: Any, mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError (one line, naming `data.tokens_per_batch`) unless a packed batch's rows,
  `tokens_per_batch // max_len`, split evenly over the devices of the mesh's batch axes (data x fsdp)."""
  rows, ways = data_config.tokens_per_batch // data_config.max_len, sharding.batch_ways(mesh)
  if rows % ways:
    raise ValueError(f"--config.data.tokens_per_batch={data_config.tokens_per_batch} packs {rows} rows of "
                     f"data.max_len={data_config.max_len} slots, which do not split over the {ways} devices of the "
                     f"mesh {dict(mesh.shape)}: use a multiple of {ways * data_config.max_len} tokens")


def with_budget_decision(config: Any, decision: budget_lib.BudgetDecision | None) -> Any:
  """`config` with the run length a time budget decided (a copy), or `config` itself when there is none."""
  if decision is None:
    return config
  config = copy.deepcopy(config)
  config.num_train_steps, config.cooldown_steps = decision.num_train_steps, decision.cooldown_steps
  config.cooldown_knots = decision.cooldown_knots
  return config


def fit_to_budget(run: Run, previous: budget_lib.BudgetDecision | None, step: int, seconds: float,
                  first_step_seconds: float) -> budget_lib.BudgetDecision:
  """Plans (or, given the `previous` decision, revises) the run's length for its time budget after `step`
  (`training/budget.py`; inside a cool-down already under way, `revise_in_cooldown`): process 0's decision on
  every host, saved in the workdir and config.json. A revision that moves the end by under 1% keeps it (no
  rebuild). A new length rebuilds the optimizer (its schedule ends at the new last step; Adam's state carries
  over, a schedule has none) and the compiled step."""
  measured = dict(step=step, start_step=run.start_step, seconds=seconds, first_step_seconds=first_step_seconds)
  if previous and step >= previous.cooldown_start:
    decision = budget_lib.revise_in_cooldown(previous, **measured)
  else:
    basis = (dict(budget_minutes=previous.budget_minutes, cap=previous.cap, cooldown_share=previous.cooldown_share)
             if previous else budget_lib.plan(run.config))
    decision = budget_lib.decide(**basis, **measured)
  total, cooldown = multihost.agree_on_ints(decision.num_train_steps, decision.cooldown_steps)
  knots = decision.cooldown_knots
  if previous and abs(total - previous.num_train_steps) <= 0.01 * previous.num_train_steps:
    total, cooldown, knots = previous.num_train_steps, previous.cooldown_steps, previous.cooldown_knots
  decision = dataclasses.replace(decision, num_train_steps=total, cooldown_steps=cooldown, cooldown_knots=knots)
  logging.info("Time budget: %s", decision.describe())
  changed = (total, cooldown, knots) != (run.config.num_train_steps, run.config.cooldown_steps,
                                        tuple(run.config.cooldown_knots))
  run.config = with_budget_decision(run.config, decision)
  run.resolved_config.update(num_train_steps=total, cooldown_steps=cooldown, cooldown_knots=knots)
  if run.is_chief:  # saved even when nothing changed: a resumed run starts from the latest plan
    run.workdir.write_train_budget(decision)
    write_json_atomically(run.workdir.config_json, run.resolved_config)
  if changed:  # the schedule lives in the state's (static) optimizer: both it and the step are rebuilt
    tx, _ = optimizer(run.config, run.model_config.d_model)
    run.state = run.state.replace(tx=tx)
    compile_train_step(run, step + 1)
  return decision


# The evaluator (a `config.evals` section) that computes each metric of `metrics_lib.METRIC_DIRECTIONS`.
METRIC_EVALUATORS = {"loss": "loss", "nll": "loss", "perplexity": "loss", "accuracy": "loss", "bleu": "bleu",
                     "chrf": "bleu"}


def check_best_metric(config: Any) -> None:
  """Raises ValueError (one line) unless `checkpoint_best_metric` ('' or '<split>/<metric>') is computed by
  this run: the split is one of `data.eval_splits`, the metric has a known direction (`metrics.METRIC_DIRECTIONS`)
  and its evaluator is on (`evals.<evaluator>.every_steps > 0`)."""
  name = config.checkpoint_best_metric
  if not name:
    return
  split, metric = name.split("/", 1)
  flag = f"--config.checkpoint_best_metric={name!r}"
  if split not in config.data.eval_splits:
    raise ValueError(f"{flag}: split {split!r} is not evaluated (data.eval_splits={tuple(config.data.eval_splits)})")
  if metric not in METRIC_EVALUATORS:
    raise ValueError(f"{flag}: no evaluator computes {metric!r} with a known direction; one of "
                     f"{', '.join(sorted(METRIC_EVALUATORS))}")
  evaluator = METRIC_EVALUATORS[metric]
  if not config.evals[evaluator].every_steps:
    raise ValueError(f"{flag}: computed by the {evaluator} evaluator, which is off "
                     f"(evals.{evaluator}.every_steps=0); set evals.{evaluator}.every_steps > 0")


def _checkpointer(config: Any, workdir: Workdir) -> checkpoint_lib.Checkpointer:
  best_metric = config.checkpoint_best_metric or None
  higher = best_metric is not None and metrics_lib.higher_is_better(best_metric)
  return checkpoint_lib.Checkpointer(workdir.checkpoints, max_to_keep=config.checkpoint_keep,
                                     best_metric=best_metric, best_mode="max" if higher else "min",
                                     enable_async_checkpointing=config.async_checkpointing)


def init_or_restore(run: Run) -> None:
  """A fresh sharded state and dropout key, or the newest complete checkpoint's; compiles the steps."""
  init_rng, run.rng = jax.random.split(jax.random.key(run.config.seed))
  run.state = create_state(run.config, run.model_config, run.mesh, init_rng, run.rules)
  logging.info("Mesh %s over %d devices; train state %.1f MiB per device", dict(run.mesh.shape), run.mesh.size,
               max(sharding.per_device_bytes(run.state).values()) / 2**20)
  run.checkpointer = _checkpointer(run.config, run.workdir)
  latest = run.checkpointer.latest_step()
  if latest is not None and is_untrained_import(checkpoint_lib.read_config(run.checkpointer.directory, latest)):
    start_from_import(run, latest)
  elif latest is not None:
    restored = run.checkpointer.restore_latest_complete(sharding.abstract_state(run.state))
    run.state, run.start_step = restored.state, restored.step
    run.rng = restored.rng if restored.rng is not None else run.rng
    run.data.train.set_state(restored.data_state)
    logging.info("Resumed from the checkpoint at step %d in %s (data position %s)", run.start_step,
                 run.checkpointer.directory, restored.data_state)
  log_packing(run.data.train)
  compile_train_step(run, run.start_step + 1)
  run.eval_step = partitioned.jit_eval_step(run.model_config, run.mesh, sharding.shardings_of(run.state.params),
                                            run.rules, label_smoothing=run.config.label_smoothing)


def log_packing(train: pipeline.TrainStream, batches: int = 20) -> None:
  """Logs the packing of the next `batches` batches of this process from where training continues (read from a
  copy of the stream: the position does not move)."""
  src_eff, tgt_eff = train.padding_efficiency(batches)
  logging.info("Packed batches: %d rows x %d slots (%d on this process); padding efficiency of the next %d "
               "batches (epoch %d): source %.1f%%, target %.1f%%", train.rows_per_batch, train.row_length,
               train.rows_per_batch // train.process_count, batches, train.epoch, 100 * src_eff, 100 * tgt_eff)


def start_from_import(run: Run, step: int) -> None:
  """Fine-tuning: the imported checkpoint's parameters in `run.state` (read straight into their shards), at
  its step, with a fresh optimizer state built for them (zero Adam moments; a moving average that starts at
  the imported parameters, not at the random ones `init_or_restore` drew).

  An import has no optimizer state worth restoring (Adam's moments of a model trained elsewhere are not in a
  Hugging Face checkpoint), so Adam starts from zero moments and its count from 0: the learning-rate schedule
  (indexed by Adam's count) starts again with its warm-up. The step counter continues from the imported step
  (0 for `experiments.import_marian`), the data from the start of the first epoch, dropout from
  `config.seed`. The first checkpoint this run saves is a normal one, so a restart resumes exactly.
  """
  params = checkpoint_lib.restore_params(run.checkpointer.directory, step=step,
                                         abstract=sharding.abstract_state(run.state.params))
  step_array = jax.device_put(np.asarray(step, run.state.step.dtype), run.state.step.sharding)
  opt_state = jax.jit(run.state.tx.init, out_shardings=sharding.shardings_of(run.state.opt_state))(params)
  run.state = run.state.replace(params=params, opt_state=opt_state, step=step_array)
  run.start_step = step
  logging.info("Fine-tuning the model imported in %s from its step %d: parameters restored; a fresh Adam state "
               "(the import has none) with the schedule's warm-up; data from the start", run.workdir.root, step)


def _format_eta(seconds: float) -> str:
  seconds = max(0, int(seconds))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class _TrainLog:
  """Collects the step metrics between logging steps and turns them into scalars (one host sync per log)."""

  def __init__(self, start_step: int):
    self.pending: list[tuple[int, dict, Mapping | None]] = []  # (step, metrics, data position)
    self.last_time, self.last_step = time.time(), start_step

  def add(self, step: int, metrics: dict, position: Mapping | None = None) -> None:
    """`position`: the data position its batch was read from (`TrainStream.get_state()` before it)."""
    self.pending.append((step, metrics, position))

  def flush(self, step: int, total_steps: int) -> dict[str, float]:
    """Scalars since the last flush; raises NonFiniteLossError at the first NaN/Inf training quantity."""
    fetched = jax.device_get([m for _, m, _ in self.pending])
    for (s, _, position), m in zip(self.pending, fetched):
      bad = [k for k in ("nll", "loss", "grad_norm") if k in m and not np.isfinite(m[k])]  # computation order
      if bad:
        where = (f"; its batch was read in epoch {position['epoch']} of the data stream (seed {position['seed']}, "
                 f"process {position['process_index']}'s position {position['grain']})") if position else ""
        raise NonFiniteLossError(
            f"training {bad[0]} is {m[bad[0]]} at step {s} (non-finite: {', '.join(bad)}){where}; every token id "
            "and position of it was within the model's tables (checked before each step), so the cause is "
            "numerical (learning rate, warm-up, dtype); stopping")
    now = time.time()
    steps_per_s = (step - self.last_step) / max(now - self.last_time, 1e-9)
    scalars = {k: float(np.mean([m[k] for m in fetched])) for k in ("loss", "nll", "accuracy", "grad_norm")}
    scalars.update(learning_rate=float(fetched[-1]["learning_rate"]), steps_per_s=steps_per_s,
                   tokens_per_s=sum(float(m["token_count"]) for m in fetched) / max(now - self.last_time, 1e-9))
    logging.info("step %d/%d | loss %.3f | acc %.3f | lr %.2e | %.0f tok/s | %.2f steps/s | eta %s", step,
                 total_steps, scalars["loss"], scalars["accuracy"], scalars["learning_rate"],
                 scalars["tokens_per_s"], steps_per_s, _format_eta((total_steps - step) / max(steps_per_s, 1e-9)))
    self.pending, self.last_time, self.last_step = [], now, step
    return scalars


def evaluate(run: Run, evaluators: list[Evaluator], step: int) -> dict[str, float]:
  """Runs the evaluators due at `step` on every eval split; returns `{"<split>/<metric>": value}`."""
  results = {}
  for evaluator in evaluators:
    if itstime(step, evaluator.every_steps, run.config.num_train_steps):
      for split, eval_set in run.data.eval_sets.items():
        for metric, value in evaluator(run, run.state.params, split, eval_set).items():
          results[f"{split}/{metric}"] = value
  return results


def _checkpoint_due(run: Run, step: int, last_save_time: float) -> bool:
  config = run.config
  if itstime(step, config.checkpoint_every_steps, config.num_train_steps):
    return True
  # Wall-clock saves are checked at logging steps (already a host sync point) and decided by process 0:
  # hosts' clocks differ, and a save only some hosts enter never completes.
  return (config.checkpoint_every_minutes > 0 and itstime(step, config.log_every_steps, 0, last=False)
          and multihost.agree_across_hosts(time.time() - last_save_time >= 60 * config.checkpoint_every_minutes))


def save(run: Run, step: int, eval_metrics: dict[str, float]) -> None:
  """Writes the checkpoint of `step` (state, rng, data position, resolved config, and the best metric's value)."""
  best = run.config.checkpoint_best_metric
  data_state = {"processes": multihost.gather_json(run.data.train.get_state())}  # each process's own position
  saved = run.checkpointer.save(step, run.state, run.rng, data_state, run.resolved_config,
                                metrics=eval_metrics if best and best in eval_metrics else None)
  checkpoint_lib.require_saved(saved, run.checkpointer.directory, step)


def train(run: Run, stop: StopSignal, profiler: profiling.StepProfiler) -> TrainResult:
  """The step loop from `run.start_step` to `num_train_steps`, with its periodic actions."""
  config, total, writer = run.config, run.config.num_train_steps, run.writer
  evaluators = make_evaluators(config)
  early = early_stopping_lib.resume(config.early_stopping, run.workdir.early_stopping_json, run.start_step)
  log = _TrainLog(run.start_step)
  train_metrics: dict[str, float] = {}
  eval_metrics: dict[str, float] = {}
  last_save_time = train_start = time.time()
  step, stopped, first_step_seconds = run.start_step, False, 0.0
  stage_starts = {start for start, _ in config.dropout_schedule}  # where the compiled step's dropout may change
  decision = budget_lib.from_json(run.workdir.read_train_budget()) if config.train_budget_minutes > 0 else None
  fit_at = (budget_lib.revision_step(decision, run.start_step) if decision else
            budget_lib.decision_step(config, run.start_step) if config.train_budget_minutes > 0 else None)
  if run.start_step >= total:
    logging.warning("Nothing to train: the checkpoint at step %d is at or past num_train_steps=%d (raise "
                    "--config.num_train_steps to continue this run)", run.start_step, total)
  else:
    logging.info("Training %d parameters to step %d (from step %d)%s",
                 sum(x.size for x in jax.tree_util.tree_leaves(run.state.params)), total, run.start_step,
                 f"; the time budget plans the length after step {fit_at}" if fit_at else "")
  early_stop = bool(early and early.state.stop)
  while step < total and not early_stop:
    step += 1
    position = run.data.train.get_state()
    host_batch = next_batch(run.data.train, config.grad_accum_steps)
    check_batch_in_tables(host_batch, run.model_config, step)
    batch = sharding.shard_batch(host_batch, run.mesh, run.rules)
    if (step in stage_starts and
        train_model_config(config, run.model_config, step).dropout_rate != run.train_dropout_rate):
      compile_train_step(run, step)
      logging.info("Dropout %g from step %d (config.dropout_schedule)", run.train_dropout_rate, step)
    with profiler.step(step, outputs=lambda: run.state):
      run.state, metrics = run.train_step(run.state, batch, run.rng)
    if step == run.start_step + 1:
      first_step_seconds = time.time() - train_start
    if step == fit_at:
      jax.block_until_ready(metrics)  # the rate of steps done, not of steps dispatched
      decision = fit_to_budget(run, decision, step, time.time() - train_start, first_step_seconds)
      fit_at = budget_lib.revision_step(decision, run.start_step)
      config, total = run.config, run.config.num_train_steps
    log.add(step, metrics, position)
    if itstime(step, config.log_every_steps, total):
      train_metrics = log.flush(step, total)
      writer.write(step, {f"train/{k}": v for k, v in train_metrics.items()})
    new_eval = evaluate(run, evaluators, step)
    if new_eval:
      writer.write(step, new_eval)
      write_samples(writer, evaluators, step)
      eval_metrics.update(new_eval)
      early_stop = bool(early) and early.update(step, new_eval, run.workdir.early_stopping_json if run.is_chief
                                                else None)
    stopped = stop.requested(step)
    if stopped or early_stop or step == total or _checkpoint_due(run, step, last_save_time):
      save(run, step, new_eval)
      last_save_time = time.time()
    if stopped:
      logging.warning("Received %s: saved the checkpoint of step %d; stopping. Re-run to resume.",
                      stop.signal_name, step)
      break
  if early_stop:
    logging.warning("%s; the checkpoint of step %d is saved", early.describe(step), step)
  return TrainResult(state=run.state, model_config=run.model_config, datasets=run.data, config=run.config,
                     final_step=step, train_minutes=(time.time() - train_start) / 60, stopped_early=stopped,
                     train_metrics=train_metrics, eval_metrics=eval_metrics,
                     early_stopping=early.summary(step if early_stop else None) if early else {})


def write_samples(writer: MetricWriter, evaluators: list[Evaluator], step: int) -> None:
  """Sends the sample translations the BLEU evaluator kept at `step` to the trackers."""
  for evaluator in evaluators:
    for split, rows in getattr(evaluator, "samples_by_split", {}).items():
      if rows:
        writer.write_samples(step, split, rows)
    getattr(evaluator, "samples_by_split", {}).clear()


def train_and_evaluate(config: Any, workdir: str) -> TrainResult:
  """Trains `config` in `workdir` (resuming from its latest complete checkpoint) and returns the result.

  For a workdir holding an imported model, pass `config_for_workdir(config, workdir)`: the run then
  fine-tunes it (`start_from_import`) with its own tokenizer and special ids.

  Only one training process owns a workdir at a time (`owner_lock.OwnerLock`, `<workdir>/train.lock`, local
  or gs://): `WorkdirInUseError` (an OSError) when another live one holds it.
  Raises ValueError for a workdir holding an incompatible run or an invalid config, or a checkpoint whose
  data position indexes another batch plan (nothing written then: `config.json` is written after the restore),
  `checkpoint.CheckpointMismatchError` for a checkpoint of another architecture, NonFiniteLossError when
  the loss becomes NaN/Inf, `trackers.TrackerError` for a tracker that cannot start (before anything is
  written). SIGTERM/SIGINT finish the current step, save, and return (`stopped_early`). An early-stopping rule
  that fires saves and returns with `early_stopping["stopped_at_step"]` set.
  """
  multihost.maybe_initialize_distributed(config.distributed)
  with OwnerLock(workdir, enabled=jax.process_index() == 0):  # one trainer per workdir (process 0 holds it)
    run = prepare(config, workdir)
    stop, profiler = None, None
    try:
      init_or_restore(run)
      write_run_config(run)  # only now: a refused resume leaves config.json, events and metrics untouched
      run.writer.start(run.resolved_config, logged_eval_metrics(run.config))
      stop = StopSignal()
      profiler = profiling.StepProfiler(run.config.profile_steps, run.workdir.profile,
                                        first_step=run.start_step + 1)
      return train(run, stop, profiler)
    finally:
      if stop:
        stop.restore()
      if profiler:
        profiler.close()
      if run.checkpointer:
        run.checkpointer.wait()
        run.checkpointer.close()
      run.writer.close()
