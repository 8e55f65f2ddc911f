"""A training run fitted to a wall-clock budget: how many steps fit, decided once, kept by the run.

A recipe that must finish inside an hour cannot fix its step count in advance when machines of the same kind
differ in speed (the 2-core hosts of docs/results.md: 1.0x to 0.6x). With `config.train_budget_minutes > 0`
the trainer measures its own rate over the warm-up (steps per second of wall time, evaluations and checkpoints
included) and at step `decision_step(...)` sets the run's length:

    num_train_steps = min(cap, decision step + (budget - elapsed) * steps/s)

where `cap` is the configured `num_train_steps` and `elapsed` the training time so far (the first step's
compilation included). The schedule's cool-down keeps its share of the run (`cooldown_steps` of
`num_train_steps` as configured) and ends at the new last step; the decision comes before any cool-down has
begun, so the schedule a run follows is one schedule. It is written
to `<workdir>/train_budget.json` and a resumed run keeps it, so a restart trains exactly the same steps.
The idea of a schedule set by a time budget: Geiping & Goldstein, "Cramming" (2022), section 3.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformer_jax.workdir import Workdir, read_json, write_json_atomically

MIN_MEASURED_STEPS = 20  # steps of this process the rate is measured over, at least


@dataclasses.dataclass(frozen=True)
class BudgetDecision:
  """The run length chosen for a budget (what `train_budget.json` holds)."""

  budget_minutes: float     # the training budget (`config.train_budget_minutes`)
  decided_at_step: int      # the step after which the length was decided
  elapsed_minutes: float    # training wall time up to that step (earlier processes' steps at the same rate)
  steps_per_s: float        # the measured rate, evaluations and checkpoints included
  cap: int                  # the configured `num_train_steps`, an upper bound
  num_train_steps: int      # the run's length from then on
  cooldown_steps: int       # the configured cool-down's share of the new length (at most the steps left)

  def describe(self) -> str:
    return (f"{self.num_train_steps} steps fit a {self.budget_minutes:g}-minute training budget at "
            f"{self.steps_per_s:.3f} steps/s measured over the first {self.decided_at_step} steps "
            f"(cap {self.cap})")


def path(workdir: Workdir | str | os.PathLike) -> os.PathLike:
  root = workdir if isinstance(workdir, Workdir) else Workdir(workdir)
  return root.root / "train_budget.json"


def read(workdir) -> BudgetDecision | None:
  """The decision saved in `workdir`, or None."""
  saved = read_json(path(workdir))
  return BudgetDecision(**saved) if saved else None


def write(workdir, decision: BudgetDecision) -> None:
  write_json_atomically(path(workdir), dataclasses.asdict(decision))


def decision_step(config: Any, start_step: int) -> int:
  """The step after which the length is decided: the end of the warm-up, and at least `MIN_MEASURED_STEPS`
  steps after this process's first, but before the configured cool-down would begin."""
  latest = max(config.num_train_steps - config.cooldown_steps, 1)
  return min(max(config.warmup_steps, start_step + MIN_MEASURED_STEPS), latest)


def decide(config: Any, step: int, start_step: int, seconds: float, first_step_seconds: float) -> BudgetDecision:
  """The length that fits `config.train_budget_minutes`, after `step`.

  `seconds` is this process's training time from its first step to `step` (`step - start_step` steps),
  `first_step_seconds` the part of it the first step took (compilation, not counted in the rate). Steps of
  an earlier process (`start_step` of them) are taken to have run at the same rate. The length is at most the
  configured `num_train_steps` and at least `step` (a budget already spent ends the run at once). The cool-down
  keeps its share of the run (`cooldown_steps / num_train_steps` as configured), but never more than the steps
  that remain, so it never starts in the past.
  """
  measured = max(step - start_step - 1, 1)
  steps_per_s = measured / max(seconds - first_step_seconds, 1e-9)
  elapsed = seconds + start_step / steps_per_s
  budget_s = 60.0 * config.train_budget_minutes
  fitted = step + int(max(budget_s - elapsed, 0.0) * steps_per_s)
  cap = int(config.num_train_steps)
  total = max(min(fitted, cap), step)
  return BudgetDecision(budget_minutes=float(config.train_budget_minutes), decided_at_step=step,
                        elapsed_minutes=elapsed / 60, steps_per_s=steps_per_s, cap=cap,
                        num_train_steps=total, cooldown_steps=min(round(config.cooldown_steps * total / cap),
                                                                  total - step))
