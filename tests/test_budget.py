"""A run fitted to a wall-clock budget (transformer_jax/training/budget.py and the trainer's `fit_to_budget`)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments.configs import default, number_words
from transformer_jax import trainer
from transformer_jax.training import budget as budget_lib
from transformer_jax.workdir import Workdir


def _config(**overrides):
  config = default.get_config()
  config.update(num_train_steps=5000, warmup_steps=800, cooldown_steps=1000, train_budget_minutes=10.0)
  config.update(overrides)
  return config


def test_decide_fits_the_steps_left_in_the_budget_at_the_measured_rate():
  # 800 steps in 60 s of which the first step (compiling) took 10 s: 799 steps / 50 s = 15.98 steps/s.
  decision = budget_lib.decide(10.0, 20_000, 0.2, step=800, start_step=0, seconds=60.0, first_step_seconds=10.0)
  assert decision.steps_per_s == pytest.approx(15.98)
  assert decision.elapsed_minutes == pytest.approx(1.0)
  assert decision.num_train_steps == 800 + int(540 * 15.98)  # 9 minutes left
  assert decision.cooldown_steps == round(0.2 * decision.num_train_steps)  # the cool-down keeps its share
  assert budget_lib.plan(_config()) == dict(budget_minutes=10.0, cap=5000, cooldown_share=0.2)


def test_decide_never_exceeds_the_cap_and_a_spent_budget_ends_the_run_at_once():
  capped = budget_lib.decide(1e4, 5000, 0.2, step=800, start_step=0, seconds=60.0, first_step_seconds=1.0)
  assert (capped.num_train_steps, capped.cooldown_steps) == (5000, 1000)
  spent = budget_lib.decide(0.5, 5000, 0.2, step=800, start_step=0, seconds=60.0, first_step_seconds=1.0)
  assert (spent.num_train_steps, spent.cooldown_steps) == (800, 0)
  # Fewer steps left than the cool-down's share: it is shortened to them, never started in the past.
  short = budget_lib.decide(1.1, 5000, 0.8, step=800, start_step=0, seconds=60.0, first_step_seconds=10.0)
  assert short.num_train_steps - 800 == short.cooldown_steps < 0.8 * short.num_train_steps


def test_decide_counts_the_steps_of_an_earlier_process_at_the_same_rate():
  # Resumed at step 600; 200 more steps in 21 s (1 s compiling): 199 / 20 steps/s, 60.3 s of earlier training.
  decision = budget_lib.decide(10.0, 5000, 0.2, step=800, start_step=600, seconds=21.0, first_step_seconds=1.0)
  assert decision.steps_per_s == pytest.approx(199 / 20)
  assert decision.elapsed_minutes == pytest.approx((21.0 + 600 / (199 / 20)) / 60)


def test_the_plan_comes_after_the_warmup_and_its_revision_before_the_cooldown():
  assert budget_lib.decision_step(_config(), start_step=0) == 800
  assert budget_lib.decision_step(_config(), start_step=790) == 790 + budget_lib.MIN_MEASURED_STEPS
  assert budget_lib.decision_step(_config(num_train_steps=1500), start_step=0) is None  # cool-down from 500
  plan = budget_lib.decide(10.0, 5000, 0.25, step=800, start_step=0, seconds=300.0, first_step_seconds=1.0)
  assert budget_lib.revision_step(plan, 0) == plan.num_train_steps - plan.cooldown_steps - 1
  assert budget_lib.revision_step(plan, plan.num_train_steps - plan.cooldown_steps - 5) is None  # too few steps
  final = dataclasses.replace(plan, decided_at_step=plan.num_train_steps - plan.cooldown_steps - 1)
  assert budget_lib.revision_step(final, 0) is None


def _tiny_config(tmp_path, **overrides):
  config = number_words.get_config()
  config.data.update(builder_config="tiny", vocab_size=128, tfds_data_dir=str(tmp_path / "tfds"),
                     tokens_per_batch=512)
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2)
  config.update(num_train_steps=60, warmup_steps=2, cooldown_steps=10, log_every_steps=1,
                checkpoint_every_steps=20, async_checkpointing=False)
  config.evals.loss.every_steps = 20
  config.evals.attention.every_steps = 0
  config.update(overrides)
  return config


def _fake_clock(monkeypatch, seconds_at):
  """The trainer's decisions see `seconds_at(step)` of training (the first step 0.5 s), not the real clock."""
  real_decide = budget_lib.decide
  monkeypatch.setattr(trainer.budget_lib, "decide", lambda *args, **kw: real_decide(
      *args, **{**kw, "seconds": seconds_at(kw["step"]), "first_step_seconds": 0.5}))


def test_the_trainer_ends_the_run_where_the_budget_says_and_a_resume_keeps_it(tmp_path, monkeypatch):
  _fake_clock(monkeypatch, lambda step: 0.5 * step)  # 2 steps/s throughout: 48 steps fit 24 s
  config = _tiny_config(tmp_path, train_budget_minutes=0.4)
  workdir = str(tmp_path / "run")
  result = trainer.train_and_evaluate(config, workdir)

  assert result.final_step == int(result.state.step) == 48 == result.config.num_train_steps
  assert config.num_train_steps == 60  # the caller's config is left alone; the result holds the run's
  saved = budget_lib.read(workdir)  # planned after step 20, revised after 39 (the last before the cool-down)
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps, saved.cap) == (39, 48, 8, 60)
  assert saved.cooldown_steps == round(10 * 48 / 60) == result.config.cooldown_steps
  assert Workdir(workdir).require_config()["num_train_steps"] == 48
  # The optimizer itself follows the new schedule, not only the logged rate: the run is bitwise the run that
  # was given that length and cool-down from the start (the schedules agree up to the decision at step 20).
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  last_lr = [r["train/learning_rate"] for r in rows if r["step"] == 48 and "train/learning_rate" in r][0]
  _, configured = trainer.optimizer(config, 32)
  assert last_lr < 0.25 * float(configured(48))  # deep in the new cool-down; the configured one is not
  fixed = trainer.train_and_evaluate(_tiny_config(tmp_path, num_train_steps=48, cooldown_steps=8),
                                     str(tmp_path / "fixed"))
  for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(fixed.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A resumed run keeps the plan (it is final: no decision is left to take).
  monkeypatch.setattr(trainer.budget_lib, "decide", lambda *a, **kw: pytest.fail("decided again"))
  again = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), workdir)
  assert again.final_step == 48 and again.config.num_train_steps == 48


def test_a_slowdown_after_the_plan_is_caught_by_the_revision(tmp_path, monkeypatch):
  # 2 steps/s up to the plan after step 20 (48 steps), then 1 step/s: at step 39 the budget is spent.
  _fake_clock(monkeypatch, lambda step: 0.5 * min(step, 20) + max(step - 20, 0))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), str(tmp_path / "run"))
  saved = budget_lib.read(str(tmp_path / "run"))
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps) == (39, 39, 0)
  assert result.final_step == 39


def test_a_speedup_after_the_plan_is_taken_up_by_further_revisions_up_to_the_cap(tmp_path, monkeypatch):
  # 1 step/s up to the plan after step 20 (35 steps fit 36 s), then 4 steps/s: each revision, at the last step
  # before the planned cool-down, moves the end later (45, 53, then the cap of 60), and the last keeps it.
  _fake_clock(monkeypatch, lambda step: min(step, 20) + 0.25 * max(step - 20, 0))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.6), str(tmp_path / "run"))
  saved = budget_lib.read(str(tmp_path / "run"))
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps) == (49, 60, 10)
  assert result.final_step == 60


def test_without_a_budget_the_configured_length_holds(tmp_path, monkeypatch):
  monkeypatch.setattr(trainer.budget_lib, "decide", lambda *a: pytest.fail("no budget, no decision"))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, num_train_steps=24), str(tmp_path / "run"))
  assert result.final_step == 24 and budget_lib.read(str(tmp_path / "run")) is None
