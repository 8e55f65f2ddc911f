r"""Decoding speed as an importer sees it: the library's documented entry points in a plain script, vs CTranslate2.

    python benchmarks/plain_entry_points.py --rounds=3                       # as a user's script: no huge pages
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/plain_entry_points.py --rounds=3

Not a `python -m` program on purpose: started as a file, Python never imports `experiments`, so the programs'
restart with glibc huge pages (`experiments/huge_pages.py`) does not happen unless the caller sets the tunable,
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


def _ct2(model_dir: str, pieces: list):
  def runner(beam):
    if FLAGS.ct2_process == "own":
      return lambda: ctranslate2_bench._in_own_process(  # noqa: SLF001 (the benchmark's own runner)
          ctranslate2_bench._ct2_fixed_alone, model_dir, pieces, beam, FLAGS.out_len, FLAGS.threads)  # noqa: SLF001
    translator = ct2.translator(model_dir, compute_type="float32", threads=FLAGS.threads)
    return lambda: ctranslate2_bench._ct2_fixed(translator, pieces, beam, FLAGS.out_len)  # noqa
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
    runners = {**_ours(cfg, params, inputs, sources), **_ct2(model_dir, pieces)}
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
  for search in ("greedy", "beam4"):
    for ours in ("jit", "translate"):
      result[f"{ours}_{search}_vs_ct2"] = result["median_s"][f"ct2_{search}"] / result["median_s"][f"{ours}_{search}"]
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    common.dump_json(result, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
