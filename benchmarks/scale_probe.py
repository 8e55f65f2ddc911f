r"""The input pipeline at WMT scale: start-up, memory and throughput of `experiments.train` on a WMT-like corpus.

    python -m benchmarks.scale_probe --pairs=100000,1000000,4500000 --root=/tmp/scale_probe

Builds, for each size, a parallel corpus from Multi30k (`../shared/data/multi30k`, or `--multi30k`): every line
joins 1-3 consecutive training sentences (seeded), ~124 characters per English line like news text, with
Multi30k's `val` as the validation split. Then runs `experiments.train` as a child process, as a new user would:
a tiny model, a 32k vocabulary, rows of 256 slots, `--steps` steps on a fresh workdir (vocabulary, dataset
preparation and tokenisation included), then again to twice the steps (a restart from the checkpoint). Prints
per size: time to the first training step (the first `step N/M` log line) and peak RSS of the child
(`os.wait4`'s `ru_maxrss`) for the first start and the restart, the tokenisation and vocabulary times the child
logged, the id shards' bytes on disk, the pipeline's packed target tokens/s (`pipeline.TrainStream` over the
workdir's shards in this process, `--tokens` slots per batch, after its first batch) and its packing efficiency.
Then the packing efficiency of the Multi30k recipe's own rows (64 slots, its `data.tokens_per_batch`). Last, whether
an epoch boundary stalls training: a run over a small corpus (`--epoch_pairs`, many epochs in `--epoch_steps`
steps) logs every step; the steps whose batch crosses an epoch boundary (the same stream replayed here) are
compared with all steps (median, p99, max seconds).

Timings only (nothing is trained to convergence); the machine is shared: run it under `flock -x`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import grain
import numpy as np
from absl import flags

import launch
from benchmarks import common
from experiments.configs import multi30k as multi30k_config
from transformer_jax.data import id_shards, packing, pipeline
from transformer_jax.data import tokenizer as tok_lib

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
TINY = ["--config.model.d_model=64", "--config.model.d_ff=128", "--config.model.num_heads=2",
        "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1"]


def build_corpus(multi30k: Path, directory: Path, pairs: int, seed: int = 0) -> float:
  """Writes `directory/{train,validation}.{en,de}` (`pairs` training lines); returns mean English characters."""
  directory.mkdir(parents=True, exist_ok=True)
  if (directory / "train.de").exists():
    return float("nan")
  en = (multi30k / "train.en").read_text(encoding="utf-8").splitlines()
  de = (multi30k / "train.de").read_text(encoding="utf-8").splitlines()
  rng = np.random.default_rng(seed)
  counts = rng.integers(1, 4, pairs)
  starts = np.cumsum(np.concatenate([[0], counts[:-1]])) % len(en)
  chars = 0
  with open(directory / "train.en", "w", encoding="utf-8") as fe, open(directory / "train.de", "w",
                                                                        encoding="utf-8") as fd:
    for block in range(0, pairs, 100_000):
      lines_en, lines_de = [], []
      for start, count in zip(starts[block:block + 100_000], counts[block:block + 100_000]):
        idx = [(start + j) % len(en) for j in range(count)]
        lines_en.append(" ".join(en[i] for i in idx))
        lines_de.append(" ".join(de[i] for i in idx))
      chars += sum(map(len, lines_en))
      fe.write("\n".join(lines_en) + "\n")
      fd.write("\n".join(lines_de) + "\n")
  for lang in ("en", "de"):
    (directory / f"validation.{lang}").write_text((multi30k / f"val.{lang}").read_text(encoding="utf-8"),
                                                  encoding="utf-8")
  return chars / pairs


def run_train(corpus: Path, workdir: Path, steps: int, tokens: int, vocab_size: int = 32_000) -> dict:
  """`experiments.train` as a child: seconds to its first step log line, peak RSS, what it logged (`log`)."""
  cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", "--config.data.dataset=parallel_text",
         f"--config.data.dir={corpus}", f"--config.data.vocab_size={vocab_size}", "--config.data.max_len=256",
         f"--config.data.tokens_per_batch={tokens}", "--config.model.max_len=256", *TINY,
         f"--config.num_train_steps={steps}", "--config.warmup_steps=1", "--config.log_every_steps=1",
         f"--config.checkpoint_every_steps={steps}", "--config.evals.loss.every_steps=0",
         "--config.evals.bleu.every_steps=0", "--config.evals.attention.every_steps=0",
         "--config.final_eval.split="]
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
  first_step, lines = None, []
  for line in proc.stderr:
    lines.append(line)
    if first_step is None and re.search(r"\] step \d+/\d+ \|", line):
      first_step = time.perf_counter() - start
  _, status, usage = os.wait4(proc.pid, 0)
  if status != 0:
    raise RuntimeError(f"experiments.train failed ({status}):\n{''.join(lines[-30:])}")
  text = "".join(lines)
  Path(f"{workdir}.{steps}.log").write_text(text)  # the child's log, for the breakdown
  found = lambda pattern: (float(m.group(1)) if (m := re.search(pattern, text)) else float("nan"))  # noqa: E731
  return {"first_step_s": first_step, "peak_rss_gb": usage.ru_maxrss / 2**20, "wall_s": time.perf_counter() - start,
          "log": text,
          "tokenise_s": found(r"Tokenised \d+ of the \d+ shards of \S+ into \S+ in ([\d.]+)s"),
          "efficiency": re.findall(r"padding efficiency of the next \d+ batches \(epoch \d+\): source ([\d.]+)%, "
                                   r"target ([\d.]+)%", text)}


def step_seconds(log: str) -> dict[int, float]:
  """{step: seconds since the previous step's log line} from a child's `step N/M |` lines (logged every step)."""
  stamps = {int(m.group(2)): 3600 * int(m.group(1)[:2]) + 60 * int(m.group(1)[3:5]) + float(m.group(1)[6:])
            for m in re.finditer(r"^I\d{4} (\d\d:\d\d:[\d.]+) .*\] step (\d+)/\d+ \|", log, re.M)}
  return {k: (t - stamps[k - 1]) % 86_400 for k, t in stamps.items() if k - 1 in stamps}


def epoch_boundaries(shards: id_shards.IdShards, tokens: int, row_length: int, steps: int) -> set[int]:
  """The training steps (1-based) whose batch holds the first pairs of a new epoch: the same stream the run read
  (seed 0, one process), replayed batch by batch."""
  stream = pipeline.TrainStream(shards, tokens_per_batch=tokens, row_length=row_length, pad_id=tok_lib.PAD_ID)
  boundaries = set()
  for step in range(1, steps + 1):
    first = stream.consumed  # stream index of the batch's first pair
    next(stream)
    last = stream.consumed - 1
    if last // stream.share > first // stream.share or (first and first % stream.share == 0):
      boundaries.add(step)
  return boundaries


def epoch_stalls(multi30k: Path, root: Path, pairs: int, steps: int, tokens: int) -> dict:
  """Step times of a run of `steps` steps over a corpus of `pairs` pairs (many epochs): at the steps whose batch
  crosses an epoch boundary against all steps. The pipeline computes no epoch plan, so none should stand out."""
  corpus, workdir = root / f"corpus_epochs_{pairs}", root / f"work_epochs_{pairs}"
  build_corpus(multi30k, corpus, pairs)
  if workdir.exists():
    shutil.rmtree(workdir)
  seconds = step_seconds(run_train(corpus, workdir, steps, tokens, vocab_size=2000)["log"])
  shards = id_shards.IdShards.newest(workdir / "data" / "train.ids")
  boundaries = epoch_boundaries(shards, tokens, 256, steps) & set(seconds)
  every = np.asarray([seconds[k] for k in sorted(seconds) if k > 2])  # steps 1-2 compile
  at = np.asarray([seconds[k] for k in sorted(boundaries) if k > 2])
  return {"steps": len(every), "boundaries": len(at), "median_s": float(np.median(every)),
          "p99_s": float(np.percentile(every, 99)), "max_s": float(every.max()),
          "boundary_median_s": float(np.median(at)), "boundary_max_s": float(at.max())}


def last_step(workdir: Path) -> int:
  """The newest checkpoint's step in `workdir` (a restart trains `--steps` past it)."""
  return max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


class _Unchunk(grain.experimental.FlatMapTransform):
  max_fan_out = packing.READ_CHUNK

  def flat_map(self, element):
    return element


def grain_first_fit(chunks: Callable[[int], list], rows: int, row_length: int, pad_id: int) -> Iterator[dict]:
  """grain's own first-fit packer and batching over `chunks` (what `packing.FirstFitBatches` replaces), with
  the pipeline's key names: the reference its batches equal (tests) and its speed is compared with."""
  chunk_stream = grain.MapDataset.range(1 << 40).map(chunks).to_iter_dataset()
  stream = grain.experimental.FlatMapIterDataset(chunk_stream, _Unchunk())
  packed = grain.experimental.FirstFitPackIterDataset(
      stream, length_struct={"inputs": row_length, "targets": row_length}, num_packing_bins=rows,
      shuffle_bins=False, padding_struct={"inputs": pad_id, "targets": pad_id})
  names = {"inputs_positions": "inputs_position", "targets_positions": "targets_position",
           "inputs_segment_ids": "inputs_segmentation", "targets_segment_ids": "targets_segmentation"}
  return iter(packed.batch(rows).map(lambda b: {names.get(k, k): v for k, v in b.items()}))


def _rate(batches: Iterator[dict], count: int) -> tuple[float, np.ndarray, int]:
  """(seconds, real (source, target) tokens, slots) of `count` batches after the first."""
  next(batches)
  start, real, slots = time.perf_counter(), np.zeros(2), 0
  for _ in range(count):
    batch = next(batches)
    real += [(batch["inputs_segmentation"] > 0).sum(), (batch["targets_segmentation"] > 0).sum()]
    slots += batch["inputs"].size
  return time.perf_counter() - start, real, slots


def pipeline_rate(shards: id_shards.IdShards, tokens: int, row_length: int, batches: int, rounds: int = 3) -> dict:
  """Packed target tokens/s of `TrainStream` over `shards` after its first batch, its packing efficiency, and
  the same stream's reading and packing without the prefetch thread, `packing.FirstFitBatches` against grain's
  `FirstFitPackIterDataset` (`grain_first_fit`), alternating, `rounds` each: the median ratio of their times."""
  stream = pipeline.TrainStream(shards, tokens_per_batch=tokens, row_length=row_length, pad_id=tok_lib.PAD_ID)
  seconds, real, slots = _rate(stream, batches)
  chunks = pipeline.ReadChunk(shards, stream.kept, stream.order)
  rows = stream.rows_per_batch
  times = {"ours": [], "grain": []}
  for _ in range(rounds):
    times["ours"].append(_rate(iter(packing.FirstFitBatches(chunks, rows, row_length, tok_lib.PAD_ID)),
                               batches)[0])
    times["grain"].append(_rate(grain_first_fit(chunks, rows, row_length, tok_lib.PAD_ID), batches)[0])
  return {"target_tokens_per_s": real[1] / seconds, "source_eff": real[0] / slots, "target_eff": real[1] / slots,
          "grain_over_ours": float(np.median(np.asarray(times["grain"]) / np.asarray(times["ours"]))),
          "grain_target_tokens_per_s": real[1] / float(np.median(times["grain"]))}


def multi30k_packing(multi30k: Path, root: Path, batches: int) -> tuple[float, float]:
  """Packing efficiency of the Multi30k recipe's rows (its max_len and tokens_per_batch, its 6k vocabulary)."""
  config = multi30k_config.get_config()
  en = (multi30k / "train.en").read_text(encoding="utf-8").splitlines()
  de = (multi30k / "train.de").read_text(encoding="utf-8").splitlines()
  path = root / "multi30k_spm.model"
  tok = tok_lib.Tokenizer(str(path)) if path.exists() else tok_lib.train_tokenizer(
      en + de, str(path), config.data.vocab_size)
  sources, targets = tok_lib.encode_pairs(tok, list(zip(en, de)))
  shards = id_shards.write_id_arrays(root / "multi30k_ids" / str(time.time_ns()), {"probe": 1}, sources, targets,
                                    tok.vocab_size)
  stream = pipeline.TrainStream(shards, tokens_per_batch=config.data.tokens_per_batch,
                                row_length=config.data.max_len, pad_id=tok.pad_id)
  return stream.padding_efficiency(batches)


FLAGS = flags.FLAGS


def _sizes(texts: list[str]) -> list[int]:
  """Corpus sizes of `--pairs` (integers, `1e6` forms allowed); ValueError names the flag."""
  try:
    sizes = [int(float(p)) for p in texts]
  except ValueError:
    raise ValueError(f"--pairs={','.join(texts)}: comma-separated integers expected") from None
  if not sizes or min(sizes) < 1:
    raise ValueError(f"--pairs={','.join(texts)}: positive corpus sizes expected")
  return sizes


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program: tests import this module)."""
  flags.DEFINE_list("pairs", ["100000", "1000000", "4500000"], "corpus sizes, comma-separated")
  flags.DEFINE_string("root", "/tmp/scale_probe", "corpora and workdirs go here")
  flags.DEFINE_string("multi30k", str(MULTI30K), "the Multi30k corpus directory (train.en, train.de, val.*)")
  flags.DEFINE_integer("steps", 3, "training steps of each run", lower_bound=1)
  flags.DEFINE_integer("tokens", 8 * 256, "slots per batch of the training runs")
  flags.DEFINE_integer("pipeline_tokens", 26_624, "slots per batch of the pipeline rate")
  flags.DEFINE_integer("pipeline_batches", 100, "batches of the pipeline rate")
  flags.DEFINE_bool("restart_only", False, "reuse existing workdirs (time restarts only)")
  flags.DEFINE_integer("epoch_pairs", 3000,
                       "corpus size of the epoch-boundary run (0: skip it); small, so it crosses many epochs")
  flags.DEFINE_integer("epoch_steps", 400, "steps of the epoch-boundary run")
  common.check_flag("pairs", _sizes)


@launch.program
def main() -> None:
  multi30k, root, sizes = Path(FLAGS.multi30k), Path(FLAGS.root), _sizes(FLAGS.pairs)
  if not (multi30k / "train.en").exists():
    raise FileNotFoundError(f"--multi30k={multi30k} has no train.en")
  print("pairs | chars/line | first start: to step 1, peak RSS | restart: to first step, peak RSS | tokenise | "
        "ids on disk | pipeline target tok/s | with grain's packer | packing src/tgt (rows of 256)", flush=True)
  for n in sizes:
    corpus, workdir = root / f"corpus_{n}", root / f"work_{n}"
    chars = build_corpus(multi30k, corpus, n)
    fresh = None if FLAGS.restart_only else run_train(corpus, workdir, FLAGS.steps, FLAGS.tokens)
    restart = run_train(corpus, workdir, last_step(workdir) + FLAGS.steps, FLAGS.tokens)
    shards = id_shards.IdShards.newest(workdir / "data" / "train.ids")
    disk = sum(os.path.getsize(p) for p in shards.directory.iterdir())
    rate = pipeline_rate(shards, FLAGS.pipeline_tokens, 256, FLAGS.pipeline_batches)
    first = f"{fresh['first_step_s']:.1f} s, {fresh['peak_rss_gb']:.2f} GB" if fresh else "-"
    print(f"{n:,} | {chars:.0f} | {first} | {restart['first_step_s']:.1f} s, {restart['peak_rss_gb']:.2f} GB | "
          f"{fresh['tokenise_s'] if fresh else float('nan'):.1f} s | {disk / 2**20:.0f} MiB | "
          f"{rate['target_tokens_per_s']:,.0f} | {rate['grain_target_tokens_per_s']:,.0f} "
          f"({rate['grain_over_ours']:.2f}x our packer's time) | "
          f"{100 * rate['source_eff']:.1f}% / {100 * rate['target_eff']:.1f}%",
          flush=True)
  src, tgt = multi30k_packing(multi30k, root, FLAGS.pipeline_batches)
  print(f"Multi30k recipe rows of 64: packing source {100 * src:.1f}%, target {100 * tgt:.1f}%", flush=True)
  if FLAGS.epoch_pairs:
    e = epoch_stalls(multi30k, root, FLAGS.epoch_pairs, FLAGS.epoch_steps, FLAGS.tokens)
    print(f"Epoch boundaries ({FLAGS.epoch_pairs:,} pairs, {e['steps']} steps logged one by one, {e['boundaries']} "
          f"of them cross an epoch boundary): step seconds median {e['median_s']:.4f}, p99 {e['p99_s']:.4f}, "
          f"max {e['max_s']:.4f}; at the boundaries median {e['boundary_median_s']:.4f}, "
          f"max {e['boundary_max_s']:.4f} ({e['boundary_max_s'] / e['median_s']:.2f}x the median step)", flush=True)


if __name__ == "__main__":
  define_flags()
  launch.run(main)
