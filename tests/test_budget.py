"""A run fitted to a wall-clock budget: the decisions (transformer_jax/run/budget.py) and the trainer that
applies them (`trainer.apply_budget`)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments.configs import default, number_words
from transformer_jax.run import budget as budget_lib
from transformer_jax.run import factories, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import schedule as schedule_lib
from transformer_jax.workdir import Workdir


def _saved(workdir):
  """The decision the trainer saved in `workdir`, or None."""
  return budget_lib.from_json(Workdir(workdir).read_train_budget())


def _config(**overrides):
  config = default.get_config()
  config.update(num_train_steps=5000, warmup_steps=800, cooldown_steps=1000, train_budget_minutes=10.0)
  config.update(overrides)
  return ExperimentConfig.from_config_dict(config)


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


def test_the_plan_comes_after_the_warmup_and_its_revisions_before_and_inside_the_cooldown():
  assert budget_lib.decision_step(_config(), start_step=0) == 800
  assert budget_lib.decision_step(_config(), start_step=790) == 790 + budget_lib.MIN_MEASURED_STEPS
  assert budget_lib.decision_step(_config(num_train_steps=1500), start_step=0) is None  # cool-down from 500
  plan = budget_lib.decide(10.0, 5000, 0.25, step=800, start_step=0, seconds=300.0, first_step_seconds=1.0)
  end, start, least = plan.num_train_steps, plan.cooldown_start, budget_lib.MIN_MEASURED_STEPS
  assert budget_lib.revision_step(plan, 0) == start - 1  # the last step before the cool-down
  # Once that is past: halfway from the last decision (or this process's first measured steps) to the end.
  at_start = dataclasses.replace(plan, decided_at_step=start - 1)
  assert budget_lib.revision_step(at_start, 0) == start - 1 + (end - start + 1) // 2
  resumed = start - 5 + least - 1  # a process resumed 5 steps before the cool-down measures `least` steps first
  assert budget_lib.revision_step(plan, start - 5) == resumed + (end - resumed) // 2
  near_end = dataclasses.replace(plan, decided_at_step=end - 2 * least + 1)  # fewer than `least` to the midpoint
  assert budget_lib.revision_step(near_end, 0) is None


def test_a_revision_inside_the_cooldown_keeps_its_start_and_pins_its_progress():
  # Planned after step 800 at 2 steps/s: 1,919 steps, the cool-down from step 1,439. Then slower: at step 1,700
  # 900 s have passed (530.5 were planned), so the 60 s left fit 113 steps at the run's rate, 1,699 / 899 steps/s.
  plan = budget_lib.decide(16.0, 5000, 0.25, step=800, start_step=0, seconds=400.5, first_step_seconds=1.0)
  assert (plan.num_train_steps, plan.cooldown_start) == (1919, 1439)
  revised = budget_lib.revise_in_cooldown(plan, step=1700, start_step=0, seconds=900.0, first_step_seconds=1.0)
  assert revised.num_train_steps == 1700 + int(60 * 1699 / 899) == 1813
  assert revised.cooldown_start == plan.cooldown_start == 1439  # the cool-down under way keeps its start
  assert revised.cooldown_knots == ((1700, pytest.approx((1700 - 1439) / 481)),)  # the progress reached
  spent = budget_lib.revise_in_cooldown(plan, step=1700, start_step=0, seconds=1000.0, first_step_seconds=1.0)
  assert (spent.num_train_steps, spent.cooldown_start) == (1700, 1439)  # over budget: the run ends now
  # The revised schedule follows the old one up to the knot, so the rate is continuous there, then falls to 0
  # after the new end; a second revision bends it again from its own knot.
  base = lambda step: 1.0  # noqa: E731
  old = schedule_lib.cooldown(base, plan.num_train_steps, plan.cooldown_steps, "1-sqrt")
  new = schedule_lib.cooldown(base, revised.num_train_steps, revised.cooldown_steps, "1-sqrt", revised.cooldown_knots)
  for step in (1439, 1500, 1650, 1700):
    assert float(new(step)) == pytest.approx(float(old(step)), rel=1e-5)
  assert float(old(1701)) > float(new(1701)) and float(new(1813)) > 0 == float(new(1814))
  again = budget_lib.revise_in_cooldown(revised, step=1760, start_step=0, seconds=930.0, first_step_seconds=1.0)
  assert again.cooldown_knots[0] == revised.cooldown_knots[0] and again.cooldown_knots[1][0] == 1760
  schedule_lib.check_cooldown(again.num_train_steps, again.cooldown_steps, "1-sqrt", again.cooldown_knots)


def test_next_decision_plans_revises_agrees_and_keeps_a_small_change():
  """`next_decision`: a first plan from the config, a revision with the plan's budget, the hosts' agreement on
  the numbers, and a revision within 1% of the plan keeps it whole."""
  config = _config(num_train_steps=20_000, cooldown_steps=4000)  # 10 minutes, cool-down share 0.2
  measured = dict(start_step=0, first_step_seconds=10.0)
  plan = budget_lib.next_decision(config, None, step=800, seconds=60.0, **measured)
  assert plan == budget_lib.decide(10.0, 20_000, 0.2, step=800, seconds=60.0, **measured)
  agreed = budget_lib.next_decision(config, None, step=800, seconds=60.0, agree=lambda t, c: (4000, 800),
                                    **measured)
  assert (agreed.num_train_steps, agreed.cooldown_steps, agreed.steps_per_s) == (4000, 800, plan.steps_per_s)
  # At the last step before the planned cool-down, a rate 0.5% above the plan's moves the end by < 1%: kept.
  before_cooldown = plan.cooldown_start - 1
  seconds = 10.0 + (before_cooldown - 1) / (plan.steps_per_s * 1.005)
  kept = budget_lib.next_decision(config, plan, step=before_cooldown, seconds=seconds, **measured)
  assert (kept.num_train_steps, kept.cooldown_steps, kept.decided_at_step) == (
      plan.num_train_steps, plan.cooldown_steps, before_cooldown)
  # 10% slower: the end moves earlier (the cool-down its share, at most the steps left), as `decide` says.
  slow = budget_lib.next_decision(config, plan, step=before_cooldown, seconds=1.1 * seconds, **measured)
  assert slow == budget_lib.decide(10.0, 20_000, 0.2, step=before_cooldown, seconds=1.1 * seconds, **measured)
  assert slow.num_train_steps < 0.99 * plan.num_train_steps
  assert budget_lib.with_decision(config, slow).num_train_steps == slow.num_train_steps
  assert budget_lib.with_decision(config, None) is config and config.num_train_steps == 20_000
  assert budget_lib.next_decision_step(config, None, 0) == 800
  assert budget_lib.next_decision_step(config, plan, 0) == plan.cooldown_start - 1
  assert budget_lib.next_decision_step(_config(train_budget_minutes=0.0), plan, 0) is None


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
  return ExperimentConfig.from_config_dict(config)


def _fake_clock(monkeypatch, seconds_at):
  """The trainer's decisions see `seconds_at(step)` of training (the first step 0.5 s), not the real clock."""
  real_decide = budget_lib.decide
  monkeypatch.setattr(budget_lib, "decide", lambda *args, **kw: real_decide(
      *args, **{**kw, "seconds": seconds_at(kw["step"]), "first_step_seconds": 0.5}))


def test_the_trainer_ends_the_run_where_the_budget_says_and_a_resume_keeps_it(tmp_path, monkeypatch):
  _fake_clock(monkeypatch, lambda step: 0.5 * step)  # 2 steps/s throughout: 48 steps fit 24 s
  config = _tiny_config(tmp_path, train_budget_minutes=0.4)
  workdir = str(tmp_path / "run")
  result = trainer.train_and_evaluate(config, workdir)

  assert result.final_step == int(result.state.step) == 48 == result.config.num_train_steps
  assert config.num_train_steps == 60  # the caller's config is left alone; the result holds the run's
  saved = _saved(workdir)  # planned after step 20, revised after 39 (the last before the cool-down)
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps, saved.cap) == (39, 48, 8, 60)
  assert saved.cooldown_steps == round(10 * 48 / 60) == result.config.cooldown_steps
  assert Workdir(workdir).require_config()["num_train_steps"] == 48
  # The optimizer itself follows the new schedule, not only the logged rate: the run is bitwise the run that
  # was given that length and cool-down from the start (the schedules agree up to the decision at step 20).
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  last_lr = [r["train/learning_rate"] for r in rows if r["step"] == 48 and "train/learning_rate" in r][0]
  _, configured = factories.optimizer(config, 32)
  assert last_lr < 0.25 * float(configured(48))  # deep in the new cool-down; the configured one is not
  fixed = trainer.train_and_evaluate(_tiny_config(tmp_path, num_train_steps=48, cooldown_steps=8),
                                     str(tmp_path / "fixed"))
  for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(fixed.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A resumed run keeps the plan (it is final: no decision is left to take).
  monkeypatch.setattr(budget_lib, "decide", lambda *a, **kw: pytest.fail("decided again"))
  again = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), workdir)
  assert again.final_step == 48 and again.config.num_train_steps == 48


def test_a_slowdown_after_the_plan_is_caught_by_the_revision(tmp_path, monkeypatch):
  # 2 steps/s up to the plan after step 20 (48 steps), then 1 step/s: at step 39 the budget is spent.
  _fake_clock(monkeypatch, lambda step: 0.5 * min(step, 20) + max(step - 20, 0))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), str(tmp_path / "run"))
  saved = _saved(str(tmp_path / "run"))
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps) == (39, 39, 0)
  assert result.final_step == 39


def test_a_speedup_after_the_plan_is_taken_up_by_further_revisions_up_to_the_cap(tmp_path, monkeypatch):
  # 1 step/s up to the plan after step 20 (35 steps fit 36 s), then 4 steps/s: each revision, at the last step
  # before the planned cool-down, moves the end later (45, 53, then the cap of 60), and the last keeps it.
  _fake_clock(monkeypatch, lambda step: min(step, 20) + 0.25 * max(step - 20, 0))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.6), str(tmp_path / "run"))
  saved = _saved(str(tmp_path / "run"))
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_steps) == (49, 60, 10)
  assert result.final_step == 60


def test_a_slowdown_inside_the_cooldown_moves_its_end_and_the_run_ends_on_the_budget(tmp_path, monkeypatch):
  # 2 steps/s up to the cool-down (48 steps fit 24 s; cool-down 8, from step 40), then 1 step/s. Revisions after
  # step 39 (kept) and halfway to the end, after step 43: 23 s spent, 1 s left: the end moves from 48 to 44, the
  # cool-down keeps its start and the progress reached at step 43 (3 / 9). Without it the run ended at 28 s.
  monkeypatch.setattr(budget_lib, "MIN_MEASURED_STEPS", 4)
  seconds_at = lambda step: 0.5 * min(step, 40) + max(step - 40, 0)  # noqa: E731
  _fake_clock(monkeypatch, seconds_at)
  workdir = str(tmp_path / "run")
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), workdir)
  saved = _saved(workdir)
  assert (saved.decided_at_step, saved.num_train_steps, saved.cooldown_start) == (43, 44, 40)
  assert saved.cooldown_knots == ((43, pytest.approx(3 / 9)),)
  assert result.final_step == 44 and seconds_at(result.final_step) == 24.0
  assert Workdir(workdir).require_config()["cooldown_knots"] == [[43, saved.cooldown_knots[0][1]]]
  # The logged rate falls through the cool-down without a jump at the revision.
  rows = [json.loads(line) for line in Workdir(workdir).metrics_jsonl.read_text().splitlines()]
  rates = {r["step"]: r["train/learning_rate"] for r in rows if "train/learning_rate" in r}
  assert all(rates[step + 1] < rates[step] for step in range(40, 44))
  # The run is bitwise the run given that length, cool-down and knot from the start.
  fixed = trainer.train_and_evaluate(
      _tiny_config(tmp_path, num_train_steps=44, cooldown_steps=4, cooldown_knots=saved.cooldown_knots),
      str(tmp_path / "fixed"))
  for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(fixed.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A resumed run keeps the plan: no decision is left to take.
  monkeypatch.setattr(budget_lib, "decide", lambda *a, **kw: pytest.fail("decided again"))
  again = trainer.train_and_evaluate(_tiny_config(tmp_path, train_budget_minutes=0.4), workdir)
  assert again.final_step == 44 and again.config.cooldown_knots == saved.cooldown_knots


def test_without_a_budget_the_configured_length_holds(tmp_path, monkeypatch):
  monkeypatch.setattr(budget_lib, "decide", lambda *a: pytest.fail("no budget, no decision"))
  result = trainer.train_and_evaluate(_tiny_config(tmp_path, num_train_steps=24), str(tmp_path / "run"))
  assert result.final_step == 24 and _saved(str(tmp_path / "run")) is None


def test_a_decision_goes_through_the_workdir_and_back_unchanged(tmp_path):
  decision = budget_lib.BudgetDecision(budget_minutes=55.0, decided_at_step=5193, elapsed_minutes=40.5,
                                       steps_per_s=2.153, cap=9000, cooldown_share=0.25, num_train_steps=7087,
                                       cooldown_steps=1772, cooldown_knots=((6000, 0.375), (6500, 0.625)))
  workdir = Workdir(tmp_path / "run")
  assert workdir.read_train_budget() is None and budget_lib.from_json(workdir.read_train_budget()) is None
  workdir.write_train_budget(decision)
  saved = json.loads(workdir.train_budget_json.read_text())
  assert saved == {**dataclasses.asdict(decision), "cooldown_knots": [[6000, 0.375], [6500, 0.625]]}
  assert budget_lib.from_json(saved) == decision  # the knots come back as tuples, so the decisions compare equal
