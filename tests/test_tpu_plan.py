"""The run's own train step compiled for TPU topologies on this host (libtpu, no TPU): the collectives each
mesh implies, memory within the chip, the compiler's FLOPs against the analytic count, and the refusal of a run
that cannot fit (`transformer_jax.run.plan`, `benchmarks.tpu_plan`); and for an 8-GPU H100 host (jax's CUDA plugin,
no GPU). Skipped only where libtpu (the `tpu` extra) or the CUDA plugin (the `gpu-plan` extra) is absent."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common
from transformer_jax import accelerators, sharding
from transformer_jax.config import ModelConfig
from transformer_jax.run import plan
from transformer_jax.run.experiment_config import DataConfig, ExperimentConfig

needs_libtpu = pytest.mark.skipif(not accelerators.libtpu_available(),
                                reason="libtpu is not installed (pip install -e '.[tpu]'; make test installs it)")

needs_cuda_plugin = pytest.mark.skipif(
    not accelerators.cuda_plugin_available(),
    reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-plan]'; not in make setup: see pyproject.toml)")

MODEL = ModelConfig(vocab_size=512, num_encoder_layers=1, num_decoder_layers=1, d_model=256, d_ff=1024,
                    num_heads=4, max_len=32, dtype="bfloat16")
CONFIG = ExperimentConfig(model=MODEL, data=DataConfig(vocab_size=512, max_len=32, tokens_per_batch=32 * 16))


def _train_report(topology_name: str, mesh_config: sharding.MeshConfig):
  topology = accelerators.compile_topology(topology_name)
  config = dataclasses.replace(CONFIG, mesh=mesh_config)
  mesh = sharding.mesh_from_config(mesh_config, devices=topology.devices)
  return topology, plan.compile_report(plan.build_programs(config, MODEL, mesh, decode_rows=0).train)


def _check_memory_and_flops(topology, report):
  assert 0 < report.peak_bytes <= topology.hbm_bytes_per_device
  analytic = common.model_flops(MODEL, 16, 32, 32)["total"]
  assert report.flops * len(topology.devices) == pytest.approx(analytic, rel=0.15)


@needs_libtpu
def test_data_parallel_on_v5e_all_reduces_gradients():
  topology, report = _train_report("v5e:2x2", sharding.MeshConfig(data=4))
  assert len(topology.devices) == 4 and topology.chip.name == "v5e"
  assert report.collectives["all-reduce"]["count"] >= 1
  assert "all-gather" not in report.collectives and "reduce-scatter" not in report.collectives
  _check_memory_and_flops(topology, report)


@needs_libtpu
def test_fsdp_on_v4_gathers_weights_and_scatters_gradients():
  # v4:2x2x1 is 4 megacore chips = 4 devices (as a v4-8 TPU VM shows them): data 2 x fsdp 2.
  topology, report = _train_report("v4:2x2x1", sharding.MeshConfig(data=2, fsdp=2))
  assert len(topology.devices) == 4
  assert report.collectives["all-gather"]["count"] >= 1
  assert {"reduce-scatter", "all-reduce"} & set(report.collectives)  # gradients reduced over fsdp, then data
  _check_memory_and_flops(topology, report)


@needs_libtpu
def test_a_run_too_big_for_one_v5e_chip_is_refused_in_one_line_with_nothing_written(tmp_path):
  output = tmp_path / "plan.json"
  # A 1+1-layer model with a 64k-wide FFN: ~2.1 G parameters, 8.6 GB in float32 and twice that in Adam moments.
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.tpu_plan", "--config=experiments/configs/number_words.py",
       "--topology=v5e:1x1", "--programs=train", f"--output={output}", f"--cache_dir={tmp_path / 'cache'}",
       "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
       "--config.model.d_model=8192", "--config.model.d_ff=65536", "--config.model.num_heads=64"],
      capture_output=True, text=True, cwd=common.REPO, check=False)
  assert result.returncode == 1, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "GiB per device at its peak" in errors[0] and "15.75 GiB" in errors[0], errors
  assert "mesh.fsdp" in errors[0] and "grad_accum_steps" in errors[0] and "remat" in errors[0]
  assert not output.exists()


@needs_cuda_plugin
def test_data_parallel_on_eight_h100s_all_reduces_gradients_and_gives_memory_but_no_cost():
  topology, report = _train_report("H100:8", sharding.MeshConfig(data=8))
  assert len(topology.devices) == 8 and topology.devices[0].device_kind == "NVIDIA H100 80GB HBM3"
  assert report.collectives["all-reduce"]["count"] >= 1 and "all-gather" not in report.collectives
  assert 0 < report.peak_bytes <= topology.hbm_bytes_per_device
  assert report.flops == 0 and plan.step_estimate(report, topology) == (None, "no cost analysis")


def test_gpu_target_configs_come_from_the_chips_spec_and_bad_names_are_refused_in_one_line():
  h100 = accelerators.gpu_target_config(accelerators.chip_named("H100"))
  assert "core_count: 132" in h100 and "major: 9 minor: 0" in h100 and "memory_bandwidth: 3350000000000" in h100
  assert 'device_description_str: "NVIDIA A100-SXM4-80GB"' in accelerators.gpu_target_config(
      accelerators.chip_named("A100"))
  for bad in ("H200:8", "H100:0", "H100x8"):
    with pytest.raises(ValueError, match=r"CHIP:N with CHIP one of H100, A100") as refusal:
      accelerators.gpu_topology(bad)
    assert "\n" not in str(refusal.value)
  with pytest.raises(ValueError, match="a GPU topology .* is one host"):
    accelerators.compile_topology("H100:8", num_slices=2)


def test_a_repeated_program_is_read_back_from_the_report_cache_and_says_so(tmp_path):
  program = (jax.jit(lambda x: jnp.tanh(x @ x)), (jax.ShapeDtypeStruct((64, 64), jnp.float32),))
  first = plan.compile_report(program, str(tmp_path), "cpu")
  again = plan.compile_report(program, str(tmp_path), "cpu")
  assert not first.from_cache and again.from_cache and len(list(tmp_path.iterdir())) == 1
  assert dataclasses.replace(again, from_cache=False) == first and first.flops > 0
  assert not plan.compile_report(program, str(tmp_path), "another topology").from_cache


def test_collectives_are_read_from_the_optimised_hlo():
  hlo = ("%ar = f32[512,128]{1,0} all-reduce(f32[512,128]{1,0} %g), replica_groups={}\n"
         "%ags = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) all-gather-start(bf16[64,128]{1,0} %w)\n"
         "%agd = bf16[256,128]{1,0} all-gather-done(%ags)\n")
  assert plan.collectives(hlo) == {"all-reduce": {"count": 1, "bytes": 512 * 128 * 4},
                                   "all-gather": {"count": 1, "bytes": 256 * 128 * 2}}


def test_custom_calls_are_counted_by_target():
  hlo = ('%c1 = f32[512,8,64]{0,2,1} custom-call(%a, %b), custom_call_target="ConcatBitcast", backend_config={}\n'
         '%c2 = f32[512,8,64]{0,2,1} custom-call(%c, %d), custom_call_target="ConcatBitcast"\n'
         '%f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused\n')
  assert plan.custom_calls(hlo) == {"ConcatBitcast": 2}


def test_top_ops_sum_the_cost_models_cycles_per_source_op_across_layers():
  hlo = ('%f1 = f32[8]{0} fusion(%x), metadata={op_name="jit(train_step)/decoder/layer_0/ffn/dot_general"}, '
         'backend_config={"estimated_cycles":"300"}\n'
         '%f2 = f32[8]{0} fusion(%x), metadata={op_name="jit(train_step)/decoder/layer_1/ffn/dot_general"}, '
         'backend_config={"estimated_cycles":"300"}\n'
         '%f3 = f32[8]{0} fusion(%y), metadata={op_name="jit(train_step)/attend/dot_general"}, '
         'backend_config={"estimated_cycles":"400"}\n%p = f32[8]{0} parameter(0)\n')
  assert plan.top_ops(hlo) == [[0.6, "decoder/layer_*/ffn/dot_general"], [0.4, "attend/dot_general"]]
  assert plan.top_ops("%p = f32[8]{0} parameter(0)") == []


def test_fit_candidates_go_from_the_config_to_fsdp_tensor_then_accumulation():
  config = dataclasses.replace(CONFIG, data=dataclasses.replace(CONFIG.data, tokens_per_batch=32 * 16))
  splits = [plan.describe_split(c) for c in plan.fit_candidates(config, 4, max_accum=4)]
  assert splits == [
      "mesh data=-1 fsdp=1 tensor=1, tokens_per_batch=512 x grad_accum_steps=1",
      "mesh data=-1 fsdp=2 tensor=1, tokens_per_batch=512 x grad_accum_steps=1",
      "mesh data=-1 fsdp=4 tensor=1, tokens_per_batch=512 x grad_accum_steps=1",
      "mesh data=-1 fsdp=1 tensor=2, tokens_per_batch=512 x grad_accum_steps=1",
      "mesh data=-1 fsdp=1 tensor=4, tokens_per_batch=512 x grad_accum_steps=1",
      "mesh data=-1 fsdp=1 tensor=1, tokens_per_batch=256 x grad_accum_steps=2",
      "mesh data=-1 fsdp=1 tensor=1, tokens_per_batch=128 x grad_accum_steps=4"]
