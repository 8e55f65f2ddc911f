r"""One command that says whether this code works on an accelerator, and how fast: a table and a JSON file.

    python -m benchmarks.accelerator_check                       # on a GPU/TPU host: <= 8 min on one chip
    python -m benchmarks.accelerator_check --tiny                # CPU-sized (automatic on CPU): < 1 min
    python -m benchmarks.accelerator_check --output=check.json --skip=number_words

Sections, each a row (or rows) of the table, in this order:
  devices       what JAX sees: platform, device count, device kind, memory per device
  matmul        a large bf16 matmul (8192^2; --tiny 512^2): the chip's reachable rate, beside its bf16 peak
                from `accelerators.CHIPS` (the vendor's dense figure for the device kind)
  train         the base and big train steps in bf16 (--tiny: the CPU preset only), the trainer's own compiled
                step (`benchmarks.common.build_train_step`, what `experiments.train` runs) on plain full rows
                (`common.plain_batch`, 64 x 256 per side; --tiny 8 x 32): compile time, step time, target
                tokens/s, and MFU = analytic model FLOP/s (`common.model_flops`) / the peak, and / the matmul;
                beside the measured step, the compiler's own estimate of it (`plan.step_estimate`, the figure
                `benchmarks.tpu_plan` gives without the chip), so the first lent chip says how good it is
  attention     `model.attention_impl` xla vs cudnn (GPU only): the first step's loss and gradient norm from
                the same init and batch (equal within bf16 rounding), and both step times
  decode        greedy and beam 4 at base size (--tiny: the CPU preset), random init, 256 sources of 24
                random ids (--tiny 16 of 12), outputs to their cap len + 50 (--tiny + 8): `inference.translate_ids`,
                output tokens/s of a second pass (the first compiles)
  number_words  the built-in task (`experiments/configs/number_words.py`, 1500 steps) trained by the trainer
                in a temporary workdir: exact match on 1000 test numbers (>= 98% passes) and the wall time
                (--tiny: 30 steps of a small model on the tiny split, no target)
  checkpoint    the base train state (--tiny: CPU preset) sharded over every device (data axis), saved by
                `checkpoint.Checkpointer` and restored into the same shardings: bitwise equal, same shardings

Every row has a status: `ok`, `refused` (the part cannot run here: no GPU for cudnn, a model too big for the
device's memory, a section skipped), or `failed` (it ran and did not hold: an error, unequal outputs, exact
match under 98%); the error is one line in the row, never a crash. Exit status 0 unless a row failed.
JSON (`--output`, default runs/accelerator_check/<platform>-<time>.json): {"machine": ..., "tiny": bool,
"seconds": total, "rows": [{"section", "item", "status", "value", "detail": {...}}]}; docs/performance.md
("Accelerator check") describes the fields.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import linen as nn
import launch
from benchmarks import common
from experiments.configs import number_words
from transformer_jax import accelerators
from transformer_jax import sharding
from transformer_jax.decoding import inference
from transformer_jax.run import checkpoint as checkpoint_lib
from transformer_jax.run import plan as tpu_plan_lib
from transformer_jax.run import trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training.steps import init_params

SECTIONS = ("devices", "matmul", "train", "attention", "decode", "number_words", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The sizes of one check: the accelerator's, or --tiny's (CPU)."""

  tiny: bool
  presets: tuple = ("base", "big")
  vocab: int = 37000
  rows: int = 64
  length: int = 256
  steps: int = 10
  matmul_n: int = 8192
  decode_sources: int = 256
  source_len: int = 24
  extra_len: int = 50
  model_overrides: tuple = ()   # (field, value) pairs on every preset (--tiny: a 1+1-layer model, fast to compile)


TINY = Plan(tiny=True, presets=("tiny",), vocab=1000, rows=8, length=32, steps=3, matmul_n=512,
            decode_sources=8, source_len=8, extra_len=4,
            model_overrides=(("num_encoder_layers", 1), ("num_decoder_layers", 1), ("d_model", 64),
                             ("d_ff", 128), ("num_heads", 2)))


def preset(plan: Plan, name: str, **overrides):
  """The `ModelConfig` of preset `name` at the plan's vocabulary, with its overrides and `overrides`."""
  return common.preset_config(name, plan.vocab, **{**dict(plan.model_overrides), **overrides})


@dataclasses.dataclass
class Row:
  section: str
  item: str
  status: str       # ok | refused | failed
  value: str        # the headline figure, or the reason
  detail: dict = dataclasses.field(default_factory=dict)


class Refused(Exception):
  """This part cannot run here (no GPU, too big for the device, skipped); the message says why."""


def refuse(reason: str) -> Callable[[], Row]:
  """A section body that is refused with `reason`."""
  def body() -> Row:
    raise Refused(reason)
  return body


def _too_big(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def guarded(section: str, item: str, fn: Callable[[], Row | list[Row]]) -> list[Row]:
  """`fn()`'s rows, or one row for what stopped it: `refused` (Refused, out of device memory) or `failed`."""
  try:
    rows = fn()
    return rows if isinstance(rows, list) else [rows]
  except Refused as error:
    return [Row(section, item, "refused", str(error))]
  except Exception as error:  # noqa: BLE001  (a row, never a crash: that is this program's job)
    if _too_big(error):
      return [Row(section, item, "refused", "too big for the device: " + " ".join(str(error).split())[:200])]
    traceback.print_exc(file=sys.stderr)
    return [Row(section, item, "failed", f"{type(error).__name__}: " + " ".join(str(error).split())[:300])]


def peak_tflops(device_kind: str) -> float | None:
  """The dense bf16 peak per chip of a device kind (`accelerators.CHIPS`, the vendors' datasheets), None for a
  device kind the table has not (CPUs)."""
  chip = accelerators.chip_of(device_kind)
  return chip.bf16_tflops if chip else None


def _timed(fn: Callable[[], object], reps: int) -> float:
  """Median seconds of `reps` calls of `fn` (which blocks on its own result)."""
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


# ------------------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------------------

def devices_rows(plan: Plan) -> list[Row]:
  devices = jax.devices()
  memory = {}
  try:
    memory = devices[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  (CPU backends have none)
    pass
  limit = memory.get("bytes_limit")
  kind = devices[0].device_kind
  return [Row("devices", "seen", "ok", f"{len(devices)} x {kind} ({devices[0].platform})",
              {"platform": devices[0].platform, "count": len(devices), "device_kind": kind,
               "process_count": jax.process_count(), "memory_bytes": limit,
               "peak_bf16_tflops": peak_tflops(kind), "tiny": plan.tiny})]


def matmul_row(plan: Plan) -> Row:
  n = plan.matmul_n
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.bfloat16)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  seconds = _timed(lambda: matmul(a, a).block_until_ready(), 10 if not plan.tiny else 3)
  tflops = 2 * n ** 3 / seconds / 1e12
  peak = peak_tflops(jax.devices()[0].device_kind)
  share = f"; {tflops / peak:.0%} of the {peak:g} TFLOP/s peak" if peak else "; no bf16 peak known for this device"
  return Row("matmul", f"bf16 {n}x{n}", "ok", f"{tflops:.3g} TFLOP/s{share}",
             {"n": n, "seconds": seconds, "tflops": tflops, "peak_tflops": peak})


def _train_step(plan: Plan, name: str, **overrides) -> tuple[common.TrainStep, dict]:
  """The trainer's compiled step for `preset` in bf16 and one plain batch, sharded as the trainer does."""
  cfg = preset(plan, name, dtype="bfloat16", **overrides)
  built = common.build_train_step(common.train_config(cfg))
  return built, built.shard(common.plain_batch(plan.rows, plan.length, cfg.vocab_size))


def _time_steps(plan: Plan, built: common.TrainStep, batch: dict) -> dict:
  """Compile time, the first step's metrics, and the median step time over `plan.steps` steps."""
  start = time.perf_counter()
  state, metrics = built.step(built.state, batch, built.rng)
  first = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
  compile_s = time.perf_counter() - start
  holder = {"state": state}

  def one_step():
    holder["state"], out = built.step(holder["state"], batch, built.rng)
    jax.block_until_ready(out)

  one_step()
  return {"compile_s": compile_s, "step_s": _timed(one_step, plan.steps), "first_metrics": first}


def compiler_estimate(built: common.TrainStep, batch: dict) -> dict:
  """The compiler's own estimate of the step (`plan.step_estimate`: `optimal_seconds`, or its known part, or a
  roofline, labelled) and its peak bytes per device, for the program `built.step` runs on `batch`: what
  `benchmarks.tpu_plan` predicts without the chip, beside what the chip measures. Lowered before any step (the
  state is donated). Seconds None where the backend gives no estimate and the chip is not in
  `accelerators.CHIPS` (CPUs)."""
  report = tpu_plan_lib.analyse(built.step.lower(built.state, batch, built.rng))
  topology = accelerators.attached_topology()
  if topology is not None:
    seconds, source = tpu_plan_lib.step_estimate(report, topology)
  elif report.optimal_seconds is not None and report.optimal_seconds > 0:
    seconds, source = report.optimal_seconds, "compiler"
  else:
    seconds, source = None, "none"
  return {"estimate_s": seconds, "estimate_source": source, "compiled_peak_bytes": report.peak_bytes}


def train_row(plan: Plan, name: str, matmul_tflops: float | None) -> Row:
  built, batch = _train_step(plan, name)
  params = int(sum(x.size for x in jax.tree_util.tree_leaves(built.state.params)))  # before a step donates them
  estimate = compiler_estimate(built, batch)
  timing = {**_time_steps(plan, built, batch), **estimate}
  flops = common.model_flops(built.model_config, plan.rows, plan.length, plan.length)["total"]
  tflops = flops / timing["step_s"] / 1e12
  tokens_per_s = plan.rows * plan.length / timing["step_s"]
  peak = peak_tflops(jax.devices()[0].device_kind)
  mfu = tflops / peak if peak else None
  mfu_matmul = tflops / matmul_tflops if matmul_tflops else None
  value = (f"{tokens_per_s:,.0f} tok/s, step {timing['step_s'] * 1e3:.1f} ms, MFU "
           f"{f'{mfu:.1%}' if mfu is not None else 'n/a (no peak)'} of peak"
           + (f", {mfu_matmul:.0%} of the matmul" if mfu_matmul else "")
           + (f"; compiler's estimate {estimate['estimate_s'] * 1e3:.1f} ms ({estimate['estimate_source']})"
              if estimate["estimate_s"] else "; no compiler estimate"))
  return Row("train", f"{name} bf16 {plan.rows}x{plan.length}", "ok", value,
             {**timing, "tokens_per_s": tokens_per_s, "model_tflops": tflops, "mfu_peak": mfu,
              "mfu_matmul": mfu_matmul, "params": params})


def attention_rows(plan: Plan) -> list[Row]:
  platform = jax.devices()[0].platform
  if platform != "gpu":
    raise Refused(f"cudnn attention needs an NVIDIA GPU (this is {platform})")
  results = {}
  for impl in ("xla", "cudnn"):
    built, batch = _train_step(plan, plan.presets[0], attention_impl=impl)
    results[impl] = _time_steps(plan, built, batch)
    del built
  xla, cudnn = results["xla"]["first_metrics"], results["cudnn"]["first_metrics"]
  diffs = {k: abs(xla[k] - cudnn[k]) / max(abs(xla[k]), 1e-6) for k in ("loss", "grad_norm")}
  equal = all(d <= 2e-2 for d in diffs.values())  # bf16 matmuls: ~3 significant digits
  speedup = results["xla"]["step_s"] / results["cudnn"]["step_s"]
  return [Row("attention", f"xla vs cudnn ({plan.presets[0]} bf16)", "ok" if equal else "failed",
              f"first-step loss/grad-norm rel. diff {max(diffs.values()):.1e}; cudnn step {speedup:.2f}x xla's",
              {"relative_diffs": diffs, **{impl: r for impl, r in results.items()}})]


def decode_rows(plan: Plan) -> list[Row]:
  cfg = preset(plan, "base" if not plan.tiny else "tiny", dtype="bfloat16")
  params = jax.device_put(nn.unbox(init_params(cfg, jax.random.key(0))))
  rng = np.random.default_rng(0)
  sources = [list(rng.integers(4, cfg.vocab_size, plan.source_len)) for _ in range(plan.decode_sources)]
  rows = []
  for beam, name in ((1, "greedy"), (4, "beam 4")):
    translate = lambda: inference.translate_ids(params, cfg, sources, beam_size=beam,  # noqa: E731
                                                extra_len=plan.extra_len)
    start = time.perf_counter()
    outputs = translate()
    first_s = time.perf_counter() - start
    seconds = _timed(translate, 1)
    tokens = sum(len(o) + 1 for o in outputs)
    rows.append(Row("decode", f"{name} ({'base' if not plan.tiny else 'tiny'} bf16, random init)", "ok",
                    f"{tokens / seconds:,.0f} output tok/s, {len(sources) / seconds:,.1f} sentences/s",
                    {"sources": len(sources), "source_len": plan.source_len, "output_tokens": tokens,
                     "seconds": seconds, "first_pass_s": first_s, "tokens_per_s": tokens / seconds}))
  return rows


def number_words_row(plan: Plan) -> Row:
  config = number_words.get_config()
  config.final_eval.max_examples = 1000
  config.async_checkpointing = False
  if plan.tiny:
    config.data.builder_config = "tiny"
    config.data.vocab_size = 128
    config.data.tokens_per_batch = 512
    config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2)
    config.num_train_steps, config.warmup_steps, config.log_every_steps = 30, 10, 10
    config.evals.loss.every_steps = config.evals.attention.every_steps = 0
    config.checkpoint_every_steps, config.final_eval.max_examples = 0, 20
  config = ExperimentConfig.from_config_dict(config)
  with tempfile.TemporaryDirectory(prefix="accelerator_check_") as workdir:
    start = time.perf_counter()
    result = trainer.train_and_evaluate(config, workdir)
    report = launch.report_final_eval(config, workdir, result)
    wall = time.perf_counter() - start
  exact = report["exact_match"]
  passed = plan.tiny or exact >= 0.98
  target = "(tiny: no target)" if plan.tiny else ("(target >= 98%)" if passed else "(under the 98% target)")
  return Row("number_words", f"{config.num_train_steps} steps, {report['examples']} test numbers",
             "ok" if passed else "failed", f"exact match {exact:.2%} {target} in {wall:.0f} s",
             {"exact_match": exact, "wall_s": wall, "train_minutes": result.train_minutes,
              "steps": result.final_step})


def checkpoint_row(plan: Plan) -> Row:
  mesh = sharding.mesh_from_config(sharding.MeshConfig(data=-1, fsdp=1, tensor=1))
  cfg = preset(plan, "base" if not plan.tiny else "tiny")
  built = common.build_train_step(common.train_config(cfg), mesh=mesh)
  with tempfile.TemporaryDirectory(prefix="accelerator_check_ckpt_") as directory:
    start = time.perf_counter()
    with checkpoint_lib.Checkpointer(directory, enable_async_checkpointing=True) as checkpointer:
      checkpointer.save(1, built.state, built.rng, {"epoch": 0, "index": 0}, {"accelerator_check": True})
      checkpointer.wait()
      save_s = time.perf_counter() - start
      restored = checkpointer.restore_latest_complete(sharding.abstract_state(built.state))
    restore_s = time.perf_counter() - start - save_s
  saved_leaves, restored_leaves = (jax.tree_util.tree_leaves(t) for t in (built.state, restored.state))
  same_values = all(np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
                    for a, b in zip(saved_leaves, restored_leaves))
  same_shardings = all(a.sharding == b.sharding for a, b in zip(saved_leaves, restored_leaves))
  same_rng = bool(np.array_equal(jax.random.key_data(built.rng), jax.random.key_data(restored.rng)))
  ok = same_values and same_shardings and same_rng and restored.step == 1
  return Row("checkpoint", f"{'base' if not plan.tiny else 'tiny'} train state on mesh {dict(mesh.shape)}",
             "ok" if ok else "failed",
             f"{'bitwise equal, same shardings' if ok else 'MISMATCH'}; save {save_s:.1f} s, restore {restore_s:.1f} s",
             {"same_values": same_values, "same_shardings": same_shardings, "same_rng": same_rng,
              "save_s": save_s, "restore_s": restore_s, "leaves": len(saved_leaves)})


# ------------------------------------------------------------------------------------------------------------
# The program
# ------------------------------------------------------------------------------------------------------------

def run_check(plan: Plan, skip: set[str]) -> list[Row]:
  """Every section in order (a skipped one is a `refused` row); each row printed as it is measured."""
  rows: list[Row] = []

  def add(section: str, item: str, fn: Callable[[], Row | list[Row]]) -> None:
    start = time.perf_counter()
    new = [Row(section, item, "refused", "skipped (--skip)")] if section in skip else guarded(section, item, fn)
    for row in new:
      row.detail["section_seconds"] = time.perf_counter() - start
      print(format_row(row), flush=True)
    rows.extend(new)

  add("devices", "seen", lambda: devices_rows(plan))
  add("matmul", f"bf16 {plan.matmul_n}^2", lambda: matmul_row(plan))
  matmul = next((r.detail["tflops"] for r in rows if r.section == "matmul" and r.status == "ok"), None)
  for name in ("base", "big"):
    if name not in plan.presets:
      add("train", f"{name} bf16", refuse(f"--tiny (or a CPU): the {name} preset is not run"))
  for name in plan.presets:
    add("train", f"{name} bf16", lambda name=name: train_row(plan, name, matmul))
  add("attention", "xla vs cudnn", lambda: attention_rows(plan))
  add("decode", "greedy, beam 4", lambda: decode_rows(plan))
  add("number_words", "train + test", lambda: number_words_row(plan))
  add("checkpoint", "save/restore", lambda: checkpoint_row(plan))
  return rows


def format_row(row: Row) -> str:
  return f"{row.section:13s} {row.item:50s} {row.status:8s} {row.value}"


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module)."""
  flags.DEFINE_bool("tiny", False, "CPU sizes (automatic when JAX sees only CPUs)")
  flags.DEFINE_string("output", "", "JSON path; default runs/accelerator_check/<platform>-<time>.json")
  flags.DEFINE_list("skip", [], f"comma-separated sections to skip, of {','.join(SECTIONS)}")
  launch.check_list_choices("skip", SECTIONS)


@launch.program
def main() -> int:
  skip = set(FLAGS.skip)
  platform = jax.devices()[0].platform
  plan = TINY if FLAGS.tiny or platform == "cpu" else Plan(tiny=False)
  output = FLAGS.output or os.path.join(common.REPO, "runs", "accelerator_check",
                                        f"{platform}-{time.strftime('%Y%m%d-%H%M%S')}.json")
  start = time.perf_counter()
  print(f"{'section':13s} {'item':50s} {'status':8s} value", flush=True)
  rows = run_check(plan, skip)
  seconds = time.perf_counter() - start
  common.dump_json({"machine": launch.machine_info(), "tiny": plan.tiny, "plan": dataclasses.asdict(plan),
                    "seconds": seconds, "rows": [dataclasses.asdict(r) for r in rows]}, output)
  failed = [r for r in rows if r.status == "failed"]
  print(f"{len(rows)} rows: {sum(r.status == 'ok' for r in rows)} ok, "
        f"{sum(r.status == 'refused' for r in rows)} refused, {len(failed)} failed in {seconds:.0f} s; {output}")
  return 1 if failed else 0


if __name__ == "__main__":
  define_flags()
  launch.run(main)
