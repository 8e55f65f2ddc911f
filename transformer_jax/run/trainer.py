"""The training run: one config and one workdir in, a trained state and a typed result out. The loop and the
run's lifecycle only (t5x's `train.py`); what they use lives in rooms of its own: the factories
(`factories.py`), the imported-workdir policy (`imported_workdir.py`), the evaluators (`evaluators.py`), the
refusals (`run_checks.py`), the training scalars (`train_log.py`), stop signals (`stop_signal.py`), metric
writers (`trackers.py`), the time budget (`budget.py`), early stopping, a profile.

    result = trainer.train_and_evaluate(config, workdir)    # what `python -m experiments.train` runs

`config` is the run's typed `experiment_config.ExperimentConfig` (a program converts its `ConfigDict` once,
`ExperimentConfig.from_config_dict`; frozen) and `workdir` a run directory (`transformer_jax.workdir`). The run,
in named steps:

1. `prepare`: refuse an incompatible workdir before touching it, build the datasets and the model config (a
   frozen `Run`). `config.json` is written once the checkpoint restored (`write_run_config`).
2. `init_or_restore`: where training starts (a frozen `Start`): a fresh state born sharded on the config's mesh,
   the latest complete checkpoint (state, dropout rng, data position), or an untrained import's parameters.
3. `train`: the compiled step (`factories.make_train_step`, the one the benchmarks time) in a loop whose periodic
   actions (logging, evaluators, checkpoints, stop signals) are each decided by big_vision's `itstime`. The loop
   alone replaces the state and the `Program` (the config with the run's length, the step compiled for it): at a
   dropout stage (`config.dropout_schedule`), and where it applies a time-budget decision (`apply_budget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from transformer_jax import multihost, sharding
from transformer_jax import workdir as workdir_lib
from transformer_jax.config import ModelConfig
from transformer_jax.data import datasets as datasets_lib, tokenizer as tokenizer_lib
from transformer_jax.run import budget as budget_lib
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run import early_stopping as early_stopping_lib
from transformer_jax.run import evaluators as evaluators_lib
from transformer_jax.run import factories, imported_workdir, plan, profiling
from transformer_jax.run.experiment_config import ExperimentConfig, check_logged_metrics
from transformer_jax.run.owner_lock import OwnerLock
from transformer_jax.run.run_checks import (check_backend_dtype, check_batch_in_tables, check_batch_rows,
                                        check_position_table)
from transformer_jax.run.stop_signal import StopSignal
from transformer_jax.run.trackers import MetricWriter
from transformer_jax.run.train_log import TrainLog
from transformer_jax.training import steps
from transformer_jax.workdir import Workdir, to_jsonable



def itstime(step: int, every_steps: int, total_steps: int, *, last: bool = True) -> bool:
  """True every `every_steps` steps and (with `last`) at the final step; `every_steps <= 0` means never.

  The one helper for every "every N steps" decision (big_vision's `itstime`).
  """
  if every_steps <= 0:
    return False
  return step % every_steps == 0 or (last and step == total_steps)


def next_batch(batches: Iterator[dict], accum: int) -> dict:
  """One batch, or `accum` consecutive batches stacked to `[accum, rows, length]` for accumulation."""
  if accum == 1:
    return next(batches)
  parts = [next(batches) for _ in range(accum)]
  return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


# What the run holds: fixed (`Run`), its start (`Start`), what the loop replaces (`Program`), its result -----

@dataclasses.dataclass(frozen=True)
class Run:
  """What `prepare` builds and the whole run keeps: never replaced (the loop's changing parts are `Program`)."""

  config: ExperimentConfig       # as given (with the length a saved time-budget decision set, if any)
  workdir: Workdir
  resolved_config: dict          # `config` as a dict, `model.vocab_size` set; what config.json holds
  model_config: ModelConfig
  data: datasets_lib.Datasets
  mesh: jax.sharding.Mesh
  rules: tuple
  writer: MetricWriter           # metrics.jsonl and the trackers (`config.trackers`), opened by `prepare`
  checked_step: plan.CheckedStep | None = None  # the train step the fit check compiled (TPU, GPU), reused

  @property
  def is_chief(self) -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class Start:
  """Where training starts (`init_or_restore`): the state at `step`, and the typed dropout key
  (`jax.random.key`), saved with every checkpoint."""

  state: steps.TrainState
  rng: jax.Array
  step: int


@dataclasses.dataclass(frozen=True)
class Program:
  """The config the loop trains with and the step compiled for it; the loop replaces it at a dropout stage and
  where a time-budget decision changes the run's length (`apply_budget`)."""

  config: ExperimentConfig       # the run's config with the length the time budget last decided
  resolved_config: dict          # its config.json
  train_step: sharding.PartitionedFunction
  dropout_rate: float            # the residual dropout rate `train_step` was compiled with


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What `train_and_evaluate` returns."""

  state: steps.TrainState
  model_config: ModelConfig
  datasets: datasets_lib.Datasets
  config: ExperimentConfig         # the config trained with: `num_train_steps` as a time budget set it, if any
  final_step: int
  train_minutes: float
  stopped_early: bool              # a signal stopped the run before `num_train_steps`
  train_metrics: dict[str, float]  # the last logged training scalars (loss, accuracy, tokens/s, ...)
  eval_metrics: dict[str, float]   # the last value of every `<split>/<metric>` the evaluators produced
  early_stopping: dict = dataclasses.field(default_factory=dict)  # `EarlyStopping.summary`; {} when off


# The run's lifecycle: prepare, init-or-restore --------------------------------------------------------------

def prepare(config: ExperimentConfig, workdir: str) -> Run:
  """Checks the workdir and the config, builds the datasets and the model config. `config.json` is written by
  `write_run_config` once the checkpoint restored (`init_or_restore`): a refused resume rewrites nothing.

  A workdir holding an imported model needs `config` from `imported_workdir.config_for_workdir` (ValueError
  otherwise). The model's pad/EOS ids must be the tokenizer's (`tokenizer.check_model_ids`, VocabularyError).
  The trackers of `config.trackers` start before anything is written (`trackers.TrackerError` if one cannot).
  On devices that report their memory (TPU, GPU) the train step is compiled first and a run whose peak exceeds
  a device's memory is refused (`plan.DoesNotFitError`, one line naming the levers), before anything is written.
  """
  multihost.maybe_initialize_distributed(config.distributed)
  run_dir = Workdir(workdir)
  saved = run_dir.read_config()
  saved_decision = run_dir.read_train_budget() if config.train_budget_minutes > 0 else None
  config = budget_lib.with_decision(config, budget_lib.from_json(saved_decision))
  imported_workdir.check_adopted(config, saved, run_dir.root)
  untrained_import = imported_workdir.is_untrained_import(saved)
  # Before anything in the workdir is touched:
  run_dir.check_compatible(to_jsonable(config), defaults=workdir_lib.DATA_DEFAULTS,
                           keys=workdir_lib.IMPORTED_DATA_KEYS if untrained_import else workdir_lib.DATA_KEYS)
  check_position_table(config)
  check_backend_dtype(config.model)
  check_logged_metrics(config)  # a config built without `from_config_dict` has not been validated
  mesh = sharding.mesh_from_config(config.mesh)
  check_batch_rows(config.data, mesh)
  checked_step = plan.check_run_fits(config, mesh)  # on an accelerator: a step that cannot fit is refused here
  # A tracker that cannot start is refused (trackers.TrackerError) before we write anything.
  writer = MetricWriter.open(config.tracker_options(), run_dir, enabled=jax.process_index() == 0)
  try:
    return dataclasses.replace(_prepare_run(config, run_dir, saved, untrained_import, mesh, writer),
                               checked_step=checked_step)
  except BaseException:
    writer.close()
    raise


def _prepare_run(config: ExperimentConfig, run_dir: Workdir, saved: dict | None, untrained_import: bool,
                 mesh: jax.sharding.Mesh, writer: MetricWriter) -> Run:
  """`prepare` once the workdir is accepted and the trackers run: datasets, model config, resolved config."""
  run_dir.create()
  data = datasets_lib.build_datasets(config.data, str(run_dir.root), seed=config.seed,
                                     process_index=jax.process_index(), process_count=jax.process_count(),
                                     barrier=multihost.sync_processes)
  model_config = factories.model_config_from(config, data.tokenizer.vocab_size, mesh.devices.flat[0].platform)
  tokenizer_lib.check_model_ids(data.tokenizer, model_config)
  resolved = to_jsonable(config)
  resolved["model"] = to_jsonable(model_config)
  resolved = imported_workdir.with_provenance(resolved, saved)
  run_dir.check_compatible(resolved, defaults={"model": ModelConfig()},
                           keys=workdir_lib.IMPORTED_MODEL_KEYS if untrained_import else workdir_lib.MODEL_KEYS)
  rules = sharding.validate_model_for_mesh(model_config, mesh)
  logging.info("Model: %s", model_config)
  return Run(config=config, workdir=run_dir, resolved_config=resolved, model_config=model_config, data=data,
             mesh=mesh, rules=rules, writer=writer)


def write_run_config(run: Run, resolved_config: Mapping) -> None:
  """Writes `config.json` (process 0): the resolved config of the run that now owns the workdir."""
  if run.is_chief:
    run.workdir.write_config(resolved_config)


def init_or_restore(run: Run, checkpointer: checkpoint_lib.Checkpointer) -> Start:
  """A fresh sharded state and dropout key, the newest complete checkpoint's (the data stream set to its
  position), or an untrained import's parameters (`imported_workdir.restore_import`)."""
  init_rng, rng = jax.random.split(jax.random.key(run.config.seed))
  state = factories.create_state(run.config, run.model_config, run.mesh, init_rng, run.rules)
  logging.info("Mesh %s over %d devices; train state %.1f MiB per device", dict(run.mesh.shape), run.mesh.size,
               max(sharding.per_device_bytes(state).values()) / 2**20)
  latest = checkpointer.latest_step()
  if latest is None:
    start = Start(state=state, rng=rng, step=0)
  elif imported_workdir.is_untrained_import(checkpoint_lib.read_config(checkpointer.directory, latest)):
    start = Start(state=imported_workdir.restore_import(checkpointer.directory, latest, state), rng=rng,
                  step=latest)
    logging.info("Fine-tuning the model imported in %s from its step %d: parameters restored; a fresh Adam "
                 "state (the import has none) with the schedule's warm-up; data from the start", run.workdir.root,
                 latest)
  else:
    restored = checkpointer.restore_latest_complete(sharding.abstract_state(state))
    start = Start(state=restored.state, rng=restored.rng if restored.rng is not None else rng, step=restored.step)
    run.data.train.set_state(restored.data_state)
    logging.info("Resumed from the checkpoint at step %d in %s (data position %s)", start.step,
                 checkpointer.directory, restored.data_state)
  run.data.train.log_packing()  # from where training continues
  return start


# What the loop replaces: its program (dropout stages, time-budget decisions) --------------------------------

def compile_program(run: Run, config: ExperimentConfig, resolved_config: dict, state: steps.TrainState,
                    step: int) -> Program:
  """The `Program` for update `step` onwards: `config`'s schedule and the dropout rate it sets there
  (`factories.train_model_config`), compiled for `state`'s shardings: the fit check's step where it is the
  same program (`Run.checked_step`; compiled once per run), else a new one."""
  model_config = factories.train_model_config(config, run.model_config, step)
  checked = run.checked_step and run.checked_step.step_for(config, model_config)
  train_step = checked or factories.make_train_step(config, model_config, run.mesh, state, run.rules)
  return Program(config=config, resolved_config=resolved_config, dropout_rate=model_config.dropout_rate,
                 train_step=train_step)


def apply_budget(run: Run, program: Program, state: steps.TrainState, decision: budget_lib.BudgetDecision,
                 step: int) -> tuple[Program, steps.TrainState]:
  """The one place a time-budget decision (taken after `step`) changes the run: the config and config.json get
  its length, process 0 saves it (`train_budget.json`; also when nothing changed: a resumed run starts from the
  latest plan), and a new length rebuilds the optimizer (its schedule ends at the new last step; Adam's state
  carries over, a schedule has none) and the compiled step."""
  logging.info("Time budget: %s", decision.describe())
  config = budget_lib.with_decision(program.config, decision)
  resolved = dict(program.resolved_config, num_train_steps=decision.num_train_steps,
                  cooldown_steps=decision.cooldown_steps, cooldown_knots=decision.cooldown_knots)
  if run.is_chief:
    run.workdir.write_train_budget(decision)
  write_run_config(run, resolved)
  old = program.config
  if (old.num_train_steps, old.cooldown_steps, tuple(old.cooldown_knots)) == (
      decision.num_train_steps, decision.cooldown_steps, decision.cooldown_knots):
    return dataclasses.replace(program, config=config, resolved_config=resolved), state
  tx, _ = factories.optimizer(config, run.model_config.d_model)
  state = state.replace(tx=tx)  # the schedule lives in the state's (static) optimizer
  return compile_program(run, config, resolved, state, step + 1), state


# The loop ---------------------------------------------------------------------------------------------------

def evaluate(evaluators: list[evaluators_lib.Evaluator], params: Any, step: int,
             total: int) -> evaluators_lib.Evaluation:
  """Runs the evaluators due at `step` of `total`; returns their metrics and sample translations together."""
  evaluation = evaluators_lib.Evaluation({})
  for evaluator in evaluators:
    if itstime(step, evaluator.every_steps, total):
      evaluation = evaluation.merged(evaluator(params))
  return evaluation


def write_evaluation(run: Run, step: int, evaluation: evaluators_lib.Evaluation) -> None:
  """The one place an evaluation reaches the trackers: its metrics (metrics.jsonl too), then each split's
  sample translations (`<split>/samples`)."""
  run.writer.write(step, evaluation.metrics)
  for split, rows in evaluation.samples.items():
    run.writer.write_samples(step, split, rows)


def _checkpoint_due(config: ExperimentConfig, step: int, last_save_time: float) -> bool:
  if itstime(step, config.checkpoint_every_steps, config.num_train_steps):
    return True
  # Wall-clock saves are checked at logging steps (already a host sync point) and decided by process 0:
  # hosts' clocks differ, and a save only some hosts enter never completes.
  return (config.checkpoint_every_minutes > 0 and itstime(step, config.log_every_steps, 0, last=False)
          and multihost.agree_across_hosts(time.time() - last_save_time >= 60 * config.checkpoint_every_minutes))


def save(run: Run, checkpointer: checkpoint_lib.Checkpointer, program: Program, state: steps.TrainState,
         rng: jax.Array, step: int, eval_metrics: dict[str, float]) -> None:
  """Writes the checkpoint of `step` (state, rng, data position, resolved config, and the best metric's value)."""
  best = program.config.checkpoint_best_metric
  data_state = {"processes": multihost.gather_json(run.data.train.get_state())}  # each process's own position
  saved = checkpointer.save(step, state, rng, data_state, program.resolved_config,
                            metrics=eval_metrics if best and best in eval_metrics else None)
  checkpoint_lib.require_saved(saved, checkpointer.directory, step)


def _sharded_batch(run: Run, accum: int, step: int) -> dict:
  """The next training batch, checked against the model's tables and sharded over the mesh."""
  host_batch = next_batch(run.data.train, accum)
  check_batch_in_tables(host_batch, run.model_config, step)
  return sharding.shard_batch(host_batch, run.mesh, run.rules)


def _log_start(run: Run, start: Start, total: int, fit_at: int | None) -> None:
  if start.step >= total:
    logging.warning("Nothing to train: the checkpoint at step %d is at or past num_train_steps=%d (raise "
                    "--config.num_train_steps to continue this run)", start.step, total)
  else:
    logging.info("Training %d parameters to step %d (from step %d)%s",
                 sum(x.size for x in jax.tree_util.tree_leaves(start.state.params)), total, start.step,
                 f"; the time budget plans the length after step {fit_at}" if fit_at else "")


def _make_evaluators(run: Run, params: Any) -> list[evaluators_lib.Evaluator]:
  eval_step = factories.make_eval_step(run.config, run.model_config, run.mesh, params, run.rules)
  return evaluators_lib.make_evaluators(run.config, model_config=run.model_config, tokenizer=run.data.tokenizer,
                                        eval_sets=run.data.eval_sets, eval_step=eval_step, mesh=run.mesh,
                                        rules=run.rules)


def train(run: Run, start: Start, checkpointer: checkpoint_lib.Checkpointer, stop: StopSignal,
          profiler: profiling.StepProfiler) -> TrainResult:
  """The step loop from `start.step` to `num_train_steps`, with its periodic actions; the only place the
  state and the `Program` (config, length, compiled step) are replaced."""
  state, step, rng = start.state, start.step, start.rng
  program = compile_program(run, run.config, run.resolved_config, state, step + 1)
  evaluators, log = _make_evaluators(run, state.params), TrainLog(step)
  early = early_stopping_lib.resume(run.config.early_stopping, run.workdir.early_stopping_json, step)
  stage_starts = {s for s, _ in run.config.dropout_schedule}  # where the compiled step's dropout may change
  decision = budget_lib.from_json(run.workdir.read_train_budget()) if run.config.train_budget_minutes > 0 else None
  fit_at = budget_lib.next_decision_step(run.config, decision, step)
  _log_start(run, start, run.config.num_train_steps, fit_at)
  train_metrics, eval_metrics, stopped, early_stop = {}, {}, False, bool(early and early.state.stop)
  first_step_seconds = 0.0
  last_save_time = train_start = time.time()
  while step < program.config.num_train_steps and not early_stop:
    step += 1
    position = run.data.train.get_state()
    batch = _sharded_batch(run, program.config.grad_accum_steps, step)
    if step in stage_starts and factories.train_model_config(
        program.config, run.model_config, step).dropout_rate != program.dropout_rate:
      program = compile_program(run, program.config, program.resolved_config, state, step)
      logging.info("Dropout %g from step %d (config.dropout_schedule)", program.dropout_rate, step)
    with profiler.step(step, outputs=lambda: state):
      state, metrics = program.train_step(state, batch, rng)
    checkpointer.check_background_save()  # a failed save stops the run now, the last complete step intact
    if step == start.step + 1:
      first_step_seconds = time.time() - train_start
    if step == fit_at:
      jax.block_until_ready(metrics)  # the rate of steps done, not of steps dispatched
      decision = budget_lib.next_decision(program.config, decision, step=step, start_step=start.step,
                                          seconds=time.time() - train_start, first_step_seconds=first_step_seconds,
                                          agree=multihost.agree_on_ints)
      fit_at = budget_lib.revision_step(decision, start.step)
      program, state = apply_budget(run, program, state, decision, step)
    config, total = program.config, program.config.num_train_steps
    log.add(step, metrics, position)
    if itstime(step, config.log_every_steps, total):
      train_metrics = log.flush(step, total)
      run.writer.write(step, {f"train/{k}": v for k, v in train_metrics.items()})
    evaluation = evaluate(evaluators, state.params, step, total)
    new_eval = evaluation.metrics
    if new_eval:
      write_evaluation(run, step, evaluation)
      eval_metrics.update(new_eval)
      early_stop = bool(early) and early.update(step, new_eval, run.workdir.early_stopping_json if run.is_chief
                                                else None)
    stopped = stop.requested(step)
    if stopped or early_stop or step == total or _checkpoint_due(config, step, last_save_time):
      save(run, checkpointer, program, state, rng, step, new_eval)
      last_save_time = time.time()
    if stopped:
      logging.warning("Received %s: saved the checkpoint of step %d; stopping. Re-run to resume.",
                      stop.signal_name, step)
      break
  if early_stop:
    logging.warning("%s; the checkpoint of step %d is saved", early.describe(step), step)
  return TrainResult(state=state, model_config=run.model_config, datasets=run.data, config=program.config,
                     final_step=step, train_minutes=(time.time() - train_start) / 60, stopped_early=stopped,
                     train_metrics=train_metrics, eval_metrics=eval_metrics,
                     early_stopping=early.summary(step if early_stop else None) if early else {})


def train_and_evaluate(config: ExperimentConfig, workdir: str) -> TrainResult:
  """Trains `config` in `workdir` (resuming from its latest complete checkpoint) and returns the result.

  For a workdir holding an imported model, pass `imported_workdir.config_for_workdir(config, workdir)`: the run
  then fine-tunes it (`imported_workdir.restore_import`) with its own tokenizer and special ids.

  Only one training process owns a workdir at a time (`owner_lock.OwnerLock`, `<workdir>/train.lock`, local
  or gs://): `WorkdirInUseError` (an OSError) when another live one holds it.
  Raises ValueError for a workdir holding an incompatible run or an invalid config, or a checkpoint whose
  data position indexes another batch plan (nothing written then: `config.json` is written after the restore),
  `checkpoint.CheckpointMismatchError` for a checkpoint of another architecture, `train_log.NonFiniteLossError`
  when the loss becomes NaN/Inf, `trackers.TrackerError` for a tracker that cannot start (before anything is
  written). SIGTERM/SIGINT finish the current step, save, and return (`stopped_early`). An early-stopping rule
  that fires saves and returns with `early_stopping["stopped_at_step"]` set.
  """
  multihost.maybe_initialize_distributed(config.distributed)
  with OwnerLock(workdir, enabled=jax.process_index() == 0), contextlib.ExitStack() as cleanup:
    run = prepare(config, workdir)  # one trainer per workdir (process 0 holds the lock)
    cleanup.callback(run.writer.close)
    checkpointer = cleanup.enter_context(factories.checkpointer(run.config, run.workdir.checkpoints))
    cleanup.callback(checkpointer.wait)
    start = init_or_restore(run, checkpointer)
    write_run_config(run, run.resolved_config)  # only now: a refused resume leaves config.json, events, metrics
    run.writer.start(run.resolved_config, evaluators_lib.logged_eval_metrics(run.config))
    profiler = profiling.StepProfiler(run.config.profile_steps, run.workdir.profile, first_step=start.step + 1,
                                      last_step=run.config.num_train_steps)
    cleanup.callback(profiler.close)
    stop = StopSignal()
    cleanup.callback(stop.restore)
    return train(run, start, checkpointer, stop, profiler)
