r"""The benchmark sections; each runs in its own process (`run.py` starts them) and writes one JSON file.

    python -m experiments.benchmarks.sections machine  --out=/tmp/m.json
    python -m experiments.benchmarks.sections train    --out=/tmp/t.json --preset=tiny --steps=20 --torch
    python -m experiments.benchmarks.sections decode   --out=/tmp/d.json --sources=500
    python -m experiments.benchmarks.sections scaling  --out=/tmp/s.json

The machine is shared, so nothing is timed alone: every section interleaves what it compares in rounds
(ours, the peer, the ablation variants, the data pipeline and a 2048^2 matmul probe take turns inside each
round) and reports medians and ratios of medians measured in the same rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.benchmarks import common  # noqa: E402
from transformer_jax import config as presets  # noqa: E402


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def preset_config(preset: str, vocab_size: int):
  return {"tiny": presets.tiny, "base": presets.base, "big": presets.big}[preset](vocab_size=vocab_size)


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------
# 1. Machine limit
# ----------------------------------------------------------------------------------------------------------

def machine(args) -> dict:
  out = {"machine": common.machine_info(), "matmul": {}}
  for n in (1024, 2048, 4096):
    if n == 4096 and args.quick:
      continue
    probe = common.MatmulProbe(n)
    for _ in range(args.reps):
      probe.rate(1)
    out["matmul"][str(n)] = {"median_flops": probe.median(), "max_flops": max(probe.samples),
                             "reps": args.reps}
  out["matmul_flops"] = out["matmul"]["2048"]["median_flops"]
  return out


# ----------------------------------------------------------------------------------------------------------
# 2./3. Training (ours, ablation variants, the torch peer) + the host data pipeline, interleaved
# ----------------------------------------------------------------------------------------------------------

def _device_batch(batch):
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _batch_tokens(batch) -> tuple[int, int]:
  return int((batch["inputs"] != 0).sum()), int((batch["targets"] != 0).sum())


class _Pipeline:
  """Times `PackedBatches` batch building: epoch planning (amortised) + `build_packed_batch` per batch."""

  def __init__(self, corpus, tokens_per_batch, row_length):
    from transformer_jax.data.pipeline import PackedBatches
    self.batches = PackedBatches(corpus.sources, corpus.targets, tokens_per_batch=tokens_per_batch,
                                 row_length=row_length, seed=0)
    _, self.plan_s = _timed(lambda: self.batches.plan(0))
    self.batches_per_epoch = len(self.batches.plan(0))
    self.times: list[float] = []
    self.target_tokens: list[int] = []

  def build(self, n: int):
    out = []
    for _ in range(n):
      start = time.perf_counter()
      if self.batches.index >= self.batches_per_epoch:  # keep the measured epoch's plan (no re-planning)
        self.batches.index = 0
      batch = next(self.batches)
      self.times.append(time.perf_counter() - start)
      self.target_tokens.append(_batch_tokens(batch)[1])
      out.append(batch)
    return out

  def result(self) -> dict:
    per_batch = common.median(self.times) + self.plan_s / self.batches_per_epoch
    tokens = float(np.mean(self.target_tokens))
    src_eff, tgt_eff = self.batches.padding_efficiency(0)
    return {"plan_epoch_s": self.plan_s, "batches_per_epoch": self.batches_per_epoch,
            "build_batch_s": common.median(self.times), "per_batch_s": per_batch,
            "target_tokens_per_s": tokens / per_batch, "padding_efficiency": [src_eff, tgt_eff]}


def train(args) -> dict:
  from transformer_jax.training.schedule import adam_with_schedule
  from transformer_jax.training.steps import create_train_state
  from experiments.benchmarks import ablations

  corpus = common.load_corpus(args.row_length)
  cfg = preset_config(args.preset, args.vocab or corpus.vocab_size)
  rows = args.tokens // args.row_length
  out = {"preset": args.preset, "config": {k: v for k, v in vars(cfg).items()}, "corpus": corpus.name,
         "tokens_per_batch": args.tokens, "row_length": args.row_length, "rows": rows,
         "flops_formula": common.FLOPS_FORMULA}
  flops = common.model_flops(cfg, rows, args.row_length, args.row_length)
  out["flops_per_step"] = flops

  # Data: the measured pipeline feeds a fixed set of batches (cycled) to every framework.
  pipeline = _Pipeline(corpus, args.tokens, args.row_length)
  host_batches = pipeline.build(args.num_batches)
  target_tokens = float(np.mean([_batch_tokens(b)[1] for b in host_batches]))
  source_tokens = float(np.mean([_batch_tokens(b)[0] for b in host_batches]))
  out["real_tokens_per_batch"] = {"source": source_tokens, "target": target_tokens}
  dev_batches = [_device_batch(b) for b in host_batches]
  probe = common.MatmulProbe(2048)

  # Ours (+ variants): lower/compile timed separately, then the AOT executable is what we step.
  tx = adam_with_schedule(cfg.d_model, warmup_steps=4000)
  runners = {}
  variants = ["baseline"] + [v for v in args.variants.split(",") if v and v != "baseline"]
  for name in variants:
    vcfg = ablations.variant_config(name, cfg)
    state = create_train_state(vcfg, tx, jax.random.key(0))
    step = ablations.variant_step(cfg, name)
    rng = jax.random.key(1)
    lowered, lower_s = _timed(lambda: step.lower(state, dev_batches[0], rng))
    compiled, compile_s = _timed(lowered.compile)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    losses = []
    for i in range(args.warmup):
      state, metrics = compiled(state, dev_batches[i % len(dev_batches)], rng)
      losses.append(float(metrics["loss"]))
    runners[name] = {"fn": compiled, "state": state, "rng": rng, "times": [], "dispatch": [],
                     "lower_s": lower_s, "compile_s": compile_s, "losses": losses,
                     "xla_flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
                     "bytes_accessed": float(cost.get("bytes accessed", float("nan"))) if cost else float("nan")}
    if name == "baseline":
      out["params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
      out["peak_rss_mb"] = common.peak_rss_mb()  # compile + warm-up of the library's step only
      out["hlo_has_f64"] = "f64[" in compiled.as_text()
    _log(f"[train {args.preset}] {name}: lower {lower_s:.1f}s compile {compile_s:.1f}s loss {losses}")
    gc.collect()

  torch_runners = {}
  if args.torch:
    try:
      import torch
      from experiments.benchmarks import torch_peer
    except ImportError as e:
      out["torch_error"] = f"torch not installed ({e}); pip install -e '.[bench]'"
    else:
      default_threads = torch.get_num_threads()
      trainer = torch_peer.TorchTrainer(cfg)
      torch_batches = [torch_peer.to_torch_batch(b, cfg.num_heads) for b in host_batches]
      losses = [trainer.step(torch_batches[i % len(torch_batches)]) for i in range(args.warmup)]
      for threads in args.torch_threads:
        name = "torch" if threads == 0 else f"torch_{threads}thread"
        torch_runners[name] = {"threads": threads or default_threads, "times": []}
      torch_mm = (torch.randn(2048, 2048), torch.randn(2048, 2048))
      out["torch"] = {"version": torch.__version__, "threads": default_threads,
                      "params": trainer.num_params(), "warmup_losses": losses}
      _log(f"[train {args.preset}] torch warm-up losses {losses}")

  def torch_matmul_rate():
    torch.set_num_threads(default_threads)
    times = []
    for _ in range(2):
      start = time.perf_counter()
      torch.mm(*torch_mm)
      times.append(time.perf_counter() - start)
    return 2 * 2048 ** 3 / common.median(times)

  # Timed rounds: matmul probe, each JAX variant, torch, pipeline - `block` steps each per round (the
  # ablation variants and the torch peer may take fewer per round: --variant_block, --torch_block).
  rounds = -(-args.steps // args.block)
  per_round = {name: [] for name in list(runners) + list(torch_runners)}
  per_round["matmul"], per_round["torch_matmul"] = [], []
  k = 0
  for r in range(rounds):
    per_round["matmul"].append(probe.rate(2))
    for name, run in runners.items():
      times = []
      for _ in range(args.block if name == "baseline" else (args.variant_block or args.block)):
        batch = dev_batches[k % len(dev_batches)]
        k += 1
        start = time.perf_counter()
        run["state"], metrics = run["fn"](run["state"], batch, run["rng"])
        run["dispatch"].append(time.perf_counter() - start)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
      run["times"] += times
      per_round[name].append(common.median(times))
    if torch_runners:
      per_round["torch_matmul"].append(torch_matmul_rate())
    for name, run in torch_runners.items():
      torch.set_num_threads(run["threads"])
      times = []
      for _ in range(args.torch_block or args.block):
        batch = torch_batches[k % len(torch_batches)]
        k += 1
        start = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - start)
      run["times"] += times
      per_round[name].append(common.median(times))
    pipeline.build(args.block)
    _log(f"[train {args.preset}] round {r + 1}/{rounds}: " + " ".join(
        f"{n}={v[-1]:.3f}s" for n, v in per_round.items() if v and "matmul" not in n)
        + f" matmul={per_round['matmul'][-1] / 1e9:.0f}GF/s")

  matmul = common.median(per_round["matmul"])
  out["matmul_flops"] = matmul
  out["matmul_flops_samples"] = per_round["matmul"]
  out["per_round"] = per_round  # median step time of each runner in each round, and the round's probes
  out["pipeline"] = pipeline.result()
  res = {}
  for name, run in runners.items():
    step_s = common.median(run["times"])
    res[name] = {
        "step_s": step_s, "step_s_all": run["times"], "steps": len(run["times"]),
        "dispatch_s": common.median(run["dispatch"]), "lower_s": run["lower_s"],
        "compile_s": run["compile_s"], "target_tokens_per_s": target_tokens / step_s,
        "source_tokens_per_s": source_tokens / step_s, "model_flops_per_s": flops["total"] / step_s,
        "mfu_vs_matmul": flops["total"] / step_s / matmul, "xla_flops": run["xla_flops"],
        "xla_bytes_accessed": run["bytes_accessed"], "warmup_losses": run["losses"],
        "speedup_vs_baseline": common.median(
            [b / v for b, v in zip(per_round["baseline"], per_round[name])])}
  out["jax"] = res
  for tname, trun in torch_runners.items():
    step_s = common.median(trun["times"])
    entry = {"threads": trun["threads"], "step_s": step_s, "step_s_all": trun["times"],
             "steps": len(trun["times"]), "target_tokens_per_s": target_tokens / step_s,
             "model_flops_per_s": flops["total"] / step_s, "mfu_vs_matmul": flops["total"] / step_s / matmul}
    if tname == "torch":
      out["torch"].update(entry)
      out["torch"]["torch_matmul_flops"] = common.median(per_round["torch_matmul"])
    else:
      out[tname] = entry
    key = "speedup_vs_torch" if tname == "torch" else f"speedup_vs_{tname}"
    for name in runners:
      res[name][key] = common.median([t / v for t, v in zip(per_round[tname], per_round[name])])
  out["pipeline"]["ratio_vs_training"] = (out["pipeline"]["target_tokens_per_s"]
                                          / res["baseline"]["target_tokens_per_s"])
  return out


# ----------------------------------------------------------------------------------------------------------
# 4. Decoding: greedy and beam 4 over a file of mixed-length sources; cached vs uncached; encoder alone
# ----------------------------------------------------------------------------------------------------------

def _encoder_batches(sources, max_tokens, max_len):
  """The (bucket, rows) batches `translate_ids` forms for `sources` (EOS already appended)."""
  from transformer_jax import inference
  order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
  batches = []
  for i in order:
    bucket = min(inference.length_bucket(len(sources[i])), max_len)
    rows = max(1, max_tokens // bucket)
    if batches and batches[-1][0] == bucket and len(batches[-1][1]) < rows:
      batches[-1][1].append(i)
    else:
      batches.append((bucket, [i]))
  out = []
  for bucket, idx in batches:
    rows = inference._rows_bucket(len(idx), max(1, max_tokens // bucket))
    arr = np.zeros((rows, bucket), np.int32)
    arr[:, 0] = presets.EOS_ID
    for r, i in enumerate(idx):
      arr[r] = 0
      arr[r, :len(sources[i])] = sources[i]
    out.append(jnp.asarray(arr))
  return out


def decode(args) -> dict:
  from flax import linen as nn
  from transformer_jax import decode as decode_lib
  from transformer_jax import inference
  from transformer_jax.model import Transformer
  from transformer_jax.training.steps import init_params

  corpus = common.load_corpus()
  cfg = preset_config(args.preset, args.vocab or corpus.vocab_size)
  params = jax.device_put(nn.unbox(init_params(cfg, jax.random.key(0))))
  rng = np.random.default_rng(0)
  pick = rng.choice(len(corpus.test_sources), size=min(args.sources, len(corpus.test_sources)), replace=False)
  sources = [corpus.test_sources[i] for i in pick]  # each ends with EOS
  lengths = [len(s) for s in sources]
  out = {"preset": args.preset, "config": vars(cfg), "corpus": corpus.name, "sources": len(sources),
         "source_len": {"mean": float(np.mean(lengths)), "min": int(min(lengths)), "max": int(max(lengths))},
         "extra_len": args.extra_len, "max_tokens_per_batch": args.max_tokens,
         "model": "random init (untrained): outputs mostly run to their cap len(source)+extra_len"}
  probe = common.MatmulProbe(2048)

  # Encoder alone, on the batches translate_ids forms.
  enc_batches = _encoder_batches(sources, args.max_tokens, cfg.max_len)
  encode = jax.jit(lambda p, x: Transformer(cfg).apply({"params": p}, x, method=Transformer.encode))
  for b in enc_batches:
    encode(params, b).block_until_ready()

  def run_encoder():
    for b in enc_batches:
      encode(params, b).block_until_ready()

  searches = {}
  for beam in (1, 4):
    before = inference.compilation_count()
    (outputs, first_s) = _timed(lambda: inference.translate_ids(
        params, cfg, sources, beam_size=beam, extra_len=args.extra_len, max_tokens_per_batch=args.max_tokens))
    searches[beam] = {"first_pass_s": first_s, "compilations_first_pass": inference.compilation_count() - before,
                      "batches": len(enc_batches), "output_tokens": int(sum(len(o) + 1 for o in outputs)),
                      "times": [], "compilations_later_passes": 0}
    _log(f"[decode] beam {beam}: first pass {first_s:.1f}s, "
         f"{searches[beam]['compilations_first_pass']} compilations for {len(enc_batches)} batches")

  enc_times, matmul = [], []
  for r in range(args.rounds):
    matmul.append(probe.rate(2))
    for beam, s in searches.items():
      before = inference.compilation_count()
      _, t = _timed(lambda: inference.translate_ids(params, cfg, sources, beam_size=beam,
                                                   extra_len=args.extra_len,
                                                   max_tokens_per_batch=args.max_tokens))
      s["times"].append(t)
      s["compilations_later_passes"] += inference.compilation_count() - before
    enc_times.append(_timed(run_encoder)[1])
    _log(f"[decode] round {r + 1}/{args.rounds}: greedy {searches[1]['times'][-1]:.2f}s "
         f"beam4 {searches[4]['times'][-1]:.2f}s encoder {enc_times[-1]:.3f}s")

  enc_s = common.median(enc_times)
  out["encoder"] = {"file_s": enc_s, "sentences_per_s": len(sources) / enc_s}
  out["matmul_flops"] = common.median(matmul)
  for beam, s in searches.items():
    t = common.median(s["times"])
    key = "greedy" if beam == 1 else f"beam{beam}"
    out[key] = {"file_s": t, "sentences_per_s": len(sources) / t, "output_tokens": s["output_tokens"],
                "mean_output_len": s["output_tokens"] / len(sources), "tokens_per_s": s["output_tokens"] / t,
                "compilations_first_pass": s["compilations_first_pass"],
                "compilations_later_passes": s["compilations_later_passes"], "batches": s["batches"],
                "first_pass_s": s["first_pass_s"], "encoder_share": enc_s / t, "times": s["times"]}

  # Cached vs uncached on a subset: one batch, exactly `gen_len` decoder steps each (no early stop).
  subset = sorted(sources, key=len)[len(sources) // 2 - args.subset // 2:][:args.subset]
  bucket = inference.length_bucket(max(len(s) for s in subset))
  inputs = np.zeros((len(subset), bucket), np.int32)
  for r, s in enumerate(subset):
    inputs[r, :len(s)] = s
  inputs = jnp.asarray(inputs)
  length = args.gen_len

  def search_fn(search, cached):  # a fresh jit per variant (the library's jits would share one cache entry)
    if search == "greedy":
      return jax.jit(lambda p, x: decode_lib.greedy_search(p, cfg, x, length, cached=cached)[0])
    return jax.jit(lambda p, x: decode_lib.beam_search(p, cfg, x, 4, 0.6, length, cached=cached,
                                                       early_stop="none")[0])

  fns = {(search, mode): search_fn(search, mode == "cached")
         for search in ("greedy", "beam4") for mode in ("cached", "uncached")}
  tokens = {key: np.asarray(fn(params, inputs)) for key, fn in fns.items()}  # compiles
  out["cached_same_tokens"] = {search: bool((tokens[(search, "cached")] == tokens[(search, "uncached")]).all())
                               for search in ("greedy", "beam4")}
  times = {key: [] for key in fns}
  for _ in range(args.rounds):
    for key, fn in fns.items():
      times[key].append(_timed(lambda: jax.block_until_ready(fn(params, inputs)))[1])
  out["cache"] = {"subset_sources": len(subset), "bucket": bucket, "output_len": length,
                  "note": "every hypothesis runs exactly output_len steps (early_stop='none'; greedy: "
                          "an untrained model rarely emits EOS)"}
  for search in ("greedy", "beam4"):
    c_t, u_t = times[(search, "cached")], times[(search, "uncached")]
    cached, uncached = common.median(c_t), common.median(u_t)
    ratio = common.median([u / c for c, u in zip(c_t, u_t)])
    out["cache"][search] = {"cached_s": cached, "uncached_s": uncached, "speedup": ratio,
                            "cached_tokens_per_s": len(subset) * length / cached,
                            "uncached_tokens_per_s": len(subset) * length / uncached,
                            "file_uncached_s_extrapolated": out[search]["file_s"] * ratio}
  _log(f"[decode] cached vs uncached: greedy x{out['cache']['greedy']['speedup']:.1f} "
       f"beam4 x{out['cache']['beam4']['speedup']:.1f}; same tokens: {out['cached_same_tokens']}")
  return out


# ----------------------------------------------------------------------------------------------------------
# 5. Scaling: step time vs row length (fixed tokens/batch) and vs tokens/batch (fixed row length)
# ----------------------------------------------------------------------------------------------------------

def scaling(args) -> dict:
  from transformer_jax.data.pipeline import PackedBatches
  from transformer_jax.training.schedule import adam_with_schedule
  from transformer_jax.training.steps import create_train_state, jit_train_step

  corpus = common.load_corpus(max(args.lengths))
  cfg = preset_config(args.preset, args.vocab or corpus.vocab_size)
  cfg = cfg.replace(max_len=max(cfg.max_len, max(args.lengths)))
  points = [("length", L, args.tokens) for L in args.lengths]
  points += [("tokens", args.row_length, T) for T in args.batch_tokens if T != args.tokens
             or args.row_length not in args.lengths]
  tx = adam_with_schedule(cfg.d_model, warmup_steps=4000)
  probe = common.MatmulProbe(2048)
  runs = []
  for kind, L, T in points:
    batches = PackedBatches(corpus.sources, corpus.targets, tokens_per_batch=T, row_length=L, seed=0)
    host = [next(batches) for _ in range(3)]
    dev = [_device_batch(b) for b in host]
    state = create_train_state(cfg, tx, jax.random.key(0))
    step = jit_train_step(cfg)
    rng = jax.random.key(1)
    compiled, compile_s = _timed(lambda: step.lower(state, dev[0], rng).compile())
    state, m = compiled(state, dev[0], rng)
    jax.block_until_ready(m)
    runs.append({"kind": kind, "row_length": L, "tokens_per_batch": T, "rows": T // L, "fn": compiled,
                 "state": state, "rng": rng, "dev": dev, "times": [], "compile_s": compile_s,
                 "target_tokens": float(np.mean([_batch_tokens(b)[1] for b in host])),
                 "flops": common.model_flops(cfg, T // L, L, L)})
    _log(f"[scaling] compiled {kind} L={L} T={T} in {compile_s:.1f}s")
  matmul = []
  for r in range(args.rounds):
    matmul.append(probe.rate(2))
    for run in runs:
      for i in range(args.block):
        start = time.perf_counter()
        run["state"], m = run["fn"](run["state"], run["dev"][i % 3], run["rng"])
        jax.block_until_ready(m)
        run["times"].append(time.perf_counter() - start)
    _log(f"[scaling] round {r + 1}/{args.rounds}")
  mm = common.median(matmul)
  out = {"preset": args.preset, "config": vars(cfg), "matmul_flops": mm, "points": []}
  for run in runs:
    step_s = common.median(run["times"])
    out["points"].append({
        "kind": run["kind"], "row_length": run["row_length"], "tokens_per_batch": run["tokens_per_batch"],
        "rows": run["rows"], "step_s": step_s, "steps": len(run["times"]), "compile_s": run["compile_s"],
        "target_tokens_per_s": run["target_tokens"] / step_s,
        "real_target_tokens": run["target_tokens"], "flops": run["flops"]["total"],
        "attention_share_flops": run["flops"]["attention_share"],
        "mfu_vs_matmul": run["flops"]["total"] / step_s / mm})
  base = next(p for p in out["points"] if p["kind"] == "length")
  for p in out["points"]:
    p["step_s_rel"] = p["step_s"] / base["step_s"]
    p["flops_rel"] = p["flops"] / base["flops"]
  return out


# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("section", choices=("machine", "train", "decode", "scaling"))
  parser.add_argument("--out", required=True)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--vocab", type=int, default=0, help="0: the corpus tokenizer's vocabulary")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--row_length", type=int, default=64)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--block", type=int, default=2)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--num_batches", type=int, default=8)
  parser.add_argument("--variants", default="")
  parser.add_argument("--torch", action="store_true")
  parser.add_argument("--torch_threads", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                      help="torch intra-op threads per torch runner; 0 = torch's default (one per core)")
  parser.add_argument("--torch_block", type=int, default=0, help="torch steps per round (0: --block)")
  parser.add_argument("--variant_block", type=int, default=0, help="ablation-variant steps per round")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--sources", type=int, default=500)
  parser.add_argument("--extra_len", type=int, default=50)
  parser.add_argument("--max_tokens", type=int, default=4096)
  parser.add_argument("--subset", type=int, default=32)
  parser.add_argument("--gen_len", type=int, default=50)
  parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512])
  parser.add_argument("--batch_tokens", type=lambda s: [int(x) for x in s.split(",")],
                      default=[1024, 2048, 4096, 8192])
  args = parser.parse_args(argv)
  start = time.perf_counter()
  load_start = os.getloadavg()
  result = globals()[args.section](args)
  result["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
  result["section_wall_s"] = time.perf_counter() - start
  result["process_peak_rss_mb"] = common.peak_rss_mb()
  result["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
  common.dump_json(result, args.out)


if __name__ == "__main__":
  main()
