r"""Where a training or decoding step's time goes: a `jax.profiler` trace aggregated by XLA op and model source.

    python -m benchmarks.profile --preset=tiny            # CPU preset, 4096-token batches
    python -m benchmarks.profile --preset=base --vocab=37000 --steps=2
    python -m benchmarks.profile --preset=base --search=beam4 --sources=64   # one decoding batch
    python -m benchmarks.profile --preset=base --search=beam4 --sources=32 --fixed_len=50

With `--search=greedy|beam4` it traces `translate_ids`' compiled search on one batch of `--sources` multi30k
test2016 sources of the `--bucket` length bucket (random init, outputs capped at len(source)+50, as the
ctranslate2 bench section), and reports per decoder step.

Compiles the trainer's own train step (`common.build_train_step`: `factories.create_state` +
`factories.make_train_step` of the default recipe with the preset's sizes, one-device mesh) on the
benchmark's packed multi30k batches, traces `--steps` steps and
reads the trace back (`jax.profiler.ProfileData`). Every XLA op event is mapped to its HLO instruction in
the compiled module (`compiled.as_text()`): its kind (`ynn_fusion` = matmul, `copy_*`/`transpose_*` =
layout copies, other fusions = elementwise/reduce passes), its output shape and the JAX source op it came
from (`op_name` metadata: the flax module path and the jnp op). Printed: op time per step (summed over the
worker threads), how much of the step had 0, 1 or 2+ ops running, and the shares by kind, by model area
and by op. `--trace_dir` keeps the raw trace for TensorBoard / Perfetto. A training run's own trace
(`config.profile_steps`, `<workdir>/profile`, `transformer_jax.run.profiling`) is the same format: `op_events`
reads it too (tests/test_trackers.py does).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np
from absl import flags

import launch
from benchmarks import common
from transformer_jax import sharding
from transformer_jax.decoding import inference
from transformer_jax.decoding.generate import DecodeOptions
from transformer_jax.training.steps import init_params

# First match wins: the finer module paths before the blocks that contain them.
AREAS = (("Dropout", "dropout"), ("layer_norm", "layer norm"), ("attend", "tied logits"),
         ("/query/", "attention q/k/v/out projections"), ("/key/", "attention q/k/v/out projections"),
         ("/value/", "attention q/k/v/out projections"), ("/out/", "attention q/k/v/out projections"),
         ("attention", "attention scores, mask, softmax"), ("ffn", "feed-forward"), ("embed", "embedding"),
         ("positions", "positions"))
# A decoding batch's areas: the first entry whose substrings all occur in an op's source (`op_name`) names it.
DECODE_AREAS = ((("Transformer.encode",), "encoder and cross-attention K/V (once a batch)"),
                (("_cached_memory",), "encoder and cross-attention K/V (once a batch)"),
                (("log_softmax",), "output projection + log-softmax [rows, vocab]"),
                (("attend",), "output projection + log-softmax [rows, vocab]"),
                (("_fused_self_projections",), "attention q/k/v/out projections"),
                (("/query/",), "attention q/k/v/out projections"), (("/out/",), "attention q/k/v/out projections"),
                (("self_attention", "dynamic_update_slice"), "self-attention cache write"),
                (("self_attention",), "self-attention over the cache (scores, mask, softmax, sum)"),
                (("cross_attention",), "cross-attention over the source"), (("ffn",), "feed-forward"),
                (("layer_norm",), "layer norm"), (("Transformer.decode",), "embedding, positions, rest of the step"),
                (("while/body",), "beam choice: top-k over beam x vocab, finished list, ancestry reorder"),
                (("while/cond",), "beam choice: top-k over beam x vocab, finished list, ancestry reorder"))
# A conditional's event spans the events of the branch it runs (counted themselves): `cond.*` is skipped.
SKIP = ("ThunkExecutor", "ThreadpoolListener", "end:", "while", "call", "conditional", "cond.")


def hlo_instructions(hlo_text: str) -> dict:
  """instruction name -> (output type, opcode, op_name metadata) for every instruction of the module."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+?) ([\w\-]+)\((.*)$", hlo_text, re.M):
    name, typ, opcode, rest = m.groups()
    op_name = re.search(r'op_name="([^"]*)"', rest)
    out[name] = (typ, opcode, op_name.group(1) if op_name else "")
  return out


def area(op_name: str) -> str:
  where = "backward" if "transpose(" in op_name else "forward"
  for key, label in AREAS:
    if key in op_name:
      return f"{label} ({where})"
  if "optax" in op_name or "adam" in op_name.lower() or op_name.startswith("jit(train_step)/mul"):
    return "optimizer / other"
  return f"loss and the rest ({where})"


def decode_area(op_name: str) -> str:
  """A decoding op's area (`DECODE_AREAS`); ops without metadata (copies XLA added, thread-pool waits) apart."""
  if not op_name:
    return "no source (layout copies XLA added, thread-pool waits)"
  return next((label for keys, label in DECODE_AREAS if all(k in op_name for k in keys)),
              "outside the loop (setup, results)")


def op_events(trace_dir: str):
  """(start_ns, end_ns, thread, name) of every XLA op event on the host CPU plane."""
  path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
  events = []
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for e in line.events:
        if not e.name.startswith(SKIP):
          events.append((e.start_ns, e.start_ns + e.duration_ns, line.name, e.name))
  return events


def concurrency(events) -> dict:
  """Share of the traced span during which 0, 1, 2+ ops were running."""
  start, end = min(e[0] for e in events), max(e[1] for e in events)
  points = sorted([(s, 1) for s, _, _, _ in events] + [(e, -1) for _, e, _, _ in events])
  busy, running, last = collections.Counter(), 0, start
  for t, d in points:
    busy[min(running, 2)] += t - last
    running, last = running + d, t
  return {k: v / (end - start) for k, v in sorted(busy.items())}, end - start


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module for `op_events`)."""
  flags.DEFINE_enum("preset", "tiny", ["tiny", "base", "big"], "model preset")
  flags.DEFINE_integer("vocab", 0, "0: the benchmark tokenizer's (8000)")
  flags.DEFINE_integer("tokens", 4096, "training: slots per packed batch")
  flags.DEFINE_integer("row_length", 64, "training: slots per packed row")
  flags.DEFINE_integer("steps", 3, "training: traced steps")
  flags.DEFINE_enum("search", "train", ["train", "greedy", "beam4"],
                    "profile the train step (default) or a decoding batch")
  flags.DEFINE_integer("sources", 64, "decoding: sources in the batch")
  flags.DEFINE_integer("bucket", 16, "decoding: their padded source length")
  flags.DEFINE_integer("fixed_len", 0, "decoding: every output exactly this long (`common.fixed_length_search`, "
                       "the searches of the fixed-shape CTranslate2 comparison); 0: translate_ids' search, capped at "
                       "len+50")
  flags.DEFINE_integer("top", 15, "rows of each printed ranking")
  flags.DEFINE_string("trace_dir", "", "keep the raw trace here (default: a temporary directory)")


@launch.program
def main() -> None:
  program = _train_program(FLAGS) if FLAGS.search == "train" else _decode_program(FLAGS)
  _report(FLAGS, *program)


def _train_program(args):
  """(compiled step, run once, steps per run, title) for the trainer's step on one packed batch."""
  corpus = common.load_corpus(args.row_length)
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
  batches = common.packed_stream(corpus, args.tokens, args.row_length)
  built = common.build_train_step(common.train_config(cfg), mesh=sharding.single_device_mesh())
  batch = built.shard(next(batches))
  state, rng = built.state, built.rng
  step = built.step.lower(state, batch, rng).compile()
  carry = {"state": state}

  def run_once():
    carry["state"], metrics = step(carry["state"], batch, rng)
    jax.block_until_ready(metrics)

  flops = common.model_flops(cfg, args.tokens // args.row_length, args.row_length, args.row_length)["total"]
  title = (f"{args.preset} (d={cfg.d_model}, V={cfg.vocab_size}), {args.tokens} tokens/batch: "
           + "step {wall:.3f}s (traced), {gflops:.0f} model GFLOP/s")
  return step, run_once, 1, title, flops


def _decode_program(args):
  """(compiled search, run once, decoder steps per run, title) for one batch of `translate_ids`."""
  corpus = common.load_corpus()
  cfg = common.preset_config(args.preset, args.vocab or corpus.vocab_size)
  params = jax.device_put(nn.unbox(init_params(cfg, jax.random.key(0))))
  prepared = [p for p in inference.prepare_sources(corpus.test_sources, cfg, 50, True)
              if inference.source_bucket(p[1], cfg) == args.bucket][:args.sources]
  if not prepared:
    raise ValueError(f"--bucket={args.bucket}: no test source falls in that length bucket")
  inputs = np.full((len(prepared), args.bucket), cfg.pad_id, np.int32)
  limits = np.zeros((len(prepared),), np.int32)
  for r, (_, ids, limit) in enumerate(prepared):
    inputs[r, :len(ids)] = ids
    limits[r] = min(limit, args.bucket + 50)
  beam = 4 if args.search == "beam4" else 1
  if args.fixed_len:
    compiled = common.fixed_length_search(cfg, beam, args.fixed_len).lower(params, inputs).compile()
    run_once = lambda: jax.block_until_ready(compiled(params, inputs))  # noqa: E731
    steps = args.fixed_len
  else:
    options = DecodeOptions(beam_size=beam, alpha=0.6, token_log_probs=False)
    search = inference.search_program(cfg, options, args.bucket + 50)
    extra = (np.zeros((len(prepared),), np.int32), np.int32(0), np.zeros((len(prepared), 0), np.int32),
             np.zeros((len(prepared),), np.int32))  # indices, seed, prefix tokens and lengths (unused)
    compiled = search.lower((params,), inputs, limits, *extra).compile()
    run_once = lambda: jax.block_until_ready(compiled((params,), inputs, limits, *extra))  # noqa: E731
    steps = int(limits.max())
  title = (f"{args.search} {args.preset} (d={cfg.d_model}, V={cfg.vocab_size}), {len(prepared)} sources of "
           f"bucket {args.bucket} ({len(prepared) * beam} decoder rows"
           + (f", every output {args.fixed_len} tokens" if args.fixed_len else "") + "): "
           "{wall:.3f}s per decoder step (traced)")
  return compiled, run_once, steps, title, 0.0


def _report(args, compiled, run_once, steps_per_run: int, title: str, flops: float):
  """Traces `args.steps` runs (after two untimed ones) and prints the op time by kind, area and op."""
  runs = args.steps if args.search == "train" else 1
  for _ in range(2 if args.search == "train" else 1):
    run_once()
  trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="profile_")
  start = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    for _ in range(runs):
      run_once()
  steps = runs * steps_per_run
  wall = (time.perf_counter() - start) / steps

  instructions = hlo_instructions(compiled.as_text())
  events = op_events(trace_dir)
  per_op = collections.Counter()
  for s, e, _, name in events:
    per_op[name] += e - s
  total = sum(per_op.values())
  shares, span = concurrency(events)
  print(title.format(wall=wall, gflops=flops / wall / 1e9) + f"; op time {total / steps / 1e9:.3f}s per step "
        "summed over threads; ops running during the traced span: "
        + ", ".join(f"{k}{'+' if k == 2 else ''}: {v:.0%}" for k, v in shares.items()))
  by_kind, by_area = collections.Counter(), collections.Counter()
  for name, t in per_op.items():
    by_kind[re.sub(r"[.\d]+$", "", name)] += t
    op_name = instructions.get(name, ("", "", ""))[2]
    by_area[area(op_name) if args.search == "train" else decode_area(op_name)] += t
  for title_, counter in (("by op kind", by_kind), ("by model area", by_area)):
    print(f"\n{title_} (share of op time)")
    for key, t in counter.most_common(args.top):
      print(f"  {t / total:6.1%}  {key}")
  print(f"\ntop {args.top} ops (ms per step, share, output, source)")
  for name, t in per_op.most_common(args.top):
    typ, _, op_name = instructions.get(name, ("?", "?", ""))
    print(f"  {t / steps / 1e6:7.1f} {t / total:6.1%}  {name:28s} {typ[:28]:28s} {op_name[-90:]}")
  print(f"\ntrace: {trace_dir}")


if __name__ == "__main__":
  define_flags()
  launch.run(main)
