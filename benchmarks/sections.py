r"""The benchmark sections; each runs in its own process (`run.py` starts them) and writes one JSON file.

    python -m benchmarks.sections --section=machine  --out=/tmp/m.json
    python -m benchmarks.sections --section=train    --out=/tmp/t.json --preset=tiny --steps=20
    python -m benchmarks.sections --section=peer     --out=/tmp/p.json --framework=flax --kind=plain
    python -m benchmarks.sections --section=decode   --out=/tmp/d.json --sources=500
    python -m benchmarks.sections --section=scaling  --out=/tmp/s.json
    python -m benchmarks.sections --section=long_inputs --out=/tmp/l.json --lengths=512,1024 --steps=2

Every timed JAX training step is the trainer's own compiled step (`common.build_train_step`: the
`factories.create_state` + `factories.make_train_step` of `experiments/configs/default.py` with the preset's
sizes, on a one-device mesh). The machine is shared, so the training section interleaves what it compares
in rounds (ours, the ablation variants, the data pipeline and a 2048^2 matmul probe take turns inside each
round) and reports medians and ratios of medians measured in the same rounds. Peers (`peer`: ours, the
Flax example's model, PyTorch `nn.Transformer`) each run alone in their own process, with a 2048^2 probe
in every round of each, on the same batches: packed multi30k, or plain full rows of random ids.
"""

from __future__ import annotations

import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from absl import flags  # noqa: E402

from benchmarks import ablations, common, flax_peer  # noqa: E402
import launch  # noqa: E402
from transformer_jax import config as presets  # noqa: E402
from transformer_jax import sharding  # noqa: E402


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------
# 1. Machine limit
# ----------------------------------------------------------------------------------------------------------

def machine(args) -> dict:
  out = {"machine": launch.machine_info(), "matmul": {}}
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
# 2./3. Training (ours and the ablation variants) + the host data pipeline, interleaved
# ----------------------------------------------------------------------------------------------------------

def _batch_tokens(batch) -> tuple[int, int]:
  return int((batch["inputs"] != 0).sum()), int((batch["targets"] != 0).sum())


class _Pipeline:
  """Times the trainer's input pipeline (`pipeline.TrainStream`: read, decode, pack, batch) per batch, after its
  first batch (start-up and prefetch filling timed apart)."""

  def __init__(self, corpus, tokens_per_batch, row_length):
    self.batches = common.packed_stream(corpus, tokens_per_batch, row_length)
    _, self.first_s = _timed(lambda: next(self.batches))
    self.times: list[float] = []
    self.target_tokens: list[int] = []

  def build(self, n: int):
    out = []
    for _ in range(n):
      start = time.perf_counter()
      batch = next(self.batches)
      self.times.append(time.perf_counter() - start)
      self.target_tokens.append(_batch_tokens(batch)[1])
      out.append(batch)
    return out

  def result(self) -> dict:
    per_batch = common.median(self.times)
    tokens = float(np.mean(self.target_tokens))
    src_eff, tgt_eff = self.batches.padding_efficiency()
    return {"first_batch_s": self.first_s, "per_batch_s": per_batch,
            "target_tokens_per_s": tokens / per_batch, "padding_efficiency": [src_eff, tgt_eff]}


def _compile_runner(built: common.TrainStep, batch: dict, warmup: int, dev_batches: list) -> dict:
  """Lowers and compiles `built.step` on `batch` (timed apart), then takes `warmup` steps."""
  lowered, lower_s = _timed(lambda: built.step.lower(built.state, batch, built.rng))
  compiled, compile_s = _timed(lowered.compile)
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  state, losses = built.state, []
  for i in range(warmup):
    state, metrics = compiled(state, dev_batches[i % len(dev_batches)], built.rng)
    losses.append(float(metrics["loss"]))
  return {"fn": compiled, "state": state, "rng": built.rng, "times": [], "dispatch": [],
          "lower_s": lower_s, "compile_s": compile_s, "losses": losses,
          "xla_flops": float(cost.get("flops", float("nan"))),
          "bytes_accessed": float(cost.get("bytes accessed", float("nan")))}


def _step_block(run: dict, dev_batches: list, k: int, n: int) -> tuple[list[float], int]:
  """`n` timed steps of a compiled runner from batch index `k`; (step times, next index)."""
  times = []
  for _ in range(n):
    batch = dev_batches[k % len(dev_batches)]
    k += 1
    start = time.perf_counter()
    run["state"], metrics = run["fn"](run["state"], batch, run["rng"])
    run["dispatch"].append(time.perf_counter() - start)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  run["times"] += times
  return times, k


def _runner_result(run: dict, per_round: dict, name: str, flops: dict, matmul: float,
                   source_tokens: float, target_tokens: float) -> dict:
  step_s = common.median(run["times"])
  return {"step_s": step_s, "step_s_all": run["times"], "steps": len(run["times"]),
          "dispatch_s": common.median(run["dispatch"]), "lower_s": run["lower_s"],
          "compile_s": run["compile_s"], "target_tokens_per_s": target_tokens / step_s,
          "source_tokens_per_s": source_tokens / step_s, "model_flops_per_s": flops["total"] / step_s,
          "mfu_vs_matmul": flops["total"] / step_s / matmul, "xla_flops": run["xla_flops"],
          "xla_bytes_accessed": run["bytes_accessed"], "warmup_losses": run["losses"],
          "speedup_vs_baseline": common.median([b / v for b, v in zip(per_round["baseline"], per_round[name])])}


def _train_rounds(args, runners: dict, dev_batches: list, pipeline: "_Pipeline", probe) -> dict:
  """Timed rounds: matmul probe, each JAX variant, pipeline - `block` steps each per round (the ablation
  variants may take fewer per round: --variant_block). Returns each runner's per-round median step time."""
  rounds = -(-args.steps // args.block)
  per_round = {name: [] for name in runners}
  per_round["matmul"] = []
  k = 0
  for r in range(rounds):
    per_round["matmul"].append(probe.rate(2))
    for name, run in runners.items():
      times, k = _step_block(run, dev_batches, k,
                             args.block if name == "baseline" else (args.variant_block or args.block))
      per_round[name].append(common.median(times))
    pipeline.build(args.block)
    _log(f"[train {args.preset}] round {r + 1}/{rounds}: " + " ".join(
        f"{n}={v[-1]:.3f}s" for n, v in per_round.items() if v and "matmul" not in n)
        + f" matmul={per_round['matmul'][-1] / 1e9:.0f}GF/s")
  return per_round


def train(args) -> dict:
  """The trainer's compiled step ("baseline") and the ablation variants on packed multi30k batches."""
  corpus = common.load_corpus(args.row_length)
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
  config = common.train_config(cfg)
  rows = args.tokens // args.row_length
  out = {"preset": args.preset, "config": dict(vars(cfg)), "corpus": corpus.name,
         "tokens_per_batch": args.tokens, "row_length": args.row_length, "rows": rows,
         "flops_formula": common.FLOPS_FORMULA, "step": "factories.make_train_step (one-device mesh)"}
  flops = common.model_flops(cfg, rows, args.row_length, args.row_length)
  out["flops_per_step"] = flops

  # Data: the measured pipeline feeds a fixed set of batches (cycled), sharded as the trainer shards them.
  pipeline = _Pipeline(corpus, args.tokens, args.row_length)
  host_batches = pipeline.build(args.num_batches)
  target_tokens = float(np.mean([_batch_tokens(b)[1] for b in host_batches]))
  source_tokens = float(np.mean([_batch_tokens(b)[0] for b in host_batches]))
  out["real_tokens_per_batch"] = {"source": source_tokens, "target": target_tokens}
  mesh = sharding.single_device_mesh()
  dev_batches = [sharding.shard_batch(b, mesh) for b in host_batches]
  probe = common.MatmulProbe(2048)

  # Ours (+ variants): lower/compile timed separately, then the AOT executable is what we step.
  runners = {}
  variants = ["baseline"] + [v for v in args.variants if v and v != "baseline"]
  for name in variants:
    built = ablations.variant_step(config, name, mesh=mesh)
    runners[name] = _compile_runner(built, dev_batches[0], args.warmup, dev_batches)
    if name == "baseline":
      out["params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(built.state.params)))
      out["peak_rss_mb"] = common.peak_rss_mb()  # compile + warm-up of the library's step only
      out["hlo_has_f64"] = "f64[" in runners[name]["fn"].as_text()
    del built
    _log(f"[train {args.preset}] {name}: lower {runners[name]['lower_s']:.1f}s compile "
         f"{runners[name]['compile_s']:.1f}s loss {runners[name]['losses']}")
    gc.collect()

  per_round = _train_rounds(args, runners, dev_batches, pipeline, probe)
  matmul = common.median(per_round["matmul"])
  out["matmul_flops"] = matmul
  out["matmul_flops_samples"] = per_round["matmul"]
  out["per_round"] = per_round  # median step time of each runner in each round, and the round's probes
  out["pipeline"] = pipeline.result()
  out["jax"] = {name: _runner_result(run, per_round, name, flops, matmul, source_tokens, target_tokens)
                for name, run in runners.items()}
  out["pipeline"]["ratio_vs_training"] = (out["pipeline"]["target_tokens_per_s"]
                                          / out["jax"]["baseline"]["target_tokens_per_s"])
  return out


# ----------------------------------------------------------------------------------------------------------
# 3b. Peers: one framework per process (ours, the Flax example's model, PyTorch), packed or plain batches
# ----------------------------------------------------------------------------------------------------------

def _peer_batches(args) -> tuple[list[dict], int, int, int]:
  """(host batches, rows, row length, vocabulary) of batch kind `args.kind`, identical in every process."""
  if args.kind == "packed":
    corpus = common.load_corpus(args.row_length)
    batches = common.packed_stream(corpus, args.tokens, args.row_length)
    host = [next(batches) for _ in range(args.num_batches)]
    return host, args.tokens // args.row_length, args.row_length, args.vocab or corpus.vocab_size
  vocab = args.vocab or common.VOCAB_SIZE
  host = [common.plain_batch(args.rows, args.length, vocab, seed=i) for i in range(args.num_batches)]
  return host, args.rows, args.length, vocab


def _ours_peer(cfg, host: list[dict]):
  """The trainer's compiled step: (version, warm-up step function `step(k) -> loss`)."""
  built = common.build_train_step(common.train_config(cfg))
  dev = [built.shard(b) for b in host]
  compiled = built.step.lower(built.state, dev[0], built.rng).compile()
  box = {"state": built.state}

  def step(k):
    box["state"], metrics = compiled(box["state"], dev[k % len(dev)], built.rng)
    return metrics["loss"]
  return f"jax {jax.__version__}, flax {flax.__version__} (factories.make_train_step)", step


def _flax_peer(cfg, host: list[dict]):
  path = flax_peer.ensure_example()
  models = flax_peer.load_models(path)
  config = common.train_config(cfg)
  box = {"state": flax_peer.create_state(models, cfg, config, jax.random.key(0))}
  fn = flax_peer.make_train_step(models, cfg, config)
  dev = [{k: jnp.asarray(v) for k, v in flax_peer.model_inputs(b).items()} for b in host]
  rng = jax.random.key(1)

  def step(k):
    box["state"], metrics = fn(box["state"], dev[k % len(dev)], rng)
    return metrics["loss"]
  return f"flax {flax.__version__} examples/wmt/models.py (jax.jit, donated state)", step


def _torch_peer(cfg, host: list[dict]):
  import torch  # the optional `bench` extra; only this process imports it
  from benchmarks import torch_peer
  trainer = torch_peer.TorchTrainer(cfg)
  packed = "inputs_segmentation" in host[0]
  batches = [torch_peer.to_torch_batch(b, cfg.num_heads) if packed else torch_peer.to_plain_torch_batch(b)
             for b in host]
  return (f"torch {torch.__version__} eager, {torch.get_num_threads()} threads",
          lambda k: trainer.step(batches[k % len(batches)]))


PEERS = {"ours": _ours_peer, "flax": _flax_peer, "torch": _torch_peer}


def peer(args) -> dict:
  """One framework's training step on one batch kind, alone in this process, `block` steps per round."""
  host, rows, length, vocab = _peer_batches(args)
  cfg = common.preset_config(args.preset, vocab)
  cfg = cfg.replace(max_len=max(cfg.max_len, length))
  target_tokens = float(np.mean([_batch_tokens(b)[1] for b in host]))
  source_tokens = float(np.mean([_batch_tokens(b)[0] for b in host]))
  flops = common.model_flops(cfg, rows, length, length)
  (version, step), setup_s = _timed(lambda: PEERS[args.framework](cfg, host))
  probe = common.MatmulProbe(2048)
  losses, k = [], 0
  warm_start = time.perf_counter()
  for _ in range(args.warmup):  # the first call compiles (JAX peers)
    losses.append(float(step(k)))
    k += 1
  warmup_s = time.perf_counter() - warm_start
  times, matmul, per_round = [], [], []
  for r in range(args.rounds):
    matmul.append(probe.rate(2))
    block = []
    for _ in range(args.block):
      start = time.perf_counter()
      losses.append(float(step(k)))  # float() waits for the step
      block.append(time.perf_counter() - start)
      k += 1
    times += block
    per_round.append(common.median(block))
    _log(f"[peer {args.framework} {args.kind} {args.preset}] round {r + 1}/{args.rounds}: "
         f"{per_round[-1]:.3f}s matmul={matmul[-1] / 1e9:.0f}GF/s")
  step_s = common.median(times)
  return {"framework": args.framework, "kind": args.kind, "preset": args.preset, "version": version,
          "config": dict(vars(cfg)), "rows": rows, "row_length": length,
          "real_tokens_per_batch": {"source": source_tokens, "target": target_tokens},
          "flops_per_step": flops, "setup_s": setup_s, "warmup_s": warmup_s, "losses": losses,
          "step_s": step_s, "step_s_all": times, "steps": len(times), "per_round": per_round,
          "matmul_flops_samples": matmul, "matmul_flops": common.median(matmul),
          "target_tokens_per_s": target_tokens / step_s, "model_flops_per_s": flops["total"] / step_s,
          "mfu_vs_same_process_probe": flops["total"] / step_s / common.median(matmul)}


# ----------------------------------------------------------------------------------------------------------
# 4. Decoding: greedy and beam 4 over a file of mixed-length sources; cached vs uncached; encoder alone
# ----------------------------------------------------------------------------------------------------------

def _encoder_batches(sources, max_tokens, max_len):
  """The (bucket, rows) batches `translate_ids` forms for `sources` (EOS already appended)."""
  from transformer_jax.decoding import inference
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
    rows = inference.rows_bucket(len(idx), max(1, max_tokens // bucket))
    arr = np.zeros((rows, bucket), np.int32)
    arr[:, 0] = presets.EOS_ID
    for r, i in enumerate(idx):
      arr[r] = 0
      arr[r, :len(sources[i])] = sources[i]
    out.append(jnp.asarray(arr))
  return out


def _toolkit_searches(params, cfg, sources, args) -> tuple[dict, dict]:
  """The decoding toolkit's variants of beam 4 over the same file (`inference.decode_ids`), each run once here
  to compile: the 4-best list with scores and per-token log-probs (what `translate --nbest=4
  --output_format=jsonl` computes), an ensemble of two models, lexically constrained beam 4 (one 2-token
  phrase per source). The ensemble's second model is the first plus Gaussian noise of 1% of each tensor's
  spread, as two checkpoints of one run are near each other: two unrelated random models would average to a
  flatter distribution that stops at other lengths, and the ratio would measure lengths, not the work per
  step. Returns the runners and the output tokens of each (EOS counted), to compare with plain beam 4's."""
  from flax import linen as nn
  from transformer_jax.decoding import inference
  from transformer_jax.decoding.generate import DecodeOptions
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  second = jax.tree_util.tree_unflatten(tree, [x + 0.01 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                               for x, k in zip(leaves, keys)])
  phrases = [[[int(t) for t in s[:2]]] for s in sources]  # one 2-token phrase per source (its first 2 ids)
  run = lambda models, options, **kw: (lambda: inference.decode_ids(  # noqa: E731
      models, cfg, sources, options, extra_len=args.extra_len, max_tokens_per_batch=args.max_tokens, **kw))
  plain = DecodeOptions(beam_size=4, token_log_probs=False)
  fns = {"nbest4_scores": run(params, DecodeOptions(beam_size=4, nbest=4, token_log_probs=True)),
         "ensemble2": run([params, nn.unbox(second)], plain),
         "constrained_beam4": run(params, plain, constraints=phrases)}
  tokens = {name: sum(len(hyps[0].ids) + 1 for hyps in fn() if hyps) for name, fn in fns.items()}
  return fns, tokens


def _toolkit_ratios(times: dict, beam4_times: list, tokens: dict, beam4_tokens: int) -> dict:
  """Median over rounds of each variant's time / plain beam 4's (`translate_ids`) in the same round."""
  return {"ratios": {name: common.median([t / b for t, b in zip(ts, beam4_times)]) for name, ts in times.items()},
          "file_s": {name: common.median(ts) for name, ts in times.items()},
          "output_tokens_vs_beam4": {name: n / beam4_tokens for name, n in tokens.items()},
          "note": "same file, same rounds, interleaved with plain beam 4; targets: ensemble2 <= 2.2, "
                  "nbest4_scores <= 1.1, constrained_beam4 <= 2; output_tokens_vs_beam4: the 1-best outputs' "
                  "tokens / plain beam 4's (the work differs by that much besides the per-step cost)"}


def _cached_vs_uncached(params, cfg, sources: list, args, file_s: dict) -> tuple[dict, dict]:
  """Cached vs uncached decoding on `args.subset` middle-length sources in one batch, exactly `args.gen_len`
  decoder steps each (no early stop): `(cache figures per search, whether both gave the same tokens)`; the
  uncached time of the whole file is extrapolated from `file_s` {search: cached file seconds}."""
  from transformer_jax import decoding as decode_lib
  from transformer_jax.decoding import inference

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
  same_tokens = {search: bool((tokens[(search, "cached")] == tokens[(search, "uncached")]).all())
                               for search in ("greedy", "beam4")}
  times = {key: [] for key in fns}
  for _ in range(args.rounds):
    for key, fn in fns.items():
      times[key].append(_timed(lambda: jax.block_until_ready(fn(params, inputs)))[1])
  cache = {"subset_sources": len(subset), "bucket": bucket, "output_len": length,
                  "note": "every hypothesis runs exactly output_len steps (early_stop='none'; greedy: "
                          "an untrained model rarely emits EOS)"}
  for search in ("greedy", "beam4"):
    c_t, u_t = times[(search, "cached")], times[(search, "uncached")]
    cached, uncached = common.median(c_t), common.median(u_t)
    ratio = common.median([u / c for c, u in zip(c_t, u_t)])
    cache[search] = {"cached_s": cached, "uncached_s": uncached, "speedup": ratio,
                            "cached_tokens_per_s": len(subset) * length / cached,
                            "uncached_tokens_per_s": len(subset) * length / uncached,
                            "file_uncached_s_extrapolated": file_s[search] * ratio}
  _log(f"[decode] cached vs uncached: greedy x{cache['greedy']['speedup']:.1f} "
       f"beam4 x{cache['beam4']['speedup']:.1f}; same tokens: {same_tokens}")
  return cache, same_tokens


def _time_searches(params, cfg, sources: list, args, n_batches: int, run_encoder, probe) -> dict:
  """Greedy and beam 4 over the file (`inference.translate_ids`: a first pass that compiles, then
  `args.rounds` interleaved rounds with the decoding toolkit, the encoder alone and the matmul probe):
  `{"searches": {beam: ...}, "toolkit": (times, tokens), "encoder": times, "matmul": rates}`."""
  from transformer_jax.decoding import inference

  searches = {}
  for beam in (1, 4):
    before = inference.compilation_count()
    (outputs, first_s) = _timed(lambda: inference.translate_ids(
        params, cfg, sources, beam_size=beam, extra_len=args.extra_len, max_tokens_per_batch=args.max_tokens))
    searches[beam] = {"first_pass_s": first_s, "compilations_first_pass": inference.compilation_count() - before,
                      "batches": n_batches, "output_tokens": int(sum(len(o) + 1 for o in outputs)),
                      "times": [], "compilations_later_passes": 0}
    _log(f"[decode] beam {beam}: first pass {first_s:.1f}s, "
         f"{searches[beam]['compilations_first_pass']} compilations for {n_batches} batches")

  toolkit, toolkit_tokens = _toolkit_searches(params, cfg, sources, args)
  toolkit_times = {name: [] for name in toolkit}

  enc_times, matmul = [], []
  for r in range(args.rounds):
    matmul.append(probe.rate(2))
    for name, fn in toolkit.items():
      toolkit_times[name].append(_timed(fn)[1])
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

  return {"searches": searches, "toolkit": (toolkit_times, toolkit_tokens), "encoder": enc_times,
          "matmul": matmul}


def decode(args) -> dict:
  """Greedy and beam 4 over the test sources with the library's `translate_ids` (a random base/tiny model):
  sentences and tokens/s, compilations, the encoder's share, the decoding toolkit against plain beam 4, and
  cached vs uncached decoding."""
  from flax import linen as nn
  from transformer_jax.model import Transformer
  from transformer_jax.training.steps import init_params

  corpus = common.load_corpus()
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
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

  timed = _time_searches(params, cfg, sources, args, len(enc_batches), run_encoder, probe)
  searches, enc_times, matmul = timed["searches"], timed["encoder"], timed["matmul"]
  toolkit_times, toolkit_tokens = timed["toolkit"]

  out["toolkit"] = _toolkit_ratios(toolkit_times, searches[4]["times"], toolkit_tokens, searches[4]["output_tokens"])
  _log(f"[decode] toolkit vs beam 4: {', '.join(f'{k} x{v:.2f}' for k, v in out['toolkit']['ratios'].items())}")
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

  out["cache"], out["cached_same_tokens"] = _cached_vs_uncached(
      params, cfg, sources, args, {search: out[search]["file_s"] for search in ("greedy", "beam4")})
  return out


def ctranslate2(args) -> dict:
  """Our greedy/beam 4 vs CTranslate2 fp32/int8 on the same random model and sources (ctranslate2_bench.py)."""
  from flax import linen as nn
  from transformer_jax.training.steps import init_params
  try:
    from benchmarks import ctranslate2_bench
  except ImportError as e:  # the interop extra is not installed
    return {"error": f"needs the interop extra ({e})"}
  corpus = common.load_corpus()
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
  params = jax.device_put(nn.unbox(init_params(cfg, jax.random.key(0))))
  out = ctranslate2_bench.run(args, corpus, cfg, params) if args.sources else {}
  if args.fixed_sources:
    out["fixed"] = ctranslate2_bench.run_fixed(args, corpus, cfg, params)
  return out


# ----------------------------------------------------------------------------------------------------------
# 5. Scaling: step time vs row length (fixed tokens/batch) and vs tokens/batch (fixed row length)
# ----------------------------------------------------------------------------------------------------------

def scaling(args) -> dict:
  """The trainer's compiled step vs row length (fixed tokens/batch) and vs tokens/batch."""
  corpus = common.load_corpus(max(args.lengths))
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
  cfg = cfg.replace(max_len=max(cfg.max_len, max(args.lengths)))
  config = common.train_config(cfg)
  mesh = sharding.single_device_mesh()
  points = [("length", L, args.tokens) for L in args.lengths]
  points += [("tokens", args.row_length, T) for T in args.batch_tokens if T != args.tokens
             or args.row_length not in args.lengths]
  probe = common.MatmulProbe(2048)
  runs = []
  for kind, L, T in points:
    batches = common.packed_stream(corpus, T, L)
    host = [next(batches) for _ in range(3)]
    dev = [sharding.shard_batch(b, mesh) for b in host]
    built = common.build_train_step(config, mesh=mesh)
    state, rng = built.state, built.rng
    compiled, compile_s = _timed(lambda: built.step.lower(state, dev[0], rng).compile())
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
# 6. Long inputs: full vs windowed vs chunked attention, 512 .. 16,384 tokens (one process per point)
# ----------------------------------------------------------------------------------------------------------

def long_inputs(args) -> dict:
  from benchmarks import long_inputs as long_inputs_lib
  return long_inputs_lib.sweep(args.modes, args.lengths, args.steps, args.vocab or 8192, args.limit_gib,
                               args.budget_s)


# ----------------------------------------------------------------------------------------------------------

SECTIONS = ("machine", "train", "peer", "decode", "scaling", "ctranslate2", "long_inputs")
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: other modules and tests import this one)."""
  flags.DEFINE_enum("section", None, SECTIONS, "which section to measure")
  flags.DEFINE_string("out", None, "the JSON file the section's results go to")
  flags.DEFINE_bool("quick", False, "machine: skip the 4096^2 matmul")
  flags.DEFINE_string("preset", "tiny", "model preset: tiny, base or big")
  flags.DEFINE_integer("vocab", 0, "0: the corpus tokenizer's vocabulary")
  flags.DEFINE_integer("tokens", 4096, "slots per packed batch")
  flags.DEFINE_integer("row_length", 64, "slots per packed row")
  flags.DEFINE_integer("steps", 20, "timed steps")
  flags.DEFINE_integer("block", 2, "steps per round")
  flags.DEFINE_integer("warmup", 2, "untimed steps first (the first compiles)")
  flags.DEFINE_integer("num_batches", 8, "distinct batches cycled")
  flags.DEFINE_list("variants", [], "train: ablation variants (benchmarks/ablations.py), comma-separated")
  flags.DEFINE_enum("framework", "ours", sorted(PEERS), "peer: who trains")
  flags.DEFINE_enum("kind", "packed", ["packed", "plain"], "peer: packed multi30k batches (--tokens, --row_length) "
                    "or plain random full rows (--rows x --length)")
  flags.DEFINE_integer("rows", 32, "plain batches: rows")
  flags.DEFINE_integer("length", 64, "plain batches: tokens per row (both sides)")
  flags.DEFINE_integer("variant_block", 0, "ablation-variant steps per round")
  flags.DEFINE_integer("reps", 10, "machine: timed calls per matmul size")
  flags.DEFINE_integer("rounds", 3, "interleaved rounds")
  flags.DEFINE_integer("sources", 500, "decode, ctranslate2: test sources translated")
  flags.DEFINE_integer("extra_len", 50, "decoding: outputs capped at len(source) + extra_len")
  flags.DEFINE_integer("max_tokens", 4096, "decoding: source tokens per batch")
  flags.DEFINE_integer("subset", 32, "decode: sources of the uncached-vs-cached comparison")
  flags.DEFINE_integer("gen_len", 50, "decode: generated tokens of the cache comparison")
  flags.DEFINE_integer("threads", 2, "CTranslate2 intra-op threads")
  flags.DEFINE_integer("ct2_batch", 64, "CTranslate2 max_batch_size (sentences)")
  flags.DEFINE_integer("fixed_sources", 0,
                       "ctranslate2: also this many sources in one batch with fixed-length outputs (0: no)")
  flags.DEFINE_integer("fixed_len", 50, "ctranslate2: the fixed output length")
  flags.DEFINE_enum("ct2_process", "own", ["own", "shared"],
                    "ctranslate2 fixed shapes: time each CTranslate2 call in a fresh process of its own (its "
                    "OpenMP workers keep spinning after a call) or in this process beside ours")
  common.define_int_list("lengths", [64, 128, 256, 512], "scaling, long_inputs: row lengths")
  common.define_int_list("batch_tokens", [1024, 2048, 4096, 8192], "scaling: tokens per batch")
  flags.DEFINE_list("modes", ["full", "windowed", "chunked"], "long_inputs: attention modes")
  flags.DEFINE_float("limit_gib", 16.0, "long_inputs: the memory a point may use")
  flags.DEFINE_float("budget_s", 60.0, "long_inputs: timing budget per point")
  flags.mark_flags_as_required(["section", "out"])


@launch.program
def main() -> None:
  start = time.perf_counter()
  load_start = os.getloadavg()
  result = globals()[FLAGS.section](FLAGS)
  result["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
  result["section_wall_s"] = time.perf_counter() - start
  result["process_peak_rss_mb"] = common.peak_rss_mb()
  result["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
  common.dump_json(result, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  launch.run(main)
