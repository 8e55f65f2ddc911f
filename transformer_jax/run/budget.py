"""A training run fitted to a wall-clock budget: how many steps fit, planned after the warm-up, revised once
more just before the cool-down, kept by the run.

A recipe that must finish inside an hour cannot fix its step count in advance when machines of the same kind
differ in speed (the 2-core hosts of docs/multi30k_runs.md ran the same recipe at 2.2 and at 0.95-1.4 steps/s, the
slow one drifting by 20% within an hour). With `config.train_budget_minutes > 0` the trainer measures its own
rate (steps per second of wall time, evaluations and checkpoints included, the first step's compilation not)
and sets the run's length:

    num_train_steps = min(cap, step + (budget - elapsed) * steps/s)

where `cap` is the configured `num_train_steps` and `elapsed` the training time so far (compilation included).
The cool-down keeps its share of the run (`cooldown_steps` of `num_train_steps` as configured) and ends at the
new last step. The length is planned at the end of the warm-up (`decision_step`) and revised at the last step
before the planned cool-down (`revision_step`), with the rate of most of the run; a revision that moves the
end later is revised again before its own cool-down. Once the cool-down has begun its start stays, and its end
is revised again halfway through the rest of it each time (at 1/2, 3/4, 7/8, ... of the way while at least
`MIN_MEASURED_STEPS` are left to measure), so a host that slows down or speeds up in the last quarter still ends
on the budget: the training time so far is measured, only the rest is extrapolated, and the error shrinks with
it. Such a revision pins the cool-down's progress reached so far as a knot (`cooldown_knots`, see
`schedule.cooldown`), so the rate stays continuous and the steps a run has taken follow the schedule it ends
with. The trainer saves every decision in `<workdir>/train_budget.json` (`Workdir.write_train_budget`; `from_json`
reads it back); a resumed run starts from it, so a restart follows the same plan. Nothing here reads or writes
a file: these are the budget's decisions only.
The idea of a schedule set by a time budget: Geiping & Goldstein, "Cramming" (2022), section 3.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import schedule as schedule_lib

MIN_MEASURED_STEPS = 20  # steps of this process the rate is measured over, at least


@dataclasses.dataclass(frozen=True)
class BudgetDecision:
  """The run length chosen for a budget (what `train_budget.json` holds)."""

  budget_minutes: float     # the training budget (`config.train_budget_minutes`)
  decided_at_step: int      # the step after which the length was (last) decided
  elapsed_minutes: float    # training wall time up to that step (earlier processes' steps at the same rate)
  steps_per_s: float        # the measured rate, evaluations and checkpoints included
  cap: int                  # the configured `num_train_steps`, an upper bound
  cooldown_share: float     # the configured `cooldown_steps / num_train_steps`
  num_train_steps: int      # the run's length from then on
  cooldown_steps: int       # `cooldown_share` of that length, at most the steps left after the decision; once
                            # the cool-down has begun, from its (fixed) start to the new end
  cooldown_knots: tuple = ()  # (step, progress) pinned by revisions inside the cool-down (`schedule.cooldown`)

  @property
  def cooldown_start(self) -> int:
    """The last step before the cool-down."""
    return self.num_train_steps - self.cooldown_steps

  def describe(self) -> str:
    bent = (f", its end moved after step{'s' if len(self.cooldown_knots) > 1 else ''} "
            f"{', '.join(str(k[0]) for k in self.cooldown_knots)}" if self.cooldown_knots else "")
    return (f"{self.num_train_steps} steps (cool-down {self.cooldown_steps}{bent}) fit a "
            f"{self.budget_minutes:g}-minute training budget at {self.steps_per_s:.3f} steps/s measured up to step "
            f"{self.decided_at_step} (cap {self.cap})")


def from_json(saved: Mapping | None) -> BudgetDecision | None:
  """The decision a workdir saved (`Workdir.read_train_budget()`: its fields, tuples as lists), or None for none.

  Raises TypeError when `saved` lacks a field or holds an unknown one (a file of another version)."""
  if not saved:
    return None
  return BudgetDecision(**{**saved, "cooldown_knots": tuple(tuple(k) for k in saved.get("cooldown_knots", ()))})


def decision_step(config: ExperimentConfig, start_step: int) -> int | None:
  """The step after which the length is first planned: the end of the warm-up, at least `MIN_MEASURED_STEPS`
  steps after this process's first, before the configured cool-down would begin (None when it already has)."""
  step = max(config.warmup_steps, start_step + MIN_MEASURED_STEPS)
  return step if step < config.num_train_steps - config.cooldown_steps else None


def revision_step(decision: BudgetDecision, start_step: int) -> int | None:
  """The step after which `decision` is revised, at least `MIN_MEASURED_STEPS` after this process's first: the
  last before its cool-down, or, once that is past, halfway from the last decision to the end (when at least
  `MIN_MEASURED_STEPS` lie in between); None when there is no such step (the plan is final)."""
  earliest = max(decision.decided_at_step, start_step + MIN_MEASURED_STEPS - 1)
  before_cooldown = decision.cooldown_start - 1
  if before_cooldown > earliest:
    return before_cooldown
  anchor = max(earliest, before_cooldown)
  step = anchor + (decision.num_train_steps - anchor) // 2
  return step if step - anchor >= MIN_MEASURED_STEPS else None


def plan(config: ExperimentConfig) -> dict:
  """What a first decision needs of `config`: the budget, the cap and the cool-down's share."""
  return dict(budget_minutes=float(config.train_budget_minutes), cap=int(config.num_train_steps),
              cooldown_share=config.cooldown_steps / config.num_train_steps)


def decide(budget_minutes: float, cap: int, cooldown_share: float, *, step: int, start_step: int, seconds: float,
           first_step_seconds: float) -> BudgetDecision:
  """The length that fits `budget_minutes` of training, decided after `step`.

  `seconds` is this process's training time from its first step to `step` (`step - start_step` steps),
  `first_step_seconds` the part of it the first step took (compilation, not counted in the rate). Steps of
  an earlier process (`start_step` of them) are taken to have run at the same rate. The length is at most
  `cap` and at least `step` (a budget already spent ends the run at once); the cool-down is `cooldown_share`
  of it, but never more than the steps left, so it never starts in the past.
  """
  measured = max(step - start_step - 1, 1)
  steps_per_s = measured / max(seconds - first_step_seconds, 1e-9)
  elapsed = seconds + start_step / steps_per_s
  fitted = step + int(max(60.0 * budget_minutes - elapsed, 0.0) * steps_per_s)
  total = max(min(fitted, cap), step)
  return BudgetDecision(budget_minutes=budget_minutes, decided_at_step=step, elapsed_minutes=elapsed / 60,
                        steps_per_s=steps_per_s, cap=cap, cooldown_share=cooldown_share, num_train_steps=total,
                        cooldown_steps=min(round(cooldown_share * total), total - step))


def revise_in_cooldown(previous: BudgetDecision, *, step: int, start_step: int, seconds: float,
                       first_step_seconds: float) -> BudgetDecision:
  """`previous` revised after `step`, inside its cool-down (`step >= previous.cooldown_start`): the end moves to
  what fits the budget now (`decide`), the cool-down's start stays, and the progress `step` has reached along
  `previous`'s cool-down is pinned as a knot, so the rate is continuous at `step`."""
  fitted = decide(previous.budget_minutes, previous.cap, previous.cooldown_share, step=step, start_step=start_step,
                  seconds=seconds, first_step_seconds=first_step_seconds)
  progress = schedule_lib.cooldown_progress(step, previous.num_train_steps, previous.cooldown_steps,
                                            previous.cooldown_knots)
  knots = previous.cooldown_knots + (((step, progress),) if 0 < progress < 1 else ())
  return dataclasses.replace(fitted, cooldown_steps=fitted.num_train_steps - previous.cooldown_start,
                             cooldown_knots=knots)


def next_decision_step(config: ExperimentConfig, decision: BudgetDecision | None, start_step: int) -> int | None:
  """The step after which a run starting at `start_step` next decides its length: with a budget
  (`config.train_budget_minutes > 0`), the revision of its saved `decision` (`revision_step`), or without one its
  first plan (`decision_step`); None without a budget or when no decision is left to take."""
  if config.train_budget_minutes <= 0:
    return None
  return revision_step(decision, start_step) if decision else decision_step(config, start_step)


def next_decision(config: ExperimentConfig, previous: BudgetDecision | None, *, step: int, start_step: int,
                  seconds: float, first_step_seconds: float,
                  agree: Callable[[int, int], tuple[int, ...]] = lambda *values: values) -> BudgetDecision:
  """The run's length decided after `step`: planned from `config` (no `previous` decision: `plan`, `decide`), or
  `previous` revised (`decide` with its budget; inside its cool-down, `revise_in_cooldown`).

  `seconds` and `first_step_seconds` are this process's training time so far and its first step's share of it
  (see `decide`). `agree(num_train_steps, cooldown_steps)` returns the numbers every host uses (process 0's:
  the trainer passes `multihost.agree_on_ints`). A revision that moves the end by at most 1% keeps `previous`'s
  length, cool-down and knots (the trainer then rebuilds nothing). The caller applies the decision
  (`with_decision`) and saves it (`Workdir.write_train_budget`).
  """
  measured = dict(step=step, start_step=start_step, seconds=seconds, first_step_seconds=first_step_seconds)
  if previous and step >= previous.cooldown_start:
    decision = revise_in_cooldown(previous, **measured)
  else:
    basis = (dict(budget_minutes=previous.budget_minutes, cap=previous.cap, cooldown_share=previous.cooldown_share)
             if previous else plan(config))
    decision = decide(**basis, **measured)
  total, cooldown = agree(decision.num_train_steps, decision.cooldown_steps)
  knots = decision.cooldown_knots
  if previous and abs(total - previous.num_train_steps) <= 0.01 * previous.num_train_steps:
    total, cooldown, knots = previous.num_train_steps, previous.cooldown_steps, previous.cooldown_knots
  return dataclasses.replace(decision, num_train_steps=total, cooldown_steps=cooldown, cooldown_knots=knots)


def with_decision(config: ExperimentConfig, decision: BudgetDecision | None) -> ExperimentConfig:
  """`config` with the run length `decision` sets (`num_train_steps`, `cooldown_steps`, `cooldown_knots`), or
  `config` itself when there is none."""
  if decision is None:
    return config
  return dataclasses.replace(config, num_train_steps=decision.num_train_steps,
                             cooldown_steps=decision.cooldown_steps, cooldown_knots=decision.cooldown_knots)
