"""Issue 54: no wrong answers at the edges, through the real programs.

Positions and ids past the model's tables are refused by name; a workdir has one training owner at a time; a
metric's direction comes from one table; a refused checkpoint write is an error; a resume that would replay
another batch plan is refused before anything is rewritten; BLEU tokenises the target language as sacreBLEU does.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import sacrebleu

import helpers
from tests.test_experiments import REPO, TINY_OVERRIDES, _env, _one_line_error, _run, _tree
from transformer_jax import config as config_lib
from transformer_jax.evaluation import metrics
from transformer_jax.run import evaluators, run_checks, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.run.owner_lock import LOCK_FILENAME, OwnerLock, WorkdirInUseError
from transformer_jax.run.train_log import NonFiniteLossError

QUICK = [*TINY_OVERRIDES, "--config.num_train_steps=10", "--config.final_eval.split="]


@pytest.fixture(scope="module")
def run10(tmp_path_factory):
  """A tiny number-words run of 10 steps (checkpoints 10)."""
  wd = tmp_path_factory.mktemp("run10") / "w"
  _run(["experiments.train", f"--workdir={wd}", *QUICK])
  return wd


# -- positions and ids past the tables ----------------------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ["--config.data.max_len=128", "--config.model.max_len=64"],
    ["--config.data.max_len=65", "--config.model.max_len=64", "--config.model.position_embedding=learned"],
], ids=["sinusoidal", "learned"])
def test_data_rows_longer_than_the_position_table_are_refused_naming_both_keys(tmp_path, flags):
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *TINY_OVERRIDES, *flags], check=False)
  _one_line_error(result, "--config.data.max_len=", "--config.model.max_len=64")
  assert not os.path.exists(tmp_path / "w")


def test_a_model_without_a_position_table_may_take_longer_rows():
  from experiments.configs import number_words
  cfg = number_words.get_config()
  cfg.data.max_len, cfg.model.max_len = 128, 64
  cfg.model.position_embedding, cfg.model.max_relative_position = "none", 8
  cfg = ExperimentConfig.from_config_dict(cfg)
  run_checks.check_position_table(cfg)  # relative distances are clipped: no table to run past
  with pytest.raises(ValueError, match="data.max_len=128 exceeds --config.model.max_len=64"):
    run_checks.check_position_table(cfg.replace(model=cfg.model.replace(position_embedding="sinusoidal")))


@pytest.mark.parametrize("key, value, needle", [
    ("inputs", 300, "token ids [300] outside [0, 256)"), ("targets", -1, "token ids [-1] outside [0, 256)"),
    ("inputs_position", 64, "positions [64] outside [0, 64)"),
    ("targets_position", 70, "positions [70] outside [0, 64)")])
def test_a_batch_past_the_tables_is_refused_with_step_row_and_values(key, value, needle):
  model = config_lib.ModelConfig(vocab_size=256, max_len=64, d_model=32, d_ff=64, num_heads=2)
  batch = {k: np.zeros((2, 3, 8), np.int32) for k in ("inputs", "targets", "inputs_position", "targets_position")}
  run_checks.check_batch_in_tables(batch, model, step=5)
  batch[key][1, 2, 4] = value  # micro-batch 1, row 2: row 5 of the 6
  with pytest.raises(run_checks.BatchOutOfTableError, match=r"step 5, row 5: " + key) as error:
    run_checks.check_batch_in_tables(batch, model, step=5)
  assert needle in str(error.value)


def test_relative_distances_past_the_clip_stay_in_the_table():
  """Shaw et al.'s distances are clipped to +-k: any distance reads a row of the `[2k+1]` table."""
  import jax.numpy as jnp
  from transformer_jax.attention import RelativePositions
  rel = RelativePositions(jnp.zeros((9, 2)), jnp.zeros((9, 2)), max_distance=4)
  distances = np.asarray([-10_000, -5, -4, -1, 0, 3, 4, 5, 10_000])
  np.testing.assert_array_equal(np.asarray(rel.index(jnp.asarray(distances))),
                                np.clip(distances, -4, 4) + 4)


def test_a_non_finite_grad_norm_names_the_quantity_step_and_batch(monkeypatch, tmp_path):
  from experiments.configs import number_words

  helpers.poison_train_step(monkeypatch, 4, grad_norm=float("inf"))
  config = number_words.get_config()
  config.data.builder_config, config.data.vocab_size = "tiny", 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 2
  config.num_train_steps, config.log_every_steps, config.evals.loss.every_steps = 10, 5, 0
  with pytest.raises(NonFiniteLossError,
                     match=r"training grad_norm is inf at step 4 \(non-finite: grad_norm\); its batch was read in "
                           r"epoch 0 of the data stream \(seed 0, process 0's position"):
    trainer.train_and_evaluate(ExperimentConfig.from_config_dict(config), str(tmp_path / "run"))


# -- one owner per workdir --------------------------------------------------------------------------------

def _lock(path, pid, host=None):
  with open(os.path.join(path, LOCK_FILENAME), "w") as f:
    json.dump({"pid": pid, "host": host or socket.gethostname(), "started": "then"}, f)


def test_a_live_lock_refuses_a_second_trainer_in_one_line_and_readers_still_work(run10, tmp_path):
  _lock(run10, os.getpid())
  try:
    before = _tree(run10)
    result = _run(["experiments.train", f"--workdir={run10}", *QUICK, "--config.num_train_steps=20"], check=False)
    _one_line_error(result, "is in use by another training run", f"pid {os.getpid()}")
    assert _tree(run10) == before
    out = _run(["experiments.translate", f"--workdir={run10}"], stdin="twelve\n")  # a reader takes no lock
    assert len(out.stdout.split("\n")) == 2
    _lock(run10, 1, host="another-host")  # another host's lock: its process cannot be checked, so it holds
    _one_line_error(_run(["experiments.train", f"--workdir={run10}", *QUICK], check=False),
                    "another-host")
  finally:
    os.remove(os.path.join(run10, LOCK_FILENAME))


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  lock = OwnerLock(tmp_path)
  _lock(tmp_path, dead.pid)
  with lock:
    assert json.load(open(tmp_path / LOCK_FILENAME))["pid"] == os.getpid()
    with pytest.raises(WorkdirInUseError, match=f"pid {os.getpid()}"):
      OwnerLock(tmp_path).acquire()
  assert not (tmp_path / LOCK_FILENAME).exists()


def test_two_trainers_on_one_workdir_the_second_is_refused(tmp_path):
  workdir = tmp_path / "w"
  first = subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *TINY_OVERRIDES,
                            "--config.num_train_steps=100000", "--config.final_eval.split="],
                           cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 240  # until it trains (its SIGTERM handler is installed then)
    while not (workdir / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
      time.sleep(0.5)
    assert (workdir / LOCK_FILENAME).exists(), first.stderr.read()[-2000:] if first.poll() is not None else ""
    second = _run(["experiments.train", f"--workdir={workdir}", *QUICK], check=False)
    _one_line_error(second, "is in use by another training run", f"pid {first.pid}")
  finally:
    first.send_signal(signal.SIGTERM)  # saves and stops; the lock goes with it
    first.wait(timeout=240)
  assert first.returncode == 0 and not (workdir / LOCK_FILENAME).exists()


# -- a metric's direction is known ----------------------------------------------------------------------

def test_metric_directions_come_from_one_table():
  assert not metrics.higher_is_better("validation/perplexity") and not metrics.higher_is_better("nll")
  assert metrics.higher_is_better("validation/bleu") and metrics.higher_is_better("chrf")
  with pytest.raises(ValueError, match="no known direction"):
    metrics.higher_is_better("validation/attention/encoder/near_uniform_share")


def test_best_checkpoint_by_perplexity_keeps_the_lowest(tmp_path):
  workdir = tmp_path / "w"
  _run(["experiments.train", f"--workdir={workdir}", *TINY_OVERRIDES, "--config.num_train_steps=40",
        "--config.evals.loss.every_steps=10", "--config.checkpoint_keep=1", "--config.warmup_steps=5",
        "--config.learning_rate=8.0",  # a schedule that overshoots: perplexity is not monotone here
        "--config.checkpoint_best_metric=validation/perplexity", "--config.final_eval.split="])
  logged = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  perplexity = {row["step"]: row["validation/perplexity"] for row in logged if "validation/perplexity" in row}
  best = min(perplexity, key=perplexity.get)
  kept = {int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()}
  assert best in kept and kept <= {best, 40}, (perplexity, kept)


@pytest.mark.parametrize("flags, needle", [
    (["--config.checkpoint_best_metric=validation/bleu"], "bleu evaluator, which is off"),
    (["--config.checkpoint_best_metric=test/loss"], "split 'test' is not evaluated"),
    (["--config.checkpoint_best_metric=validation/entropy", "--config.evals.loss.every_steps=5"],
     "'entropy' is not logged during training"),
    (["--config.checkpoint_best_metric=validation/perplexity"], "loss evaluator, which is off"),
])
def test_a_best_metric_that_is_never_computed_is_refused_at_start(tmp_path, flags, needle):
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *TINY_OVERRIDES, *flags], check=False)
  _one_line_error(result, needle)
  assert not os.path.exists(tmp_path / "w")


# -- a refused write is an error --------------------------------------------------------------------------

def test_averaging_into_an_output_holding_that_step_is_an_error_and_keeps_it(run10, tmp_path):
  out = tmp_path / "avg"
  _run(["experiments.average_checkpoints", f"--workdir={run10}", "--last=1", f"--output={out}"])
  before = _tree(out)
  result = _run(["experiments.average_checkpoints", f"--workdir={run10}", "--last=1", f"--output={out}"],
                check=False)
  _one_line_error(result, "already holds step 10")
  assert _tree(out) == before and "wrote the average" not in result.stdout


def test_a_save_orbax_refuses_raises(tmp_path):
  from transformer_jax.run import checkpoint
  with pytest.raises(checkpoint.CheckpointWriteError, match="step 7 was not written"):
    checkpoint.require_saved(False, tmp_path, 7)
  checkpoint.require_saved(True, tmp_path, 7)


# -- a resume that would replay another batch plan ------------------------------------------------------

@pytest.mark.parametrize("flag, needle", [
    ("--config.data.tokens_per_batch=512", "rows_per_batch"),
    ("--config.seed=3", "saved with seed 0"),
    ("--config.data.max_len=32", "row_length"),
])
def test_a_resume_on_another_batch_plan_is_refused_and_rewrites_nothing(run10, flag, needle):
  before = _tree(run10)
  result = _run(["experiments.train", f"--workdir={run10}", *QUICK, "--config.num_train_steps=20", flag],
                check=False)
  _one_line_error(result, needle)
  assert _tree(run10) == before  # config.json included


# -- BLEU follows the target language -----------------------------------------------------------------

def test_bleu_tokenises_chinese_as_sacrebleu_does():
  hyps, refs = ["猫坐在垫子上。", "今天天气很好"], ["猫坐在垫子上。", "今天天气不错"]
  scores = metrics.sacrebleu_scores(hyps, refs, target_lang="zh")
  assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score)
  assert "tok:zh" in scores["bleu_signature"] and scores["bleu"] > 40
  assert metrics.sacrebleu_scores(hyps, refs)["bleu"] < 1  # 13a sees one "word" per line
  assert "tok:zh" in metrics.sacrebleu_scores(hyps, refs, target_lang="zh-Hans")["bleu_signature"]
  assert "tok:13a" in metrics.sacrebleu_scores(hyps, refs, target_lang="de")["bleu_signature"]


def test_evaluate_scores_with_the_target_languages_tokenizer(run10, tmp_path):
  src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
  src.write_text("twenty-one\nfive\n", encoding="utf-8")
  ref.write_text("二十一\n五\n", encoding="utf-8")
  result = _run(["experiments.evaluate", f"--workdir={run10}", f"--source={src}", f"--reference={ref}",
                 "--beam_size=1", "--target_lang=zh", f"--output_prefix={tmp_path}/eval"])
  assert "tok:zh" in result.stdout
  hyps = (tmp_path / "eval.hyp").read_text(encoding="utf-8").split("\n")[:-1]
  scored = json.loads((tmp_path / "eval.json").read_text())
  assert scored["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [["二十一", "五"]], tokenize="zh").score)


def test_a_target_language_whose_tokenizer_is_missing_is_one_line(run10, tmp_path):
  try:
    __import__("MeCab")
    pytest.skip("MeCab is installed: ja-mecab loads")
  except ImportError:
    pass
  src = tmp_path / "src.txt"
  src.write_text("five\n", encoding="utf-8")
  result = _run(["experiments.evaluate", f"--workdir={run10}", f"--source={src}", f"--reference={src}",
                 "--target_lang=ja", f"--output_prefix={tmp_path}/eval"], check=False)
  _one_line_error(result, "ja-mecab")
  assert not (tmp_path / "eval.json").exists()


def test_eval_pairs_longer_than_the_position_table_are_left_out_not_nan():
  from transformer_jax.data.datasets import EvalSet
  model = config_lib.ModelConfig(vocab_size=32, max_len=4, d_model=8, d_ff=16, num_heads=2)
  ids = [np.arange(n, dtype=np.int32) for n in (3, 4, 5, 2)]
  eval_set = EvalSet(pairs=[("", "")] * 4, sources=ids, targets=[np.arange(2, dtype=np.int32)] * 4)
  sources, _ = evaluators.within_position_table(eval_set, model, "validation")
  assert [len(s) for s in sources] == [3, 4, 2]
  relative = model.replace(position_embedding="none", max_relative_position=2)
  assert len(evaluators.within_position_table(eval_set, relative, "validation")[0]) == 4


# -- wrong kinds of input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [('{"add_source_eos": true, "bos_token": "<s>"}', "not a transformer_jax run's config"),
                                             ("\x00\x01garbage", "is not valid JSON")])
def test_a_directory_of_another_kind_is_not_taken_for_a_workdir(tmp_path, content, needle):
  (tmp_path / "config.json").write_text(content, encoding="utf-8")
  before = _tree(tmp_path)
  for program in (["experiments.translate", f"--workdir={tmp_path}"],
                  ["experiments.train", f"--workdir={tmp_path}", *QUICK]):
    _one_line_error(_run(program, stdin="five\n", check=False), needle, str(tmp_path))
  assert _tree(tmp_path) == before


# -- a checkpoint of another run: same shapes, another vocabulary -----------------------------------------------

def test_a_checkpoint_trained_with_another_vocabulary_is_refused_by_every_reader(run10, tmp_path):
  """Same architecture and vocabulary size, a case-folded vocabulary: the parameters load without a shape error,
  so only the vocabulary check stands between the user and translations decoded with the wrong pieces."""
  other = tmp_path / "lowercased"
  _run(["experiments.train", f"--workdir={other}", *QUICK, "--config.data.lowercase=True"])
  bare = tmp_path / "bare"
  subprocess.run(["cp", "-r", str(other / "checkpoints"), str(bare)], check=True)
  for checkpoint, needle in [(other / "checkpoints", f"was trained with another vocabulary than {run10}'s "
                              "(lowercase True there, False here); translate it with --workdir="),
                             (bare, "was trained on other data or vocabulary settings than "
                              f"{run10} (data.lowercase: saved True, requested False)")]:
    result = _run(["experiments.translate", f"--workdir={run10}", f"--checkpoint={checkpoint}"],
                  stdin="twelve\n", check=False)
    _one_line_error(result, f"--checkpoint={checkpoint} {needle}")
  # The run's own checkpoints, and another run's of the same vocabulary, still translate.
  same = tmp_path / "same"
  _run(["experiments.train", f"--workdir={same}", *QUICK, "--config.seed=7"])
  for checkpoint in (run10 / "checkpoints", same / "checkpoints"):
    result = _run(["experiments.translate", f"--workdir={run10}", f"--checkpoint={checkpoint}"], stdin="twelve\n")
    # One translation line for the one input (a 10-step model may well decode it to the empty string).
    assert result.returncode == 0 and result.stdout.count("\n") == 1


# -- issue 67: line endings and blank lines do not change the model -------------------------------------------

CORPUS_FLAGS = ["--config.data.dataset=parallel_text", "--config.data.eval_splits=()", "--config.data.max_len=32",
                "--config.data.tokens_per_batch=256", "--config.data.vocab_size=96", "--config.model.d_model=32",
                "--config.model.d_ff=64", "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
                "--config.model.num_decoder_layers=1", "--config.num_train_steps=12", "--config.warmup_steps=4",
                "--config.evals.loss.every_steps=0", "--config.checkpoint_every_steps=12",
                "--config.final_eval.split="]


def _number_corpus(directory, lines_en, lines_de, newline="\n", bom=""):
  directory.mkdir()
  for lang, lines in (("en", lines_en), ("de", lines_de)):
    (directory / f"train.{lang}").write_bytes((bom + newline.join(lines) + newline).encode("utf-8"))
  return directory


def _pieces_and_scores(workdir):
  import sentencepiece as spm
  model = spm.SentencePieceProcessor(model_file=str(workdir / "vocab/spm.model"))
  return [(model.id_to_piece(i), model.get_score(i)) for i in range(model.get_piece_size())]


def test_crlf_bom_and_blank_lines_train_the_same_vocabulary_and_parameters(tmp_path):
  """400 pairs; the same with CRLF, a BOM, 3 blank pairs and 2 one-side-blank pairs: the 5 are skipped, and the
  vocabulary (trained on the pairs training keeps) and the parameters after 12 steps are bit-identical."""
  from transformer_jax.run import trained
  from transformer_jax.data import number_words
  numbers = [n * 7919 % 1_000_000 for n in range(400)]
  en, de = [number_words.english(n) for n in numbers], [number_words.german(n) for n in numbers]
  en2, de2 = list(en), list(de)
  for at, (s, t) in [(0, ("", "")), (50, ("", "")), (120, ("quiet jazz quiz", "")), (200, ("   ", "")),
                     (300, ("", "nur ziel hier"))]:
    en2.insert(at, s)
    de2.insert(at, t)
  corpora = {"lf": _number_corpus(tmp_path / "lf", en, de),
             "crlf": _number_corpus(tmp_path / "crlf", en2, de2, newline="\r\n", bom="\ufeff")}
  loaded = {}
  for name, corpus in corpora.items():
    result = _run(["experiments.train", f"--workdir={tmp_path}/{name}-run", *CORPUS_FLAGS,
                   f"--config.data.dir={corpus}"])
    assert "400" in result.stderr + result.stdout
    loaded[name] = trained.load(str(tmp_path / f"{name}-run"), "12")
  lf, crlf = loaded["lf"], loaded["crlf"]
  assert _pieces_and_scores(tmp_path / "lf-run") == _pieces_and_scores(tmp_path / "crlf-run")
  for a, b in zip(jax.tree_util.tree_leaves(lf.params), jax.tree_util.tree_leaves(crlf.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- issue 67: sampling's temperature and seed over their whole range ------------------------------------------

def test_a_vanishing_temperature_samples_the_argmax_and_an_infinite_one_is_refused(run10, tmp_path):
  """--temperature=1e-45 divided log-probs into -inf/NaN rows: every line came back empty, exit 0."""
  lines = "twenty-one\nfive\nthree hundred twelve\n"
  greedy = _run(["experiments.translate", f"--workdir={run10}", "--strategy=greedy", "--output_format=jsonl"],
                stdin=lines)
  cold = _run(["experiments.translate", f"--workdir={run10}", "--strategy=sample", "--temperature=1e-45",
               "--output_format=jsonl"], stdin=lines)
  ids = lambda result: [json.loads(line)["hypotheses"][0]["ids"] for line in result.stdout.splitlines()]  # noqa
  assert ids(cold) == ids(greedy) and all(ids(greedy))
  for value in ("inf", "nan", "0", "-1"):
    _one_line_error(_run(["experiments.translate", f"--workdir={run10}", "--strategy=sample",
                          f"--temperature={value}"], stdin=lines, check=False), "--temperature=",
                    "must be a finite number > 0")


@pytest.mark.parametrize("seed", [2**31, 2**32 - 1])
def test_any_seed_a_key_can_hold_samples(run10, seed):
  """--seed=2147483648 ended in OverflowError (int32) after the model had loaded."""
  result = _run(["experiments.translate", f"--workdir={run10}", "--strategy=sample", f"--seed={seed}"],
                stdin="twenty-one\nfive\n")
  assert result.stdout.count("\n") == 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("seed", [2**32, 2**63, -1])
def test_a_seed_outside_a_keys_range_is_refused_in_one_line(run10, seed):
  _one_line_error(_run(["experiments.translate", f"--workdir={run10}", "--strategy=sample", f"--seed={seed}"],
                       stdin="five\n", check=False), "--seed", "4294967295")


# -- issue 67: nothing the vocabulary cannot spell is forced into an output -----------------------------------

@pytest.mark.parametrize("flag", ["constraints_file", "prefix_file"])
def test_a_forced_phrase_the_vocabulary_cannot_spell_is_refused_naming_its_line(run10, tmp_path, flag):
  """A constraint of characters outside the vocabulary was encoded as <unk>, forced into the output as '⁇' and
  reported as met."""
  (tmp_path / "forced.txt").write_text("fünf\n漢字\n", encoding="utf-8")
  result = _run(["experiments.translate", f"--workdir={run10}", "--beam_size=4", f"--{flag}={tmp_path}/forced.txt",
                 "--output_format=jsonl"], stdin="five\nsix\n", check=False)
  what = "constraint" if flag == "constraints_file" else "prefix"
  _one_line_error(result, f"the {what} '漢字' of line 2 has characters outside the vocabulary")


# -- issue 67: a refusal says why ------------------------------------------------------------------------------

def test_a_corpus_whose_every_pair_is_too_long_names_the_length_key(tmp_path):
  """A one-pair corpus longer than data.max_len ended in 'no training examples left to batch', no reason given."""
  long_en = " ".join(["seven hundred seventy-seven thousand"] * 6)
  corpus = _number_corpus(tmp_path / "long", [long_en], ["siebenhundert " * 12])
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *CORPUS_FLAGS, f"--config.data.dir={corpus}",
                 "--config.data.max_len=8", "--config.data.tokens_per_batch=64"], check=False)
  _one_line_error(result, "every one of its 1 non-blank pairs was dropped for its length",
                  "--config.data.max_len=8", "raise data.max_len")


# -- issue 67: a tracker whose import fails is one line ---------------------------------------------------------

def test_a_tracker_whose_package_fails_to_import_is_refused_in_one_line(tmp_path):
  """wandb installed but broken (its protobuf mismatch, wandb issue 11548) ended in a traceback."""
  broken = tmp_path / "site" / "wandb"
  broken.mkdir(parents=True)
  (broken / "__init__.py").write_text(
      "raise TypeError('Descriptors cannot be created directly.\\nIf this call came from a _pb2.py file, your "
      "generated code is out of date')\n")
  env = {**_env(), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
  result = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}/w", *QUICK,
                           "--config.trackers=('tensorboard', 'wandb')"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
  _one_line_error(result, "--config.trackers includes 'wandb' but importing the wandb package failed",
                  "TypeError: Descriptors cannot be created directly.")
  assert not os.path.exists(tmp_path / "w")


# -- issue 67: a profile window outside the run ------------------------------------------------------------------

def test_a_profile_window_after_the_run_is_refused_and_one_it_cuts_short_is_logged(tmp_path):
  """profile_steps=(50, 60) on a 20-step run: exit 0, no trace, not one log line."""
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *QUICK, "--config.num_train_steps=20",
                 "--config.profile_steps=(50, 60)"], check=False)
  _one_line_error(result, "--config.profile_steps=(50, 60): starts after the run's last step (num_train_steps=20)")
  assert not os.path.exists(tmp_path / "w")
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *QUICK, "--config.num_train_steps=12",
                 "--config.profile_steps=(11, 30)"])
  assert "profile_steps (11, 30): the run ends at step 12; the trace will hold steps 11-12" in result.stderr
  assert list((tmp_path / "w" / "profile").rglob("*.xplane.pb"))


# -- issue 67: a dtype the backend cannot run is refused before anything is written ---------------------------

def test_a_dtype_the_backend_cannot_run_is_refused_before_the_workdir_exists(tmp_path):
  """float16 on XLA:CPU (no F16 dot_general) passed the checks, wrote the workdir, and died at the first step."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU is the backend without float16 matmuls")
  result = _run(["experiments.train", f"--workdir={tmp_path}/w", *QUICK, "--config.model.dtype=float16"],
                check=False)
  _one_line_error(result, "--config.model.dtype=float16 with model.attention_impl=xla: the cpu backend cannot run "
                  "the model in them")
  assert not os.path.exists(tmp_path / "w")


# -- issue 67: a checkpoint save that fails in the background ----------------------------------------------------

def test_a_failed_background_save_stops_the_run_in_one_line_keeping_the_last_good_step(tmp_path):
  """A save that failed in orbax's background write (disk full) printed 15 tracebacks in 400 lines, the error
  line not last, and training went on to the next save. Here the disk 'fills' once step 40 is saved: files the
  process writes may then hold 40 kB (RLIMIT_FSIZE, set from outside; Python ignores SIGXFSZ, so a write
  fails with EFBIG as on a full disk), which the checkpoint's array files exceed and the logs do not."""
  import resource
  from transformer_jax.run import trained
  workdir = tmp_path / "w"
  trainer_process = subprocess.Popen(
      [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *QUICK, "--config.num_train_steps=100000",
       "--config.checkpoint_every_steps=40", "--config.checkpoint_every_minutes=0"],
      cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  while not (workdir / "checkpoints" / "40").is_dir() and time.time() < deadline and trainer_process.poll() is None:
    time.sleep(0.01)
  resource.prlimit(trainer_process.pid, resource.RLIMIT_FSIZE, (40_000, 40_000))
  stdout, stderr = trainer_process.communicate(timeout=240)
  result = subprocess.CompletedProcess(trainer_process.args, trainer_process.returncode, stdout, stderr)
  _one_line_error(result, f"{workdir}/checkpoints: the checkpoint of step 80 could not be written",
                  "the last complete checkpoint is step 40")
  logged = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl") if '"train/loss"' in line]
  assert max(logged) < 120  # it stopped before the next save, not at it
  assert [d for d in os.listdir(workdir / "checkpoints") if d.isdigit()] == ["40"]
  trained.load(str(workdir), "40")  # the last good step restores


# -- issue 67: a checkpoint step whose files go while it is read -------------------------------------------------

@pytest.mark.parametrize("removed", ["state/_METADATA", "state/manifest.ocdbt", "state/ocdbt.process_0", "state/d",
                                     "state/ocdbt.process_0/d", "_CHECKPOINT_METADATA", "state"])
def test_a_step_missing_files_translates_exactly_or_is_one_line(run10, tmp_path, removed):
  """A trainer keeping `checkpoint_keep` removes a step while `translate --checkpoint=<step>` reads it: 1 load in
  20 ended in a traceback. Each stage of the removal, frozen: the step's exact translation or one error line."""
  import shutil
  copy = tmp_path / "run"
  shutil.copytree(run10, copy)
  target = copy / "checkpoints" / "10" / removed
  shutil.rmtree(target) if target.is_dir() else target.unlink()
  whole = _run(["experiments.translate", f"--workdir={run10}", "--checkpoint=10"], stdin="twelve\nfive\n")
  result = _run(["experiments.translate", f"--workdir={copy}", "--checkpoint=10"], stdin="twelve\nfive\n",
                check=False)
  if result.returncode == 0:
    assert result.stdout == whole.stdout and "Traceback" not in result.stderr
  else:
    _one_line_error(result, "10")
