"""First-fit packing of a pair stream into fixed `[rows, row_length]` batches (`FirstFitBatches`): the batches of
grain's `FirstFitPackIterDataset`, faster (docs/performance.md), with `BATCH_KEYS` int32 arrays (ids, positions,
segment ids) and a one-integer state. `data.pipeline.TrainStream` packs its stream with it.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import grain
import numpy as np

# Pairs per chunk of the stream: one batched ArrayRecord read (a single random read costs ~20x more per pair).
READ_CHUNK = 256
BATCH_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
              "targets_segmentation")


class FirstFitBatches(grain.IterDataset):
  """Packed batches of a pair stream, first-fit: each pair goes into the first of `rows` rows where both its
  sides still fit; the first pair that fits in no row closes the batch and opens the next one. The same batches
  as grain's `FirstFitPackIterDataset(num_packing_bins=rows, shuffle_bins=False)` followed by `.batch(rows)`
  (`tests/test_pipeline.py` compares them), at a fraction of its cost per pair (see `docs/performance.md`, "The
  input pipeline at WMT scale"): one boolean scan of the rows and six slice writes, no per-feature tree walks.

  Args:
    chunks: `j -> [{"inputs", "targets"}]`: chunk j of the stream (its `READ_CHUNK` pairs, int32 ids; e.g.
      `pipeline.ReadChunk`).
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
