"""The benchmarks time the trainer's own compiled step (issue 12): same program, same numbers.

A tiny number-words run is prepared by the trainer (`prepare` + `init_or_restore`, what
`python -m experiments.train` does); `benchmarks.common.build_train_step` builds the benchmark's
step for the same config. Both must lower to the same StableHLO text, take the same step with the same
numbers, and a changed config must change the program.
"""

import os
import subprocess
import sys
import types

import jax
import numpy as np
import optax
import pytest

from benchmarks import ablations, common, flax_peer
from benchmarks import profile as profile_bench
from experiments.configs import default, number_words
from transformer_jax import sharding
from transformer_jax.run import factories, trainer
from transformer_jax.run.experiment_config import ExperimentConfig


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config(tmp_path):
  config = number_words.get_config()
  config.data.builder_config = "tiny"
  config.data.vocab_size = 128
  config.data.tfds_data_dir = str(tmp_path / "tfds")
  config.data.tokens_per_batch = 512
  config.model.update(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                      dropout_rate=0.1)
  config.evals.loss.every_steps = 0
  return ExperimentConfig.from_config_dict(config)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """The trainer's run (state, compiled step, rng) and one batch as the trainer shards it."""
  tmp_path = tmp_path_factory.mktemp("bench")
  run = trainer.prepare(_tiny_config(tmp_path), str(tmp_path / "run"))
  with factories.checkpointer(run.config, run.workdir.checkpoints) as checkpointer:
    start = trainer.init_or_restore(run, checkpointer)
  program = trainer.compile_program(run, run.config, run.resolved_config, start.state, start.step + 1)
  batch = sharding.shard_batch(trainer.next_batch(run.data.train, 1), run.mesh, run.rules)
  run.writer.close()
  return types.SimpleNamespace(config=run.config, model_config=run.model_config, mesh=run.mesh, state=start.state,
                               rng=start.rng, train_step=program.train_step), batch


def _bench_config(run):
  """The run's config as the benchmark gets it: `config.model.vocab_size` = the tokenizer's."""
  return run.config.replace(model=run.config.model.replace(vocab_size=run.model_config.vocab_size))


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
    config = config.replace(label_smoothing=0.2)
  elif change == "warmup_steps":
    config = config.replace(warmup_steps=301)
  else:
    config = config.replace(model=config.model.replace(d_ff=96))
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
  assert factories.model_config_from(config, 8000) == model_config
  for key in ("label_smoothing", "warmup_steps", "learning_rate", "adam_b1", "adam_b2", "adam_eps", "weight_decay",
              "grad_accum_steps", "seed"):
    assert getattr(config, key) == reference[key], key
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    common.preset_config("huge", 8000)


def test_plain_batch_has_full_rows_of_real_ids():
  batch = common.plain_batch(32, 64, 8000)
  assert set(batch) == {"inputs", "targets"}
  for ids in batch.values():
    assert ids.shape == (32, 64) and ids.dtype == np.int32
    assert ids.min() >= 4 and ids.max() < 8000
  np.testing.assert_array_equal(common.plain_batch(32, 64, 8000)["inputs"], batch["inputs"])


def _fake_sdist(path, version, member_text):
  """A flax sdist stand-in holding `examples/wmt/models.py` (or not, with member_text None)."""
  import io
  import tarfile
  with tarfile.open(path, "w:gz") as tar:
    for name, text in ((f"flax-{version}/{flax_peer.MODELS_MEMBER}", member_text),
                       (f"flax-{version}/README.md", "flax")):
      if text is None:
        continue
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def test_flax_example_is_extracted_from_a_cached_sdist_and_imported(tmp_path):
  _fake_sdist(tmp_path / "flax-9.9.9.tar.gz", "9.9.9", "ANSWER = 42\n")
  path = flax_peer.ensure_example(tmp_path, "9.9.9")
  assert path == tmp_path / "flax-9.9.9" / "examples" / "wmt" / "models.py"
  assert flax_peer.load_models(path).ANSWER == 42


def test_flax_sdist_without_the_example_is_one_line_error(tmp_path):
  _fake_sdist(tmp_path / "flax-9.9.8.tar.gz", "9.9.8", None)
  with pytest.raises(flax_peer.ExampleUnavailableError, match=r"has no flax-9.9.8/examples/wmt/models.py"):
    flax_peer.ensure_example(tmp_path, "9.9.8")
  assert not flax_peer.example_path(tmp_path, "9.9.8").exists()


def test_flax_peer_loss_matches_optax_soft_target_cross_entropy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
  targets = rng.integers(0, 11, (2, 5)).astype(np.int32)
  eps = 0.1
  soft = np.full((2, 5, 11), eps / 10, np.float32)
  np.put_along_axis(soft, targets[..., None], 1 - eps, axis=-1)
  expected = optax.softmax_cross_entropy(logits, soft)
  np.testing.assert_allclose(flax_peer.smoothed_cross_entropy(logits, targets, eps), expected, rtol=1e-6)


def test_flax_peer_gets_packing_only_from_packed_batches():
  plain = common.plain_batch(2, 4, 100)
  assert set(flax_peer.model_inputs(plain)) == {"inputs", "targets"}
  packed = dict(plain, inputs_position=plain["inputs"], targets_position=plain["targets"],
                inputs_segmentation=plain["inputs"], targets_segmentation=plain["targets"])
  assert set(flax_peer.model_inputs(packed)) == {"inputs", "targets", "inputs_positions", "targets_positions",
                                                 "inputs_segmentation", "targets_segmentation"}


def test_torch_plain_batch_has_the_causal_mask_only():
  torch = pytest.importorskip("torch")
  from benchmarks import torch_peer
  batch = torch_peer.to_plain_torch_batch(common.plain_batch(3, 5, 100))
  assert batch["src_mask"] is None and batch["memory_mask"] is None and batch["tgt_is_causal"]
  blocked = np.isneginf(batch["tgt_mask"].numpy())
  np.testing.assert_array_equal(blocked, np.triu(np.ones((5, 5), bool), k=1))
  np.testing.assert_array_equal(batch["targets_position"].numpy(), np.tile(np.arange(5), (3, 1)))
  assert batch["token_count"] == 15 and batch["inputs"].dtype == torch.int64


@pytest.mark.parametrize("program, argv, message", [
    ("run", ["--sections=machine,bogus"], "unknown ['bogus']; of machine,train_tiny,"),
    ("sections", ["--section=nothing", "--out=x.json"], "--section"),
    ("sections", ["--section=scaling", "--out=x.json", "--lengths=64,long"], "comma-separated integers expected"),
    ("long_inputs", ["--mode=full", "--length=0", "--out=x.json"], "--length"),
    ("profile", ["--search=beam8"], "--search"),
    ("profile_window", ["--window=30"], "--window must be FIRST,LAST"),
    ("scale_probe", ["--pairs=1000,lots"], "--pairs=1000,lots: comma-separated integers expected"),
    ("sharding_bench", ["--meshes=model=8"], "--meshes=model=8: expected AXIS=SIZE,... with axes of data, fsdp, "
                                             "tensor"),
    ("flax_peer", ["--quick"], "Unknown command line flag 'quick'"),
])
def test_a_bad_flag_is_a_one_line_refusal(tmp_path, program, argv, message):
  """Every benchmark program parses absl flags: a bad value is one line, `error: ...`, exit status 1, nothing
  written (the programs run in an empty directory)."""
  proc = subprocess.run([sys.executable, "-m", f"benchmarks.{program}", *argv], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO, TRANSFORMER_JAX_HUGE_PAGES="0"))
  assert proc.returncode == 1 and proc.stderr.startswith("error: "), proc.stderr[-2000:]
  assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
  assert list(tmp_path.iterdir()) == []


def test_the_suite_starts_each_section_with_its_flags():
  """`run.py` starts `python -m benchmarks.sections --section=NAME ...`: every flag it passes is one the
  sections program defines (absl refuses unknown ones), for the quick and the full suite."""
  from benchmarks import run, sections
  names = set()
  section_names = [s for s in run.ALL_SECTIONS if not s.startswith("peers_")]
  argvs = [run.section_args(s, quick) for s in section_names for quick in (True, False)]
  argvs += [run.peer_args(p, k, f, q) for p in ("tiny", "base") for k in run.PEER_KINDS for f in run.PEER_FRAMEWORKS
            for q in (True, False)]
  for argv in argvs:
    assert argv[0].startswith("--section=") and argv[0].split("=")[1] in sections.SECTIONS, argv
    names |= {a[2:].split("=")[0] for a in argv}
  code = "from absl import flags; from benchmarks import sections; sections.define_flags(); print(*flags.FLAGS)"
  defined = set(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                               timeout=300, env=dict(os.environ, PYTHONPATH=REPO)).stdout.split())
  assert names <= defined, names - defined


@pytest.mark.parametrize("op_name, area", [
    ("jit(run)/while/body/jit(log_softmax)/reduce_max", "output projection + log-softmax [rows, vocab]"),
    ("jit(run)/while/body/Transformer.decode/decoder/layer_1/self_attention_block/self_attention/cond/"
     "dynamic_update_slice", "self-attention cache write"),
    ("jit(run)/while/body/Transformer.decode/decoder/layer_1/self_attention_block/self_attention/cond/exp",
     "self-attention over the cache (scores, mask, softmax, sum)"),
    ("jit(run)/while/body/Transformer.decode/decoder/layer_0/ffn_block/ffn/wi/dot_general", "feed-forward"),
    ("jit(run)/while/body/top_k", "beam choice: top-k over beam x vocab, finished list, ancestry reorder"),
    ("jit(run)/Transformer.encode/encoder/layer_0/ffn_block/ffn/wi/dot_general",
     "encoder and cross-attention K/V (once a batch)"),
    ("", "no source (layout copies XLA added, thread-pool waits)"),
])
def test_profile_names_each_decoding_op_by_what_it_does_for_the_search(op_name, area):
  """The profile's decoding areas (docs/performance.md's beam-4 table); a conditional's own event, which spans
  the branch's op events, is not counted beside them."""
  assert profile_bench.decode_area(op_name) == area
  assert any("cond.431.clone".startswith(skip) for skip in profile_bench.SKIP)
