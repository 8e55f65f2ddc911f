"""The training run (transformer_jax/run/trainer.py) and its pieces: periodic decisions, evaluators, factories, the
typed result."""

import copy
import json
import logging

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import helpers
from experiments.configs import number_words
from transformer_jax import sharding
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run import evaluators, factories, plan, trained, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import Workdir


def test_itstime_every_n_steps_and_the_last():
  assert [s for s in range(1, 11) if trainer.itstime(s, 3, 10)] == [3, 6, 9, 10]
  assert [s for s in range(1, 11) if trainer.itstime(s, 3, 10, last=False)] == [3, 6, 9]
  assert not any(trainer.itstime(s, 0, 10) for s in range(1, 11))   # 0 = off, even at the end
  assert not any(trainer.itstime(s, -1, 10) for s in range(1, 11))


def test_evaluators_are_listed_by_the_config():
  config = number_words.get_config()
  config.evals.bleu.every_steps = 7
  config = ExperimentConfig.from_config_dict(config)
  loss, attention, bleu = evaluators.make_evaluators(config, model_config=None, tokenizer=None, eval_sets={},
                                                    eval_step=None, mesh=None)
  assert (loss.name, loss.every_steps, loss.tokens_per_batch) == ("loss", 500, 8192)
  assert (attention.name, attention.every_steps, attention.rows) == ("attention", 500, 16)
  assert (bleu.name, bleu.every_steps, bleu.beam_size, bleu.alpha) == ("bleu", 7, 1, config.decode.alpha)


def test_optimizer_cools_down_over_the_last_steps_when_asked():
  config = ExperimentConfig.from_config_dict(number_words.get_config()).replace(num_train_steps=100, warmup_steps=10)
  _, paper = factories.optimizer(config, 64)
  _, cooled = factories.optimizer(config.replace(cooldown_steps=30), 64)
  assert float(cooled(70)) == pytest.approx(float(paper(70)))
  assert float(cooled(85)) == pytest.approx(float(paper(85)) * (1 - 15 / 31))
  assert 0 < float(cooled(100)) < float(paper(100)) / 30


def _tiny_config(tmp_path):
  config = helpers.tiny_number_words_config(tmp_path)
  config.num_train_steps, config.warmup_steps, config.log_every_steps = 6, 2, 2
  config.evals.loss.every_steps = 3
  config.evals.bleu.update(every_steps=6, max_examples=8)
  config.checkpoint_every_steps = 4
  return config


def _training_only_config(tmp_path, **overrides):
  """`_tiny_config` without periodic evaluations, with `overrides` of its top-level keys (typed)."""
  config = _tiny_config(tmp_path)
  config.evals.loss.every_steps = config.evals.bleu.every_steps = config.evals.attention.every_steps = 0
  config.update(overrides)
  return ExperimentConfig.from_config_dict(config)


def test_train_and_evaluate_returns_a_typed_result_and_leaves_the_config_alone(tmp_path):
  config = ExperimentConfig.from_config_dict(_tiny_config(tmp_path))
  before = copy.deepcopy(config)
  result = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert config == before == result.config  # frozen, and no time budget (vocab_size lives in result.model_config)

  assert isinstance(result, trainer.TrainResult)
  assert result.final_step == 6 and not result.stopped_early and int(result.state.step) == 6
  assert result.model_config.vocab_size == result.datasets.tokenizer.vocab_size
  assert set(result.train_metrics) >= {"loss", "accuracy", "learning_rate", "tokens_per_s", "steps_per_s"}
  assert {k for k in result.eval_metrics if "/attention/" not in k} == {
      "validation/loss", "validation/nll", "validation/accuracy", "validation/perplexity",
      "validation/token_count", "validation/bleu", "validation/chrf"}
  # The attention evaluator (every 500 steps in this recipe) also runs at the last step.
  assert 0.0 <= result.eval_metrics["validation/attention/cross/near_uniform_share"] <= 1.0
  assert np.isfinite(result.eval_metrics["validation/attention/encoder_self/layer_0/head_1/entropy"])
  # Periodic actions: losses at 3 and 6, BLEU at 6, checkpoints at 4 and the last step.
  rows = [json.loads(line) for line in Workdir(tmp_path / "run").metrics_jsonl.read_text().splitlines()]
  assert [r["step"] for r in rows if "validation/loss" in r] == [3, 6]
  assert [r["step"] for r in rows if "validation/bleu" in r] == [6]
  assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6]
  # TensorBoard reads the same scalars from the event files as metrics.jsonl holds.
  events = event_accumulator.EventAccumulator(str(Workdir(tmp_path / "run").tensorboard))
  events.Reload()
  for tag in ("train/loss", "validation/bleu"):
    logged = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
    assert logged == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows if tag in r]
  with checkpoint_lib.Checkpointer(str(Workdir(tmp_path / "run").checkpoints), read_only=True) as ckpt:
    assert ckpt.all_steps() == [4, 6]
    restored = ckpt.restore(6)
  assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
  saved = Workdir(tmp_path / "run").require_config()
  assert saved["model"]["vocab_size"] == result.model_config.vocab_size
  assert saved["num_train_steps"] == 6


def _started(config, workdir):
  """(run, start, program) as `train_and_evaluate` has them when its loop begins (the workdir's checkpoints
  restored, the step compiled for the next update); the trackers and checkpointer closed again."""
  run = trainer.prepare(config, workdir)
  with factories.checkpointer(run.config, run.workdir.checkpoints) as checkpointer:
    start = trainer.init_or_restore(run, checkpointer)
  run.writer.close()
  return run, start, trainer.compile_program(run, run.config, run.resolved_config, start.state, start.step + 1)


def _final_params(result):
  return jax.tree_util.tree_leaves(jax.device_get(result.state.params))


def test_a_dropout_stage_recompiles_the_step_at_its_update_and_on_resume(tmp_path, caplog):
  """`config.dropout_schedule`: the step is recompiled with the stage's rate at the stage's update, and a run
  resumed after it compiles that rate; a run that adds the stage on resume ends bitwise where one that had it
  from the start ends, and elsewhere than one without it."""
  def config_with(**overrides):
    config = _training_only_config(tmp_path, **overrides)
    return config.replace(model=config.model.replace(dropout_rate=0.1))

  staged_config = config_with(dropout_schedule=((4, 0.3),))
  with caplog.at_level(logging.INFO):
    staged = trainer.train_and_evaluate(staged_config, str(tmp_path / "staged"))
  assert "Dropout 0.3 from step 4 (config.dropout_schedule)" in caplog.text
  assert staged.model_config.dropout_rate == 0.1  # the model's own rate (what config.json keeps)

  trainer.train_and_evaluate(config_with(num_train_steps=3), str(tmp_path / "resumed"))
  resumed = trainer.train_and_evaluate(staged_config, str(tmp_path / "resumed"))
  assert resumed.final_step == staged.final_step == 6
  for a, b in zip(_final_params(staged), _final_params(resumed), strict=True):
    np.testing.assert_array_equal(a, b)
  plain = trainer.train_and_evaluate(config_with(), str(tmp_path / "plain"))
  assert any((a != b).any() for a, b in zip(_final_params(staged), _final_params(plain)))

  # The step a run resumed after the stage compiles is the trainer's step at the stage's rate.
  run, start, program = _started(staged_config, str(tmp_path / "staged"))
  assert (start.step, program.dropout_rate) == (6, 0.3)
  batch = sharding.shard_batch(next(run.data.train), run.mesh, run.rules)
  at_rate = factories.make_train_step(staged_config, run.model_config.replace(dropout_rate=0.3), run.mesh,
                                      start.state, run.rules)
  assert program.train_step.lower(start.state, batch, start.rng).as_text() == at_rate.lower(
      start.state, batch, start.rng).as_text()


def test_weight_decay_trains_resumes_exactly_and_refuses_a_checkpoint_without_it(tmp_path):
  """`config.weight_decay` (AdamW): a run resumed from its checkpoint ends bitwise where the uninterrupted run
  ends and elsewhere than the same run without decay; a checkpoint of Adam without decay (another optimizer
  state) is refused in one line that names the optimizer, and left as it was."""
  def decayed_config(**overrides):
    return _training_only_config(tmp_path, weight_decay=0.1, **overrides)

  decayed = trainer.train_and_evaluate(decayed_config(), str(tmp_path / "decayed"))
  trainer.train_and_evaluate(decayed_config(num_train_steps=4), str(tmp_path / "resumed"))
  resumed = trainer.train_and_evaluate(decayed_config(), str(tmp_path / "resumed"))
  assert resumed.final_step == decayed.final_step == 6
  for a, b in zip(_final_params(decayed), _final_params(resumed), strict=True):
    np.testing.assert_array_equal(a, b)
  plain = trainer.train_and_evaluate(_training_only_config(tmp_path), str(tmp_path / "plain"))
  assert any((a != b).any() for a, b in zip(_final_params(decayed), _final_params(plain)))

  checkpoints = Workdir(tmp_path / "plain").checkpoints
  before = sorted(p.name for p in checkpoints.iterdir())
  with pytest.raises(checkpoint_lib.CheckpointMismatchError, match=r"does not fit the optimizer .*opt_state/"):
    trainer.train_and_evaluate(decayed_config(num_train_steps=8), str(tmp_path / "plain"))
  assert sorted(p.name for p in checkpoints.iterdir()) == before


def test_moving_average_resumes_exactly_and_is_what_the_finished_run_translates_with(tmp_path):
  """`config.ema_decay`: the average lives in the optimizer state, so a resumed run ends with the same average,
  bitwise, as the uninterrupted one; `inference_params`, a translation program's `load_for_inference` and
  `restore_params(ema=True)` all give it, and it differs from the trained parameters, which periodic
  validation and `--average_last` numbers keep using. A checkpoint without it is refused, and left alone."""
  def averaged_config(**overrides):
    return _training_only_config(tmp_path, ema_decay=0.9, **overrides)

  averaged = trainer.train_and_evaluate(averaged_config(), str(tmp_path / "averaged"))
  trainer.train_and_evaluate(averaged_config(num_train_steps=4), str(tmp_path / "resumed"))
  resumed = trainer.train_and_evaluate(averaged_config(), str(tmp_path / "resumed"))
  ema = jax.device_get(factories.inference_params(averaged.config, averaged.state))
  for a, b in zip(jax.tree_util.tree_leaves(ema),
                  jax.tree_util.tree_leaves(factories.inference_params(resumed.config, resumed.state)), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_final_params(averaged), _final_params(resumed), strict=True):
    np.testing.assert_array_equal(a, b)
  assert any((a != b).any() for a, b in zip(jax.tree_util.tree_leaves(ema), _final_params(averaged)))

  checkpoints = str(Workdir(tmp_path / "averaged").checkpoints)
  _, loaded, _ = trained.load(str(tmp_path / "averaged"))
  for restored in (loaded, checkpoint_lib.restore_params(checkpoints, averaged.model_config, ema=True)):
    for a, b in zip(jax.tree_util.tree_leaves(ema), jax.tree_util.tree_leaves(restored), strict=True):
      np.testing.assert_array_equal(a, b)
  _, raw, _ = trained.load(str(tmp_path / "averaged"), ema=False)
  for a, b in zip(_final_params(averaged), jax.tree_util.tree_leaves(raw), strict=True):
    np.testing.assert_array_equal(a, b)

  trainer.train_and_evaluate(_training_only_config(tmp_path), str(tmp_path / "plain"))
  plain_checkpoints = Workdir(tmp_path / "plain").checkpoints
  before = sorted(p.name for p in plain_checkpoints.iterdir())
  with pytest.raises(checkpoint_lib.CheckpointMismatchError, match=r"does not fit the optimizer .*opt_state/"):
    trainer.train_and_evaluate(averaged_config(num_train_steps=8), str(tmp_path / "plain"))
  assert sorted(p.name for p in plain_checkpoints.iterdir()) == before


def test_make_train_step_is_the_step_the_trainer_runs(tmp_path):
  """`factories.make_train_step` (what the benchmarks time) compiles the same program as the trainer's own step."""
  config = ExperimentConfig.from_config_dict(_tiny_config(tmp_path)).replace(num_train_steps=0)
  run, start, program = _started(config, str(tmp_path / "run"))
  batch = sharding.shard_batch(next(run.data.train), run.mesh, run.rules)
  mine = factories.make_train_step(config, run.model_config, run.mesh, start.state, run.rules)
  text = program.train_step.lower(start.state, batch, start.rng).as_text()
  assert mine.lower(start.state, batch, start.rng).as_text() == text
  other = factories.make_train_step(config.replace(label_smoothing=0.2), run.model_config, run.mesh, start.state,
                                    run.rules)
  assert other.lower(start.state, batch, start.rng).as_text() != text


def test_the_fit_check_compiles_the_train_step_the_run_then_uses(tmp_path, monkeypatch):
  """On a device that reports its memory, `plan.check_run_fits` compiles the train step before anything is
  written; the run runs that executable: the train step is compiled once (XLA's compile events counted)."""
  monkeypatch.setattr(plan, "device_capacity", lambda device: 64 * 2**30)  # as a GPU or TPU reports it
  compiles = []

  def count(event, seconds, **kwargs):
    if event == jax._src.dispatch.BACKEND_COMPILE_EVENT and "train_step" in kwargs.get("fun_name", ""):
      compiles.append(kwargs["fun_name"])

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    config = ExperimentConfig.from_config_dict(_tiny_config(tmp_path)).replace(num_train_steps=0)
    run, start, program = _started(config, str(tmp_path / "run"))
    batch = sharding.shard_batch(next(run.data.train), run.mesh, run.rules)
    state, _ = program.train_step(start.state, batch, start.rng)
    state, metrics = program.train_step(state, sharding.shard_batch(next(run.data.train), run.mesh, run.rules),
                                        start.rng)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert run.checked_step is not None and 0 < run.checked_step.report.peak_bytes < 64 * 2**30
  assert compiles == ["jit(train_step)"], compiles
  assert program.train_step is run.checked_step.train_step
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 2
