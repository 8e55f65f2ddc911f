"""The absl programs end to end: train -> translate / evaluate / average / attention map, and bad input."""

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import sacrebleu

import helpers
from transformer_jax.run.experiment_config import ExperimentConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_OVERRIDES = ["--config.data.builder_config=tiny", "--config.data.vocab_size=128",
                  "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
                  "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
                  "--config.num_train_steps=30", "--config.warmup_steps=10", "--config.log_every_steps=10",
                  "--config.evals.loss.every_steps=0", "--config.checkpoint_every_steps=10",
                  "--config.final_eval.max_examples=20"]


def _env():
  env = dict(os.environ)
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


def test_tune_decoding_decodes_the_moving_average_of_a_run_that_kept_one(tmp_path):
  """`--average_last=...,ema` on a run trained with `ema_decay`: one row per setting, in the flag's order."""
  workdir = tmp_path / "ema_run"
  _run(["experiments.train", f"--workdir={workdir}", *TINY_OVERRIDES, "--config.num_train_steps=10",
        "--config.ema_decay=0.9", "--config.final_eval.split="])
  src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
  src.write_text("twenty-one\nfive\n", encoding="utf-8")
  ref.write_text("einundzwanzig\nfünf\n", encoding="utf-8")
  report = tmp_path / "tune.json"
  _run(["experiments.tune_decoding", f"--workdir={workdir}", f"--source={src}", f"--reference={ref}",
        "--average_last=ema,1", "--beam_sizes=1", f"--report={report}"])
  assert [r["average_last"] for r in json.loads(report.read_text())["rows"]] == ["ema", 1]


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


def test_tune_decoding_scores_every_setting_and_agrees_with_evaluate(workdir, tmp_path):
  src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
  src.write_text("twenty-one\nfive\nthree hundred\n", encoding="utf-8")
  ref.write_text("einundzwanzig\nfünf\ndreihundert\n", encoding="utf-8")
  report = tmp_path / "tune.json"
  result = _run(["experiments.tune_decoding", f"--workdir={workdir}", f"--source={src}", f"--reference={ref}",
                 "--average_last=1,3", "--beam_sizes=1,2", "--alphas=0.6,1.0", "--mbr_utilities=none,chrf",
                 f"--report={report}"])
  rows = json.loads(report.read_text())["rows"]
  # Greedy once per average (neither alpha nor MBR applies), beam 2 with each alpha and utility: 2 x (1 + 4).
  beam2 = [(2, 0.6, ""), (2, 0.6, "chrf"), (2, 1.0, ""), (2, 1.0, "chrf")]
  assert [(r["average_last"], r["beam_size"], r["alpha"], r["mbr_utility"]) for r in rows] == [
      (n, *setting) for n in (1, 3) for setting in [(1, None, "")] + beam2]
  assert "best on src.txt: average_last" in result.stdout
  # The newest checkpoint with beam 2, alpha 0.6 is what experiments.evaluate scores by default, with or
  # without MBR.
  for row, utility in ((rows[1], ""), (rows[2], "chrf")):
    _run(["experiments.evaluate", f"--workdir={workdir}", f"--source={src}", f"--reference={ref}",
          "--beam_size=2", f"--mbr_utility={utility}", f"--output_prefix={tmp_path}/eval"])
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["mbr_utility"] == utility and row["bleu"] == pytest.approx(scored["bleu"])


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
  from experiments.configs import number_words
  from transformer_jax.run import trainer
  from transformer_jax.run.train_log import NonFiniteLossError
  from transformer_jax.run.experiment_config import ExperimentConfig

  helpers.poison_train_step(monkeypatch, 7, loss=float("nan"))
  config = number_words.get_config()
  config.data.builder_config = "tiny"
  config.data.vocab_size = 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 2
  config.num_train_steps, config.log_every_steps, config.evals.loss.every_steps = 20, 5, 0
  with pytest.raises(NonFiniteLossError, match="at step 7"):
    trainer.train_and_evaluate(ExperimentConfig.from_config_dict(config), str(tmp_path / "run"))


# -- issue 13: another architecture's checkpoint, flags and config values out of range ----------------------

def _tree_snapshot(path):
  """Every file under `path` with its size and mtime: a refused input must change none of them."""
  return {os.path.relpath(os.path.join(d, f), path): (os.path.getsize(os.path.join(d, f)),
                                                      os.path.getmtime(os.path.join(d, f)))
          for d, _, files in os.walk(path) for f in files}


def _one_line_error(result, *needles):
  assert result.returncode != 0, result.stdout[-2000:]
  lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[experiments]")]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  last = lines[-1]
  assert last.startswith("error: "), result.stderr[-2000:]
  for needle in needles:
    assert needle in last, last
  return last


@pytest.fixture(scope="module")
def deeper_workdir(tmp_path_factory):
  """A run whose model has 2+2 layers (the `workdir` fixture's has 1+1), same vocabulary settings."""
  wd = tmp_path_factory.mktemp("deeper")
  _run(["experiments.train", f"--workdir={wd}", *TINY_OVERRIDES, "--config.model.num_encoder_layers=2",
        "--config.model.num_decoder_layers=2", "--config.num_train_steps=10", "--config.final_eval.split="])
  return wd


@pytest.mark.parametrize("direction", ["deeper checkpoint into shallower model", "shallower into deeper"])
def test_checkpoint_of_another_architecture_is_refused_by_translate(workdir, deeper_workdir, direction):
  model, ckpt = (workdir, deeper_workdir) if direction.startswith("deeper") else (deeper_workdir, workdir)
  before = _tree_snapshot(model), _tree_snapshot(ckpt)
  result = _run(["experiments.translate", f"--workdir={model}", f"--checkpoint={ckpt}/checkpoints"],
                stdin="twenty-one\n", check=False)
  _one_line_error(result, "does not fit the model", "layer_1/")
  assert (_tree_snapshot(model), _tree_snapshot(ckpt)) == before


def test_resume_with_another_architecture_is_refused(deeper_workdir):
  before = _tree_snapshot(deeper_workdir)
  result = _run(["experiments.train", f"--workdir={deeper_workdir}", *TINY_OVERRIDES,
                 "--config.num_train_steps=20"], check=False)  # 1+1 layers requested, 2+2 saved
  _one_line_error(result, "model.num_decoder_layers: saved 2, requested 1")
  assert _tree_snapshot(deeper_workdir) == before


@pytest.mark.parametrize("program, flags, needle", [
    ("experiments.translate", ["--beam_size=0"], "--beam_size=0: must be an integer >= 1"),
    # issue 67: a number flag's range is its type's too (int32 for JAX), not a traceback after loading
    ("experiments.translate", ["--beam_size=2147483648"], "--beam_size=2147483648: must be an integer >= 1 and <= "
     "2147483647"),
    ("experiments.translate", ["--beam_size=20000000"], "beam_size must be <= 16777215"),
    ("experiments.translate", ["--beam_size=1000000"], "out of memory: RESOURCE_EXHAUSTED"),
    ("experiments.translate", ["--alpha=nan"], "--alpha=nan: must be a finite number"),
    ("experiments.translate", ["--extra_len=-1"], "--extra_len=-1: must be an integer >= 0"),
    ("experiments.translate", ["--input=/no/such/file"], "--input must name an existing file"),
    ("experiments.translate", ["--checkpoint=999"], "holds no step 999"),
    ("experiments.translate", ["--checkpoint=/no/such/dir"], "is not a checkpoint directory"),
    ("experiments.translate", ["--no_such_flag=1"], "no_such_flag"),
    ("experiments.evaluate", ["--source=/no/such.en", "--reference=/no/such.de"], "must name an existing file"),
    ("experiments.average_checkpoints", ["--last=0"], "--last=0: must be an integer >= 1"),
    ("experiments.average_checkpoints", ["--steps=10,abc"], "abc"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--alphas=0.6,abc"],
     "--alphas=0.6,abc: 'abc' is not a number"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--beam_sizes=0"],
     "--beam_sizes=0: must be an integer >= 1"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--mbr_utilities=none,meteor"],
     "--mbr_utilities=none,meteor: 'meteor' is not one of none, chrf, bleu"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--mbr_utilities="],
     "--mbr_utilities is empty: give at least one value"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--alphas="],
     "--alphas is empty: give at least one value"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--average_last=5,ema"],
     "was trained without a moving average of the parameters (config.ema_decay 0)"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--average_last=ema,x"],
     "--average_last=ema,x: 'x' is not an integer"),
    ("experiments.translate", ["--mbr_utility=meteor", "--beam_size=4"],
     "--mbr_utility='meteor'; expected '' or one of chrf, bleu"),
    ("experiments.translate", ["--mbr_utility=chrf"], "--mbr_utility='chrf' chooses from beam search's n-best list: "
     "it needs strategy='beam' and beam_size >= 2"),
    ("experiments.translate", ["--output=experiments"], "--output must name a file to write (it is a directory"),
    ("experiments.average_checkpoints", ["--steps=1,1"], "--steps=1,1: step 1 is given twice"),
    ("experiments.average_checkpoints", ["--steps=1,x"], "--steps=1,x: 'x' is not a step"),
    ("experiments.average_checkpoints", ["--output=README.md"], "--output=README.md is a file; expected a "
     "checkpoint directory"),
    ("experiments.translate", ["--output=README.md/out.txt"], "--output must name a file to write"),
    ("experiments.attention_map", ["--source=one", "--output=experiments"], "--output must name a file to write"),
    ("experiments.tune_decoding", ["--source=README.md", "--reference=README.md", "--report=experiments"],
     "--report must name a file to write"),
    # the translation tools' own number flags: in range, finite, and int32 (launch.check_ranges)
    ("experiments.serve", ["--port=70000"], "--port=70000: must be an integer in [0, 65535]"),
    ("experiments.serve", ["--max_wait_ms=nan"], "--max_wait_ms=nan: must be a finite number in [0, 60000]"),
    ("experiments.serve", ["--max_pending_texts=2147483648"], "--max_pending_texts=2147483648: must be an integer"),
    ("experiments.translate_corpus", ["--input=README.md", "--output_dir=out", "--lines_per_shard=0"],
     "--lines_per_shard=0: must be an integer in [1, 2147483647]"),
])
def test_bad_program_flags_are_one_line_errors(workdir, program, flags, needle):
  before = _tree_snapshot(workdir)
  result = _run([program, f"--workdir={workdir}", *flags], stdin="twenty-one\n", check=False)
  _one_line_error(result, needle)
  assert _tree_snapshot(workdir) == before


BAD_CONFIG = [  # (flags, what the one error line says)
    (["--config.no_such_key=3"], "--config.no_such_key=3: the config has no such key"),
    (["--config.model.no_such_key=3"], "--config.model.no_such_key=3: the config has no such key"),
    (["--config=experiments/configs/nope.py"], "--config=experiments/configs/nope.py: no such file"),
    (["--config.num_train_steps=-5"], "--config.num_train_steps=-5: must be an integer >= 1"),
    (["--config.num_train_steps=9223372036854775808"], "must be an integer >= 1 and <= 2147483647"),
    (["--config.seed=4294967296"], "--config.seed=4294967296: must be an integer >= 0 and <= 2147483647"),
    (["--config.learning_rate=nan"], "--config.learning_rate=nan: must be a finite number"),
    (["--config.label_smoothing=1.5"], "--config.label_smoothing=1.5"),
    (["--config.num_train_steps=abc"], "--config.num_train_steps=abc"),
    (["--config.mesh.data=0"], "--config.mesh.data=0"),
    (["--config.model.d_model=30"], "d_model=30 is not divisible by num_heads=4"),
    (["--config.data.tokens_per_batch=8"], "must be >= data.max_len"),
    (["--config.checkpoint_best_metric=bleu"], "'<eval split>/<metric>'"),
    (["--config.cooldown_steps=-1"], "--config.cooldown_steps=-1: must be an integer >= 0"),
    (["--config.num_train_steps=10", "--config.cooldown_steps=11"], "must be <= num_train_steps (10)"),
    (["--config.cooldown_shape=cosine"], "--config.cooldown_shape='cosine': must be one of 'linear', '1-sqrt'"),
    (["--config.cooldown_knots=(3, 0.5)"], "--config.cooldown_knots=(3, 0.5): must be a tuple of (step, progress)"),
    (["--config.cooldown_knots=((5, 0.5),)"], "--config.cooldown_knots=((5, 0.5),): cooldown knots ((5, 0.5),) "
     "need a cool-down (cooldown_steps > 0)"),
    (["--config.num_train_steps=100", "--config.cooldown_steps=20", "--config.cooldown_knots=((90, 1.5),)"],
     "--config.cooldown_knots=((90, 1.5),): cooldown knot (90, 1.5) must be (step, progress) with steps increasing "
     "in (80, 100] and progress increasing in (0, 1)"),
    (["--config.dropout_schedule=(300, 0.2)"], "--config.dropout_schedule=(300, 0.2): must be a tuple of (step, rate)"),
    (["--config.dropout_schedule=((300, 0.2), (200, 0.3))"], "--config.dropout_schedule=((300, 0.2), (200, 0.3)): "
     "dropout stage (200, 0.3) must be (step, rate) with integer steps increasing from 301 and a rate in [0, 1)"),
    (["--config.num_cpu_devices=-1"], "--config.num_cpu_devices=-1: must be an integer >= 0"),
    (["--config.ema_decay=1.0"], "--config.ema_decay=1.0: must be a finite number in [0.0, 1.0)"),
    (["--config.decode.mbr_utility=comet"], "--config.decode.mbr_utility='comet'; expected '' or one of"),
    (["--config.decode.mbr_utility=chrf", "--config.decode.beam_size=1"],
     "--config.decode.mbr_utility='chrf' chooses from beam search's n-best list: it needs strategy='beam' and "
     "beam_size >= 2"),
    # Two host devices (the config makes them: a program starts with one) cannot split 3 rows.
    (["--config.num_cpu_devices=2", "--config.data.max_len=64", "--config.data.tokens_per_batch=192"],
     "--config.data.tokens_per_batch=192 packs 3 rows of data.max_len=64 slots, which do not split over the 2 "
     "devices of the mesh {'data': 2, 'fsdp': 1, 'tensor': 1}: use a multiple of 128 tokens"),
    # issue 67's sweep: a model key's type and range (num_heads=0 was a ZeroDivisionError traceback, a d_model
    # past int32 or a NaN layer_norm_epsilon were accepted), ids the search cannot tell apart, the tuple keys' numbers
    (["--config.model.num_heads=0"], "--config.model: num_heads=0 must be an integer in [1, 2147483647]"),
    (["--config.model.eos_id=0"], "--config.model: eos_id=0 must differ from pad_id=0 and bos_id=2"),
    (["--config.model.eos_id=40000"], "--config.model: eos_id=40000 must be < vocab_size=37000"),
    (["--config.profile_steps=(1, 2147483648)"], "--config.profile_steps=(1, 2147483648): must be () or (start, "
     "stop) steps with 1 <= start <= stop <= 2147483647"),
    (["--config.early_stopping=('validation/loss', 2147483648, 0.0)"], "patience in [1, 2147483647]"),
    (["--config.early_stopping=('validation/loss', 3, 1e39)"], "min_delta a finite number >= 0 (float32)"),
    (["--config.dropout_schedule=((2147483648, 0.2),)"], "--config.dropout_schedule=((2147483648, 0.2),): must be "
     "a tuple of (step, rate) pairs"),
    (["--config.dropout_schedule=((5, 1.0),)"], "dropout stage (5, 1.0) must be (step, rate) with integer steps "
     "increasing from 1 and a rate in [0, 1)"),
    (["--config.cooldown_knots=((2147483648, 0.5),)"], "--config.cooldown_knots=((2147483648, 0.5),): must be a "
     "tuple of (step, progress) pairs"),
]

BAD_CONFIG_FILES = [  # (the file's text, what the one error line says after --config=<dir>/)
    ("x = (\n", "bad.py:1: '(' was never closed (a config file is Python defining get_config())"),
    ("def get_config():\n  return 1 / 0\n", "bad.py:2: loading it raised ZeroDivisionError: division by zero"),
    ("import no_such_module_here\n", "bad.py:1: loading it raised ModuleNotFoundError: No module named"),
    ("x = 1\n", "bad.py: the file defines no get_config() returning the config"),
]


def _number_key_edges() -> list:
  """(flags, needle) for every number key of the schema, `model` included, at the edges of its type: an integer
  past int32 either way; a float NaN, +-inf, past float32 (1e39) and negative (no float key allows < 0)."""
  cases = []

  def walk(section, prefix):
    for field in dataclasses.fields(section):
      value, key = getattr(section, field.name), prefix + field.name
      if dataclasses.is_dataclass(value):
        walk(value, key + ".")
      elif isinstance(value, (int, float)) and not isinstance(value, bool):
        edges = (2**31, -2**31 - 1) if isinstance(value, int) else ("nan", "inf", "-inf", "1e39", "-1.0")
        named = f"--config.model: {field.name}=" if prefix == "model." else f"--config.{key}="
        cases.extend(([f"--config.{key}={edge}"], named) for edge in edges)

  walk(ExperimentConfig(), "")
  return cases


def test_bad_config_values_are_refused_before_anything_is_written(tmp_path):
  """Every case through the real `experiments.train`, batched (`helpers.run_cases`: one start for ~250 cases)."""
  for i, (text, _) in enumerate(BAD_CONFIG_FILES):
    (tmp_path / f"file{i}").mkdir()
    (tmp_path / f"file{i}" / "bad.py").write_text(text)
  cases = ([(flags, needle) for flags, needle in BAD_CONFIG] + _number_key_edges()
           + [([f"--config={tmp_path}/file{i}/bad.py"], f"--config={tmp_path}/file{i}/{needle}")
              for i, (_, needle) in enumerate(BAD_CONFIG_FILES)])
  results = helpers.run_cases("experiments.train",
                              [[f"--workdir={tmp_path}/w{i}", *flags] for i, (flags, _) in enumerate(cases)])
  failures = []
  for i, ((flags, needle), result) in enumerate(zip(cases, results)):
    try:
      _one_line_error(result, needle)
      assert not os.path.exists(tmp_path / f"w{i}"), "the workdir was created"
    except AssertionError as error:
      failures.append(f"{' '.join(flags)}: {' '.join(str(error).split())[:300]}")
  assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


# -- text normalisation: text that looks the same translates the same ------------------------------------

def _tree(directory):
  """{relative path: bytes} of every file under `directory` (to show that a refused run wrote nothing)."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = f.read()
  return out


def test_byte_order_mark_and_invisible_characters_translate_like_plain_text(workdir, tmp_path):
  """Issue 13: a file starting with a BOM translated its first line differently (exit 0, no warning)."""
  # The file, then the same kind: zero-width space, word joiner, soft hyphen, NBSP and other Unicode
  # spaces, CR LF, and lines with nothing visible (output empty, like an empty line).
  variants = ["twenty\u200b-one", "\u2060twenty-one\u00ad", "\u00a0twenty-one\u2003", "twenty-one\r",
              "\u200b", "\ufeff \u00a0\t"]
  bom = tmp_path / "bom.en"
  bom.write_bytes(b"\xef\xbb\xbftwenty-one\ntwenty-one\n" + "\n".join(variants).encode("utf-8") + b"\n")
  lines = _run(["experiments.translate", f"--workdir={workdir}", f"--input={bom}"]).stdout.split("\n")
  assert lines[0] == lines[1] != ""
  assert lines[2:] == [lines[0]] * 4 + ["", "", ""]
  # A UTF-16 file (Windows "Unicode") is named as such, not as invalid UTF-8 somewhere.
  utf16 = tmp_path / "utf16.en"
  utf16.write_bytes("twenty-one\n".encode("utf-16"))
  result = _run(["experiments.translate", f"--workdir={workdir}", f"--input={utf16}"], check=False)
  assert result.returncode == 1 and result.stdout == ""
  assert result.stderr.strip().splitlines()[-1].startswith(f"error: {utf16}:1: UTF-16 or UTF-32 text")


def test_evaluate_normalises_references_and_hypotheses(workdir, tmp_path):
  from transformer_jax.data.normalize import normalize
  import unicodedata
  src = tmp_path / "src.txt"
  src.write_text("\ufefftwenty-one\nfive\nthree hundred\n", encoding="utf-8")
  clean = ["einundzwanzig", "fünf", "dreihundert"]
  scores = {}
  for name, refs in (("clean", clean), ("odd", ["\ufeffeinundzwanzig", unicodedata.normalize("NFD", "fünf"),
                                                "drei\u00adhundert\u00a0"])):
    (tmp_path / f"{name}.de").write_text("\n".join(refs) + "\n", encoding="utf-8")
    _run(["experiments.evaluate", f"--workdir={workdir}", f"--source={src}", f"--reference={tmp_path}/{name}.de",
          "--beam_size=2", f"--output_prefix={tmp_path}/{name}"])
    scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
  hyps = (tmp_path / "odd.hyp").read_text(encoding="utf-8").split("\n")[:-1]
  assert hyps == (tmp_path / "clean.hyp").read_text(encoding="utf-8").split("\n")[:-1]
  for key in ("bleu", "chrf"):
    assert scores["odd"][key] == scores["clean"][key]
  assert scores["clean"]["chrf"] == pytest.approx(
      sacrebleu.corpus_chrf([normalize(h) for h in hyps], [clean]).score)


def test_workdir_from_before_normalisation_translates_as_before(workdir, tmp_path):
  """A vocabulary without a normalisation stamp (trained before it existed) keeps encoding raw text."""
  import sentencepiece as spm
  from transformer_jax.run import trained
  from transformer_jax.decoding import inference
  from transformer_jax.config import EOS_ID
  old = tmp_path / "old"
  shutil.copytree(workdir, old, ignore=shutil.ignore_patterns("tensorboard"))
  os.remove(old / "vocab" / "spm.normalization.json")
  before = _tree(old)
  stdin = "twenty-one\nthree hundred five\n\ufeffseven\n"
  legacy = _run(["experiments.translate", f"--workdir={old}"], stdin=stdin)
  current = _run(["experiments.translate", f"--workdir={workdir}"], stdin=stdin)
  got = legacy.stdout.split("\n")
  assert got[:2] == current.stdout.split("\n")[:2]  # visible ASCII text: the same ids either way
  warning = [line for line in legacy.stderr.splitlines() if "spm.normalization.json" in line]
  assert len(warning) == 1 and "trained before text normalisation" in warning[0]
  assert _tree(old) == before  # nothing written (no stamp guessed)
  # The BOM line gives what the code before normalisation gave: the raw text's ids through the same search.
  model_config, params, tokenizer = trained.load(str(old))
  raw = spm.SentencePieceProcessor(model_file=str(old / "vocab" / "spm.model"))
  ids = raw.encode("\ufeffseven") + [EOS_ID]
  assert ids != tokenizer.encode("seven") and tokenizer.encode("\ufeffseven") == ids
  assert got[2] == raw.decode(inference.translate_ids(params, model_config, [ids], beam_size=1)[0])


def test_vocabulary_replaced_under_its_stamp_is_refused(workdir, tmp_path):
  from transformer_jax.data.tokenizer import train_tokenizer
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("tensorboard"))
  other = train_tokenizer(["twenty-one einundzwanzig five fünf"] * 50, str(tmp_path / "other" / "spm.model"),
                          vocab_size=30)
  shutil.copy(other.path, copy / "vocab" / "spm.model")  # the model alone, under the old stamp
  before = _tree(copy)
  result = _run(["experiments.translate", f"--workdir={copy}"], stdin="five\n", check=False)
  assert result.returncode == 1 and result.stdout == ""
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "spm.normalization.json was written for another model" in last
  assert _tree(copy) == before


# -- issue 67: --nbest=N gives N finished hypotheses, or says why not ----------------------------------------

HELD_OUT = [608885, 462353, 911697, 164944, 66047, 556143, 876546, 163315, 386090, 374620, 470307, 991670, 988136,
            346873, 872217, 515840, 917796, 971801, 680035, 617490, 46055, 859126, 704246, 972127, 361170, 721034,
            738665, 364382, 413276, 459718]


def _nbest_lines(result):
  return [json.loads(line) for line in result.stdout.splitlines()]


def test_nbest_returns_n_finished_hypotheses_best_first(workdir):
  """Beam search went on only until the best was exact: a line of this list came back with 1 hypothesis of 3."""
  from transformer_jax.data import number_words
  numbers = HELD_OUT + [n * 7919 % 1_000_000 for n in range(1, 121)]
  text = "".join(number_words.english(n) + "\n" for n in numbers)
  rows = _nbest_lines(_run(["experiments.translate", f"--workdir={workdir}", "--beam_size=4", "--nbest=3",
                            "--output_format=jsonl"], stdin=text))
  assert len(rows) == len(numbers)
  short = [(row["line"], len(row["hypotheses"])) for row in rows if len(row["hypotheses"]) != 3]
  assert not short, short
  for row in rows:
    assert row["finished"] == 3, row
    scores = [h["score"] for h in row["hypotheses"]]
    assert scores == sorted(scores, reverse=True)
    assert all(h["ids"][-1:] != [3] for h in row["hypotheses"])  # EOS is not among the ids


def test_nbest_cut_short_by_the_length_limit_says_so(workdir):
  result = _run(["experiments.translate", f"--workdir={workdir}", "--beam_size=4", "--nbest=4",
                 "--output_format=jsonl", "--extra_len=0"], stdin="seven hundred seventy-seven thousand\n")
  row = _nbest_lines(result)[0]
  assert row["finished"] < 4 and sum(1 for h in row["hypotheses"]) <= 4
  assert f"line 1: {row['finished']} of the 4 hypotheses of --nbest finished within the length limit" in result.stderr
