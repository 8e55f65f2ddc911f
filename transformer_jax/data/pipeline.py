"""The training input pipeline: token ids in sharded ArrayRecord files, streamed through grain, packed per host.

    <workdir>/data/<split>.ids/<key16>/manifest.json              what the ids were encoded from (token_cache key)
    <workdir>/data/<split>.ids/<key16>/ids-00003-of-00023.array_record   one record per non-blank pair
    <workdir>/data/<split>.ids/<key16>/lengths-00003-of-00023.npy        [pairs, 2] uint32 (source, target) lengths
    <workdir>/data/<split>.ids/<key16>/done-00003-of-00023.json          the shard is complete: its counts

The training split is tokenised once (`write_shards`): the split is cut into shards of ~`SHARD_PAIRS` pairs
(`tfds.even_splits`), process `p` of `n` encodes shards `p, p + n, ...`, each written under a temporary name and
renamed into place with a `done-*.json` last, so an interrupted preparation resumes at the first missing shard.
A record holds both sides' ids (EOS included; uint16 when the vocabulary fits, else int32) and the two UTF-8
texts (for subword sampling in the pipeline's workers), with a 16-byte header of four uint32 lengths.

The stream (`TrainStream`, grain): the kept pairs (both sides at most `row_length` tokens, from the `lengths`
files; the index of kept records is the only per-pair state in memory, 4 bytes a pair) are shuffled globally by
`(seed, epoch)` (`grain.MapDataset.shuffle`: an index permutation, nothing materialised), process `p` takes
every `n`-th position of each epoch's order (a disjoint share, the shares' union is every kept pair once),
reads and decodes its records in threads, packs them first-fit into `rows_per_batch // n` rows of `row_length`
slots (`grain.experimental.FirstFitPackIterDataset`: the same first-fit as the paper-era planner, and across
epoch boundaries) and batches those rows; a background thread keeps batches ready
(`grain.experimental.ThreadPrefetchIterDataset`). The iterator state (grain's, a few integers) is the data
position saved in every checkpoint; restoring it replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np
from etils import epath

from transformer_jax.data import subword_sampling

BATCH_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
              "targets_segmentation")
FORMAT = 1
SHARD_PAIRS = 200_000  # pairs per shard: ~40 MB of ids and text at WMT's ~125 characters a line
_HEADER = 4  # uint32: source ids, target ids, source bytes, target bytes


# -- records ------------------------------------------------------------------------------------------------
def encode_record(source: Sequence[int], target: Sequence[int], source_text: str, target_text: str,
                  dtype: Any) -> bytes:
  """One pair as bytes: header `[4]` uint32, both sides' ids as `dtype`, both texts as UTF-8."""
  src_bytes, tgt_bytes = source_text.encode("utf-8"), target_text.encode("utf-8")
  header = np.asarray([len(source), len(target), len(src_bytes), len(tgt_bytes)], np.uint32)
  ids = np.asarray([*source, *target], dtype)
  return header.tobytes() + ids.tobytes() + src_bytes + tgt_bytes


def decode_record(raw: bytes, dtype: Any, texts: bool = False) -> dict[str, Any]:
  """`{"inputs", "targets"}` int32 `[len]` of a record (and `"texts"` (source, target) when asked)."""
  n_src, n_tgt, b_src, b_tgt = (int(x) for x in np.frombuffer(raw, np.uint32, _HEADER))
  ids = np.frombuffer(raw, dtype, n_src + n_tgt, offset=4 * _HEADER).astype(np.int32)
  out = {"inputs": ids[:n_src], "targets": ids[n_src:]}
  if texts:
    start = 4 * _HEADER + ids.size * np.dtype(dtype).itemsize
    out["texts"] = (raw[start:start + b_src].decode("utf-8"), raw[start + b_src:start + b_src + b_tgt].decode())
  return out


def shard_name(kind: str, index: int, count: int, suffix: str) -> str:
  return f"{kind}-{index:05d}-of-{count:05d}.{suffix}"


def key_directory(root: str | os.PathLike, key: Mapping) -> epath.Path:
  """`root/<16 hex digits of SHA-256 of the key>`: another vocabulary or dataset never reads these ids."""
  digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
  return epath.Path(root) / digest


def write_shard(directory: epath.Path, index: int, count: int, texts: Sequence[tuple[str, str]],
                sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], dtype: Any,
                skipped_blank: int = 0) -> dict:
  """Writes shard `index` of `count` (the pairs' texts and ids, aligned) as its three files, `done-*` last."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  ids_path = directory / shard_name("ids", index, count, "array_record")
  tmp = directory / f".{ids_path.name}.tmp"
  writer = ArrayRecordWriter(os.fspath(tmp), "group_size:1,uncompressed")  # random access: one record a group
  for (s_text, t_text), s, t in zip(texts, sources, targets):
    writer.write(encode_record(s, t, s_text, t_text, dtype))
  writer.close()
  tmp.replace(ids_path)
  lengths = np.asarray([[len(s), len(t)] for s, t in zip(sources, targets)], np.uint32).reshape(-1, 2)
  tmp = directory / f".lengths-{index}.tmp.npy"
  with tmp.open("wb") as f:
    np.save(f, lengths)
  tmp.replace(directory / shard_name("lengths", index, count, "npy"))
  done = {"pairs": len(lengths), "skipped_blank": int(skipped_blank),
          "tokens": [int(lengths[:, 0].sum()), int(lengths[:, 1].sum())]}
  (directory / shard_name("done", index, count, "json")).write_text(json.dumps(done))
  return done


def write_manifest(directory: epath.Path, key: Mapping, shards: int, vocab_size: int) -> np.dtype:
  """Creates `directory` with its manifest (the key, the shard count, the id dtype); returns the dtype."""
  directory.mkdir(parents=True, exist_ok=True)
  dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
  manifest = dict(key, shards_format=FORMAT, shards=shards, dtype=dtype.name)
  (directory / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
  return dtype


def _encode_shard(directory: epath.Path, index: int, count: int, pairs: Sequence[tuple[str, str]],
                  tokenizer: Any, dtype: Any) -> dict:
  """Encodes one shard's pairs (blank ones skipped, counted) and writes it (`write_shard`)."""
  kept = [(s, t) for s, t in pairs if not tokenizer.is_blank(s) and not tokenizer.is_blank(t)]
  sources = tokenizer.encode_batch([s for s, _ in kept])
  targets = tokenizer.encode_batch([t for _, t in kept], target=True)
  return write_shard(directory, index, count, kept, sources, targets, dtype, len(pairs) - len(kept))


def write_id_arrays(directory: epath.Path, key: Mapping, sources: Sequence[np.ndarray],
                    targets: Sequence[np.ndarray], vocab_size: int, shard_pairs: int = SHARD_PAIRS) -> "IdShards":
  """Shards of pairs already encoded (no texts: subword sampling cannot read them), for tests and benchmarks."""
  count = max(1, -(-len(sources) // shard_pairs))
  dtype = write_manifest(directory, key, count, vocab_size)
  for i in range(count):
    lo, hi = i * shard_pairs, min((i + 1) * shard_pairs, len(sources))
    write_shard(directory, i, count, [("", "")] * (hi - lo), sources[lo:hi], targets[lo:hi], dtype)
  return IdShards.open(directory)


def write_shards(directory: epath.Path, key: Mapping, shard_splits: Sequence[str],
                 read_pairs: Callable[[str], Sequence[tuple[str, str]]], tokenizer: Any, *,
                 process_index: int = 0, process_count: int = 1, only_mine: bool = True) -> int:
  """Writes the shards of `shard_splits` (tfds split strings, in order) missing in `directory`: this process's
  (`i % process_count == process_index`) when `only_mine`, else every missing one. Returns how many it wrote.

  Progress (shards, pairs, pairs/s, time left) is logged after every shard. `directory` must be local
  (ArrayRecord's writer opens local files only)."""
  dtype = write_manifest(directory, key, len(shard_splits), tokenizer.vocab_size)
  count = len(shard_splits)
  todo = [i for i in range(count) if not (directory / shard_name("done", i, count, "json")).exists()
          and (not only_mine or i % process_count == process_index)]
  start, pairs_done = time.perf_counter(), 0
  for n, i in enumerate(todo, start=1):
    done = _encode_shard(directory, i, count, read_pairs(shard_splits[i]), tokenizer, dtype)
    pairs_done += done["pairs"] + done["skipped_blank"]
    rate = pairs_done / max(time.perf_counter() - start, 1e-9)
    logging.info("Token ids: shard %d/%d written (%d of this process's %d); %d pairs, %.0f pairs/s, ~%.0fs left",
                 i + 1, count, n, len(todo), pairs_done, rate, (len(todo) - n) * pairs_done / n / max(rate, 1e-9))
  return len(todo)


@dataclasses.dataclass
class IdShards:
  """A complete directory of id shards: its files, manifest, and the (source, target) lengths of every pair."""

  directory: epath.Path
  manifest: dict
  paths: list[str]
  lengths: np.ndarray  # [pairs, 2] uint32
  skipped_blank: int

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.manifest["dtype"])

  @classmethod
  def open(cls, directory: epath.Path, key: Mapping | None = None) -> "IdShards | None":
    """The shards at `directory`, or None when any is missing or the manifest names another key."""
    try:
      manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
      return None
    if key is not None and any(manifest.get(k) != v for k, v in key.items()):
      return None
    count = manifest["shards"]
    if manifest.get("shards_format") != FORMAT or not all(
        (directory / shard_name("done", i, count, "json")).exists() for i in range(count)):
      return None
    dones = [json.loads((directory / shard_name("done", i, count, "json")).read_text()) for i in range(count)]
    lengths = np.concatenate([np.load(directory / shard_name("lengths", i, count, "npy")) for i in range(count)])
    if len(lengths) != sum(d["pairs"] for d in dones):
      return None
    paths = [os.fspath(directory / shard_name("ids", i, count, "array_record")) for i in range(count)]
    return cls(directory, manifest, paths, lengths, sum(d["skipped_blank"] for d in dones))

  @classmethod
  def newest(cls, root: str | os.PathLike) -> "IdShards | None":
    """The most recently completed shards under `root` (`<workdir>/data/<split>.ids`), whatever their key."""
    found = [shards for d in sorted(epath.Path(root).iterdir()) if d.is_dir() and (shards := cls.open(d))] \
        if epath.Path(root).is_dir() else []
    return max(found, key=lambda s: os.path.getmtime(s.directory / "manifest.json"), default=None)

  def kept(self, max_len: int) -> np.ndarray:
    """Indices (uint32) of the pairs whose source and target both have at most `max_len` tokens."""
    return np.flatnonzero((self.lengths <= max_len).all(axis=1)).astype(np.uint32)

  def read_all(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every pair's (sources, targets) int32 ids, in stored order (small splits, tools and tests)."""
    source = grain.sources.ArrayRecordDataSource(self.paths)
    records = [decode_record(r, self.dtype) for r in source.__getitems__(list(range(len(source))))]
    return [r["inputs"] for r in records], [r["targets"] for r in records]


# -- the stream ---------------------------------------------------------------------------------------------
READ_CHUNK = 256  # pairs read in one batched ArrayRecord call (a single random read costs ~20x more per pair)


class _ReadChunk:
  """`(j, positions) -> pairs`: chunk `j` of a process's stream (stream elements `j * READ_CHUNK + i`), the kept
  pairs at `positions` read in one batched call and decoded (with `sampler`, resegmented: `k` is the element's
  stream index)."""

  def __init__(self, paths: Sequence[str], kept: np.ndarray, dtype: np.dtype, sampler: Callable | None = None):
    self.paths, self.kept, self.dtype, self.sampler = list(paths), kept, dtype, sampler
    self._source = None

  def __call__(self, j: int, positions: np.ndarray) -> list[dict[str, Any]]:
    if self._source is None:  # opened where it is used (a grain worker process, or the prefetch thread)
      self._source = grain.sources.ArrayRecordDataSource(self.paths)
    raws = self._source.__getitems__([int(self.kept[i]) for i in positions])
    if self.sampler is None:
      return [decode_record(raw, self.dtype) for raw in raws]
    return [self.sampler(j * READ_CHUNK + i, decode_record(raw, self.dtype, texts=True))
            for i, raw in enumerate(raws)]


class _Unchunk(grain.experimental.FlatMapTransform):
  max_fan_out = READ_CHUNK

  def flat_map(self, element):
    return element


def _rename(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"inputs": batch["inputs"], "targets": batch["targets"],
          "inputs_position": batch["inputs_positions"], "targets_position": batch["targets_positions"],
          "inputs_segmentation": batch["inputs_segment_ids"], "targets_segmentation": batch["targets_segment_ids"]}


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """What a stream's batches depend on besides the seed (a saved position means the same batch only under the
  same): rows per batch and slots per row, the processes, the kept pairs (how many, SHA-256 of their lengths)
  and `settings` (e.g. the subword sampling)."""

  rows_per_batch: int
  row_length: int
  process_count: int
  examples: int
  lengths_sha256: str
  settings: tuple = ()

  def to_json(self) -> dict:
    return {"rows_per_batch": self.rows_per_batch, "row_length": self.row_length,
            "process_count": self.process_count, "examples": self.examples,
            "lengths_sha256": self.lengths_sha256, **dict(self.settings)}


class TrainStream:
  """An endless, exactly resumable iterator of this process's rows of the packed training batches.

  Yields `{BATCH_KEYS}` int32 `[rows_per_batch // process_count, row_length]`: `inputs`/`targets` hold
  `pad_id` after each row's last example, `*_position` restart at 0 for every example, `*_segmentation` number
  the examples of a row 1, 2, ... (0 = padding, positions 0 there).

  Args:
    shards: the tokenised split (`IdShards`).
    tokens_per_batch: slot budget per side of the global batch; rows_per_batch = tokens_per_batch // row_length.
    row_length: slots per row; pairs longer on either side are dropped (`kept`).
    pad_id: the tokenizer's padding id.
    seed: epoch e is ordered by grain's index shuffle with seed `seed + e`.
    process_index, process_count: this process's share of every epoch and of every batch's rows.
    sampling: None, or `(tokenizer, alpha, from_epoch)` for subword regularisation in the pipeline.
    read_threads: grain's reading threads (`grain.ReadOptions.num_threads`).

  Raises:
    ValueError: no pair fits `row_length`, or the rows do not divide among the processes.
  """

  def __init__(self, shards: IdShards, *, tokens_per_batch: int, row_length: int, pad_id: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1, sampling: tuple | None = None,
               read_threads: int = 0):
    rows = tokens_per_batch // row_length
    if rows < process_count or rows % process_count:
      raise ValueError(f"tokens_per_batch={tokens_per_batch} gives {rows} rows of {row_length} slots, which "
                       f"is not a positive multiple of the {process_count} processes")
    kept = shards.kept(row_length)
    if not len(kept):
      raise ValueError("no training examples left to batch")
    self.shards, self.kept, self.row_length, self.rows_per_batch = shards, kept, row_length, rows
    self.pad_id, self.seed = int(pad_id), int(seed)
    self.process_index, self.process_count = process_index, process_count
    self.share = len(range(process_index, len(kept), process_count))  # this process's pairs per epoch
    settings = (("subword_alpha", float(sampling[1]) if sampling else 0.0),
                ("subword_from_epoch", int(sampling[2]) if sampling else 0))
    lengths = np.ascontiguousarray(shards.lengths[kept], np.uint32)  # 8 bytes a pair, only while hashing
    self.spec = StreamSpec(rows, row_length, process_count, len(kept),
                           hashlib.sha256(lengths.tobytes()).hexdigest(), settings)
    del lengths
    self._sampling, self._read_threads = sampling, read_threads
    self._iterator = self._dataset().__iter__()
    weakref.finalize(self, self._iterator.close)  # stops the prefetch thread before the interpreter tears down

  def _order(self) -> grain.MapDataset:
    """Stream element k -> the position (in `kept`) of the pair this process reads there: grain's index shuffle
    of epoch k // share with seed `seed + epoch`, every `process_count`-th position from `process_index`."""
    order = grain.MapDataset.range(len(self.kept)).shuffle(seed=self.seed)
    return order[self.process_index::self.process_count].repeat()

  def _dataset(self) -> grain.IterDataset:
    sampler = None
    if self._sampling:
      tokenizer, alpha, from_epoch = self._sampling
      sampler = subword_sampling.PairSampler(tokenizer, alpha=alpha, seed=self.seed,
                                             process_index=self.process_index, share=self.share,
                                             from_epoch=from_epoch, max_len=self.row_length)
    chunks = self._order().batch(READ_CHUNK).map_with_index(
        _ReadChunk(self.shards.paths, self.kept, self.shards.dtype, sampler))
    chunks = chunks.to_iter_dataset(grain.ReadOptions(num_threads=self._read_threads,
                                                      prefetch_buffer_size=4 if self._read_threads else 0))
    stream = grain.experimental.FlatMapIterDataset(chunks, _Unchunk())
    rows = self.rows_per_batch // self.process_count
    packed = grain.experimental.FirstFitPackIterDataset(
        stream, length_struct={"inputs": self.row_length, "targets": self.row_length}, num_packing_bins=rows,
        shuffle_bins=False, padding_struct={"inputs": self.pad_id, "targets": self.pad_id})
    batches = packed.batch(rows, drop_remainder=True).map(_rename)
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2)

  # -- position ------------------------------------------------------------------------------------------
  @staticmethod
  def _stream_index(state: Any) -> int:
    """The number of elements this process's stream has consumed at `state`: the chunk being unpacked (grain's
    `next_index` under the flat map) times READ_CHUNK plus the next element's place in it."""
    while isinstance(state, dict):
      if "next_index_in_buffer" in state:
        return int(state["parent"]["next_index"]) * READ_CHUNK + int(state["next_index_in_buffer"])
      state = state.get("parent")
    raise ValueError(f"not a TrainStream state: {state!r}")

  @property
  def consumed(self) -> int:
    """How many pairs this process's batches so far hold (its stream's position at the next batch)."""
    return self._stream_index(self._iterator.get_state())

  @property
  def epoch(self) -> int:
    """The epoch of the first pair of the next batch on this process."""
    return self.consumed // self.share

  def epoch_pairs(self, epoch: int) -> np.ndarray:
    """The pairs (record indices in `shards`) this process reads in `epoch`, in reading order: the same grain
    index chain as the stream's, over indices instead of records."""
    order = self._order()
    return self.kept[[order[k] for k in range(epoch * self.share, (epoch + 1) * self.share)]]

  def get_state(self) -> dict:
    """This process's position: grain's iterator state, the seed, the epoch and the stream spec (JSON)."""
    state = self._iterator.get_state()
    return {"grain": state, "seed": self.seed, "epoch": self._stream_index(state) // self.share,
            "process_index": self.process_index, "plan": self.spec.to_json()}

  def set_state(self, state: Mapping) -> None:
    """Moves to a saved position: this process's own (`get_state()`) or a checkpoint's `{"processes": [...]}`.

    Raises ValueError (one line) when it was saved under another seed, another process count or another
    stream spec (it would name other batches: training would replay some pairs and skip others)."""
    if "processes" in state:
      saved = state["processes"]
      if len(saved) != self.process_count:
        raise ValueError(f"the checkpoint's data position was saved by {len(saved)} processes, this run has "
                         f"{self.process_count}: every process resumes its own share of the stream; resume "
                         f"with {len(saved)} processes, or train in a new --workdir")
      state = saved[self.process_index]
    if int(state.get("seed", self.seed)) != self.seed:
      raise ValueError(f"data iterator state was saved with seed {state['seed']}, this run uses {self.seed} "
                       "(--config.seed): resuming would replay another batch order; keep the run's seed")
    saved, mine = state.get("plan") or {}, self.spec.to_json()
    changed = [f"{key} {saved.get(key)!r} -> {mine[key]!r}" for key in mine if saved.get(key) != mine[key]]
    if changed or "grain" not in state:
      raise ValueError(f"the checkpoint's data position (epoch {state.get('epoch')}) indexes another batch "
                       f"stream than this run's ({'; '.join(changed) or 'no grain state'}): resuming would replay "
                       f"some training pairs and skip others; keep the run's data.tokens_per_batch, data.max_len, "
                       f"data and subword settings, or train in a new --workdir")
    self._iterator.set_state(state["grain"])

  # -- iteration -----------------------------------------------------------------------------------------
  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def padding_efficiency(self, batches: int = 50) -> tuple[float, float]:
    """(source, target) real tokens / slots over the next `batches` batches of a fresh copy of the stream at
    this position (the stream itself does not move)."""
    probe = self._dataset().__iter__()
    probe.set_state(self._iterator.get_state())
    real = np.zeros(2)
    for _ in range(batches):
      batch = next(probe)
      real += [(batch["inputs_segmentation"] > 0).sum(), (batch["targets_segmentation"] > 0).sum()]
    probe.close()
    slots = batches * (self.rows_per_batch // self.process_count) * self.row_length
    return real[0] / slots, real[1] / slots


def evenly_spaced_splits(split: str, pairs: int, sample: int, pieces: int = 64) -> list[str]:
  """tfds split strings covering about `sample` pairs of `split` (`pairs` long) in `pieces` evenly spaced runs:
  the vocabulary's sentence sample, read without reading the corpus."""
  if sample >= pairs:
    return [split]
  base, _, rest = split.partition("[")
  if rest:  # an already sliced split: read it whole, the reservoir samples it
    return [split]
  pieces = max(1, min(pieces, sample))
  per = max(1, sample // pieces)
  return [f"{base}[{i * pairs // pieces}:{i * pairs // pieces + per}]" for i in range(pieces)]


def iterate_pairs(read_pairs: Callable[[str], Sequence[tuple[str, str]]], splits: Iterable[str]):
  """Every (source, target) pair of `splits`, one split read at a time (the vocabulary trainer's input)."""
  for split in splits:
    yield from read_pairs(split)
