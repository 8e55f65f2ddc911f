"""The benchmarks time the trainer's own compiled step (issue 12): same program, same numbers.

A tiny number-words run is prepared by the trainer (`prepare` + `init_or_restore`, what
`python -m experiments.train` does); `experiments.benchmarks.common.build_train_step` builds the benchmark's
step for the same config. Both must lower to the same StableHLO text, take the same step with the same
numbers, and a changed config must change the program.
"""

import copy

import jax
import numpy as np
import pytest

from experiments.benchmarks import ablations, common
from experiments.configs import default, number_words
from transformer_jax import sharding, trainer


def _tiny_config(tmp_path):
  config = number_words.get_config()
  config.data.builder_config = "tiny"
  config.data.vocab_size = 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.data.tokens_per_batch = 512
  config.model.update(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                      dropout_rate=0.1)
  config.evals.loss.every_steps = 0
  return config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """The trainer's run (state, compiled step, rng) and one batch as the trainer shards it."""
  tmp_path = tmp_path_factory.mktemp("bench")
  run = trainer.prepare(_tiny_config(tmp_path), str(tmp_path / "run"))
  trainer.init_or_restore(run)
  batch = sharding.shard_batch(trainer.next_batch(run.data.train, 1), run.mesh, run.rules)
  return run, batch


def _bench_config(run):
  """The run's config as the benchmark gets it: `config.model.vocab_size` = the tokenizer's."""
  config = copy.deepcopy(run.config)
  config.model.vocab_size = run.model_config.vocab_size
  return config


def test_benchmark_lowers_the_program_the_trainer_runs(prepared):
  run, batch = prepared
  bench = common.build_train_step(_bench_config(run), mesh=run.mesh)
  trainer_text = run.train_step.lower(run.state, batch, run.rng).as_text()
  bench_text = bench.step.lower(bench.state, batch, bench.rng).as_text()
  assert bench.model_config == run.model_config
  assert bench_text == trainer_text


def test_benchmark_step_gives_the_trainers_numbers(prepared):
  run, batch = prepared
  bench = common.build_train_step(_bench_config(run), mesh=run.mesh)
  state = jax.tree_util.tree_map(lambda x: x.copy(), run.state)  # the trainer's step donates its state
  for a, b in zip(jax.tree_util.tree_leaves(bench.state.params), jax.tree_util.tree_leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  bench_state, bench_metrics = bench.step(bench.state, batch, bench.rng)
  run_state, run_metrics = run.train_step(state, batch, run.rng)
  for key in ("loss", "nll", "accuracy", "grad_norm", "learning_rate", "token_count"):
    assert float(bench_metrics[key]) == float(run_metrics[key]), key
  for a, b in zip(jax.tree_util.tree_leaves(bench_state.params), jax.tree_util.tree_leaves(run_state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change", ["label_smoothing", "warmup_steps", "model.d_ff"])
def test_a_changed_config_changes_the_program(prepared, change):
  run, batch = prepared
  config = _bench_config(run)
  if change == "label_smoothing":
    config.label_smoothing = 0.2
  elif change == "warmup_steps":
    config.warmup_steps = 301
  else:
    config.model.d_ff = 96
  bench = common.build_train_step(config, mesh=run.mesh)
  assert (bench.step.lower(bench.state, batch, bench.rng).as_text()
          != run.train_step.lower(run.state, batch, run.rng).as_text())


def test_ablation_variant_changes_only_the_traced_function(prepared):
  run, batch = prepared
  config = _bench_config(run)
  baseline = ablations.variant_step(config, "baseline", mesh=run.mesh)
  variant = ablations.variant_step(config, "autodiff_loss", mesh=run.mesh)
  trainer_text = run.train_step.lower(run.state, batch, run.rng).as_text()
  assert baseline.step.lower(baseline.state, batch, baseline.rng).as_text() == trainer_text
  assert variant.step.lower(variant.state, batch, variant.rng).as_text() != trainer_text


def test_train_config_is_the_default_recipe_with_the_presets_sizes():
  model_config = common.preset_config("tiny", 8000)
  config = common.train_config(model_config)
  reference = default.get_config()
  assert trainer.model_config_from(config, 8000) == model_config
  for key in ("label_smoothing", "warmup_steps", "learning_rate", "adam_b1", "adam_b2", "adam_eps",
              "grad_accum_steps", "seed"):
    assert config[key] == reference[key], key
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    common.preset_config("huge", 8000)


def test_plain_batch_has_full_rows_of_real_ids():
  batch = common.plain_batch(32, 64, 8000)
  assert set(batch) == {"inputs", "targets"}
  for ids in batch.values():
    assert ids.shape == (32, 64) and ids.dtype == np.int32
    assert ids.min() >= 4 and ids.max() < 8000
  np.testing.assert_array_equal(common.plain_batch(32, 64, 8000)["inputs"], batch["inputs"])
