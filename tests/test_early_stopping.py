"""Early stopping (`config.early_stopping`): the rule, the metric directions, and a real run made to overfit
(64 training pairs of the tiny number-words split), stopped where the rule says, and killed with SIGKILL and
resumed in between: it stops at the same step."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.configs import default
from transformer_jax.evaluation import metrics
from transformer_jax.run import early_stopping
from transformer_jax.run.experiment_config import ConfigError, ExperimentConfig
from transformer_jax.workdir import Workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = ("validation/loss", 3, 0.0)
EVERY = 10            # evaluations and logs every 10 steps
CHECKPOINT_EVERY = 20
MAX_STEPS = 400       # the run stops long before (at step 80 on the machine this was written on)


def reference_stop(values, direction, patience, min_delta):
  """(stop index or None, best index): an independent statement of the rule over a list of values."""
  sign = 1.0 if direction == "min" else -1.0
  best_index, since = 0, 0
  for i in range(1, len(values)):
    if sign * (values[best_index] - values[i]) > min_delta:
      best_index, since = i, 0
    else:
      since += 1
      if since == patience:
        return i, best_index
  return None, best_index


def test_early_stopping_words_the_table_direction():
  assert {name: metrics.metric_direction(f"validation/{name}") for name in ("loss", "nll", "perplexity")} == {
      "loss": "min", "nll": "min", "perplexity": "min"}
  assert {metrics.metric_direction(n) for n in ("validation/bleu", "test/chrf", "accuracy", "exact_match")} == {
      "max"}
  with pytest.raises(ValueError, match=r"metric 'validation/bleu_loss' has no known direction; known: "):
    metrics.metric_direction("validation/bleu_loss")  # a suffix is not a direction


@pytest.mark.parametrize("rule, message", [
    (("validation/attention/cross/near_uniform_share", 3, 0.0), "must be () or (metric, patience in [1, 2147483647]"),
    (("validation/lossy", 3, 0.0), "must be () or (metric, patience in [1, 2147483647]"),
    (("validation/loss", 0, 0.0), "must be () or (metric, patience in [1, 2147483647]"),
    (("validation/loss", 2, -0.1), "must be () or (metric, patience in [1, 2147483647]"),
    (("test/loss", 2, 0.0), "split 'test' is not evaluated during training"),
    (("validation/bleu", 2, 0.0), "'bleu' is computed by the bleu evaluator, which is off"),
    (("validation/exact_match", 2, 0.0), "'exact_match' is not logged during training; one of accuracy"),
])
def test_config_validation_refuses_a_rule_that_cannot_work_in_one_line(rule, message):
  config = default.get_config()
  config.early_stopping = rule
  with pytest.raises(ConfigError) as error:
    ExperimentConfig.from_config_dict(config)
  assert str(error.value).startswith("--config.early_stopping=") and message in str(error.value)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("direction", ["min", "max"])
@pytest.mark.parametrize("patience, min_delta", [(1, 0.0), (2, 0.0), (3, 0.05), (4, 0.2)])
def test_the_rule_stops_where_an_independent_statement_of_it_says(direction, patience, min_delta):
  rng = np.random.default_rng(patience * 7 + int(min_delta * 100))
  for _ in range(50):
    values = list(np.round(rng.normal(size=12).cumsum() * 0.1, 2))
    stop, best = reference_stop(values, direction, patience, min_delta)
    rule = early_stopping.EarlyStopping("validation/" + ("loss" if direction == "min" else "bleu"),
                                        patience, min_delta)
    fired = [i for i, v in enumerate(values) if rule.update(10 * (i + 1), {rule.metric: v}, None)]
    assert (fired[0] if fired else None) == stop
    assert rule.state.best_step == 10 * (best + 1) and rule.state.best == values[best]


def _command(workdir, shared):
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
          "--config.data.builder_config=tiny", "--config.data.train_split=train[:64]",
          f"--config.data.tfds_data_dir={shared}/tfds", f"--config.data.vocab_path={shared}/spm.model",
          "--config.data.vocab_size=128", "--config.data.tokens_per_batch=512", "--config.data.max_len=32",
          "--config.model.d_model=64", "--config.model.d_ff=256", "--config.model.num_heads=2",
          f"--config.num_train_steps={MAX_STEPS}", "--config.warmup_steps=20",
          f"--config.log_every_steps={EVERY}", f"--config.evals.loss.every_steps={EVERY}",
          "--config.evals.attention.every_steps=0", f"--config.checkpoint_every_steps={CHECKPOINT_EVERY}",
          "--config.checkpoint_keep=50", f"--config.early_stopping={RULE!r}",
          "--config.final_eval.split=test", "--config.final_eval.max_examples=20"]


def _run(cmd):
  result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _validation_losses(workdir):
  """step -> validation loss, the last logged for each step (a killed run and its resume may both log one)."""
  losses, path = {}, Workdir(workdir).metrics_jsonl
  for line in path.read_text().splitlines() if path.exists() else ():
    if not line.endswith("}"):  # a line being written
      continue
    row = json.loads(line)
    if RULE[0] in row:
      losses[row["step"]] = row[RULE[0]]
  return losses


def _kill_after_evaluation(proc, workdir, step):
  """SIGKILL once the evaluation of `step` is logged."""
  try:
    while max(_validation_losses(workdir), default=0) < step:
      assert proc.poll() is None, "training exited before it was killed"
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait()


def test_an_overfitting_run_stops_where_the_rule_says_and_killed_and_resumed_at_the_same_step(tmp_path):
  shared, reference, killed = tmp_path / "shared", Workdir(tmp_path / "reference"), Workdir(tmp_path / "killed")
  result = _run(_command(reference.root, shared))
  losses = _validation_losses(reference.root)
  steps = sorted(losses)
  stop, best = reference_stop([losses[s] for s in steps], "min", RULE[1], RULE[2])
  assert stop is not None and steps[stop] < MAX_STEPS, losses   # it overfits: validation loss rises again
  stopped_at, best_step = steps[stop], steps[best]
  assert steps[-1] == stopped_at  # no evaluation, no training after it
  assert losses[best_step] == min(losses.values())
  assert f"Early stopping at step {stopped_at}: validation/loss has not improved on" in result.stderr
  assert f"Early stopping ended training at step {stopped_at}" in result.stdout
  assert str(stopped_at) in os.listdir(reference.checkpoints)  # saved at the stop
  report = json.loads(reference.final_eval_json.read_text())
  assert report["final_step"] == stopped_at
  assert report["early_stopping"] == {
      "metric": RULE[0], "direction": "min", "patience": RULE[1], "min_delta": RULE[2],
      "best": pytest.approx(losses[best_step]), "best_step": best_step, "bad_evaluations": RULE[1],
      "stopped_at_step": stopped_at}

  # Killed with SIGKILL after a random evaluation past the first checkpoint, before the stop; meanwhile the
  # finished run is started again: it remembers the rule fired and trains nothing more.
  kill_after = random.Random(os.getpid()).randrange(CHECKPOINT_EVERY + EVERY, stopped_at, EVERY)
  proc = subprocess.Popen(_command(killed.root, shared), cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  again = _run(_command(reference.root, shared))
  assert "(an earlier run stopped here); nothing to train" in again.stderr
  assert sorted(_validation_losses(reference.root)) == steps
  _kill_after_evaluation(proc, killed.root, kill_after)
  assert max(_validation_losses(killed.root)) < stopped_at
  assert killed.early_stopping_json.exists()  # evaluations were saved before the kill

  resumed = _run(_command(killed.root, shared))
  assert "Resumed from the checkpoint at step" in resumed.stderr
  assert f"Early stopping at step {stopped_at}:" in resumed.stderr
  assert json.loads(killed.final_eval_json.read_text())["early_stopping"] == report["early_stopping"]
  assert json.loads(killed.early_stopping_json.read_text()) == json.loads(reference.early_stopping_json.read_text())
