r"""Long inputs: training step time and peak memory against length for full, windowed and chunked attention.

    python -m benchmarks.run --sections=long_inputs            # 512 .. 16,384 tokens
    python -m benchmarks.long_inputs --mode=chunked --length=4096 --out=/tmp/one.json   # one point

One row per batch, `length` source and `length` target tokens (random ids), the CPU preset's sizes
(`config.tiny`: 3+3 layers, d_model 128, 4 heads, d_ff 512). Modes:
  full      the default fused attention (`jax.nn.dot_product_attention`), `[1, heads, L, L]` scores
  windowed  attention_window=256 in self-attention (O(L·w)), cross-attention chunked (query_chunk_size=256)
  chunked   query_chunk_size=512 everywhere: exact attention, O(L·chunk) memory, O(L²) time

Every (mode, length) runs in a fresh process, so its peak memory is its own: the process's peak resident set
(VmHWM of /proc/self/status, compiler and runtime included) after a warm-up step and the timed steps (up
to `--steps`, stopping once `--budget_s` has passed; a warm-up longer than the budget is the one step). Before
running, XLA's buffer assignment for the compiled step (`compiled.memory_analysis()`: arguments + outputs +
temporaries) is checked against the memory limit (16 GiB by default); a step that would not fit is not run and
is reported as not fitting, as is a process that dies. Lengths above a mode's first non-fitting one are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import common  # noqa: E402
import launch  # noqa: E402
from transformer_jax import config as presets  # noqa: E402

MODES = {"full": {}, "windowed": dict(attention_window=256, query_chunk_size=256),
         "chunked": dict(query_chunk_size=512)}
GIB = 2 ** 30


def model_config(mode: str, length: int, vocab_size: int):
  """The CPU preset with the mode's attention options and positions up to `length`."""
  return presets.tiny(vocab_size=vocab_size, max_len=max(length, 256), **MODES[mode])


def _batch(length: int, vocab_size: int) -> dict:
  rng = np.random.default_rng(0)
  ids = lambda: jnp.asarray(rng.integers(4, vocab_size, size=(1, length)), jnp.int32)
  return {"inputs": ids(), "targets": ids()}


def _predicted_bytes(compiled) -> int:
  """XLA's buffer assignment for one step: arguments + outputs + temporaries (what must be resident)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def measure(mode: str, length: int, steps: int, vocab_size: int, limit_bytes: int, budget_s: float) -> dict:
  """One configuration in this process: compile, check the predicted memory, time `steps` train steps."""
  built = common.build_train_step(common.train_config(model_config(mode, length, vocab_size)))  # the trainer's step
  state, rng = built.state, built.rng
  batch = built.shard(_batch(length, vocab_size))
  start = time.perf_counter()
  compiled = built.step.lower(state, batch, rng).compile()
  out = {"mode": mode, "length": length, "compile_s": time.perf_counter() - start,
         "predicted_gib": _predicted_bytes(compiled) / GIB, "options": MODES[mode]}
  if _predicted_bytes(compiled) > limit_bytes:
    return {**out, "fits": False, "reason": f"XLA needs {out['predicted_gib']:.1f} GiB"}
  start = time.perf_counter()
  state, metrics = compiled(state, batch, rng)  # warm-up
  jax.block_until_ready(metrics)
  warmup_s = time.perf_counter() - start
  # A warm-up longer than the budget (minutes at 16k) is itself the measurement: its first-touch costs are
  # negligible at that size, and a second step would double the section's time.
  times = [warmup_s] if warmup_s >= budget_s else []
  start = time.perf_counter()
  while len(times) < steps and (not times or time.perf_counter() - start < budget_s):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  peak = common.peak_rss_mb() * 2 ** 20
  step_s = common.median(times)
  return {**out, "fits": peak <= limit_bytes, "step_s": step_s, "steps": len(times), "step_s_all": times,
          "warmup_s": warmup_s, "timed_warmup": warmup_s >= budget_s,
          "seconds_per_1k_target_tokens": 1000 * step_s / length, "peak_rss_gib": peak / GIB,
          "loss": float(metrics["loss"]), "reason": "" if peak <= limit_bytes else "peak RSS over the limit"}


def sweep(modes, lengths, steps: int, vocab_size: int, limit_gib: float, budget_s: float) -> dict:
  """Every (mode, length) in its own process; a mode stops at its first length that does not fit."""
  points = []
  for mode in modes:
    for length in lengths:
      point = _run_one(mode, length, steps, vocab_size, limit_gib, budget_s)
      points.append(point)
      print(f"[long_inputs] {mode} L={length}: " + (
          f"{point['step_s']:.3f}s/step, peak RSS {point['peak_rss_gib']:.2f} GiB" if point.get("step_s")
          else f"does not fit ({point['reason']})"), file=sys.stderr, flush=True)
      if not point["fits"]:
        break
  longest = {m: max([p["length"] for p in points if p["mode"] == m and p["fits"]], default=0) for m in modes}
  return {"preset": "tiny", "vocab_size": vocab_size, "memory_limit_gib": limit_gib, "modes": MODES,
          "points": points, "longest_fitting": longest, "targets": _targets(points, longest)}


def _run_one(mode, length, steps, vocab_size, limit_gib, budget_s) -> dict:
  out = f"/tmp/long_inputs_{os.getpid()}_{mode}_{length}.json"
  cmd = [sys.executable, "-m", "benchmarks.long_inputs", f"--mode={mode}", f"--length={length}",
         f"--steps={steps}", f"--vocab={vocab_size}", f"--limit_gib={limit_gib}", f"--budget_s={budget_s}",
         f"--out={out}"]
  proc = subprocess.run(cmd, cwd=common.REPO)
  if proc.returncode != 0 or not os.path.exists(out):
    return {"mode": mode, "length": length, "fits": False, "reason": f"process exit code {proc.returncode}"}
  with open(out) as f:
    point = json.load(f)
  os.remove(out)
  return point


def _targets(points, longest) -> dict:
  """The issue's target: chunked trains at 16k where full cannot; chunked vs full time per token at 1k."""
  by = {(p["mode"], p["length"]): p for p in points if p.get("step_s")}
  full_1k, chunked_1k = by.get(("full", 1024)), by.get(("chunked", 1024))
  chunked_long = by.get(("chunked", longest.get("chunked", 0)))
  result = {"chunked_fits_16k": longest.get("chunked", 0) >= 16384,
            "full_fits_16k": longest.get("full", 0) >= 16384}
  if full_1k and chunked_1k:
    result["chunked_over_full_per_token_at_1k"] = chunked_1k["step_s"] / full_1k["step_s"]
  if full_1k and chunked_long:
    result["chunked_longest_per_token_over_full_1k"] = (
        chunked_long["seconds_per_1k_target_tokens"] / full_1k["seconds_per_1k_target_tokens"])
  return result


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: the sections import this module)."""
  flags.DEFINE_enum("mode", None, sorted(MODES), "attention mode of the point")
  flags.DEFINE_integer("length", None, "source and target tokens of the one row", lower_bound=1)
  flags.DEFINE_integer("steps", 3, "timed steps (at most)", lower_bound=1)
  flags.DEFINE_integer("vocab", 8192, "vocabulary size")
  flags.DEFINE_float("limit_gib", 16.0, "the memory the point may use (GiB)")
  flags.DEFINE_float("budget_s", 60.0, "stop timing after this long (>= 1 step)")
  flags.DEFINE_string("out", None, "the JSON file the point goes to")
  flags.mark_flags_as_required(["mode", "length", "out"])


@launch.program
def main() -> None:
  result = measure(FLAGS.mode, FLAGS.length, FLAGS.steps, FLAGS.vocab, int(FLAGS.limit_gib * GIB), FLAGS.budget_s)
  common.dump_json(result, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  launch.run(main)
