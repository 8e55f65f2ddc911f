"""Fine-tuning an imported Marian model with `experiments.train`, then translating and exporting it again.

The model is test_interop's tiny random `MarianMTModel` (pad = the last id = decoder start, EOS 0), so any code
that assumes pad id 0 pads with EOS and fails here. Offline; one fine-tuning run shared by the module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_interop import ENGLISH, GERMAN, SOURCES, _hf_logits, _padded, build_marian_dir
from test_interop import transformers  # noqa: E402  (skips the module where the interop extra is missing)

from experiments.configs import default, number_words  # noqa: E402
from transformer_jax.data import datasets as datasets_lib  # noqa: E402
from transformer_jax.data.marian_vocab import MarianVocabulary  # noqa: E402
from transformer_jax.decoding import inference
from transformer_jax.interop import marian  # noqa: E402
from transformer_jax.model import Transformer  # noqa: E402
from transformer_jax.run import factories, imported_workdir, trained, trainer  # noqa: E402
from transformer_jax.run.experiment_config import ExperimentConfig, validate  # noqa: E402
from transformer_jax.training import eval_step, token_weights  # noqa: E402
from transformer_jax.workdir import Workdir, write_json_atomically  # noqa: E402


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
  return build_marian_dir(tmp_path_factory.mktemp("marian"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
FINETUNE_FLAGS = [
    "--config.data.dataset=parallel_text", "--config.data.eval_splits=('val',)", "--config.data.max_len=32",
    "--config.data.tokens_per_batch=256", f"--config.num_train_steps={STEPS}", "--config.warmup_steps=4",
    "--config.learning_rate=0.2", "--config.log_every_steps=1", "--config.evals.loss.every_steps=4",
    "--config.evals.bleu.every_steps=8", "--config.evals.bleu.max_examples=4", "--config.checkpoint_every_steps=4",
    "--config.async_checkpointing=False", "--config.final_eval.split=val",
    "--config.model.dropout_rate=0.0",  # a run-time field: the first fine-tune may set it
]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO
  return env


def _run(args, stdin=None):
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=_env(), input=stdin, capture_output=True,
                        text=True, timeout=600)


def _corpus(directory):
  """36 training pairs (the 9 sentences 4 times), 4 validation pairs: `{train,val}.{en,de}`."""
  directory.mkdir()
  for split, en, de in (("train", ENGLISH * 4, GERMAN * 4), ("val", ENGLISH[:4], GERMAN[:4])):
    (directory / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    (directory / f"{split}.de").write_text("\n".join(de) + "\n", encoding="utf-8")
  return directory


def _tree(path):
  return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                for d, _, files in os.walk(path) for f in files)


@pytest.fixture(scope="module")
def finetuned(marian_dir, tmp_path_factory):  # noqa: F811
  """(imported model dir, corpus dir, fine-tuned workdir, train program result)."""
  root = tmp_path_factory.mktemp("finetune")
  corpus = _corpus(root / "corpus")
  workdir = root / "workdir"
  marian.import_to_workdir(marian_dir, str(workdir))
  result = _run(["experiments.train", f"--workdir={workdir}", f"--config.data.dir={corpus}", *FINETUNE_FLAGS])
  assert result.returncode == 0, result.stderr[-3000:]
  return marian_dir, corpus, workdir, result


def _first_batch(workdir):
  """The first packed batch the run trained on, rebuilt from the workdir's config and token-id cache."""
  config = trained.workdir_config(str(workdir))
  data = datasets_lib.build_datasets(config.data, str(workdir), seed=config.seed)
  return data.tokenizer, next(data.train)


def _loss(params, model_config, batch):
  sums = eval_step(params, {k: jnp.asarray(v) for k, v in batch.items()}, config=model_config,
                   label_smoothing=0.1)
  return float(sums["loss_sum"] / sums["token_count"])


def test_finetune_starts_from_the_imported_model_and_lowers_the_loss(finetuned):
  marian_dir_, _, workdir, result = finetuned
  imported_config, imported_params, _ = marian.load_marian(marian_dir_)
  assert "Fine-tuning the model imported in" in result.stderr and "from its step 0" in result.stderr

  # Steps continue from the imported step 0: logged 1..STEPS, checkpoints 4 and 8 beside the import's 0.
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_steps = [r["step"] for r in rows if "train/loss" in r]
  assert train_steps == list(range(1, STEPS + 1))
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == [0, 4, 8]
  assert any("val/loss" in r for r in rows) and any("val/bleu" in r for r in rows)

  # The imported tokenizer, and no SentencePiece vocabulary of ours.
  assert sorted(os.listdir(workdir / "vocab")) == ["source.spm", "target.spm", "vocab.json"]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["data"]["tokenizer"] == "marian" and saved["data"]["dataset"] == "parallel_text"
  assert saved["model"] == {**dataclasses.asdict(imported_config), "dropout_rate": 0.0}

  # Step 1's logged loss is the imported model's loss on the first batch (dropout off): parameters restored.
  model_config, params, _ = trained.load(str(workdir))
  assert model_config == imported_config.replace(dropout_rate=0.0)
  tokenizer, batch = _first_batch(workdir)
  before, after = _loss(imported_params, model_config, batch), _loss(params, model_config, batch)
  first_logged = next(r["train/loss"] for r in rows if r["step"] == 1)
  np.testing.assert_allclose(first_logged, before, rtol=1e-4)
  print(f"fixed-batch loss: imported {before:.4f} -> fine-tuned {after:.4f}")
  assert after < before - 0.1

  # The packed batch pads with the model's pad id (not 0, which is EOS here), weighted 0 in the loss.
  assert isinstance(tokenizer, MarianVocabulary) and model_config.pad_id == tokenizer.pad_id != 0
  assert model_config.eos_id == 0
  padding = batch["targets_segmentation"] == 0
  assert padding.any() and (batch["targets"][padding] == model_config.pad_id).all()
  assert (batch["inputs"][batch["inputs_segmentation"] == 0] == model_config.pad_id).all()
  weights = np.asarray(token_weights(jnp.asarray(batch["targets"]), model_config.pad_id))
  np.testing.assert_array_equal(weights, ~padding)
  assert (batch["targets"][~padding] == model_config.eos_id).sum() == (batch["targets_position"][~padding] == 0).sum()


def test_finetuned_workdir_translates(finetuned):
  _, _, workdir, _ = finetuned
  result = _run(["experiments.translate", f"--workdir={workdir}"], stdin="\n".join(SOURCES) + "\n")
  assert result.returncode == 0, result.stderr[-3000:]
  model_config, params, tokenizer = trained.load(str(workdir))
  assert result.stdout.splitlines() == inference.translate_texts(params, model_config, tokenizer, SOURCES)


def test_finetuned_workdir_exports_to_transformers_with_our_logits(finetuned, tmp_path):
  _, _, workdir, _ = finetuned
  out = tmp_path / "exported"
  result = _run(["experiments.export", f"--workdir={workdir}", "--format=marian", f"--output={out}"])
  assert result.returncode == 0, result.stderr[-3000:]
  model_config, params, tokenizer = trained.load(str(workdir))
  hf_model = transformers.MarianMTModel.from_pretrained(out).eval()
  hf_tok = transformers.MarianTokenizer.from_pretrained(out)
  sources = [tokenizer.encode(s) for s in SOURCES]
  assert sources == [hf_tok(s)["input_ids"] for s in SOURCES]
  targets = [tokenizer.encode(g, target=True) for g in GERMAN[:len(SOURCES)]]
  assert targets == [hf_tok(text_target=g)["input_ids"] for g in GERMAN[:len(SOURCES)]]
  inputs, target_arr = _padded(sources, model_config.pad_id), _padded(targets, model_config.pad_id)
  expected = _hf_logits(hf_model, inputs, target_arr, model_config.pad_id, model_config.bos_id)
  ours = np.asarray(Transformer(model_config).apply({"params": params}, jnp.asarray(inputs),
                                                    jnp.asarray(target_arr)))
  valid = target_arr != model_config.pad_id
  diff = float(np.abs(ours - expected)[valid].max())
  print(f"exported fine-tuned model: max |logit diff| vs transformers {diff:.2e}")
  assert diff <= 1e-4 and np.abs(expected[valid]).max() > 1.0


def test_finetune_resumes_exactly_where_it_stopped(finetuned, tmp_path):
  _, corpus, workdir, _ = finetuned
  copy = tmp_path / "workdir"
  shutil.copytree(workdir, copy)
  flags = [f for f in FINETUNE_FLAGS if not f.startswith(("--config.num_train_steps", "--config.model."))]
  result = _run(["experiments.train", f"--workdir={copy}", f"--config.data.dir={corpus}", *flags,
                 f"--config.num_train_steps={STEPS + 2}"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"Resumed from the checkpoint at step {STEPS}" in result.stderr and "Fine-tuning" not in result.stderr
  rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, STEPS + 3))


@pytest.mark.parametrize("flag, key", [("--config.model.d_model=64", "model.d_model"),
                                       ("--config.data.tokenizer=sentencepiece", "data.tokenizer")])
def test_flag_contradicting_the_imported_model_is_refused_and_nothing_written(marian_dir, tmp_path, flag,  # noqa: F811
                                                                              key):
  corpus = _corpus(tmp_path / "corpus")
  workdir = tmp_path / "workdir"
  marian.import_to_workdir(marian_dir, str(workdir))
  before = _tree(workdir)
  result = _run(["experiments.train", f"--workdir={workdir}", f"--config.data.dir={corpus}", *FINETUNE_FLAGS,
                 flag])
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and f"--config.{key}=" in last and "contradicts the imported model" in last
  assert _tree(workdir) == before


# ----------------------------------------------------------------------------------------------------------
# The pieces, in process
# ----------------------------------------------------------------------------------------------------------

def test_config_for_workdir_takes_the_imported_architecture(marian_dir, tmp_path):  # noqa: F811
  imported_config, _, _ = marian.load_marian(marian_dir)
  workdir = str(tmp_path / "workdir")
  write_json_atomically(Workdir(workdir).config_json, marian.workdir_config(imported_config, marian_dir))
  config = number_words.get_config()  # a recipe whose model (relu, d_model 128, ...) is not the import's
  config.model.dropout_rate = 0.3
  config = ExperimentConfig.from_config_dict(config)
  adopted = imported_workdir.config_for_workdir(config, workdir, explicit={"model.dropout_rate", "data.dir"})
  assert factories.model_config_from(adopted, imported_config.vocab_size) == imported_config.replace(dropout_rate=0.3)
  assert adopted.data.tokenizer == "marian" and adopted.data.vocab_size == imported_config.vocab_size
  assert config.model.d_model == 128 and config.data.tokenizer == "sentencepiece"  # the caller's is untouched
  validate(adopted)
  # An explicit key that agrees is accepted; one that does not names itself.
  agreeing = config.replace(model=config.model.replace(d_model=imported_config.d_model))
  assert imported_workdir.config_for_workdir(agreeing, workdir, explicit={"model.d_model"}).model.d_model == 32
  with pytest.raises(ValueError, match=r"--config.model.d_model=64 \(the model has 32\)") as error:
    imported_workdir.config_for_workdir(config.replace(model=config.model.replace(d_model=64)), workdir,
                                        explicit={"model.d_model"})
  assert "\n" not in str(error.value)
  # Not an imported model's workdir: the config as it is.
  assert imported_workdir.config_for_workdir(config, str(tmp_path / "other"), explicit={"model.d_model"}) is config


def test_a_moving_average_of_an_imported_model_starts_at_its_weights(marian_dir, tmp_path):  # noqa: F811
  """`config.ema_decay` on a fine-tune: the average starts at the imported parameters, not at the random ones
  the fresh state was drawn with (`imported_workdir.restore_import` builds the optimizer state for them)."""
  workdir = str(tmp_path / "workdir")
  marian.import_to_workdir(marian_dir, workdir)
  config = default.get_config()
  config.data.update(dataset="parallel_text", dir=str(_corpus(tmp_path / "corpus")), eval_splits=("val",),
                     max_len=32, tokens_per_batch=256)
  config.ema_decay = 0.99
  config = ExperimentConfig.from_config_dict(config)
  run = trainer.prepare(imported_workdir.config_for_workdir(config, workdir, explicit={"data.dir"}), workdir)
  checkpointer = factories.checkpointer(run.config, run.workdir.checkpoints)
  try:
    state = trainer.init_or_restore(run, checkpointer).state
    imported = jax.tree_util.tree_leaves(jax.device_get(state.params))
    average = jax.tree_util.tree_leaves(jax.device_get(factories.inference_params(run.config, state)))
    for a, b in zip(imported, average, strict=True):
      np.testing.assert_array_equal(a, b)
    _, reference, _ = marian.load_marian(marian_dir)
    for a, b in zip(imported, jax.tree_util.tree_leaves(reference), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  finally:
    checkpointer.close()
    run.writer.close()


def test_marian_vocabulary_encodes_targets_with_the_target_model(marian_dir):  # noqa: F811
  vocab = MarianVocabulary(marian_dir)
  hf_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
  assert [vocab.encode(g, target=True) for g in GERMAN] == [hf_tok(text_target=g)["input_ids"] for g in GERMAN]
  assert [vocab.encode(g, target=True) for g in GERMAN] != [vocab.encode(g) for g in GERMAN]
  assert vocab.is_blank(" \t") and not vocab.is_blank("a")
