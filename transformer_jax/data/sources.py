"""Where (source, target) text pairs come from: tensorflow-datasets builders, read in bulk.

`load_pairs(data_config, split)` is the one entry point the trainer and the evaluation programs use.
Supported `data_config.dataset` values:
  * `number_words` — the built-in task (`transformer_jax.data.number_words`), built into
    `data_config.tfds_data_dir` on first use.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow_datasets as tfds

Pairs = list[tuple[str, str]]


def read_tfds_pairs(builder: tfds.core.DatasetBuilder, split: str, source_key: str, target_key: str,
                    batch_size: int = 8192) -> Pairs:
  """All (source, target) strings of `split` in stored order, decoded in batches (fast on 2 cores)."""
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(batch_size)
  pairs: Pairs = []
  for batch in tfds.as_numpy(ds):
    pairs.extend(zip((s.decode("utf-8") for s in batch[source_key]),
                     (t.decode("utf-8") for t in batch[target_key])))
  return pairs


def default_tfds_dir(workdir: str | None) -> str:
  return os.path.join(workdir, "tfds") if workdir else os.path.expanduser("~/tensorflow_datasets")


def get_builder(data_config: Any, workdir: str | None = None) -> tuple[tfds.core.DatasetBuilder, str, str]:
  """The prepared tfds builder for `data_config.dataset`, plus its source and target feature keys."""
  data_dir = data_config.get("tfds_data_dir") or default_tfds_dir(workdir)
  name = data_config.dataset
  if name == "number_words":
    from transformer_jax.data.number_words import NumberWords  # registers the builder
    builder = NumberWords(config=data_config.get("builder_config") or "default", data_dir=data_dir)
    builder.download_and_prepare()
    return builder, "en", "de"
  raise ValueError(f"data.dataset={name!r} is not a known dataset; expected 'number_words'")


def load_pairs(data_config: Any, split: str, workdir: str | None = None) -> Pairs:
  """(source, target) text pairs of `split` (a tfds split name, slicing allowed: 'train[:1000]')."""
  builder, source_key, target_key = get_builder(data_config, workdir)
  return read_tfds_pairs(builder, split, source_key, target_key)
