"""Prepared tensorflow-datasets data on disk: how our builders write their splits and how any split is read.

    builder = records.prepare(NumberWords, config="tiny", data_dir=DIR)   # ArrayRecord files when it writes
    pairs = records.read_pairs(builder, "train[:1000]", "en", "de")       # [(source, target), ...] in order

Our own builders (`NumberWords`, `ParallelText`) write their splits as ArrayRecord files and read them back
with tfds' random-access `as_data_source`: neither imports TensorFlow, whose import (TFRecord writing, tf.data
reading) was seconds of every training program's start (docs/performance.md). Data prepared before in tfds' default
TFRecord format, and tfds' own datasets (WMT) as tfds prepares them, are read as they were written, through
tf.data (tfds cannot reopen TFRecord data as ArrayRecord). Both paths give the same pairs in the same order.
A `data_dir` on Cloud Storage (`gs://`, e.g. a workdir's `tfds/` there) gets TFRecord files: ArrayRecord's
reader and writer open local files only (riegeli's file descriptors), TFRecord goes through `tf.io.gfile`.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow_datasets as tfds

from transformer_jax.workdir import is_local

Pairs = list[tuple[str, str]]


def prepare(builder_class: Callable[..., tfds.core.DatasetBuilder], **kwargs: Any) -> tfds.core.DatasetBuilder:
  """`builder_class(**kwargs)`, prepared: when it writes now, as ArrayRecord in a local `data_dir` and TFRecord
  in a remote one; in its format when on disk already."""
  builder = builder_class(**kwargs)
  if not builder.is_prepared() and is_local(kwargs["data_dir"]):
    builder = builder_class(file_format=tfds.core.FileFormat.ARRAY_RECORD, **kwargs)
  builder.download_and_prepare()
  return builder


def read_pairs(builder: tfds.core.DatasetBuilder, split: str, source_key: str, target_key: str,
               batch_size: int = 8192) -> Pairs:
  """All (source, target) strings of `split` (tfds split syntax, slices allowed) in stored order."""
  if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
    examples = builder.as_data_source(split=split)
    pairs: Pairs = []
    for start in range(0, len(examples), batch_size):
      batch = examples.__getitems__(range(start, min(start + batch_size, len(examples))))
      pairs.extend((e[source_key].decode("utf-8"), e[target_key].decode("utf-8")) for e in batch)
    return pairs
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(batch_size)
  pairs = []
  for batch in tfds.as_numpy(ds):
    pairs.extend(zip((s.decode("utf-8") for s in batch[source_key]),
                     (t.decode("utf-8") for t in batch[target_key])))
  return pairs
