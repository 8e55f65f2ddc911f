r"""The benchmark suite: one command, a table on stdout, JSON, plots and the table in docs/performance.md.

    python -m benchmarks.run            # full suite (~15 min on 2 cores)
    python -m benchmarks.run --quick    # smoke run (~2-3 min): CPU preset only, few steps
    python -m benchmarks.run --sections=machine,train_tiny,peers_tiny --notorch --noflax
    make bench BENCH_ARGS="--quick --sections=machine,decode"

Every timed JAX training step is the trainer's own compiled step (`factories.create_state` +
`factories.make_train_step` of `experiments/configs/default.py` with the preset's sizes, one-device mesh:
`common.build_train_step`; tests/test_benchmarks.py proves it is the program `experiments.train` runs).

Sections (each in its own process, so peak memory is per configuration):
  machine       the fp32 matmul rate XLA reaches (1024^2, 2048^2, 4096^2), measured first
  train_tiny    CPU preset (`config.tiny`), and
  train_base    base preset (`config.base`, 37k vocabulary): 4096 target slots/batch packed from multi30k
                (rows of 64), real tokens/s, step time (median of >= 20 steps), compile time, peak RSS,
                analytic model FLOP/s vs the matmul rate of the same rounds, and ablations that undo one
                library speed-up each (benchmarks/ablations.py), plus the host data pipeline's
                tokens/s on the same config
  hugepages_off the CPU-preset step again in a process without glibc huge pages (launch/huge_pages.py)
  peers_tiny    ours, the Flax example's model (flax examples/wmt/models.py, downloaded into the bench cache)
  peers_base    and PyTorch `nn.Transformer` (eager), each alone in its own process, on two batch kinds:
                packed multi30k (as train_*) and plain full rows of random ids (32x64 tiny, 16x256 base:
                no padding, so no peer pays for masks it does not need)
  decode        greedy and beam 4 over 500 multi30k test sources (CPU preset), cached vs uncached, the
                encoder alone, compilations per file
  scaling       step time vs row length 64..512 (fixed 4096 tokens/batch) and vs tokens/batch
  ctranslate2   our greedy and beam 4 vs CTranslate2 fp32 and int8 on the same model (base preset, random
                init) and the same 500 test2016 sources, 2 CTranslate2 threads (needs the interop extra)
  long_inputs   step time and peak memory vs length 512..16,384 (one row, CPU preset) for full, windowed
                and chunked attention, one process per point; the longest length each fits in 16 GiB
                (benchmarks/long_inputs.py)

Needs `pip install -e '.[bench]'` for the PyTorch peer (skipped with a note otherwise) and PyPI (or a cached
copy) for the Flax example (`python -m benchmarks.flax_peer`; the run stops with one line
otherwise, `--noflax` skips it). Not part of the tests. Flags are absl's (`--help` lists them); a bad value is
one line, `error: ...`, and exit status 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import launch
from benchmarks import common, flax_peer
from launch import docblock

FLAGS = flags.FLAGS

DOC = common.REPO / "docs" / "performance.md"
PLOTS = common.REPO / "docs" / "benchmarks"
DEFAULT_JSON = common.REPO / "runs" / "benchmarks" / "results.json"
TABLE_BLOCK = "bench:table"  # <!-- bench:table:start --> ... <!-- bench:table:end --> in DOC

TINY_VARIANTS = "flax_dropout,autodiff_logits,autodiff_loss,unoptimized,no_dropout"
BASE_VARIANTS = "unoptimized"
ALL_SECTIONS = ["machine", "train_tiny", "hugepages_off", "train_base", "peers_tiny", "peers_base", "decode",
                "scaling", "ctranslate2", "long_inputs"]
PEER_FRAMEWORKS = ("ours", "flax", "torch")
PEER_KINDS = ("packed", "plain")
# Plain batches: one shape of full rows per preset (rows x length per side); packed: 4096 slots in rows of 64.
PLAIN_SHAPE = {"tiny": (32, 64), "base": (16, 256)}
# Timed steps per peer process: rounds x block after `warmup` untimed steps (the first one compiles).
PEER_STEPS = {"tiny": dict(rounds=4, block=3, warmup=2), "base": dict(rounds=2, block=2, warmup=1)}


def section_args(name: str, quick: bool) -> list[str]:
  if name == "machine":
    return ["--section=machine", "--reps=3", "--quick"] if quick else ["--section=machine", "--reps=10"]
  if name == "train_tiny":
    if quick:
      return ["--section=train", "--preset=tiny", "--steps=4", "--block=2", "--variants=unoptimized"]
    # 30 library steps (3 per round: a robust per-round median); each ablation takes 1.
    return ["--section=train", "--preset=tiny", "--steps=30", "--block=3", "--variant_block=1",
            f"--variants={TINY_VARIANTS}"]
  if name == "train_base":
    # 20 library steps (4 per round); the ablation takes 1 step per round.
    return ["--section=train", "--preset=base", "--vocab=37000", "--steps=4" if quick else "--steps=20",
            "--block=2" if quick else "--block=4", "--variant_block=1", "--warmup=1",
            f"--variants={BASE_VARIANTS}"]
  if name == "hugepages_off":
    return ["--section=train", "--preset=tiny", "--steps=4" if quick else "--steps=10", "--block=2"]
  if name == "decode":
    if quick:
      return ["--section=decode", "--sources=48", "--rounds=1", "--subset=8"]
    return ["--section=decode", "--sources=500", "--rounds=2", "--subset=32"]
  if name == "ctranslate2":
    if quick:
      return ["--section=ctranslate2", "--preset=tiny", "--sources=16", "--rounds=1", "--threads=2"]
    return ["--section=ctranslate2", "--preset=base", "--sources=500", "--rounds=1", "--threads=2",
            "--fixed_sources=32", "--fixed_len=50"]
  if name == "scaling":
    if quick:
      return ["--section=scaling", "--lengths=64,256", "--batch_tokens=2048", "--rounds=1", "--block=2"]
    return ["--section=scaling", "--lengths=64,128,256,512", "--batch_tokens=1024,2048,4096,8192", "--rounds=3",
            "--block=2"]
  if name == "long_inputs":
    if quick:
      return ["--section=long_inputs", "--lengths=256,512,1024", "--steps=2", "--budget_s=20", "--vocab=8192"]
    return ["--section=long_inputs", "--lengths=512,1024,2048,4096,8192,16384", "--steps=3", "--budget_s=90",
            "--vocab=8192", "--limit_gib=16"]
  raise ValueError(name)


def peer_args(preset: str, kind: str, framework: str, quick: bool) -> list[str]:
  """`sections peer` arguments of one framework on one batch kind of `preset`."""
  steps = dict(rounds=1, block=2, warmup=1) if quick else PEER_STEPS[preset]
  rows, length = PLAIN_SHAPE[preset]
  args = ["--section=peer", f"--preset={preset}", f"--kind={kind}", f"--framework={framework}",
          f"--rounds={steps['rounds']}", f"--block={steps['block']}", f"--warmup={steps['warmup']}",
          "--num_batches=4", f"--rows={rows}", f"--length={length}"]
  return args + (["--vocab=37000"] if preset == "base" else [])


def _run_process(label: str, args: list[str], out: str, env=None) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.sections"] + args + [f"--out={out}"]
  print(f"== {label}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=common.REPO, env=env)
  if proc.returncode != 0 or not os.path.exists(out):
    return {"error": f"exit code {proc.returncode}", "wall_s": time.perf_counter() - start}
  with open(out) as f:
    result = json.load(f)
  result["wall_s"] = time.perf_counter() - start
  return result


def run_peers(preset: str, quick: bool, frameworks: list[str], tmp: str) -> dict:
  """Every framework on both batch kinds, each in its own process; ratios ours/peer of real tokens/s."""
  start = time.perf_counter()
  kinds = {}
  for kind in PEER_KINDS:
    kinds[kind] = {}
    for fw in frameworks:
      # torch's idle OpenMP workers would spin between steps and slow the process's matmul probe; passive
      # waiting leaves torch's own step time unchanged.
      env = (dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
             if fw == "torch" else None)
      kinds[kind][fw] = _run_process(f"peers_{preset} {kind} {fw}", peer_args(preset, kind, fw, quick),
                                     os.path.join(tmp, f"peer_{preset}_{kind}_{fw}.json"), env)
    ours = kinds[kind].get("ours", {})
    for fw, r in kinds[kind].items():
      if fw != "ours" and "step_s" in r and "step_s" in ours:
        ours[f"ratio_vs_{fw}"] = ours["target_tokens_per_s"] / r["target_tokens_per_s"]
  failed = [f"{k}/{fw}" for k, v in kinds.items() for fw, r in v.items() if "error" in r]
  out = {"preset": preset, "kinds": kinds, "frameworks": frameworks, "wall_s": time.perf_counter() - start}
  if failed:
    out["error"] = f"peer processes failed: {failed}"
  return out


def run_section(name: str, quick: bool, frameworks: list[str], tmp: str) -> dict:
  if name.startswith("peers_"):
    return run_peers(name.split("_", 1)[1], quick, frameworks, tmp)
  env = None
  if name == "hugepages_off":  # this package re-executes with huge pages unless told not to
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t and "hugetlb" not in t]
    env = dict(os.environ, GLIBC_TUNABLES=":".join(tunables), TRANSFORMER_JAX_HUGE_PAGES="0")
  return _run_process(name, section_args(name, quick), os.path.join(tmp, f"{name}.json"), env)


# ----------------------------------------------------------------------------------------------------------
# Quiet rounds: the machine is shared; a round whose matmul probe reached >= QUIET x the section's best
# probe ran on an (almost) uncontended machine. Medians over those rounds are reported beside all rounds.
# ----------------------------------------------------------------------------------------------------------

QUIET = 0.8


def _per_round(t: dict) -> dict:
  """Per-round median step time of every runner (reconstructed from the step lists of older results)."""
  if "per_round" in t:
    return t["per_round"]
  rounds = len(t["matmul_flops_samples"])
  out = {"matmul": t["matmul_flops_samples"]}
  runners = dict(t["jax"])
  for name in ("torch", "torch_1thread"):
    if name in t and "step_s_all" in t[name]:
      runners[name] = t[name]
  for name, r in runners.items():
    times = r["step_s_all"]
    if len(times) % rounds == 0:
      k = len(times) // rounds
      out[name] = [common.median(times[i * k:(i + 1) * k]) for i in range(rounds)]
  return out


def add_quiet_round_stats(t: dict) -> None:
  pr = _per_round(t)
  mm = pr["matmul"]
  quiet = [i for i, m in enumerate(mm) if m >= QUIET * max(mm)]
  flops = t["flops_per_step"]["total"]
  stats = {"rounds": len(mm), "quiet_rounds": quiet, "threshold_flops": QUIET * max(mm),
           "matmul_flops": common.median([mm[i] for i in quiet])}
  for name in t["jax"]:
    if name not in pr:
      continue
    steps = pr[name]
    entry = {"step_s": common.median([steps[i] for i in quiet]),
             "mfu_vs_matmul": common.median([flops / steps[i] / mm[i] for i in quiet]),
             "mfu_vs_matmul_all_rounds": common.median([flops / s / m for s, m in zip(steps, mm)]),
             "speedup_vs_baseline": common.median([pr["baseline"][i] / steps[i] for i in quiet])}
    for peer in ("torch", "torch_1thread"):
      if peer in pr:
        entry[f"speedup_vs_{peer}"] = common.median([pr[peer][i] / steps[i] for i in quiet])
    stats[name] = entry
  for peer in ("torch", "torch_1thread"):
    if peer in pr:
      stats[peer] = {"step_s": common.median([pr[peer][i] for i in quiet]),
                     "mfu_vs_matmul_all_rounds": common.median([flops / s / m for s, m in zip(pr[peer], mm)])}
  t["quiet"] = stats


# ----------------------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------------------

def _g(x, digits=0):
  return "n/a" if x is None or x != x else f"{x:,.{digits}f}"


def _pct(x):
  return "n/a" if x is None or x != x else f"{100 * x:.0f}%"


def _x(x, digits=2):
  return "n/a" if x is None or x != x else f"{x:.{digits}f}x"


def _render_machine(results: dict) -> list[str]:
  """Section 1: the machine and its matmul rate."""
  lines = []
  m = results.get("machine", {})
  info = m.get("machine", {})
  if info:
    lines += [f"Machine: {info.get('cpu_model', '?')}, {info.get('logical_cpus', '?')} logical CPUs "
              f"({info.get('sockets', '?')} socket x {info.get('cores_per_socket', '?')} cores x "
              f"{info.get('threads_per_core', '?')} threads), SIMD: {info.get('simd', '?')}; "
              f"jax {info.get('jax', '?')}, flax {info.get('flax', '?')}; {info.get('date', '?')}; "
              f"load average at start {info.get('load_average_at_start', '?')}", ""]
  if "matmul" in m:
    lines += ["**1. Machine limit** (jitted fp32 `a @ b`, median of the timed calls)", "",
              "| matmul | GFLOP/s (median) | GFLOP/s (best) |", "|---|---|---|"]
    for n, v in m["matmul"].items():
      lines.append(f"| {n}x{n} | {_g(v['median_flops'] / 1e9)} | {_g(v['max_flops'] / 1e9)} |")
    lines.append("")
  return lines


def _render_training(results: dict) -> list[str]:
  """Section 2: the trainer's step per preset, then the ablations."""
  lines = []
  trains = [(k, v) for k, v in results.items() if k.startswith("train_") and "jax" in v]
  if trains:
    lines += ["**2. Training** (the trainer's own compiled step, `factories.make_train_step`, on packed multi30k "
              "batches; each row's numbers come from interleaved rounds: ours, the ablations and a 2048² "
              "matmul probe take turns, so the load of the shared machine cancels out of the ratios)", "",
              "| preset | params | batch (real src/tgt tokens) | step (median, n) | compile | peak RSS | "
              "real tgt tok/s | model GFLOP/s | MFU vs (1) | matmul GFLOP/s (same rounds) | "
              "MFU vs same-round probe (quiet rounds) | ours vs unoptimized (quiet) | "
              "unoptimized MFU (quiet) | pipeline tok/s (x training) |",
              "|" + "---|" * 14]
    for name, t in trains:
      b, c = t["jax"]["baseline"], t["config"]
      params = t.get("params") or _params(c)
      unopt = t["jax"].get("unoptimized", {})
      q = t.get("quiet", {})
      qb, qu = q.get("baseline", {}), q.get("unoptimized", {})
      lines.append(
          f"| {t['preset']} (d={c['d_model']}, V={c['vocab_size']}) | {params / 1e6:.1f}M | "
          f"{t['rows']}x{t['row_length']} ({_g(t['real_tokens_per_batch']['source'])}/"
          f"{_g(t['real_tokens_per_batch']['target'])}) | {b['step_s']:.3f}s ({b['steps']}) | "
          f"{b['lower_s'] + b['compile_s']:.1f}s | {_g(t['peak_rss_mb'])} MB | "
          f"{_g(b['target_tokens_per_s'])} | {_g(b['model_flops_per_s'] / 1e9, 1)} | "
          f"**{_pct(mfu_vs_machine(results, t))}** | "
          f"{_g(t['matmul_flops'] / 1e9)} | {_pct(qb.get('mfu_vs_matmul_all_rounds'))} "
          f"({_pct(qb.get('mfu_vs_matmul'))}) | "
          f"{_x(_inverse(unopt.get('speedup_vs_baseline')))} ({_x(_inverse(qu.get('speedup_vs_baseline')))}) | "
          f"{_pct(qu.get('mfu_vs_matmul_all_rounds'))} ({_pct(qu.get('mfu_vs_matmul'))}) | "
          f"{_g(t['pipeline']['target_tokens_per_s'])} ({_x(t['pipeline']['ratio_vs_training'], 0)}) |")
    rate, source = machine_rate(results)
    lines += ["", f"MFU vs (1) = analytic model FLOP/s at the median step / the 2048² matmul rate of "
              f"section 1 ({_g(rate / 1e9)} GFLOP/s, {source}): the issue's definition. MFU vs same-round "
              "probe = the same per round against that round's 2048² probe, median over rounds (robust to "
              "load that slows both, but the probe reads low in a process that also holds a large step, "
              "so it flatters); "
              f"quiet rounds = rounds whose matmul probe reached >= {QUIET:.0%} of the section's best probe "
              "(the machine was not contended): " + "; ".join(
                  f"{t['preset']}: {len(t['quiet']['quiet_rounds'])} of {t['quiet']['rounds']}, matmul "
                  f"{_g(t['quiet']['matmul_flops'] / 1e9)} GFLOP/s" for _, t in trains if "quiet" in t) + ".",
              "", "Ablations (benchmarks/ablations.py): each undoes one of the library's speed-ups; "
              "the library's speed-up = the variant's step time / the library's, same rounds (all rounds; "
              "quiet rounds). `no_dropout` is a reference (P_drop = 0), not an ablation:", "",
              "| variant | " + " | ".join(t["preset"] for _, t in trains) + " |",
              "|---|" + "---|" * len(trains)]
    names = []
    for _, t in trains:
      names += [n for n in t["jax"] if n not in names and n != "baseline"]
    for n in names:
      cells = [f"{_x(_inverse(t['jax'][n]['speedup_vs_baseline']))}; "
               f"{_x(_inverse(t.get('quiet', {}).get(n, {}).get('speedup_vs_baseline')))}" if n in t["jax"]
               else "-" for _, t in trains]
      lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
  return lines


def _render_huge_pages(results: dict) -> list[str]:
  """The tiny step without huge pages against the same with them."""
  lines = []
  h, tiny = results.get("hugepages_off", {}), results.get("train_tiny", {})
  if "jax" in h and "jax" in tiny:
    off, on = h["jax"]["baseline"], tiny["jax"]["baseline"]
    lines += [f"Huge pages (glibc.malloc.hugetlb=1, launch/huge_pages.py): the tiny step in a process "
              f"without them (`hugepages_off`, run right after, {off['steps']} steps): {off['step_s']:.3f}s vs "
              f"{on['step_s']:.3f}s with them: {off['step_s'] / on['step_s']:.2f}x; MFU vs (1) "
              f"{_pct(mfu_vs_machine(results, h))} vs {_pct(mfu_vs_machine(results, tiny))}. (Without huge "
              f"pages the in-process probe reads {_g(h['matmul_flops'] / 1e9)} vs {_g(tiny['matmul_flops'] / 1e9)} "
              "GFLOP/s: its 16 MB output is page-faulted too.)", ""]
  return lines


def _render_decoding(d: dict) -> list[str]:
  """Section 4: greedy and beam 4 over the file, cached vs uncached, the toolkit."""
  lines = []
  if "beam4" in d:
    lines += [f"**4. Decoding** ({d['preset']} preset, random init, {d['sources']} multi30k test2016 sources, "
              f"length {d['source_len']['min']}-{d['source_len']['max']} (mean {d['source_len']['mean']:.1f}), "
              f"outputs capped at len(source)+{d['extra_len']}; `translate_ids`, {d['max_tokens_per_batch']} "
              "source tokens/batch)", "",
              "| search | sentences/s | output tokens/s | mean output len | file time | compilations "
              "(1st pass / later) | encoder share | uncached file time (extrapolated) |", "|" + "---|" * 8]
    for key in ("greedy", "beam4"):
      s, c = d[key], d["cache"][key]
      lines.append(f"| {key} | {s['sentences_per_s']:.1f} | {_g(s['tokens_per_s'])} | "
                   f"{s['mean_output_len']:.1f} | {s['file_s']:.1f}s | {s['compilations_first_pass']} / "
                   f"{s['compilations_later_passes']} ({s['batches']} batches) | {_pct(s['encoder_share'])} | "
                   f"{c['file_uncached_s_extrapolated']:.0f}s |")
    c = d["cache"]
    lines += ["", f"Encoder alone over the file: {d['encoder']['file_s']:.3f}s "
              f"({_g(d['encoder']['sentences_per_s'])} sentences/s).", "",
              f"Cached vs uncached, measured on {c['subset_sources']} sources (bucket {c['bucket']}), exactly "
              f"{c['output_len']} output tokens each (early_stop='none'):", "",
              "| search | cached | uncached | cached/uncached speedup | same tokens |",
              "|---|---|---|---|---|"]
    for key in ("greedy", "beam4"):
      e = c[key]
      lines.append(f"| {key} | {e['cached_s']:.3f}s ({_g(e['cached_tokens_per_s'])} tok/s) | "
                   f"{e['uncached_s']:.3f}s ({_g(e['uncached_tokens_per_s'])} tok/s) | {_x(e['speedup'], 1)} | "
                   f"{d.get('cached_same_tokens', {}).get(key, 'n/a')} |")
    lines.append("")
    if "toolkit" in d:
      t = d["toolkit"]
      toks = t.get("output_tokens_vs_beam4", {})
      lines += ["Decoding toolkit (`inference.decode_ids`, same file and rounds, interleaved with plain beam 4): "
                + ", ".join(f"{name} {t['file_s'][name]:.1f}s = {_x(r)} beam 4"
                            + (f" (1-best output tokens {_x(toks[name])})" if name in toks else "")
                            for name, r in t["ratios"].items()) + ".", ""]
  return lines


def _render_scaling(s: dict) -> list[str]:
  """Section 5: step time vs row length and vs tokens per batch."""
  lines = []
  if "points" in s:
    lines += [f"**5. Scaling** ({s['preset']} preset, packed multi30k, step time relative to the first row)", "",
              "| sweep | row length | tokens/batch | rows | step | step rel. | analytic FLOPs rel. | "
              "attention share of FLOPs | real tgt tok/s | MFU |", "|" + "---|" * 10]
    for p in s["points"]:
      lines.append(f"| {p['kind']} | {p['row_length']} | {p['tokens_per_batch']} | {p['rows']} | "
                   f"{p['step_s']:.3f}s | {p['step_s_rel']:.2f} | {p['flops_rel']:.2f} | "
                   f"{_pct(p['attention_share_flops'])} | {_g(p['target_tokens_per_s'])} | "
                   f"{_pct(p['mfu_vs_matmul'])} |")
    lines.append("")
  return lines


def render(results: dict) -> str:
  """The benchmark's Markdown report: one block per section that `results` holds, then the targets."""
  lines = [*_render_machine(results), *_render_training(results), *render_peers(results),
           *_render_huge_pages(results), *_render_decoding(results.get("decode", {})),
           *_render_ctranslate2(results.get("ctranslate2", {})), *_render_scaling(results.get("scaling", {})),
           *render_long_inputs(results.get("long_inputs", {})), *targets(results)]
  return "\n".join(lines)


def render_long_inputs(s: dict) -> list[str]:
  """Section 6: one row per (mode, length), then the longest length each mode fits and the target."""
  if "points" not in s:
    return []
  lines = [f"**6. Long inputs** ({s['preset']} preset, one row of L source + L target tokens, vocabulary "
           f"{s['vocab_size']}; peak RSS of a fresh process per point; limit {s['memory_limit_gib']:g} GiB)", "",
           "| mode | options | length | step | s per 1k target tokens | peak RSS | XLA buffers | fits |",
           "|" + "---|" * 8]
  for p in s["points"]:
    step = f"{p['step_s']:.3f}s ({p['steps']})" if p.get("step_s") else "-"
    per_1k = f"{p['seconds_per_1k_target_tokens']:.3f}" if p.get("step_s") else "-"
    rss = f"{p['peak_rss_gib']:.2f} GiB" if p.get("peak_rss_gib") else "-"
    xla = f"{p['predicted_gib']:.2f} GiB" if "predicted_gib" in p else "-"
    fits = "yes" if p["fits"] else f"no ({p.get('reason', '')})"
    options = ", ".join(f"{k}={v}" for k, v in p.get("options", {}).items()) or "defaults (fused)"
    lines.append(f"| {p['mode']} | {options} | {p['length']:,} | {step} | {per_1k} | {rss} | "
                 f"{xla} | {fits} |")
  lines += ["", "Longest measured length that fits: " + ", ".join(
      f"{m} {L:,}" for m, L in s["longest_fitting"].items()) + "."]
  t = s.get("targets", {})
  ratio = t.get("chunked_over_full_per_token_at_1k")
  if ratio is not None:
    lines.append(f"Chunked vs full time per token at 1k: {ratio:.2f}x (target <= 1.5x).")
  long_ratio = t.get("chunked_longest_per_token_over_full_1k")
  if long_ratio is not None:
    lines.append(f"Chunked at its longest length vs full at 1k, time per token: {long_ratio:.2f}x (attention's "
                 "O(L) cost per token grows with L; the chunking itself is what the 1k ratio measures).")
  return lines + [""]


PEER_NAMES = {"ours": "ours (trainer's step)", "flax": "Flax example (examples/wmt)",
              "torch": "PyTorch nn.Transformer (eager)"}


def _peer_row(results: dict, preset: str, kind: str, fw: str, r: dict, ours: dict) -> str:
  if "step_s" not in r:
    return f"| {preset} | {kind} | - | {PEER_NAMES.get(fw, fw)} | {r.get('error', 'n/a')} |" + " |" * 6
  rate = machine_rate(results)[0]
  ratio = (ours["target_tokens_per_s"] / r["target_tokens_per_s"]) if "step_s" in ours and fw != "ours" else None
  return (f"| {preset} | {kind} | {r['rows']}x{r['row_length']} ({_g(r['real_tokens_per_batch']['target'])}) | "
          f"{PEER_NAMES.get(fw, fw)} | {r['step_s']:.3f}s ({r['steps']}) | {_g(r['target_tokens_per_s'])} | "
          f"{_x(ratio) if ratio else '-'} | **{_pct(r['model_flops_per_s'] / rate)}** | "
          f"{_pct(r['mfu_vs_same_process_probe'])} | {_g(r['matmul_flops'] / 1e9)} | "
          f"{r['setup_s'] + r['warmup_s']:.1f}s |")


def render_peers(results: dict) -> list[str]:
  """Section 3: every framework alone in its own process, packed and plain batches, ratios ours/peer."""
  peers = [(k, v) for k, v in results.items() if k.startswith("peers_") and "kinds" in v]
  if not peers:
    return []
  lines = ["**3. Peers** (each framework alone in its own process, on the same batches; ours = the trainer's "
           "own compiled step; real target tokens/s and the ratio ours/peer of it)", "",
           "| preset | batch kind | batch (real tgt tokens) | framework | step (median, n) | real tgt tok/s | "
           "ours/peer | MFU vs (1) | MFU vs same-process probe | probe GFLOP/s (same process) | "
           "setup + compile + warm-up |", "|" + "---|" * 11]
  for _, p in peers:
    for kind in PEER_KINDS:
      runs = p["kinds"].get(kind, {})
      for fw, r in runs.items():
        lines.append(_peer_row(results, p["preset"], kind, fw, r, runs.get("ours", {})))
  lines += ["", "Which figure to expect: **packed** is what training real data with this library looks like "
            "(multi30k packed into rows of 64; the Flax example gets its `inputs_segmentation`/"
            "`inputs_positions`, PyTorch boolean `[batch·heads, q, k]` segment masks, which it needs for "
            "packing and which cost it). **plain** (random ids, full rows of one shape, no padding) is the "
            "apples-to-apples kernel comparison: no peer pays for a mask it does not need (PyTorch: the causal "
            "mask only, `tgt_is_causal=True`; Flax example: no segmentation, though it always builds its "
            "`ids > 0` padding masks). Differences that remain: the Flax example is pre-LN and divides the tied "
            "logits by √d instead of scaling embeddings; its loss is one-hot soft targets (ours: fused "
            "smoothed cross-entropy); both peers use Adam(0.9, 0.98, 1e-9) with the rsqrt schedule "
            "(the Flax example's adamw at weight decay 0); `nn.Transformer` adds a final LayerNorm per stack. "
            "Processes run one after another, so load on a shared machine does not cancel out of the ratios "
            "as in section 2: compare each process's probe column."]
  notes = results.get("peer_notes") or []
  if notes:
    lines += ["", "; ".join(notes) + "."]
  return lines + [""]


def machine_rate(results: dict) -> tuple[float, str]:
  """The MFU denominator the issue names: section (1)'s 2048² median (else the section's own probes)."""
  m = results.get("machine", {}).get("matmul", {}).get("2048")
  if m:
    return m["median_flops"], "(1)"
  trains = [t for k, t in results.items() if k.startswith("train_") and "matmul_flops" in t]
  return (trains[0]["matmul_flops"], "same rounds") if trains else (float("nan"), "n/a")


def mfu_vs_machine(results: dict, t: dict, name: str = "baseline") -> float:
  entry = t["jax"].get(name, {})
  return entry.get("model_flops_per_s", float("nan")) / machine_rate(results)[0]


def _inverse(x):
  return None if x is None or x != x or x == 0 else 1.0 / x


def _params(c: dict) -> int:
  d, f, v = c["d_model"], c["d_ff"], c["vocab_size"]
  enc = c["num_encoder_layers"] * (4 * (d * d + d) + 2 * d * f + f + d + 4 * d)
  dec = c["num_decoder_layers"] * (8 * (d * d + d) + 2 * d * f + f + d + 6 * d)
  return v * d + enc + dec


def targets(results: dict) -> list[str]:
  rows = []
  for preset, goal in (("base", 0.60), ("tiny", 0.40)):
    t = results.get(f"train_{preset}", {})
    if "jax" in t:
      q = t.get("quiet", {})
      b = q.get("baseline", {})
      mfu = mfu_vs_machine(results, t)
      rows.append((f"training step {preset} preset >= {goal:.0%} of the matmul rate of (1) (vs same-round "
                   "probes, quiet rounds)", f"{_pct(mfu)} ({_pct(b.get('mfu_vs_matmul'))})", mfu >= goal,
                   _pct(mfu_vs_machine(results, t, "unoptimized"))))
  for preset in ("tiny", "base"):
    t = results.get(f"train_{preset}", {})
    kinds = results.get(f"peers_{preset}", {}).get("kinds", {})
    for peer, label in (("torch", "PyTorch"),):  # the Flax example's ratio is in section 3 (no target)
      ratios = {kind: kinds.get(kind, {}).get("ours", {}).get(f"ratio_vs_{peer}") for kind in PEER_KINDS}
      if ratios["packed"] is not None:
        rows.append((f">= 1.2x {label} real tokens/s ({preset}; packed; plain)",
                     f"{_x(ratios['packed'])}; {_x(ratios['plain'])}", ratios["packed"] >= 1.2, ""))
    if "pipeline" in t:
      r = t["pipeline"]["ratio_vs_training"]
      rows.append((f"data pipeline >= 3x training tokens/s ({preset})", _x(r, 0), r >= 3, ""))
  li = results.get("long_inputs", {}).get("targets", {})
  if "chunked_over_full_per_token_at_1k" in li:
    r = li["chunked_over_full_per_token_at_1k"]
    ok = li["chunked_fits_16k"] and not li["full_fits_16k"] and r <= 1.5
    rows.append(("chunked attention trains at 16k where full cannot, within 1.5x of full's time per token at 1k",
                 f"chunked fits 16k: {li['chunked_fits_16k']}, full: {li['full_fits_16k']}; {_x(r)}", ok, ""))
  d = results.get("decode", {})
  if "cache" in d:
    r = d["cache"]["beam4"]["speedup"]
    rows.append(("beam-4 cached >= 5x uncached (50-token outputs)", _x(r, 1), r >= 5, ""))
  for name, limit, what in (("ensemble2", 2.2, "ensemble of 2"), ("nbest4_scores", 1.1, "4-best list + scores"),
                            ("constrained_beam4", 2.0, "constrained beam 4 (one 2-token phrase)")):
    r = d.get("toolkit", {}).get("ratios", {}).get(name)
    if r is not None:
      rows.append((f"{what} <= {limit}x plain beam 4's time", _x(r), r <= limit, ""))
  fixed = results.get("ctranslate2", {}).get("fixed", {})
  if "ours_vs_ct2_float32_beam4" in fixed:
    r = fixed["ours_vs_ct2_float32_beam4"]
    rows.append((f"beam 4 >= 1.2x CTranslate2 fp32 (fixed shapes: {fixed['sources']} sources x "
                 f"{fixed['output_len']} tokens)", _x(r), r >= 1.2, ""))
  if not rows:
    return []
  out = ["**Targets**", "", "| target | measured | met | unoptimized (ablation) |",
         "|---|---|---|---|"]
  out += [f"| {name} | {value} | {'yes' if ok else 'NO'} | {before} |" for name, value, ok, before in rows]
  return out + [""]


def _render_ctranslate2_fixed(f: dict) -> list[str]:
  """The fixed-shape comparison (`ctranslate2_bench.run_fixed`) as one line."""
  return [f"Fixed shapes ({f['sources']} sources in one batch, source bucket {f['source_bucket']}, every output "
          f"exactly {f['output_len']} tokens, CTranslate2 fp32 {f['ct2_threads']} threads): "
          + ", ".join(f"{s} ours {_g(f['ours_' + s]['tokens_per_s'])} vs {_g(f['ct2_float32_' + s]['tokens_per_s'])} "
                      f"target tok/s = {_x(f['ours_vs_ct2_float32_' + s])}" for s in ("greedy", "beam4")) + ".", ""]


def _render_ctranslate2(c: dict) -> list[str]:
  """Section 6: our searches vs CTranslate2 fp32/int8 (benchmarks/ctranslate2_bench.py)."""
  fixed = _render_ctranslate2_fixed(c["fixed"]) if "fixed" in c else []
  if "ours_greedy" not in c:
    return ([f"**4b. Decoding vs CTranslate2**: {c['error']}", ""] if "error" in c else []) + fixed
  lines = [f"**4b. Decoding vs CTranslate2** ({c['preset']} preset, vocabulary {c['vocab_size']}, random init, "
           f"{c['sources']} multi30k test2016 sources, outputs capped at len(source)+{c['extra_len']}; "
           f"CTranslate2 {c['ct2_threads']} intra-op threads, max_batch_size {c['ct2_max_batch_size']}; "
           f"ours: {c['jax_threads']}, {c['max_tokens_per_batch']} source tokens/batch)", "",
           "| runner | search | sentences/s | target tokens/s | ours / CTranslate2 fp32 |", "|---|---|---|---|---|"]
  for runner in ("ours", "ct2_float32", "ct2_int8"):
    for search in ("greedy", "beam4"):
      r = c[f"{runner}_{search}"]
      ratio = c[f"ours_vs_ct2_float32_{search}"] if runner == "ours" else ""
      lines.append(f"| {runner} | {search} | {r['sentences_per_s']:.1f} | {_g(r['tokens_per_s'])} | "
                   f"{_x(ratio) if ratio != '' else ''} |")
  return lines + [""] + fixed


def update_doc(table: str) -> bool:
  """The generated table in docs/performance.md (between its bench:table markers); False when absent."""
  return DOC.exists() and docblock.replace_block(str(DOC), TABLE_BLOCK, table, append_if_missing=False)


def peer_frameworks(needed: bool, flax: bool, torch: bool) -> tuple[list[str], list[str]]:
  """The peer frameworks to run (`flax`/`torch`: whether the flags ask for them) and notes on the skipped ones.

  Raises ValueError (one line) when the Flax example is wanted but can be neither found in the bench cache nor
  downloaded."""
  frameworks, notes = ["ours"], []
  if needed and flax:
    try:
      notes.append(f"Flax example model: {flax_peer.ensure_example().relative_to(common.REPO)}")
      frameworks.append("flax")
    except flax_peer.ExampleUnavailableError as e:
      raise ValueError(f"{e} (or pass --noflax)") from None
  if torch:
    if importlib.util.find_spec("torch") is None:
      notes.append("PyTorch peer skipped: torch is not installed (pip install -e '.[bench]')")
    else:
      frameworks.append("torch")
  return frameworks, notes


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module)."""
  flags.DEFINE_bool("quick", False, "smoke run: CPU preset only, few steps (~2-3 min)")
  flags.DEFINE_list("sections", [], "comma-separated subset of " + ",".join(ALL_SECTIONS) + " (default: all; "
                    "with --quick all but train_base, hugepages_off, peers_base)")
  flags.DEFINE_string("json", str(DEFAULT_JSON), "where to write the results")
  flags.DEFINE_bool("torch", True, "run the PyTorch peer (--notorch skips it)")
  flags.DEFINE_bool("flax", True, "run the Flax example peer (--noflax skips it: no download)")
  flags.DEFINE_bool("plots", True, "write the plots into docs/benchmarks (--noplots skips them)")
  flags.DEFINE_string("from_json", "", "re-render the table, plots and doc from saved results")
  flags.DEFINE_enum("update_doc", "auto", ["auto", "yes", "no"],
                    "rewrite the table block of docs/performance.md (auto: full runs of every section)")
  launch.check_list_choices("sections", ALL_SECTIONS)


def measure(sections: list[str], quick: bool) -> dict:
  """Runs `sections` (each in its own process), writing partial results to --json after each."""
  frameworks, notes = peer_frameworks(any(s.startswith("peers_") for s in sections), FLAGS.flax, FLAGS.torch)
  start = time.perf_counter()
  results = {"quick": quick, "flops_formula": common.FLOPS_FORMULA, "peer_notes": notes}
  with tempfile.TemporaryDirectory() as tmp:
    for name in sections:
      results[name] = run_section(name, quick, frameworks, tmp)
      common.dump_json(results, FLAGS.json)  # partial results survive an interrupted run
  results["total_wall_s"] = time.perf_counter() - start
  return results


@launch.program
def main() -> int:
  quick = FLAGS.quick
  sections = FLAGS.sections or [s for s in ALL_SECTIONS
                                if not (quick and s in ("train_base", "hugepages_off", "peers_base"))]
  if FLAGS.from_json:
    with open(FLAGS.from_json) as f:
      results = json.load(f)
    sections = [s for s in ALL_SECTIONS if s in results]
    quick = results.get("quick", False)
  else:
    results = measure(sections, quick)
  for name in sections:
    if (name.startswith("train_") or name == "hugepages_off") and "jax" in results[name]:
      add_quiet_round_stats(results[name])
  common.dump_json(results, FLAGS.json)

  table = render(results)
  print()
  print(table)
  print(f"\nTotal {results.get('total_wall_s', float('nan')) / 60:.1f} min. JSON: {FLAGS.json}")
  if FLAGS.plots:
    from benchmarks import plots
    written = plots.write_all(results, PLOTS)
    print("Plots: " + ", ".join(str(Path(p).relative_to(common.REPO)) for p in written))
  full = not quick and set(sections) == set(ALL_SECTIONS)
  if FLAGS.update_doc == "yes" or (FLAGS.update_doc == "auto" and full):
    if update_doc(table):
      print(f"Updated the table in {DOC.relative_to(common.REPO)}")
  failed = [n for n in sections if "error" in results[n]]
  if failed:
    print(f"Sections that failed: {failed}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  define_flags()
  launch.run(main)
