"""Batching: packed token-budget training batches with an exactly resumable position, padded eval batches.

Training rows are packed: several (source, target) pairs share a row of `row_length` slots on each side;
`*_segmentation` numbers the examples in a row (1, 2, ..., 0 for padding) and `*_position` restarts at 0 for
every example, which the model honours in its masks and positional encodings. Every batch has the same
shape `[rows_per_batch, row_length]`, so the train step compiles once.

Token arrays are padded with the `pad_id` the caller passes: the tokenizer's (`TextTokenizer.pad_id`), which
`trainer.prepare` checks is the model's `ModelConfig.pad_id` (0 for vocabularies trained here, the last id
for an imported Marian model). The model masks `ids != pad_id` and the loss weighs only `targets != pad_id`,
so padding never counts as a token. Positions and segmentation ids are 0 in padding (segment 0 = no example).

The order of an epoch is a pure function of `(seed, epoch)`, so the iterator's position is just
`{"epoch", "index"}`: restoring it replays exactly the batches an uninterrupted run would have seen (with
subword regularisation, `subword_sampling`, the same pairs in the same order, segmented by a new draw).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

BATCH_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
              "targets_segmentation")


def within_length(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], max_len: int) -> list[int]:
  """The indices of the pairs whose source and target (EOS included) both have at most `max_len` tokens."""
  return [i for i, (s, t) in enumerate(zip(sources, targets)) if len(s) <= max_len and len(t) <= max_len]


def filter_by_length(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], max_len: int):
  """Drops pairs whose source or target (EOS included) is longer than `max_len`; returns kept + count."""
  keep = within_length(sources, targets, max_len)
  return [sources[i] for i in keep], [targets[i] for i in keep], len(sources) - len(keep)


def pack_epoch(source_lengths: np.ndarray, target_lengths: np.ndarray, order: np.ndarray,
               row_length: int, rows_per_batch: int) -> list[list[list[int]]]:
  """First-fit packing of examples (in `order`) into batches of `rows_per_batch` rows.

  Returns batches -> rows -> example indices. An example goes into the first open row of the current batch
  with room on both sides; when none has room and the batch has all its rows, the batch is closed.
  """
  batches: list[list[list[int]]] = []
  rows: list[list[int]] = []
  used = np.zeros((rows_per_batch, 2), dtype=np.int64)  # [row, (source, target)] slots taken
  for i in order:
    need = (source_lengths[i], target_lengths[i])
    fits = np.flatnonzero((used[: len(rows), 0] + need[0] <= row_length)
                          & (used[: len(rows), 1] + need[1] <= row_length))
    if fits.size:
      r = int(fits[0])
    elif len(rows) < rows_per_batch:
      r = len(rows)
      rows.append([])
    else:
      batches.append(rows)
      rows, used[:] = [[]], 0
      r = 0
    rows[r].append(int(i))
    used[r, 0] += need[0]
    used[r, 1] += need[1]
  if rows:
    batches.append(rows)
  return batches


def build_packed_batch(rows: list[list[int]], sources: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                       row_length: int, rows_per_batch: int, *, pad_id: int) -> dict[str, np.ndarray]:
  """Arrays `[rows_per_batch, row_length]` int32 for one planned batch (missing rows are all padding).

  `inputs`/`targets` hold `pad_id` after each row's last example; positions and segmentation hold 0 there.
  """
  out = {key: np.zeros((rows_per_batch, row_length), np.int32) for key in BATCH_KEYS}
  out["inputs"][:] = pad_id
  out["targets"][:] = pad_id
  for r, row in enumerate(rows):
    for side, seqs in (("inputs", sources), ("targets", targets)):
      offset = 0
      for segment, i in enumerate(row, start=1):
        seq = seqs[i]
        end = offset + len(seq)
        out[side][r, offset:end] = seq
        out[f"{side}_position"][r, offset:end] = np.arange(len(seq))
        out[f"{side}_segmentation"][r, offset:end] = segment
        offset = end
  return out


class PackedBatches:
  """An endless, exactly resumable iterator of packed training batches.

  Args:
    sources, targets: token-id arrays (EOS included), already filtered to `row_length`.
    tokens_per_batch: slot budget per side; rows_per_batch = tokens_per_batch // row_length.
    row_length: slots per row (the longest example that fits).
    pad_id: the token id of padding slots (the tokenizer's `pad_id`).
    seed: the shuffling seed; epoch e uses `default_rng([seed, e])`.
    process_index, process_count: each host yields its own contiguous slice of every batch's rows.
    segmentations: None (every epoch uses `sources`/`targets`), or `epoch -> (sources, targets)`: the same
      pairs' ids for that epoch, in the same order (`subword_sampling.SampledSegmentations`).
    plan_settings: JSON values the epochs' plans also depend on (e.g. `{"subword_alpha": 0.1}`): saved with the
      position, and a position saved under other values is refused (`set_state`).

  Raises:
    ValueError: no examples, an example longer than `row_length`, or rows not divisible among the processes.
  """

  def __init__(self, sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], *, tokens_per_batch: int,
               row_length: int, pad_id: int, seed: int = 0, process_index: int = 0, process_count: int = 1,
               segmentations: Callable[[int], tuple[Sequence[np.ndarray], Sequence[np.ndarray]]] | None = None,
               plan_settings: Mapping[str, Any] | None = None):
    if not sources:
      raise ValueError("no training examples left to batch")
    rows = tokens_per_batch // row_length
    if rows < process_count or rows % process_count:
      raise ValueError(f"tokens_per_batch={tokens_per_batch} gives {rows} rows of {row_length} slots, which "
                       f"is not a positive multiple of the {process_count} processes")
    self.row_length, self.rows_per_batch, self.seed, self.pad_id = row_length, rows, seed, int(pad_id)
    self.process_index, self.process_count = process_index, process_count
    self.segmentations = segmentations
    self.plan_settings = dict(plan_settings or {})
    self._set_ids(sources, targets)
    self._epoch0_fingerprint = self.plan_fingerprint()  # before a sampled epoch replaces the ids
    self.epoch, self.index = 0, 0
    self._plan_epoch: int | None = None
    self._plan: list[list[list[int]]] = []

  def _set_ids(self, sources: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> None:
    self.sources, self.targets = list(sources), list(targets)
    self.source_lengths = np.array([len(s) for s in sources])
    self.target_lengths = np.array([len(t) for t in targets])
    if max(self.source_lengths.max(), self.target_lengths.max()) > self.row_length:
      raise ValueError(f"examples longer than row_length={self.row_length}; filter them first")

  # -- position ------------------------------------------------------------------------------------------
  def plan_fingerprint(self) -> dict:
    """What the batch plan of every epoch depends on besides the seed: rows per batch and slots per row
    (`data.tokens_per_batch // data.max_len`, `data.max_len`), and the examples (how many, and a SHA-256 of
    their lengths in order: another dataset, vocabulary or length filter changes it), and `plan_settings` (what
    else the caller's plans depend on, e.g. the subword sampling settings). A position means the same batch only
    under the same."""
    lengths = np.stack([self.source_lengths, self.target_lengths]).astype(np.int64)
    return {"rows_per_batch": int(self.rows_per_batch), "row_length": int(self.row_length),
            "examples": len(self.source_lengths), "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest(),
            **self.plan_settings}

  def get_state(self) -> dict:
    """The position of the next batch, and the plan it indexes (`plan_fingerprint`): JSON-serialisable."""
    return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed),
            "plan": self._epoch0_fingerprint}

  def set_state(self, state: dict) -> None:
    """Moves to a saved position. Raises ValueError (one line) when the position was saved under another seed
    or another batch plan (it would name other batches: training would replay some pairs and skip others).
    A state saved before plans were recorded (no "plan") is taken as it is."""
    if int(state.get("seed", self.seed)) != self.seed:
      raise ValueError(f"data iterator state was saved with seed {state['seed']}, this run uses {self.seed} "
                       "(--config.seed): resuming would replay another batch order; keep the run's seed")
    saved, mine = state.get("plan"), self._epoch0_fingerprint
    if saved is not None:
      changed = [f"{key} {saved.get(key)!r} -> {mine[key]!r}" for key in mine if saved.get(key) != mine[key]]
      if changed:
        raise ValueError(f"the checkpoint's data position (epoch {state['epoch']}, batch {state['index']}) indexes "
                         f"another batch plan than this run's ({'; '.join(changed)}): resuming would replay some "
                         f"training pairs and skip others; keep the run's data.tokens_per_batch, data.max_len, "
                         f"data and subword settings, or train in a new --workdir")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])

  # -- iteration -----------------------------------------------------------------------------------------
  def plan(self, epoch: int) -> list[list[list[int]]]:
    if self._plan_epoch != epoch:
      if self.segmentations is not None:
        sources, targets = self.segmentations(epoch)
        if not len(sources) == len(targets) == len(self.sources):
          raise ValueError(f"epoch {epoch}: {len(sources)} sources and {len(targets)} targets for "
                           f"{len(self.sources)} pairs; every epoch must segment the same pairs")
        self._set_ids(sources, targets)
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self.sources))
      self._plan = pack_epoch(self.source_lengths, self.target_lengths, order, self.row_length,
                              self.rows_per_batch)
      self._plan_epoch = epoch
    return self._plan

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    plan = self.plan(self.epoch)
    if self.index >= len(plan):  # a position saved at an epoch's end before positions rolled over (below)
      self.epoch, self.index = self.epoch + 1, 0
      plan = self.plan(self.epoch)
    rows = plan[self.index]
    self.index += 1
    if self.index == len(plan):  # the next batch opens the next epoch, and the position says so: a run resumed
      self.epoch, self.index = self.epoch + 1, 0  # here starts (and logs) that epoch, without planning this one
    batch = build_packed_batch(rows, self.sources, self.targets, self.row_length, self.rows_per_batch,
                               pad_id=self.pad_id)
    if self.process_count > 1:
      per_host = self.rows_per_batch // self.process_count
      lo = self.process_index * per_host
      batch = {k: v[lo:lo + per_host] for k, v in batch.items()}
    return batch

  def padding_efficiency(self, epoch: int = 0) -> tuple[float, float]:
    """(source, target) real tokens / slots over one epoch's plan."""
    plan = self.plan(epoch)
    slots = len(plan) * self.rows_per_batch * self.row_length
    src = sum(self.source_lengths[i] for b in plan for r in b for i in r)
    tgt = sum(self.target_lengths[i] for b in plan for r in b for i in r)
    return src / slots, tgt / slots


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def length_sorted_batches(lengths: Sequence[int], max_tokens: int, length_multiple: int = 8,
                          max_rows: int | None = None) -> list[tuple[list[int], int]]:
  """Groups example indices into batches by length (never dropping or truncating one).

  Returns `(indices, padded_length)` per batch; indices are sorted by length, the padded length is the
  longest member rounded up to `length_multiple`, and rows * padded_length stays within `max_tokens`
  (a single longer example still gets its own batch).
  """
  order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
  batches: list[tuple[list[int], int]] = []
  current: list[int] = []
  for i in order:
    padded = round_up(max(lengths[i], 1), length_multiple)
    rows_ok = max_rows is None or len(current) + 1 <= max_rows
    if current and (not rows_ok or (len(current) + 1) * padded > max_tokens):
      batches.append((current, round_up(max(max(lengths[j] for j in current), 1), length_multiple)))
      current = []
    current.append(i)
  if current:
    batches.append((current, round_up(max(max(lengths[j] for j in current), 1), length_multiple)))
  return batches


def pad_batch(seqs: Sequence[np.ndarray], length: int, rows: int | None = None, *, pad_id: int) -> np.ndarray:
  """`[rows or len(seqs), length]` int32, right-padded with `pad_id`."""
  out = np.full((rows or len(seqs), length), pad_id, np.int32)
  for r, seq in enumerate(seqs):
    out[r, : len(seq)] = seq
  return out


def eval_batches(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], max_tokens: int,
                 length_multiple: int = 16, *, pad_id: int) -> Iterator[dict[str, np.ndarray]]:
  """Padded (`pad_id`), length-sorted `{'inputs', 'targets'}` `[rows, length]` int32 batches covering every
  example exactly once."""
  lengths = [max(len(s), len(t)) for s, t in zip(sources, targets)]
  for indices, length in length_sorted_batches(lengths, max_tokens, length_multiple):
    yield {"inputs": pad_batch([sources[i] for i in indices], length, pad_id=pad_id),
           "targets": pad_batch([targets[i] for i in indices], length, pad_id=pad_id)}


def log_drop_counts(name: str, dropped_long: int, skipped_blank: int, kept: int, max_len: int) -> None:
  logging.info("%s: kept %d pairs; dropped %d longer than max_len=%d tokens; skipped %d blank pairs",
               name, kept, dropped_long, max_len, skipped_blank)
