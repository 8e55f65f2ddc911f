"""The Multi30k recipe (`experiments.multi30k` with `experiments/configs/multi30k.py`) in a shortened form.

Everything the real recipe does runs here on the shared corpus: vocabulary, packed training with the recipe's
schedule (warm-up, cool-down), validation loss/BLEU, checkpoints, averaging, beam search on test2016, both
BLEU scores, results.json, the learning curve and the generated block of the results file. Only sizes,
budgets and cadences are overridden (as a user would from the command line), so a broken recipe or program
fails here; the quality target itself is measured by the full run (docs/results.md).
"""

import json
import os
import subprocess
import sys

import pytest

from experiments.configs import multi30k
from launch import docblock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 32
SHORTENED = [f"--config.num_train_steps={STEPS}", "--config.warmup_steps=8", f"--config.cooldown_steps={STEPS // 4}",
             "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
             "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
             "--config.data.vocab_size=400", "--config.data.vocab_max_sentences=4000",
             "--config.data.tokens_per_batch=1024", "--config.log_every_steps=4",
             "--config.evals.loss.every_steps=8", "--config.evals.attention.every_steps=0",
             "--config.evals.bleu.every_steps=8", "--config.evals.bleu.max_examples=40",
             "--config.checkpoint_every_steps=4", "--config.async_checkpointing=False",
             "--config.decode.beam_size=2", "--config.final_eval.max_examples=30",
             "--config.dropout_schedule=((16, 0.2),)"]  # the recipe's late dropout stage, inside the shortened run


def test_the_recipe_config_is_the_one_the_docs_report():
  config = multi30k.get_config()
  assert config.data.dataset == "parallel_text" and config.data.eval_splits == ("val",)  # tuned on val only
  assert 0 <= config.cooldown_steps <= config.num_train_steps
  # Late dropout: rising stages after the warm-up, the first reached even on the slowest host measured (below).
  steps, rates = zip(*config.dropout_schedule)
  assert config.warmup_steps < steps[0] < int(config.train_budget_minutes * 60 * 1.0)
  assert list(steps) == sorted(set(steps)) and list(rates) == sorted(set(rates))
  assert rates[0] > config.model.dropout_rate
  assert config.checkpoint_keep >= config.decode.average_last
  # The learning curve needs val BLEU at >= 8 points (issue 14), on the slowest 2-core host measured too
  # (the slowest host in docs/multi30k_runs.md ran ~1.07 steps/s, evaluations included), where the time budget
  # shortens the run most.
  assert config.train_budget_minutes > 0
  slowest_steps = min(config.num_train_steps, int(config.train_budget_minutes * 60 * 1.0))
  assert -(-slowest_steps // config.evals.bleu.every_steps) >= 8  # every N steps, and the last


# The recipe's own decode (the moving average) runs in the default suite; the average of the last 5, the
# other path, with the slow tests (the averaging itself: tests/test_checkpoint.py, tests/test_experiments.py).
@pytest.mark.parametrize("ema_decay", [0.999, pytest.param(0.0, marks=pytest.mark.slow)])
def test_shortened_recipe_end_to_end(multi30k_dir, tmp_path, ema_decay):
  """Both ways the recipe can decode test2016: the moving average of the weights (`ema_decay` > 0) or the
  average of the last checkpoints (0); one of them is the recipe's own."""
  figure = f"moving average ({ema_decay:g})" if ema_decay else "average of last 5"
  shortened = [*SHORTENED, f"--config.ema_decay={ema_decay}"]
  workdir, results, curve = tmp_path / "run", tmp_path / "results.md", tmp_path / "curve.png"
  results.write_text("# Results\n\nHand-written lever table.\n")
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)  # compiled as a user's run (-O2): this test's time is training (conftest.py)
  proc = subprocess.run([sys.executable, "-m", "experiments.multi30k", f"--workdir={workdir}",
                         f"--config.data.dir={multi30k_dir}", f"--results={results}", f"--curve={curve}", *shortened],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Dropout 0.2 from step 16 (config.dropout_schedule)" in proc.stderr  # the step was recompiled there

  summary = json.loads((workdir / "results.json").read_text())
  assert summary["steps"] == STEPS and summary["test_sentences"] == 30
  assert set(summary["rows"]) == {figure}  # the recipe's figure; the last checkpoint on request
  for row in summary["rows"].values():
    assert 0.0 <= row["lc_tok_bleu"] <= 100.0 and 0.0 <= row["bleu"] <= 100.0 and row["chrf"] > 0.0
    assert row["bleu_signature"].startswith("nrefs:1|case:mixed")
  assert summary["steps_per_s"] > 0 and len(summary["load_average_1_5_15min"]) == 3
  assert summary["machine"]["logical_cpus"] == os.cpu_count()  # which CPU: hosts of one kind differ in speed
  assert summary["devices"] == multi30k.get_config().num_cpu_devices == 2  # data parallel over 2 host devices
  # The recipe's time budget planned the length after step 20 and revised it after 23 (the last step before
  # the cool-down); all 32 steps fit it.
  assert {k: summary["train_budget"][k] for k in ("decided_at_step", "cap", "num_train_steps")} == {
      "decided_at_step": 23, "cap": STEPS, "num_train_steps": STEPS}
  assert [step for step, _ in summary["val_bleu_by_step"]] == [8, 16, 24, 32]
  assert len((workdir / "test2016.hyp").read_text().splitlines()) == 30

  # Validation BLEU and loss were logged at every evaluation (the curve's points), and the cool-down ran.
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "val/bleu" in r] == [8, 16, 24, 32]
  assert [r["step"] for r in rows if "val/loss" in r] == [8, 16, 24, 32]
  learning_rates = {r["step"]: r["train/learning_rate"] for r in rows if "train/learning_rate" in r}
  assert learning_rates[STEPS] < learning_rates[16] / 3  # cooling since step 24: at most 1/9 of the rate left
  assert curve.stat().st_size > 10_000

  # The generated block is in the results file; the hand-written part around it is kept.
  text = results.read_text()
  start, end = docblock.markers("multi30k:last-run")
  assert text.startswith("# Results\n\nHand-written lever table.\n") and start in text and end in text
  assert f"| {figure} |" in text and "seed 0" in text and "by step: 8: " in text
  assert f"{STEPS} steps of 1024 tokens, data parallel over 2 devices (warm-up 8" in text
  assert "-minute training budget at the " in text
  assert f"cool-down {STEPS // 4} (1-sqrt), seed 0" in text  # the recipe's cool-down shape is named
  averaging = f", a moving average of the weights (decay {ema_decay:g})" if ema_decay else ""
  assert f"dropout 0.1 (0.2 from step 16), label smoothing 0.2, weight decay 0.1{averaging}, shared BPE" in text
  assert "![learning curve](curve.png)" in text  # the image link points at the PNG, relative to the results file
  assert "/attention/" not in text  # the diagnostics stay in results.json and TensorBoard
  assert f"{figure}: test2016 lc-tok BLEU" in proc.stdout

  # Run again in the finished workdir with --score_last_checkpoint: nothing is trained, both are scored.
  again = subprocess.run([sys.executable, "-m", "experiments.multi30k", f"--workdir={workdir}",
                          f"--config.data.dir={multi30k_dir}", f"--results={results}", f"--curve={curve}",
                          "--score_last_checkpoint", *shortened],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  summary = json.loads((workdir / "results.json").read_text())
  assert summary["steps"] == STEPS and set(summary["rows"]) == {"last checkpoint", figure}
  assert "| last checkpoint |" in results.read_text() and "last checkpoint: test2016 lc-tok BLEU" in again.stdout
