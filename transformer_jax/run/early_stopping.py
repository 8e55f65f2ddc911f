"""Early stopping on a validation metric: stop after `patience` evaluations without improvement.

    rule = resume(config.early_stopping, workdir.early_stopping_json, start_step)   # None when () = off
    if rule.update(step, eval_metrics, path): ...save and stop    # True once the rule says stop

As t5x's `EarlyStoppingAction`, fairseq's `--patience` and Hugging Face's `EarlyStoppingCallback`: an
evaluation improves on the best value so far when it is better by more than `min_delta` (lower for a metric
`metrics.METRICS` says to minimise, higher for one to maximise; the first evaluation sets the best);
the run stops at the evaluation that makes `patience` in a row without improvement.

The value of every evaluation is saved in `<workdir>/early_stopping.json` (process 0, atomically), and the
rule's state (best, its step, evaluations since) is replayed from those values: a run resumed from the
checkpoint of step `s` keeps the values of steps <= s (the evaluations that checkpoint has seen; later ones,
of a run killed after them, are evaluated again), so killed and resumed it stops at the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Sequence

from transformer_jax.evaluation import metrics as metrics_lib
from transformer_jax.workdir import read_json, write_json_atomically


@dataclasses.dataclass(frozen=True)
class State:
  """The rule's state after some evaluations: the best value and its step, evaluations since, stop or not."""

  best: float | None
  best_step: int | None
  bad_evaluations: int
  stop: bool


def replay(history: Sequence[tuple[int, float]], direction: str, patience: int, min_delta: float) -> State:
  """The state after the evaluations `history` ((step, value), in step order) under the rule."""
  best, best_step, bad, stop = None, None, 0, False
  for step, value in history:
    improved = best is None or (value < best - min_delta if direction == "min" else value > best + min_delta)
    if improved:
      best, best_step, bad = value, step, 0
    else:
      bad += 1
    stop = bad >= patience
    if stop:
      break
  return State(best, best_step, bad, stop)


@dataclasses.dataclass
class EarlyStopping:
  """`config.early_stopping = (metric, patience, min_delta)` on `<eval split>/<metric>` (e.g. "validation/bleu").

  Raises ValueError (`metrics.higher_is_better`) for a metric whose direction is not known.
  """

  metric: str
  patience: int
  min_delta: float
  history: list[tuple[int, float]] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self.direction = metrics_lib.metric_direction(self.metric)

  @classmethod
  def from_config(cls, value: Sequence) -> "EarlyStopping | None":
    """The rule of `config.early_stopping` (a `(metric, patience, min_delta)` triple), None for `()`."""
    return cls(str(value[0]), int(value[1]), float(value[2])) if value else None

  @property
  def state(self) -> State:
    return replay(self.history, self.direction, self.patience, self.min_delta)

  def resume(self, path: os.PathLike | str, step: int) -> None:
    """Takes the values saved in `path` (if any, and of the same metric) of the evaluations at steps <= `step`."""
    saved = read_json(path) or {}
    history = saved.get("history", []) if saved.get("metric") == self.metric else []
    self.history = [(int(s), float(v)) for s, v in history if int(s) <= step]

  def update(self, step: int, eval_metrics: Mapping[str, float], path: os.PathLike | str | None) -> bool:
    """Adds this evaluation's value (when `eval_metrics` holds the metric) and saves the values in `path`
    (None: not saved, e.g. on hosts other than process 0). True when the run must stop now."""
    if self.metric in eval_metrics and not self.state.stop:
      self.history = [(s, v) for s, v in self.history if s < step] + [(step, float(eval_metrics[self.metric]))]
      if path is not None:
        write_json_atomically(path, {"metric": self.metric, "history": self.history})
    return self.state.stop

  def summary(self, stopped_at: int | None) -> dict:
    """What the result and final_eval.json report: the rule, the best value and step, where it stopped."""
    state = self.state
    return {"metric": self.metric, "direction": self.direction, "patience": self.patience,
            "min_delta": self.min_delta, "best": state.best, "best_step": state.best_step,
            "bad_evaluations": state.bad_evaluations, "stopped_at_step": stopped_at}

  def describe(self, step: int) -> str:
    state = self.state
    return (f"Early stopping at step {step}: {self.metric} has not improved on {state.best:.4g} (step "
            f"{state.best_step}) by more than {self.min_delta:g} for {state.bad_evaluations} evaluations "
            f"(patience {self.patience}, {'lower' if self.direction == 'min' else 'higher'} is better)")


def resume(value: Sequence, path: os.PathLike | str, step: int) -> EarlyStopping | None:
  """The rule of `config.early_stopping` (None for `()`) with the values saved in `path` of the evaluations at
  steps <= `step` (a run resumed from the checkpoint of `step`); logs when the rule had already fired."""
  rule = EarlyStopping.from_config(value)
  if rule:
    rule.resume(path, step)
    if rule.state.stop:
      logging.warning("%s (an earlier run stopped here); nothing to train", rule.describe(step))
  return rule
