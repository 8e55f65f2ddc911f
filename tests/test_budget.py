"""A run fitted to a wall-clock budget (transformer_jax/training/budget.py and the trainer's `fit_to_budget`)."""

import json

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
  config = _config(num_train_steps=20_000, cooldown_steps=4000)
  decision = budget_lib.decide(config, step=800, start_step=0, seconds=60.0, first_step_seconds=10.0)
  assert decision.steps_per_s == pytest.approx(15.98)
  assert decision.elapsed_minutes == pytest.approx(1.0)
  assert decision.num_train_steps == 800 + int(540 * 15.98)  # 9 minutes left
  # The cool-down keeps its share of the run: 4,000 of the 20,000-step cap, so a fifth of the fitted length.
  assert decision.cap == 20_000 and decision.cooldown_steps == round(decision.num_train_steps / 5)


def test_decide_never_exceeds_the_cap_and_a_spent_budget_ends_the_run_at_once():
  capped = budget_lib.decide(_config(train_budget_minutes=1e4), 800, 0, 60.0, 1.0)
  assert (capped.num_train_steps, capped.cooldown_steps) == (5000, 1000)
  spent = budget_lib.decide(_config(train_budget_minutes=0.5), 800, 0, 60.0, 1.0)
  assert (spent.num_train_steps, spent.cooldown_steps) == (800, 0)
  # Fewer steps left than the cool-down's share: it is shortened to them, never started in the past.
  short = budget_lib.decide(_config(train_budget_minutes=1.1, cooldown_steps=4000), 800, 0, 60.0, 10.0)
  assert short.num_train_steps - 800 == short.cooldown_steps < 0.8 * short.num_train_steps


def test_decide_counts_the_steps_of_an_earlier_process_at_the_same_rate():
  # Resumed at step 600; 200 more steps in 21 s (1 s compiling): 10 steps/s, so 60 s of earlier training.
  decision = budget_lib.decide(_config(), step=800, start_step=600, seconds=21.0, first_step_seconds=1.0)
  assert decision.steps_per_s == pytest.approx(199 / 20)
  assert decision.elapsed_minutes == pytest.approx((21.0 + 600 / (199 / 20)) / 60)


def test_decision_step_is_the_end_of_the_warmup_before_any_cooldown():
  assert budget_lib.decision_step(_config(), start_step=0) == 800
  assert budget_lib.decision_step(_config(), start_step=790) == 790 + budget_lib.MIN_MEASURED_STEPS
  assert budget_lib.decision_step(_config(num_train_steps=1500), start_step=0) == 500


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


def test_the_trainer_ends_the_run_where_the_budget_says_and_a_resume_keeps_it(tmp_path, monkeypatch):
  real_decide = budget_lib.decide
  # A fixed clock for the decision: 20 steps in 10 s, 1 s of it compiling (19/9 steps/s), 24 s of budget.
  monkeypatch.setattr(trainer.budget_lib, "decide",
                      lambda config, step, start, seconds, first: real_decide(config, step, start, 10.0, 1.0))
  config = _tiny_config(tmp_path, train_budget_minutes=0.4)
  workdir = str(tmp_path / "run")
  result = trainer.train_and_evaluate(config, workdir)

  expected = 20 + int(14 * 19 / 9)  # decided after step 20 (MIN_MEASURED_STEPS), 14 s left
  assert result.final_step == int(result.state.step) == expected == result.config.num_train_steps
  assert config.num_train_steps == 60  # the caller's config is left alone; the result holds the run's
  saved = budget_lib.read(workdir)
  assert (saved.decided_at_step, saved.num_train_steps, saved.cap) == (20, expected, 60)
  assert saved.cooldown_steps == round(10 * expected / 60) == result.config.cooldown_steps
  assert Workdir(workdir).require_config()["num_train_steps"] == expected
  # The step was rebuilt for the new schedule: the last update is deep in its cool-down (factor <= 2/9), where
  # the configured schedule (cool-down from step 50) would still be at its full rate.
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  last_lr = [r["train/learning_rate"] for r in rows if r["step"] == expected and "train/learning_rate" in r][0]
  _, configured = trainer.optimizer(config, 32)
  assert last_lr < 0.25 * float(configured(expected))

  # A resumed run keeps the decision (no second one: the clock of this process is not consulted).
  monkeypatch.setattr(trainer.budget_lib, "decide", lambda *a: pytest.fail("decided twice"))
  again = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), workdir)
  assert again.final_step == expected and again.config.num_train_steps == expected


def test_without_a_budget_the_configured_length_holds(tmp_path, monkeypatch):
  monkeypatch.setattr(trainer.budget_lib, "decide", lambda *a: pytest.fail("no budget, no decision"))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, num_train_steps=24), str(tmp_path / "run"))
  assert result.final_step == 24 and budget_lib.read(str(tmp_path / "run")) is None
