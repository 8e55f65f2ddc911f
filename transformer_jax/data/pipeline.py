"""The training input stream: the id shards of `data.id_shards`, read in each epoch's order and packed per host.

The stream (`TrainStream`): the kept pairs (both sides at most `row_length` tokens, from the `lengths` files)
are ordered per epoch by grain's index shuffle with seed `seed + epoch` (`EpochOrder`: one permutation lookup per
element, nothing materialised), process `p` takes every `n`-th place of each epoch's order (a disjoint share, the
shares' union is every kept pair once), reads its records `READ_CHUNK` at a time (`ReadChunk` over
`id_shards.RecordReader`), packs them first-fit into `rows_per_batch // n` rows of `row_length` slots
(`packing.FirstFitBatches`, across epoch boundaries); grain's prefetch thread keeps batches ready
(`grain.experimental.ThreadPrefetchIterDataset`). Per-pair state in memory: the kept positions (4 bytes), the
lengths (8) and ArrayRecord's record index (~11). The iterator state (one integer: the stream index of the next
batch's first pair) is the data position saved in every checkpoint; restoring it replays exactly the batches an
uninterrupted run would see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np

from transformer_jax.data import subword_sampling
from transformer_jax.data.id_shards import IdShards, RecordReader, decode_record
from transformer_jax.data.packing import READ_CHUNK, FirstFitBatches


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
