"""Token ids on disk: the tokenised training split as sharded ArrayRecord files, written once, read in batches.

    <workdir>/data/<split>.ids/<key16>/manifest.json              what the ids were encoded from (token_cache key)
    <workdir>/data/<split>.ids/<key16>/ids-00003-of-00023.array_record   one record per non-blank pair
    <workdir>/data/<split>.ids/<key16>/lengths-00003-of-00023.npy        [pairs, 2] uint32 (source, target) lengths
    <workdir>/data/<split>.ids/<key16>/done-00003-of-00023.json          the shard is complete: its counts

The training split is tokenised once (`write_shards`): the split is cut into shards of ~`SHARD_PAIRS` pairs
(`tfds.even_splits`), process `p` of `n` encodes shards `p, p + n, ...`, each written under a temporary name and
renamed into place with a `done-*.json` last, so an interrupted preparation resumes at the first missing shard.
A record holds both sides' ids (EOS included; uint16 when the vocabulary fits, else int32) and the two UTF-8
texts (for subword sampling in the pipeline's workers), with a 16-byte header of four uint32 lengths
(`encode_record` / `decode_record`). `IdShards` is a complete directory; `RecordReader` reads its records many
at a time. The stream over them is `data.pipeline`.
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
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np
from etils import epath

from transformer_jax.workdir import write_bytes_atomically

FORMAT = 1
SHARD_PAIRS = 200_000  # pairs per shard: ~40 MB of ids and text at WMT's ~125 characters a line
_HEADER = 4  # uint32: source ids, target ids, source bytes, target bytes
_HEADER_STRUCT = struct.Struct(f"<{_HEADER}I")


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
