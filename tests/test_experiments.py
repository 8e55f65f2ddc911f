"""The absl programs end to end: train -> translate / evaluate / average / attention map, and bad input."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import sacrebleu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_OVERRIDES = ["--config.data.builder_config=tiny", "--config.data.vocab_size=128",
                  "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
                  "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
                  "--config.num_train_steps=30", "--config.warmup_steps=10", "--config.log_every_steps=10",
                  "--config.eval_every_steps=0", "--config.checkpoint_every_steps=10",
                  "--config.final_eval.max_examples=20"]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = REPO
  return env


def _run(args, stdin=None, check=True):
  result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=_env(), input=stdin,
                          capture_output=True, text=True, timeout=300)
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = tmp_path_factory.mktemp("run")
  result = _run(["experiments.train", f"--workdir={wd}", *TINY_OVERRIDES])
  assert "Exact match on 20 test examples" in result.stdout
  return wd


def test_train_writes_the_workdir(workdir):
  for name in ("config.json", "metrics.jsonl", "vocab/spm.model", "final_eval.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()) == [10, 20, 30]


def test_translate_stdin_keeps_lines_and_empty_lines(workdir):
  result = _run(["experiments.translate", f"--workdir={workdir}"], stdin="twenty-one\n\nfive\n   \nseven\n")
  lines = result.stdout.split("\n")
  assert len(lines) == 6 and lines[-1] == ""  # five lines, each newline-terminated
  assert lines[1] == "" and lines[3] == ""
  assert all(lines[i] for i in (0, 2, 4))


def test_translate_file_with_beam_matches_line_by_line(workdir, tmp_path):
  sources = ["three hundred five", "", "twenty-one", "nine hundred ninety-nine thousand one", "six"]
  (tmp_path / "in.txt").write_text("\n".join(sources) + "\n", encoding="utf-8")
  _run(["experiments.translate", f"--workdir={workdir}", f"--input={tmp_path}/in.txt",
        f"--output={tmp_path}/out.txt", "--beam_size=4", "--alpha=0.6"])
  batch = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
  assert len(batch) == len(sources) and batch[1] == ""
  single = _run(["experiments.translate", f"--workdir={workdir}", "--beam_size=4"], stdin=sources[3] + "\n")
  assert batch[3] == single.stdout.rstrip("\n")  # input order kept in a mixed-length batch


def test_evaluate_matches_sacrebleu(workdir, tmp_path):
  src = tmp_path / "src.txt"
  ref = tmp_path / "ref.txt"
  src.write_text("twenty-one\nfive\nthree hundred\n", encoding="utf-8")
  ref.write_text("einundzwanzig\nfünf\ndreihundert\n", encoding="utf-8")
  result = _run(["experiments.evaluate", f"--workdir={workdir}", f"--source={src}", f"--reference={ref}",
                 "--beam_size=2", "--tokenized_bleu", f"--output_prefix={tmp_path}/eval"])
  hyps = (tmp_path / "eval.hyp").read_text(encoding="utf-8").split("\n")[:-1]
  scores = json.loads((tmp_path / "eval.json").read_text())
  refs = ref.read_text(encoding="utf-8").split("\n")[:-1]
  assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
  assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
  assert "nrefs:1|case:mixed|eff:no|tok:13a" in result.stdout and "tokenized_bleu" in scores


def test_average_checkpoints_output_is_accepted_by_translate(workdir, tmp_path):
  out = tmp_path / "averaged"
  _run(["experiments.average_checkpoints", f"--workdir={workdir}", "--last=3", f"--output={out}"])
  result = _run(["experiments.translate", f"--workdir={workdir}", f"--checkpoint={out}"], stdin="twelve\n")
  assert len(result.stdout.split("\n")) == 2


def test_attention_map_writes_a_png_grid(workdir, tmp_path):
  png = tmp_path / "att.png"
  result = _run(["experiments.attention_map", f"--workdir={workdir}", "--source=twenty-one",
                 "--target=einundzwanzig", f"--output={png}"])
  # The entropy table: one line per (kind, layer) with one cell per head, and the near-uniform share.
  assert "encoder_self layer 0:" in result.stdout and "cross near-uniform heads:" in result.stdout
  data = png.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  width, height = struct.unpack(">II", data[16:24])
  assert height > width  # 3 kinds x 1 layer rows, 2 head columns


# -- bad input --------------------------------------------------------------------------------------------

def test_invalid_utf8_input_names_file_and_line(workdir, tmp_path):
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"twenty\nthirty \xff\n")
  result = _run(["experiments.translate", f"--workdir={workdir}", f"--input={bad}"], check=False)
  assert result.returncode == 1
  assert f"{bad}:2: invalid UTF-8" in result.stderr.strip().splitlines()[-1]


def test_incompatible_workdir_is_refused_and_left_untouched(workdir):
  before = (workdir / "config.json").read_bytes()
  steps_before = sorted(os.listdir(workdir / "checkpoints"))
  result = _run(["experiments.train", f"--workdir={workdir}", *TINY_OVERRIDES, "--config.model.d_model=64",
                 "--config.num_train_steps=40"], check=False)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert "model.d_model: saved 32, requested 64" in last
  assert (workdir / "config.json").read_bytes() == before
  assert sorted(os.listdir(workdir / "checkpoints")) == steps_before


def test_vocabulary_that_does_not_match_the_checkpoint_is_reported(workdir, tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("tensorboard"))
  from transformer_jax.data.tokenizer import train_tokenizer
  train_tokenizer(["ein zwei drei vier fünf sechs"] * 50, str(copy / "vocab" / "spm.model"), vocab_size=40)
  result = _run(["experiments.translate", f"--workdir={copy}"], stdin="five\n", check=False)
  assert result.returncode == 1
  assert "vocabulary has" in result.stderr and "vocab_size=" in result.stderr.strip().splitlines()[-1]


def test_missing_workdir_is_a_one_line_error(tmp_path):
  result = _run(["experiments.translate", f"--workdir={tmp_path}/nope"], stdin="five\n", check=False)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_nan_loss_stops_with_the_step(monkeypatch, tmp_path):
  """A NaN loss raises NonFiniteLossError naming the step (train_step patched to produce one)."""
  import ml_collections
  from experiments.configs import number_words
  from transformer_jax import sharding
  from transformer_jax.training import loop

  real = sharding.jit_sharded_train_step

  def poisoned(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def run(state, batch, rng):
      new_state, metrics = step_fn(state, batch, rng)
      if int(new_state.step) == 7:
        metrics = dict(metrics, loss=np.float32("nan"))
      return new_state, metrics
    return run

  monkeypatch.setattr(sharding, "jit_sharded_train_step", poisoned)
  config = number_words.get_config()
  config.data.builder_config = "tiny"
  config.data.vocab_size = 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 2
  config.num_train_steps, config.log_every_steps, config.eval_every_steps = 20, 5, 0
  with pytest.raises(loop.NonFiniteLossError, match="at step 7"):
    loop.train_and_evaluate(config, str(tmp_path / "run"))
