"""Batching of id arrays held in memory: length filters, padded length-sorted evaluation batches.

Training batches are packed by the streaming input pipeline (`pipeline.TrainStream`); this module batches the
small splits that are held whole (evaluation, decoding, benchmarks). Token arrays are padded with the `pad_id`
the caller passes: the tokenizer's (`TextTokenizer.pad_id`), which `trainer.prepare` checks is the model's
`ModelConfig.pad_id` (0 for vocabularies trained here, the last id for an imported Marian model). The model
masks `ids != pad_id` and the loss weighs only `targets != pad_id`, so padding never counts as a token.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np


def within_length(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], max_len: int) -> list[int]:
  """The indices of the pairs whose source and target (EOS included) both have at most `max_len` tokens."""
  return [i for i, (s, t) in enumerate(zip(sources, targets)) if len(s) <= max_len and len(t) <= max_len]


def filter_by_length(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], max_len: int):
  """Drops pairs whose source or target (EOS included) is longer than `max_len`; returns kept + count."""
  keep = within_length(sources, targets, max_len)
  return [sources[i] for i in keep], [targets[i] for i in keep], len(sources) - len(keep)


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
