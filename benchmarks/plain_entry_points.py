r"""Decoding speed as an importer sees it: the library's documented entry points in a plain script, vs CTranslate2.

    python benchmarks/plain_entry_points.py --rounds=3                       # as a user's script: no huge pages
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/plain_entry_points.py --rounds=3

Not a `python -m` program on purpose: started as a file, Python never imports `experiments`, so the programs'
restart with glibc huge pages (`launch/huge_pages.py`) does not happen unless the caller sets the tunable,
as for any code that imports the library. The shapes are issue 67's independent harness: the base preset,
vocabulary 8k (`benchmarks.common.load_corpus`'s SentencePiece model), random weights, `--sources` sources of
`--src_len` random ids (EOS last), outputs of `--out_len` tokens, CTranslate2 fp32 with `--threads` threads on
the same model (`interop.ctranslate2`), each CTranslate2 call in a fresh process of its own (its OpenMP workers
spin after a call and would take a core from ours; `--ct2_process=shared` keeps it in this process).

Runners (each timed call after an untimed one of the same runner; medians over `--rounds`):
  jit_greedy / jit_beam4   `decoding.greedy_search` / `decoding.beam_search` (jitted by the library),
                           `max_decode_len = --out_len`
  translate_greedy / _beam4  `decoding.inference.translate_ids` (length buckets, per-row limits
                           `src_len + extra_len = --out_len`)
  ct2_greedy / ct2_beam4   `translate_batch` with every output exactly `--out_len` pieces (min = max length)
  gemm_greedy / gemm_beam4 the decoder step's dense matmuls alone (`_gemm_floor`: the same weight shapes and
                           rows, `--out_len` steps in one jitted loop, no attention and no search): what XLA's
                           matrix products alone take here, the floor of ours
Each runner's model GFLOP/s (the step's matmul FLOPs, `_step_flops`, over its time) is printed beside it.
Output lengths are printed: a random model may end a hypothesis early, which shortens that runner's work.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

# Started as a file, Python puts benchmarks/ first on the path, where profile.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import common, ctranslate2_bench  # noqa: E402
from transformer_jax import decoding  # noqa: E402
from transformer_jax.data.tokenizer import Tokenizer  # noqa: E402
from transformer_jax.decoding import inference  # noqa: E402
from transformer_jax.interop import ctranslate2 as ct2  # noqa: E402
from transformer_jax.training.steps import init_params  # noqa: E402

flags.DEFINE_integer("rounds", 3, "Timed rounds (medians reported).", lower_bound=1)
flags.DEFINE_integer("sources", 32, "Sources in the batch.", lower_bound=1)
flags.DEFINE_integer("src_len", 20, "Source length (random ids, EOS last).", lower_bound=2)
flags.DEFINE_integer("out_len", 50, "Output length limit.", lower_bound=1)
flags.DEFINE_integer("threads", 2, "CTranslate2 intra-op threads.", lower_bound=1)
flags.DEFINE_enum("ct2_process", "own", ["own", "shared"], "CTranslate2 calls in a fresh process, or in this one.")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
FLAGS = flags.FLAGS


def _lengths(tokens, cfg) -> list[int]:
  tokens = np.asarray(tokens).reshape(-1, np.asarray(tokens).shape[-1])
  return sorted({int(np.sum((t != cfg.pad_id) & (t != cfg.eos_id))) for t in tokens})


def _ours(cfg, params, inputs, sources):
  """name -> () -> (output lengths, seconds), through the documented entry points."""
  n = FLAGS.out_len

  def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start

  def jit_greedy():
    tokens, seconds = timed(lambda: decoding.greedy_search(params, cfg, inputs, n)[0])
    return _lengths(tokens, cfg), seconds

  def jit_beam4():
    tokens, seconds = timed(lambda: decoding.beam_search(params, cfg, inputs, 4, 0.6, n)[0][:, 0])
    return _lengths(tokens, cfg), seconds

  def translate(beam):
    def run():
      start = time.perf_counter()
      out = inference.translate_ids(params, cfg, sources, beam_size=beam, extra_len=n - FLAGS.src_len + 1,
                                    batch_size=len(sources))
      return sorted({len(o) for o in out}), time.perf_counter() - start
    return run

  return {"jit_greedy": jit_greedy, "jit_beam4": jit_beam4, "translate_greedy": translate(1),
          "translate_beam4": translate(4)}


def _step_flops(cfg, rows: int) -> float:
  """The matmul FLOPs of one decoder step over `rows` rows: per layer the self-attention q/k/v and output
  projections, the cross-attention query and output projections (its K/V are projected once a batch), the
  feed-forward, then the tied output projection; attention itself (`rows x (t + src_len) x d`) is left out."""
  d, f = cfg.d_model, cfg.d_ff
  return 2.0 * rows * (cfg.num_decoder_layers * (4 * d * d + 2 * d * d + 2 * d * f) + d * cfg.vocab_size)


def _gemm_floor(cfg, rows: int):
  """() -> (None, seconds): `_step_flops`' matrix products alone, `--out_len` dependent steps of `rows` rows."""
  d, f = cfg.d_model, cfg.d_ff
  keys = iter(jax.random.split(jax.random.PRNGKey(1), 8 * cfg.num_decoder_layers + 2))
  weight = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.02  # noqa: E731
  layers = [(weight(d, 3 * d), weight(d, d), weight(d, d), weight(d, d), weight(d, f), weight(f, d))
            for _ in range(cfg.num_decoder_layers)]
  embedding, x0 = weight(cfg.vocab_size, d), weight(rows, d)

  @jax.jit
  def run(layers, embedding, x):
    def step(_, x):
      for qkv, out, cross_q, cross_out, wi, wo in layers:
        x = x + (x @ qkv)[:, :d] @ out
        x = x + (x @ cross_q) @ cross_out
        x = x + jax.nn.relu(x @ wi) @ wo
      return x + (x @ embedding.T)[:, :d] * 1e-3  # the logits feed the next step, as a chosen token does
    return jax.lax.fori_loop(0, FLAGS.out_len, step, x)

  def timed():
    start = time.perf_counter()
    jax.block_until_ready(run(layers, embedding, x0))
    return [], time.perf_counter() - start
  return timed


def _ct2(model_dir: str, pieces: list):
  def runner(beam):
    if FLAGS.ct2_process == "own":
      return lambda: ctranslate2_bench.in_own_process(
          ctranslate2_bench.ct2_fixed_alone, model_dir, pieces, beam, FLAGS.out_len, FLAGS.threads)
    translator = ct2.translator(model_dir, compute_type="float32", threads=FLAGS.threads)
    return lambda: ctranslate2_bench.ct2_fixed(translator, pieces, beam, FLAGS.out_len)
  return {"ct2_greedy": runner(1), "ct2_beam4": runner(4)}


def main(argv):
  del argv
  corpus = common.load_corpus()
  cfg = common.preset_config("base", corpus.vocab_size)
  params = jax.device_put(init_params(cfg, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(0)
  sources = [list(rng.integers(4, cfg.vocab_size, FLAGS.src_len - 1)) + [cfg.eos_id] for _ in range(FLAGS.sources)]
  inputs = jax.numpy.asarray(np.asarray(sources, np.int32))
  pieces = [Tokenizer(corpus.tokenizer_path).pieces(s[:-1]) for s in sources]
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = ct2.export_ctranslate2(params, cfg, os.path.join(tmp, "ct2"), tokenizer_path=corpus.tokenizer_path)
    runners = {**_ours(cfg, params, inputs, sources), **_ct2(model_dir, pieces),
               "gemm_greedy": _gemm_floor(cfg, FLAGS.sources), "gemm_beam4": _gemm_floor(cfg, 4 * FLAGS.sources)}
    times, lengths = {k: [] for k in runners}, {k: set() for k in runners}
    for r in range(FLAGS.rounds):
      for name, fn in runners.items():
        if not name.startswith("ct2") or FLAGS.ct2_process == "shared":
          fn()  # untimed (ours: compiles in the first round)
        seen, seconds = fn()
        times[name].append(seconds)
        lengths[name].update(seen)
      print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr)
  result = {"glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "ct2_process": FLAGS.ct2_process,
            "sources": FLAGS.sources, "src_len": FLAGS.src_len, "out_len": FLAGS.out_len,
            "median_s": {k: float(np.median(v)) for k, v in times.items()},
            "output_lengths": {k: sorted(v) for k, v in lengths.items()}}
  for search, beam in (("greedy", 1), ("beam4", 4)):
    for ours in ("jit", "translate"):
      result[f"{ours}_{search}_vs_ct2"] = result["median_s"][f"ct2_{search}"] / result["median_s"][f"{ours}_{search}"]
    flops = _step_flops(cfg, beam * FLAGS.sources) * FLAGS.out_len
    for name in (f"jit_{search}", f"translate_{search}", f"ct2_{search}", f"gemm_{search}"):
      result.setdefault("model_gflops_per_s", {})[name] = flops / result["median_s"][name] / 1e9
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    common.dump_json(result, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
