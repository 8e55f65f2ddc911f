"""Decoding side by side: our greedy and beam 4 vs CTranslate2 fp32 and int8, same model, same sources.

The model (random init, like the `decode` section) is exported with `transformer_jax.interop.ctranslate2`;
the int8 runner loads the same fp32 export with `compute_type="int8"` (CTranslate2 quantises on load).
Every runner translates the same sources with the same output caps (`len(source) + extra_len`) and the
same ban on pad and BOS (ours in the search, the export by its output bias), in rounds that interleave the runners (the machine is shared); times are
medians over rounds after one untimed warm-up pass each (which compiles ours). Beam search: ours with
GNMT alpha 0.6, CTranslate2 with length_penalty 0.6 (|Y|^0.6): the same work per step.
Needs the `interop` extra; the section records an error note without it.

`run_fixed` compares the searches alone on fixed shapes: `--fixed_sources` sources in one batch, every
hypothesis exactly `--fixed_len` tokens long (EOS barred until then: CTranslate2's `min_decoding_length`, ours a
`decode.LogProbsFn`), so both do the same number of steps on the same rows whatever the random model prefers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from benchmarks import common
from transformer_jax.decoding import inference
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.interop import ctranslate2 as ct2


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def _runners(params, cfg, sources, pieces, args, translators):
  def ours(beam):
    outs = inference.translate_ids(params, cfg, sources, beam_size=beam, alpha=0.6, extra_len=args.extra_len,
                                   max_tokens_per_batch=args.max_tokens)
    return sum(len(o) + 1 for o in outs)

  def theirs(translator, beam):
    outs = ct2.translate_pieces(translator, pieces, beam_size=beam, length_penalty=0.6 if beam > 1 else 0.0,
                                extra_len=args.extra_len, max_len=cfg.max_len, max_batch_size=args.ct2_batch)
    return sum(len(o) + 1 for o in outs)

  runners = {"ours_greedy": lambda: ours(1), "ours_beam4": lambda: ours(4)}
  for name, translator in translators.items():
    runners[f"{name}_greedy"] = lambda t=translator: theirs(t, 1)
    runners[f"{name}_beam4"] = lambda t=translator: theirs(t, 4)
  return runners


def run(args, corpus, cfg, params) -> dict:
  """Times every runner over `args.sources` test sources; returns sentences/s and target tokens/s."""
  rng = np.random.default_rng(0)
  pick = rng.choice(len(corpus.test_sources), size=min(args.sources, len(corpus.test_sources)), replace=False)
  sources = [[int(x) for x in corpus.test_sources[i]] for i in pick]  # each ends with EOS
  tokenizer = Tokenizer(corpus.tokenizer_path)
  pieces = [tokenizer.pieces(s[:-1]) for s in sources]  # as CTranslate2 documents: no </s> (the model adds it)
  out = {"preset": args.preset, "vocab_size": cfg.vocab_size, "sources": len(sources), "extra_len": args.extra_len,
         "ct2_threads": args.threads, "jax_threads": f"XLA CPU default ({os.cpu_count()} logical CPUs)",
         "ct2_max_batch_size": args.ct2_batch, "max_tokens_per_batch": args.max_tokens,
         "model": "random init (untrained): outputs mostly run to their cap len(source)+extra_len"}
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    model_dir = ct2.export_ctranslate2(params, cfg, os.path.join(tmp, "ct2"), tokenizer_path=corpus.tokenizer_path)
    out["export_s"] = time.perf_counter() - start
    translators = {f"ct2_{c}": ct2.translator(model_dir, compute_type=c, threads=args.threads)
                   for c in ("float32", "int8")}
    runners = _runners(params, cfg, sources, pieces, args, translators)
    tokens, times = {}, {name: [] for name in runners}
    for name, fn in runners.items():
      tokens[name], first = _timed(fn)
      _log(f"[ctranslate2] {name}: warm-up pass {first:.1f}s, {tokens[name]} target tokens")
    for r in range(args.rounds):
      for name, fn in runners.items():
        times[name].append(_timed(fn)[1])
      _log(f"[ctranslate2] round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
  for name, t in times.items():
    s = float(np.median(t))
    out[name] = {"file_s": s, "sentences_per_s": len(sources) / s, "target_tokens": tokens[name],
                 "tokens_per_s": tokens[name] / s, "times": t}
  for search in ("greedy", "beam4"):
    out[f"ours_vs_ct2_float32_{search}"] = (out[f"ours_{search}"]["tokens_per_s"]
                                            / out[f"ct2_float32_{search}"]["tokens_per_s"])
  return out


def _timed(fn):
  start = time.perf_counter()
  value = fn()
  return value, time.perf_counter() - start


def _ours_fixed(fn, params, inputs, cfg):
  out, seconds = _timed(lambda: np.asarray(fn(params, inputs)))
  return sorted({int(np.sum((o != cfg.pad_id) & (o != cfg.eos_id))) for o in out}), seconds


def ct2_fixed(translator, pieces: list, beam: int, length: int):
  """One timed CTranslate2 call with every hypothesis exactly `length` pieces: (the set of lengths, seconds)."""
  out, seconds = _timed(lambda: translator.translate_batch(
      pieces, beam_size=beam, length_penalty=0.6 if beam > 1 else 0.0, max_decoding_length=length,
      min_decoding_length=length, max_batch_size=len(pieces)))
  return sorted({len(r.hypotheses[0]) for r in out}), seconds


def _warm_then_timed(fn):
  """`fn()` once untimed, then again: the result of the second call (`run_fixed`)."""
  fn()
  return fn()


def in_own_process(fn, *args):
  """`fn(*args)` in a fresh (spawned) process that exits afterwards."""
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(fn, *args).result()


def ct2_fixed_alone(model_dir: str, pieces: list, beam: int, length: int, threads: int):
  """`ct2_fixed` in a process of its own (`run_fixed`): one untimed call, then the timed one."""
  translator = ct2.translator(model_dir, compute_type="float32", threads=threads)
  return _warm_then_timed(functools.partial(ct2_fixed, translator, pieces, beam, length))


def run_fixed(args, corpus, cfg, params) -> dict:
  """Greedy and beam 4, ours vs CTranslate2 fp32: `args.fixed_sources` test sources in one batch, every output
  exactly `args.fixed_len` tokens; target tokens/s (sources x fixed_len / median time over `args.rounds`).

  `args.ct2_process`: 'own' times each CTranslate2 call in a fresh process of its own (after one untimed call
  there), so neither runtime shares a process with the other's idle workers: CTranslate2's OpenMP workers
  keep spinning after a call and took a core from our next search in the same process (ours 3.27-4.21 s
  instead of 3.10-3.40 s per beam-4 batch, 2026-12-06); 'shared': both in this process, as before.
  In both modes every timed call follows an untimed call of the same runner, as the fresh process gives
  CTranslate2: the other runtime's call just before slowed our next one (beam 4: median 3.14 s, rounds up to
  3.74 s, against 3.02 s with no CTranslate2 call between ours, 2026-12-07; docs/performance.md)."""
  rng = np.random.default_rng(0)
  pick = rng.choice(len(corpus.test_sources), size=args.fixed_sources, replace=False)
  sources = [[int(x) for x in corpus.test_sources[i]] for i in pick]
  bucket = inference.length_bucket(max(len(s) for s in sources))
  inputs = np.full((len(sources), bucket), cfg.pad_id, np.int32)
  for r, s in enumerate(sources):
    inputs[r, :len(s)] = s
  inputs = jnp.asarray(inputs)
  pieces = [Tokenizer(corpus.tokenizer_path).pieces(s[:-1]) for s in sources]
  n, length = len(sources), args.fixed_len
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = ct2.export_ctranslate2(params, cfg, os.path.join(tmp, "ct2"), tokenizer_path=corpus.tokenizer_path)
    shared = None if args.ct2_process == "own" else ct2.translator(model_dir, compute_type="float32",
                                                                   threads=args.threads)
    runners = {}  # name -> () -> (the set of output lengths, seconds)
    for beam, name in ((1, "greedy"), (4, "beam4")):
      fn = common.fixed_length_search(cfg, beam, length)
      runners[f"ours_{name}"] = functools.partial(
          _warm_then_timed, functools.partial(_ours_fixed, fn, params, inputs, cfg))
      runners[f"ct2_float32_{name}"] = (
          functools.partial(in_own_process, ct2_fixed_alone, model_dir, pieces, beam, length, args.threads)
          if shared is None else functools.partial(
              _warm_then_timed, functools.partial(ct2_fixed, shared, pieces, beam, length)))
    # Every call warms itself up (ours compiles in the first untimed call), so no separate warm-up pass.
    lengths = {name: set() for name in runners}  # the output lengths of every timed call: `length` only
    times = {name: [] for name in runners}
    for r in range(args.rounds):
      for name, fn in runners.items():
        seen, seconds = fn()
        lengths[name].update(seen)
        times[name].append(seconds)
      _log(f"[ctranslate2 fixed] round {r + 1}/{args.rounds}: "
           + ", ".join(f"{k} {t[-1]:.2f}s" for k, t in times.items()))
  out = {"sources": n, "source_bucket": bucket, "output_len": length, "ct2_threads": args.threads,
         "ct2_process": args.ct2_process, "output_lengths_seen": {k: sorted(v) for k, v in lengths.items()}}
  for name, t in times.items():
    out[name] = {"file_s": float(np.median(t)), "tokens_per_s": n * length / float(np.median(t)), "times": t}
  for search in ("greedy", "beam4"):
    out[f"ours_vs_ct2_float32_{search}"] = out[f"ct2_float32_{search}"]["file_s"] / out[f"ours_{search}"]["file_s"]
  return out
