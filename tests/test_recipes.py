"""The WMT 2014 recipes (`experiments/configs/wmt14_*.py`): every value against the paper, and a CPU dry run.

The paper's numbers are written out here from ../shared/docs/PAPER.md (Vaswani et al., 2017: Table 3,
sections 5 and 6), not read from the configs. The dry run builds each recipe, shrunk by config overrides only,
on `tfds.testing.mock_data` (random WMT text, no network), trains a few steps through the real loop, resumes,
averages checkpoints and translates with the averaged parameters.
"""

import importlib
import logging
import math
import os
import re

import jax
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax.decoding import inference
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run import factories, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import schedule as schedule_lib
from transformer_jax.workdir import Workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("wmt14_ende_base", "wmt14_ende_big", "wmt14_enfr_big")

# Table 3 and sections 5-6 of the paper, per recipe.
PAPER = {
    "wmt14_ende_base": dict(layers=6, d_model=512, d_ff=2048, heads=8, d_k=64, dropout=0.1, steps=100_000,
                            average_last=5, vocab=37000, dataset="wmt14_translate/de-en", target="de",
                            params=65e6),
    "wmt14_ende_big": dict(layers=6, d_model=1024, d_ff=4096, heads=16, d_k=64, dropout=0.3, steps=300_000,
                           average_last=20, vocab=37000, dataset="wmt14_translate/de-en", target="de",
                           params=213e6),
    "wmt14_enfr_big": dict(layers=6, d_model=1024, d_ff=4096, heads=16, d_k=64, dropout=0.1, steps=300_000,
                           average_last=20, vocab=32000, dataset="wmt14_translate/fr-en", target="fr",
                           params=None),  # the paper gives parameter counts for EN-DE only
}
# The same for every recipe.
LABEL_SMOOTHING = 0.1
ADAM = (0.9, 0.98, 1e-9)
WARMUP = 4000
LR_SCALE = 1.0
PEAK_LR_BASE = 7.0e-4            # d_model^-0.5 * 4000^-0.5 for d_model 512
TOKENS_PER_SIDE = 25_000         # "approximately 25000 source tokens and 25000 target tokens" per batch
PAPER_DEVICES = 8                # 8 P100s
CHECKPOINT_MINUTES = 10
BEAM, ALPHA, EXTRA_LEN = 4, 0.6, 50


def _recipe(name: str) -> ml_collections.ConfigDict:
  return importlib.import_module(f"experiments.configs.{name}").get_config()


def _flat_keys(tree, prefix: str = "") -> set[str]:
  """'a.b.c' names of the leaves of a (nested) ConfigDict."""
  keys = set()
  for key, value in tree.items():
    name = f"{prefix}{key}"
    keys |= _flat_keys(value, name + ".") if isinstance(value, ml_collections.ConfigDict) else {name}
  return keys


# -- the recipe values ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RECIPES)
def test_recipe_matches_the_paper(name):
  paper, config = PAPER[name], _recipe(name)
  m = config.model
  # Architecture (section 3, Table 3).
  assert (m.num_encoder_layers, m.num_decoder_layers) == (paper["layers"], paper["layers"])
  assert (m.d_model, m.d_ff, m.num_heads) == (paper["d_model"], paper["d_ff"], paper["heads"])
  assert m.d_model // m.num_heads == paper["d_k"]
  assert m.dropout_rate == paper["dropout"]
  assert m.attention_dropout_rate == 0.0 and m.relu_dropout_rate == 0.0
  assert m.pre_ln is False and m.position_embedding == "sinusoidal"
  assert m.share_embeddings is True and m.scale_embeddings is True
  assert m.dtype == "auto"  # the backend rule: bfloat16 compute on TPU/GPU (float32 parameters), float32 on CPU
  # Data (section 5.1): direction EN -> X, shared vocabulary, dev newstest2013, test newstest2014.
  d = config.data
  assert d.dataset == paper["dataset"]
  assert (d.source_lang, d.target_lang) == ("en", paper["target"])
  assert d.vocab_size == paper["vocab"] and m.vocab_size == paper["vocab"]
  assert tuple(d.eval_splits) == ("validation",) and d.train_split == "train"
  assert d.download is False
  # Batch (section 5.1): ~25k tokens per side per step; slots include padding, so a little more than 25k,
  # split evenly over the paper's 8 devices.
  slots = d.tokens_per_batch * config.grad_accum_steps
  assert TOKENS_PER_SIDE <= slots <= 1.10 * TOKENS_PER_SIDE
  rows = d.tokens_per_batch // d.max_len
  assert rows * d.max_len == d.tokens_per_batch and rows % PAPER_DEVICES == 0
  assert config.grad_accum_steps == 1
  # The one-accelerator variant in the docs: an eighth of the batch, accumulated 8 times.
  assert (d.tokens_per_batch // PAPER_DEVICES) % d.max_len == 0
  # Optimiser and schedule (sections 5.3-5.4).
  assert (config.adam_b1, config.adam_b2, config.adam_eps) == ADAM and config.weight_decay == 0.0  # none in the paper
  assert config.warmup_steps == WARMUP and config.learning_rate == LR_SCALE
  assert config.label_smoothing == LABEL_SMOOTHING
  assert config.num_train_steps == paper["steps"]
  # Checkpoints every 10 minutes, enough kept to average the last 5 / 20 (section 6.1).
  assert config.checkpoint_every_minutes == CHECKPOINT_MINUTES
  assert config.checkpoint_every_steps == 0
  assert config.decode.average_last == paper["average_last"]
  assert config.checkpoint_keep >= paper["average_last"]
  assert config.checkpoint_best_metric == ""
  # Decoding (section 6.1).
  assert (config.decode.beam_size, config.decode.alpha, config.decode.extra_len) == (BEAM, ALPHA, EXTRA_LEN)
  assert config.final_eval.split == "test"  # newstest2014, decoded with config.decode
  # The mesh: data parallel over every device.
  assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (-1, 1, 1)
  assert config.distributed is False
  # The model config is accepted by the library.
  assert factories.model_config_from(ExperimentConfig.from_config_dict(config), paper["vocab"]).head_dim == paper["d_k"]


@pytest.mark.parametrize("name", RECIPES + ("number_words", "multi30k"))
def test_recipe_holds_exactly_the_keys_of_default_py(name):
  """Every key lives once in configs/default.py; a recipe only changes values (no new, no missing keys)."""
  reference = importlib.import_module("experiments.configs.default").get_config()
  assert _flat_keys(_recipe(name)) == _flat_keys(reference)


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections' file loader
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_file_loads_like_the_trainer_with_the_one_accelerator_overrides(name):
  """`experiments.train --config=FILE --config.a.b=v` (ml_collections config flags), as docs/reproducing.md."""
  from absl import flags
  from ml_collections import config_flags
  argv = ["train", f"--config={os.path.join(REPO, 'experiments', 'configs', name + '.py')}",
          "--config.data.tokens_per_batch=3328", "--config.grad_accum_steps=8"]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "recipe", flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flag_values(argv)
  config = flag_values.config
  assert config.data.tokens_per_batch * config.grad_accum_steps == _recipe(name).data.tokens_per_batch
  assert config.data.tokens_per_batch % config.data.max_len == 0
  assert config.model.to_dict() == _recipe(name).model.to_dict()


@pytest.mark.parametrize("name", ["wmt14_ende_base", "wmt14_ende_big"])
def test_parameter_count_and_peak_learning_rate(name):
  from transformer_jax.training.steps import init_params
  import flax.linen as nn
  config = ExperimentConfig.from_config_dict(_recipe(name))
  model_config = factories.model_config_from(config, config.data.vocab_size)
  shapes = jax.eval_shape(lambda: nn.unbox(init_params(model_config, jax.random.key(0))))
  count = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
  assert abs(count - PAPER[name]["params"]) / PAPER[name]["params"] < 0.05, count
  lr = schedule_lib.rsqrt_schedule(config.model.d_model, config.warmup_steps, config.learning_rate)
  peak = float(lr(config.warmup_steps))
  assert peak == pytest.approx(config.model.d_model ** -0.5 * WARMUP ** -0.5)
  if config.model.d_model == 512:
    assert peak == pytest.approx(PEAK_LR_BASE, rel=0.01)
  assert float(lr(config.warmup_steps // 2)) < peak and float(lr(4 * config.warmup_steps)) == pytest.approx(peak / 2)


# -- a dry run of each recipe on mocked WMT data ----------------------------------------------------------------

def _reduced(name: str, tmp_path, num_train_steps: int, evaluate: bool) -> ExperimentConfig:
  """The recipe with only sizes, budgets and cadences overridden, as one would from the command line (typed, as
  `experiments.train` hands it to the trainer)."""
  config = _recipe(name)
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, max_len=64)
  config.data.update(download=True, tfds_data_dir=str(tmp_path / "tfds"), vocab_size=64,
                     vocab_max_sentences=1000, max_len=32, tokens_per_batch=256)
  if name == "wmt14_ende_base":          # the fewer-devices path once: two micro-batches per step
    config.update(grad_accum_steps=2)
  config.num_train_steps = num_train_steps
  config.warmup_steps = 2
  config.log_every_steps = 1
  config.evals.loss.every_steps = num_train_steps if evaluate else 0
  config.evals.loss.tokens_per_batch = 512
  config.evals.bleu.every_steps = 0
  config.checkpoint_every_steps = 2      # instead of every 10 minutes
  config.async_checkpointing = False
  config.decode.average_last = 3
  return ExperimentConfig.from_config_dict(config)


@pytest.fixture
def quick_compiles():
  """XLA with most optimisations off: the dry runs compile ~6 programs each and run them a few times."""
  previous = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


def _saved_steps(directory: str) -> list[int]:
  with checkpoint_lib.Checkpointer(directory, read_only=True) as ckpt:
    return ckpt.all_steps()


# The three dry runs differ only in values the tests above check; the default suite runs the base recipe's (with
# its gradient accumulation), `make test-all` all three.
@pytest.mark.parametrize("name", [n if n == "wmt14_ende_base" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in RECIPES])
def test_recipe_dry_run_train_resume_average_translate(name, tmp_path, caplog, quick_compiles):
  workdir = str(tmp_path / "run")
  ckpt_dir = str(Workdir(workdir).checkpoints)
  caplog.set_level(logging.INFO)
  with tfds.testing.mock_data(num_examples=24):
    first = trainer.train_and_evaluate(_reduced(name, tmp_path, 4, evaluate=True), workdir)
    assert first.final_step == 4
    assert np.isfinite(first.eval_metrics["validation/loss"])
    # Attention diagnostics at evaluation: a finite entropy per layer and head, a share in [0, 1].
    share = first.eval_metrics["validation/attention/encoder_self/near_uniform_share"]
    assert 0.0 <= share <= 1.0
    assert np.isfinite(first.eval_metrics["validation/attention/cross/layer_0/head_1/entropy"])
    assert _saved_steps(ckpt_dir) == [2, 4]
    assert "Resumed" not in caplog.text

    config = _reduced(name, tmp_path, 6, evaluate=False)  # resume to more steps
    second = trainer.train_and_evaluate(config, workdir)
  assert "Resumed from the checkpoint at step 4" in caplog.text
  # The packing logged on the resume is that of the batches the data position continues with, in its epoch.
  resumed_epoch = re.search(r"Resumed from the checkpoint at step 4 .*?'epoch': (\d+)", caplog.text).group(1)
  assert re.findall(r"padding efficiency of the next \d+ batches \(epoch (\d+)\)", caplog.text) == ["0", resumed_epoch]
  assert second.final_step == 6
  steps = _saved_steps(ckpt_dir)
  assert steps == [2, 4, 6]

  averaged_dir = os.path.join(workdir, "averaged")
  last = config.decode.average_last
  assert checkpoint_lib.average_checkpoints(ckpt_dir, last_n=last, output_directory=averaged_dir) == 6
  model_config = second.model_config
  averaged = checkpoint_lib.restore_params(averaged_dir, model_config)
  each = [checkpoint_lib.restore_params(ckpt_dir, model_config, step=s) for s in steps[-last:]]
  expected = jax.tree_util.tree_map(lambda *xs: np.mean(np.stack(xs), axis=0), *each)
  for got, want in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(jax.tree_util.tree_leaves(averaged)[0]),
                         np.asarray(jax.tree_util.tree_leaves(each[-1])[0]))

  hyps = inference.translate_texts(averaged, model_config, second.datasets.tokenizer,
                                   ["the house is red", ""], beam_size=config.decode.beam_size,
                                   alpha=config.decode.alpha, extra_len=config.decode.extra_len)
  assert len(hyps) == 2 and isinstance(hyps[0], str) and hyps[1] == ""
