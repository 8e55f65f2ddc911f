r"""A recipe compiled for a TPU topology (or a GPU host) on this host, without the accelerator: memory per chip,
FLOPs, collectives, the compiler's step-time estimate. A table and a JSON file.

    python -m benchmarks.tpu_plan --config=experiments/configs/wmt14_ende_base.py --topology=v5e:2x4
    python -m benchmarks.tpu_plan --config=experiments/configs/wmt14_ende_big.py --topology=v5e:2x4 --fit=auto
    python -m benchmarks.tpu_plan --config=... --topology=v5e:2x4 --num_slices=2 --config.mesh.fsdp=2
    python -m benchmarks.tpu_plan --config=experiments/configs/wmt14_ende_big.py --topology=H100:8

It builds what `experiments.train` would run for the config (the trainer's mesh from `config.mesh`, its abstract
train state, its partitioned train and eval steps, and the recipe's beam search at `decode.beam_size` over
`--decode_rows` sources of `--decode_src_len` tokens, one device, as evaluation decodes) and compiles them with
libtpu for the topology's devices (`transformer_jax.run.plan`, `accelerators.tpu_topology`). Multi-slice
(`--num_slices`) puts `mesh.data` across the slices over DCN, everything else within a slice on ICI
(`sharding.make_mesh`). The model computes in the TPU rule's dtype (`accelerators.backend_choices('tpu')`:
bfloat16) unless `--config.model.dtype` is given.

Per program: peak bytes per device against the device's HBM, argument and temporary bytes, the compiler's FLOPs
against the analytic count (`benchmarks.common.model_flops`, all devices), the step's estimated seconds (the
compiler's `optimal_seconds`, or a roofline `max(FLOPs / peak, bytes / HBM bandwidth)` where the compiler gives
none or a negative one, labelled), target tokens/s per chip, MFU against the chip's bf16 peak, the projected
hours of `num_train_steps`, the collectives in the optimised HLO (count, bytes per device), compile seconds,
and the source ops with the largest shares of the TPU cost model's cycles (`plan.top_ops`).
A train step whose peak exceeds the device's HBM is refused in one line (exit 1, nothing written); `--fit=auto`
instead tries FSDP, tensor splits, then gradient accumulation (`plan.fit_candidates`) and plans the first that
fits, saying which. JAX's persistent compilation cache cannot serve compile-only devices (it writes entries a
compile-only client cannot read back), so the plan keeps each compiled program's report under the hash of its
lowered text (`--cache_dir`): a repeat of an unchanged program costs its lowering (seconds), not its compile.

GPUs: `--topology=H100:8` (or `H100:1`, `A100:8`: `accelerators.gpu_topology`, one host) compiles with XLA's
CUDA compiler for GPUs described by their public spec (`accelerators.gpu_target_config`), without a GPU. Its
compile-only client gives memory and the optimised HLO but no cost analysis: the GPU rows have no estimated
seconds, tokens/s, MFU or hours (the JSON's `analytic_compute_floor_seconds` is the analytic FLOPs at the bf16
peak, a lower bound, not an estimate). Needs jax's CUDA plugin (`pip install -e '.[gpu-plan]'`).

This is the compiler's plan, not a run on the accelerator: `benchmarks.accelerator_check` on a real chip prints
the same estimate beside the measured step time. TPU topologies need libtpu (`pip install -e '.[tpu]'`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from absl import flags
from ml_collections import config_flags

import launch
from benchmarks import common
from transformer_jax import accelerators, sharding
from transformer_jax.run import factories, plan, run_checks
from transformer_jax.run.experiment_config import ExperimentConfig

FLAGS = flags.FLAGS
PROGRAMS = ("train", "eval", "decode")


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module)."""
  launch.define_config_flag(os.path.join(common.REPO, "experiments", "configs", "wmt14_ende_base.py"),
                            "the recipe's config file (default: WMT14 EN-DE base)")
  flags.declare_key_flag("config")
  flags.DEFINE_string("topology", "v5e:2x4", "TPU topology GENERATION:AxB[xC] (v2:2x2, v4:2x2x1, v5e:2x4) or GPUs "
                      "on one host CHIP:N (H100:8, A100:8; the gpu-plan extra)")
  flags.DEFINE_integer("num_slices", 1, "slices of the topology over DCN (mesh.data spans them)", lower_bound=1)
  flags.DEFINE_enum("fit", "check", ["check", "auto"], "check: refuse a train step that does not fit; auto: plan "
                    "the cheapest mesh split or accumulation that fits (plan.fit_candidates)")
  flags.DEFINE_list("programs", list(PROGRAMS), f"which of {', '.join(PROGRAMS)} to compile")
  flags.DEFINE_integer("decode_rows", 64, "sources per decode batch (decode_ids' 4096 tokens / 64)", lower_bound=1)
  flags.DEFINE_integer("decode_src_len", 64, "padded source length of the decode batch", lower_bound=1)
  flags.DEFINE_string("output", None, "JSON path (default runs/tpu_plan/<config>_<topology>.json)")
  flags.DEFINE_string("cache_dir", str(common.REPO / "runs" / "tpu_plan" / "cache"),
                      "compiled reports kept by the lowered program's hash ('' = off; plan.compile_report)")
  launch.check_list_choices("programs", PROGRAMS)


def plan_config(config: ExperimentConfig, explicit: dict, platform: str = "tpu") -> tuple[ExperimentConfig, str]:
  """`config` with `model.vocab_size` from `data.vocab_size` and the compute dtype of `platform`'s rule
  (`accelerators.backend_choices`) unless `--config.model.dtype` was given; returns (config, a note on it)."""
  vocab = config.data.vocab_size or config.model.vocab_size
  given = "model.dtype" in explicit
  dtype = accelerators.resolve_dtype(config.model.dtype if given else "auto", platform)
  note = f"model.dtype={dtype} ({'given' if given else f'the {platform} rule'}; recipe: {config.model.dtype})"
  return dataclasses.replace(config, model=config.model.replace(vocab_size=vocab, dtype=dtype)), note


def compile_train(config: ExperimentConfig, topology: accelerators.Topology, fit: str, programs: tuple):
  """(config, Programs, train report) of the first `plan.fit_candidates` config whose train step fits (only the
  config as given with fit='check'); DoesNotFitError (one line) when none does."""
  candidates = plan.fit_candidates(config, len(topology.devices)) if fit == "auto" else [config]
  error = None
  for candidate in candidates:
    try:
      built = _build(candidate, topology, programs)
    except ValueError as refusal:  # the split does not divide the model or the batch: the next candidate
      error = refusal
      continue
    try:
      report = plan.compile_report(built.train, FLAGS.cache_dir, topology.describe())
      print(f"train step, {plan.describe_split(candidate)}: peak {report.peak_bytes / 2**30:.2f} GiB per "
            f"device (compiled in {report.compile_seconds:.0f} s"
            f"{', read from --cache_dir' if report.from_cache else ''})", flush=True)
      plan.check_fits(report, topology.hbm_bytes_per_device)
      return candidate, built, report
    except plan.DoesNotFitError as refusal:
      print(f"train step, {plan.describe_split(candidate)}: does not fit", flush=True)
      error = refusal
  raise error


def _build(config: ExperimentConfig, topology: accelerators.Topology, programs: tuple) -> plan.Programs:
  mesh = sharding.mesh_from_config(config.mesh, devices=topology.devices)
  run_checks.check_batch_rows(config.data, mesh)
  model_config = factories.model_config_from(config, config.model.vocab_size, topology.devices[0].platform)
  return plan.build_programs(config, model_config, mesh, decode_rows=FLAGS.decode_rows if "decode" in programs
                             else 0, decode_src_len=FLAGS.decode_src_len)


def figures(name: str, report: plan.CompiledReport, config: ExperimentConfig, built: plan.Programs,
            topology: accelerators.Topology) -> dict:
  """One row of the table: the report and what it means on `topology` (analytic FLOPs, estimate, MFU)."""
  cfg, data = config.model, config.data
  rows = {"train": data.tokens_per_batch * config.grad_accum_steps // data.max_len,
          "eval": -(-config.evals.loss.tokens_per_batch // data.max_len), "decode": 0}[name]
  devices, chips = len(topology.devices), topology.chips_per_slice * topology.num_slices
  analytic = common.model_flops(cfg, rows, data.max_len, data.max_len, train=name == "train")["total"] \
      if rows else None
  seconds, source = plan.step_estimate(report, topology)
  row = {"program": name, **report.to_json(), "capacity_bytes": topology.hbm_bytes_per_device,
         "fits": report.peak_bytes <= topology.hbm_bytes_per_device, "step_seconds": seconds,
         "estimate": source,
         "roofline_seconds": plan.roofline_seconds(report, topology) if seconds is not None else None,
         "uncovered_ops": plan.uncovered_ops(report), "analytic_flops": analytic,
         "flops_ratio": report.flops * devices / analytic if analytic and report.flops else None}
  if seconds is None:  # no cost analysis (GPU): the analytic FLOPs at the bf16 peak bound the time from below
    row["analytic_compute_floor_seconds"] = analytic / (topology.peak_flops_per_device * devices) \
        if analytic else None
    return row
  if name == "train":
    row["tokens_per_second_per_chip"] = built.target_tokens / seconds / chips
    row["mfu"] = analytic / seconds / (topology.peak_flops_per_device * devices)
    row["hours"] = config.num_train_steps * seconds / 3600
  if name == "decode":  # a while loop: the compiler's cost covers its body once, i.e. one output position
    row["output_tokens_per_second"] = FLAGS.decode_rows / seconds  # one device; the encoder is counted too
  return row


def table(rows: list[dict]) -> str:
  """The rows as a fixed-width text table."""
  head = (f"{'program':8} {'fits':5} {'peak GiB':>9} {'HBM GiB':>8} {'args GiB':>9} {'temp GiB':>9} "
          f"{'FLOPs/an.':>9} {'est s':>9} {'source':13} {'tok/s/chip':>11} {'MFU':>6} {'hours':>7} "
          f"{'compile s':>9}  collectives")
  lines = [head]
  for r in rows:
    coll = ", ".join(f"{k} {v['count']} x ({v['bytes'] / 2**20:.1f} MiB)" for k, v in r["collectives"].items())
    fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else \
        "-".rjust(int(spec.split(".")[0]))  # noqa: E731
    lines.append(f"{r['program']:8} {str(r['fits']):5} {r['peak_bytes'] / 2**30:9.2f} "
                 f"{r['capacity_bytes'] / 2**30:8.1f} {r['argument_bytes'] / 2**30:9.2f} "
                 f"{r['temp_bytes'] / 2**30:9.2f} {fmt('flops_ratio', '9.2f')} {fmt('step_seconds', '9.4f')} "
                 f"{r['estimate']:13} {fmt('tokens_per_second_per_chip', '11.0f')} {fmt('mfu', '6.1%')} "
                 f"{fmt('hours', '7.1f')} {r['compile_seconds']:9.1f}{'*' if r.get('from_cache') else ' '} "
                 f"{coll or '-'}")
  return "\n".join(lines)


def run_plan(config: ExperimentConfig, topology: accelerators.Topology, fit: str, programs: tuple) -> dict:
  """The plan of `config` on `topology`: {"topology", "config", "rows": [...]} (DoesNotFitError when the train
  step cannot fit)."""
  config, built, train_report = compile_train(config, topology, fit, programs)
  rows = [figures("train", train_report, config, built, topology)] if "train" in programs else []
  for name in ("eval", "decode"):
    if name in programs:
      report = plan.compile_report(getattr(built, name), FLAGS.cache_dir, topology.describe())
      rows.append(figures(name, report, config, built, topology))
  return {"topology": topology.describe(), "split": plan.describe_split(config),
          "num_train_steps": config.num_train_steps, "rows": rows}


@launch.program
def main() -> None:
  topology = accelerators.compile_topology(FLAGS.topology, FLAGS.num_slices)
  config, dtype_note = plan_config(ExperimentConfig.from_config_dict(FLAGS.config),
                                   config_flags.get_override_values(FLAGS["config"]), topology.devices[0].platform)
  print(f"{topology.describe()}; {dtype_note}", flush=True)
  result = run_plan(config, topology, FLAGS.fit, tuple(FLAGS.programs))
  result.update(config_file=FLAGS["config"].config_filename, dtype=dtype_note)
  print(f"planned: {result['split']}\n" + table(result["rows"]))
  if any(row.get("from_cache") for row in result["rows"]):
    print("compile s*: the original compile's, the report read from --cache_dir (this run only lowered it)")
  if any(row["step_seconds"] is None for row in result["rows"]):
    print("est s, tok/s/chip, MFU, hours: not available: the compile-only GPU client gives no cost analysis "
          "(JSON: analytic_compute_floor_seconds, the analytic FLOPs at the bf16 peak, a lower bound)")
  for row in result["rows"]:
    if row.get("top_ops"):  # the TPU cost model's cycles per source op (plan.top_ops)
      print(f"{row['program']}: largest shares of the estimate: "
            + "; ".join(f"{share:.1%} {op[-80:]}" for share, op in row["top_ops"][:5]))
  slices = f"_x{FLAGS.num_slices}" if FLAGS.num_slices > 1 else ""
  output = FLAGS.output or str(common.REPO / "runs" / "tpu_plan" / (
      f"{Path(FLAGS['config'].config_filename).stem}_{FLAGS.topology.replace(':', '-')}{slices}.json"))
  common.dump_json(result, output)
  print(f"wrote {output}")


if __name__ == "__main__":
  define_flags()
  launch.run(main)
