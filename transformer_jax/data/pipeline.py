"""The training input pipeline: token ids in sharded ArrayRecord files, streamed and packed per host.

    <workdir>/data/<split>.ids/<key16>/manifest.json              what the ids were encoded from (token_cache key)
    <workdir>/data/<split>.ids/<key16>/ids-00003-of-00023.array_record   one record per non-blank pair
    <workdir>/data/<split>.ids/<key16>/lengths-00003-of-00023.npy        [pairs, 2] uint32 (source, target) lengths
    <workdir>/data/<split>.ids/<key16>/done-00003-of-00023.json          the shard is complete: its counts

The training split is tokenised once (`write_shards`): the split is cut into shards of ~`SHARD_PAIRS` pairs
(`tfds.even_splits`), process `p` of `n` encodes shards `p, p + n, ...`, each written under a temporary name and
renamed into place with a `done-*.json` last, so an interrupted preparation resumes at the first missing shard.
A record holds both sides' ids (EOS included; uint16 when the vocabulary fits, else int32) and the two UTF-8
texts (for subword sampling in the pipeline's workers), with a 16-byte header of four uint32 lengths.

The stream (`TrainStream`): the kept pairs (both sides at most `row_length` tokens, from the `lengths` files)
are ordered per epoch by grain's index shuffle with seed `seed + epoch` (`EpochOrder`: one permutation lookup per
element, nothing materialised), process `p` takes every `n`-th place of each epoch's order (a disjoint share, the
shares' union is every kept pair once), reads its records `READ_CHUNK` at a time (`RecordReader`), packs them
first-fit into `rows_per_batch // n` rows of `row_length` slots (`FirstFitBatches`: the batches of grain's
`FirstFitPackIterDataset`, faster: docs/performance.md; across epoch boundaries); grain's prefetch thread keeps
batches ready (`grain.experimental.ThreadPrefetchIterDataset`). Per-pair state in memory: the kept positions (4 bytes), the
lengths (8) and ArrayRecord's record index (~11). The iterator state (one integer: the stream index of the next
batch's first pair) is the data position saved in every checkpoint; restoring it replays exactly the batches an
uninterrupted run would see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np
from etils import epath

from transformer_jax.data import subword_sampling
from transformer_jax.workdir import write_bytes_atomically

BATCH_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
              "targets_segmentation")
FORMAT = 1
SHARD_PAIRS = 200_000  # pairs per shard: ~40 MB of ids and text at WMT's ~125 characters a line
_HEADER = 4  # uint32: source ids, target ids, source bytes, target bytes
_HEADER_STRUCT = struct.Struct(f"<{_HEADER}I")


# -- records ------------------------------------------------------------------------------------------------
def encode_record(source: Sequence[int], target: Sequence[int], source_text: str, target_text: str,
                  dtype: Any) -> bytes:
  """One pair as bytes: header `[4]` uint32, both sides' ids as `dtype`, both texts as UTF-8."""
  src_bytes, tgt_bytes = source_text.encode("utf-8"), target_text.encode("utf-8")
  header = _HEADER_STRUCT.pack(len(source), len(target), len(src_bytes), len(tgt_bytes))
  ids = np.asarray([*source, *target], dtype)
  return header + ids.tobytes() + src_bytes + tgt_bytes


def decode_record(raw: bytes, dtype: Any, texts: bool = False) -> dict[str, Any]:
  """`{"inputs", "targets"}` int32 `[len]` of a record (and `"texts"` (source, target) when asked)."""
  n_src, n_tgt, b_src, b_tgt = _HEADER_STRUCT.unpack_from(raw)
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
  """Writes shard `index` of `count` (the pairs' texts and ids, aligned) as its three files, `done-*` last.

  Every file appears whole or not at all (a temporary file of this writer's own, then a rename): the processes
  of a multi-host run write and read one directory at the same time."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  ids_path = directory / shard_name("ids", index, count, "array_record")
  tmp = directory / f".{ids_path.name}.{uuid.uuid4().hex}.tmp"
  writer = ArrayRecordWriter(os.fspath(tmp), "group_size:1,uncompressed")  # random access: one record a group
  for (s_text, t_text), s, t in zip(texts, sources, targets):
    writer.write(encode_record(s, t, s_text, t_text, dtype))
  writer.close()
  tmp.replace(ids_path)
  lengths = np.asarray([[len(s), len(t)] for s, t in zip(sources, targets)], np.uint32).reshape(-1, 2)
  buffer = io.BytesIO()
  np.save(buffer, lengths)
  write_bytes_atomically(directory / shard_name("lengths", index, count, "npy"), buffer.getvalue())
  done = {"pairs": len(lengths), "skipped_blank": int(skipped_blank),
          "tokens": [int(lengths[:, 0].sum()), int(lengths[:, 1].sum())]}
  write_bytes_atomically(directory / shard_name("done", index, count, "json"), json.dumps(done).encode())
  return done


def write_manifest(directory: epath.Path, key: Mapping, shards: int, vocab_size: int) -> np.dtype:
  """Creates `directory` with its manifest (the key, the shard count, the id dtype); returns the dtype."""
  directory.mkdir(parents=True, exist_ok=True)
  dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)
  manifest = dict(key, shards_format=FORMAT, shards=shards, dtype=dtype.name)
  # Atomic: every process rewrites it while the others may be reading it (`IdShards.open`).
  write_bytes_atomically(directory / "manifest.json", json.dumps(manifest, sort_keys=True).encode())
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
  sizes: list[int]  # pairs per shard
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
    return cls(directory, manifest, paths, [d["pairs"] for d in dones], lengths,
               sum(d["skipped_blank"] for d in dones))

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


@dataclasses.dataclass(frozen=True)
class EpochOrder:
  """Which kept pair a process reads at each place of its stream: stream element k is place `k % share` of
  epoch `k // share`, whose order is grain's index shuffle (`grain.experimental.index_shuffle`, 4 rounds) of
  the `examples` kept pairs with seed `seed + epoch`, of which this process takes every `process_count`-th place
  from `process_index`. The same positions as grain's
  `MapDataset.range(examples).shuffle(seed)[process_index::process_count].repeat()` (tests compare them)
  without its per-element dataset calls: one C++ call per element, nothing materialised."""

  examples: int
  seed: int
  process_index: int = 0
  process_count: int = 1

  @property
  def share(self) -> int:
    """This process's pairs per epoch."""
    return len(range(self.process_index, self.examples, self.process_count))

  def __call__(self, start: int, stop: int) -> np.ndarray:
    """int64 `[stop - start]`: the positions (in the kept pairs) of stream elements `start .. stop - 1`."""
    epoch, place = np.divmod(np.arange(start, stop, dtype=np.int64), self.share)
    index = self.process_index + place * self.process_count
    return np.fromiter((grain.experimental.index_shuffle(int(i), max_index=self.examples - 1,
                                                         seed=(self.seed + int(e)) % 2**32, rounds=4)
                        for i, e in zip(index, epoch)), np.int64, count=len(index))


class RecordReader:
  """Random reads of records across ArrayRecord shards, one record at a time: `seek` and `read` of a reader
  opened with `max_parallelism:0` (no thread pool), cheaper per record than a batched
  `ArrayRecordDataSource.__getitems__` as soon as a batch spans several shards (each reader's pooled
  `read(indices)` has a fixed cost a call); measured in `docs/performance.md`.

  Readers open on first use, each holding its shard's record index; calls from several threads take turns (a
  reader's position is shared state)."""

  OPTIONS = "readahead_buffer_size:0,max_parallelism:0"

  def __init__(self, paths: Sequence[str], sizes: Sequence[int]):
    self.paths = list(paths)
    self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [shards + 1]
    self._readers: list[Any] = [None] * len(self.paths)
    self._lock = threading.Lock()

  def read(self, keys: np.ndarray) -> list[bytes]:
    """The records at global indices `keys` (int `[n]`: records of shard i start at `starts[i]`), in order."""
    from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
    shards = np.searchsorted(self.starts, keys, side="right") - 1
    out = []
    with self._lock:
      for key, shard in zip(keys.tolist(), shards.tolist()):
        reader = self._readers[shard]
        if reader is None:
          reader = self._readers[shard] = ArrayRecordReader(self.paths[shard], self.OPTIONS)
        reader.seek(key - int(self.starts[shard]))
        out.append(reader.read())
    return out


class ReadChunk:
  """`j -> pairs` (a grain map): chunk `j` of a process's stream (stream elements `j * READ_CHUNK + i`), its kept pairs read in
  one batched call and decoded (with `sampler`, resegmented: `k` is the element's stream index)."""

  def __init__(self, shards: "IdShards", kept: np.ndarray, order: EpochOrder, sampler: Callable | None = None):
    self.kept, self.dtype, self.order, self.sampler = kept, shards.dtype, order, sampler
    self._reader = RecordReader(shards.paths, shards.sizes)

  def __call__(self, j: int) -> list[dict[str, Any]]:
    positions = self.order(j * READ_CHUNK, (j + 1) * READ_CHUNK)
    raws = self._reader.read(self.kept[positions])
    if self.sampler is None:
      return [decode_record(raw, self.dtype) for raw in raws]
    return [self.sampler(j * READ_CHUNK + i, decode_record(raw, self.dtype, texts=True))
            for i, raw in enumerate(raws)]


class FirstFitBatches(grain.IterDataset):
  """Packed batches of a pair stream, first-fit: each pair goes into the first of `rows` rows where both its
  sides still fit; the first pair that fits in no row closes the batch and opens the next one. The same batches
  as grain's `FirstFitPackIterDataset(num_packing_bins=rows, shuffle_bins=False)` followed by `.batch(rows)`
  (`tests/test_pipeline.py` compares them), at a fraction of its cost per pair (see `docs/performance.md`, "The
  input pipeline at WMT scale"): one boolean scan of the rows and six slice writes, no per-feature tree walks.

  Args:
    chunks: `j -> [{"inputs", "targets"}]`: chunk j of the stream (its `READ_CHUNK` pairs, int32 ids; e.g.
      `ReadChunk`).
    rows, row_length: the batch's shape.
    pad_id: what fills `inputs`/`targets` after a row's last pair.

  Yields `{BATCH_KEYS}` int32 `[rows, row_length]` (see `TrainStream`); its state is one integer, the stream
  index of the next batch's first pair.
  """

  def __init__(self, chunks: Callable[[int], Sequence[Mapping[str, np.ndarray]]], rows: int, row_length: int,
               pad_id: int):
    super().__init__()
    self.chunks, self.rows, self.row_length, self.pad_id = chunks, rows, row_length, pad_id

  def __iter__(self) -> "_FirstFitIterator":
    return _FirstFitIterator(self)


class _FirstFitIterator(grain.DatasetIterator):
  """The iterator of `FirstFitBatches`: stream index `next_index`, the current chunk cached."""

  def __init__(self, dataset: FirstFitBatches):
    super().__init__()
    self._dataset, self._next_index = dataset, 0
    self._chunk_index, self._chunk = -1, []
    self._arange = np.arange(dataset.row_length, dtype=np.int32)

  def _pair(self, k: int) -> dict[str, np.ndarray]:
    j, i = divmod(k, READ_CHUNK)
    if j != self._chunk_index:
      self._chunk_index, self._chunk = j, self._dataset.chunks(j)
    return self._chunk[i]

  def __next__(self) -> dict[str, np.ndarray]:
    rows, length = self._dataset.rows, self._dataset.row_length
    batch = {key: np.zeros((rows, length), np.int32) for key in BATCH_KEYS}
    batch["inputs"][:], batch["targets"][:] = self._dataset.pad_id, self._dataset.pad_id
    used = np.zeros((2, rows), np.int64)  # [side, row]: slots filled
    examples = np.zeros(rows, np.int32)  # pairs in each row
    while True:
      pair = self._pair(self._next_index)
      sizes = len(pair["inputs"]), len(pair["targets"])
      fits = (used[0] <= length - sizes[0]) & (used[1] <= length - sizes[1])  # [rows]
      row = int(fits.argmax())
      if not fits[row]:
        return batch
      examples[row] += 1
      for side, key, size in ((0, "inputs", sizes[0]), (1, "targets", sizes[1])):
        start = int(used[side, row])
        batch[key][row, start:start + size] = pair[key]
        batch[f"{key}_position"][row, start:start + size] = self._arange[:size]
        batch[f"{key}_segmentation"][row, start:start + size] = examples[row]
        used[side, row] = start + size
      self._next_index += 1

  def get_state(self) -> dict[str, int]:
    return {"stream_index": self._next_index}

  def set_state(self, state: Mapping[str, int]) -> None:
    self._next_index = int(state["stream_index"])


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

  Raises:
    ValueError: no pair fits `row_length`, or the rows do not divide among the processes.
  """

  def __init__(self, shards: IdShards, *, tokens_per_batch: int, row_length: int, pad_id: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1, sampling: tuple | None = None):
    rows = tokens_per_batch // row_length
    if rows < process_count or rows % process_count:
      raise ValueError(f"tokens_per_batch={tokens_per_batch} gives {rows} rows of {row_length} slots, which "
                       f"is not a positive multiple of the {process_count} processes")
    kept = shards.kept(row_length)
    if not len(kept):
      raise ValueError(f"no training pairs left to batch: all {len(shards.lengths)} non-blank pairs are longer than "
                       f"row_length={row_length} tokens on a side (the shortest has "
                       f"{int(shards.lengths.max(axis=1).min())}; ids with EOS)")
    self.shards, self.kept, self.row_length, self.rows_per_batch = shards, kept, row_length, rows
    self.pad_id, self.seed = int(pad_id), int(seed)
    self.process_index, self.process_count = process_index, process_count
    self.order = EpochOrder(len(kept), self.seed, process_index, process_count)
    self.share = self.order.share  # this process's pairs per epoch
    settings = (("subword_alpha", float(sampling[1]) if sampling else 0.0),
                ("subword_from_epoch", int(sampling[2]) if sampling else 0))
    lengths = np.ascontiguousarray(shards.lengths[kept], np.uint32)  # 8 bytes a pair, only while hashing
    self.spec = StreamSpec(rows, row_length, process_count, len(kept),
                           hashlib.sha256(lengths.tobytes()).hexdigest(), settings)
    del lengths
    self._sampling = sampling
    self._iterator = self._dataset().__iter__()
    weakref.finalize(self, self._iterator.close)  # stops the prefetch thread before the interpreter tears down

  def _dataset(self) -> grain.IterDataset:
    sampler = None
    if self._sampling:
      tokenizer, alpha, from_epoch = self._sampling
      sampler = subword_sampling.PairSampler(tokenizer, alpha=alpha, seed=self.seed,
                                             process_index=self.process_index, share=self.share,
                                             from_epoch=from_epoch, max_len=self.row_length)
    chunks = ReadChunk(self.shards, self.kept, self.order, sampler)
    batches = FirstFitBatches(chunks, self.rows_per_batch // self.process_count, self.row_length, self.pad_id)
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2)

  # -- position ------------------------------------------------------------------------------------------
  @staticmethod
  def _stream_index(state: Any) -> int:
    """The number of elements this process's stream has consumed at `state` (`FirstFitBatches`' position)."""
    while isinstance(state, dict):
      if "stream_index" in state:
        return int(state["stream_index"])
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
    """The pairs (record indices in `shards`) this process reads in `epoch`, in reading order (`EpochOrder`)."""
    return self.kept[self.order(epoch * self.share, (epoch + 1) * self.share)]

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

  def log_packing(self, batches: int = 20) -> None:
    """Logs the rows and the padding efficiency of the next `batches` batches (`padding_efficiency`)."""
    src_eff, tgt_eff = self.padding_efficiency(batches)
    logging.info("Packed batches: %d rows x %d slots (%d on this process); padding efficiency of the next %d "
                 "batches (epoch %d): source %.1f%%, target %.1f%%", self.rows_per_batch, self.row_length,
                 self.rows_per_batch // self.process_count, batches, self.epoch, 100 * src_eff, 100 * tgt_eff)


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
