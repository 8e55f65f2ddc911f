"""Where (source, target) text pairs come from: tensorflow-datasets builders, read in bulk.

`load_pairs(data_config, split, workdir)` is the one entry point the trainer and the evaluation programs
use. `data_config.dataset` selects the source:
  * `number_words`: the built-in task (`transformer_jax.data.number_words`), built on first use;
  * `parallel_text`: a local directory of `{split}.{lang}` files (`data.dir`), built on first use;
  * a tfds translation builder, e.g. `wmt14_translate/de-en` (the paper's), `wmt14_translate/fr-en`,
    `wmt17_translate/de-en`, `wmt_t2t_translate/de-en`, read from a prepared `data.tfds_data_dir`.
    `data.source_lang`/`data.target_lang` choose the direction (EN->DE by default, as in the paper; tfds's
    own supervised keys are DE->EN). Nothing is downloaded unless `data.download=True`. Prepared as ArrayRecord
    (docs/reproducing.md) it is read by random access without TensorFlow; as TFRecord through tf.data.
Built datasets live in `data.tfds_data_dir` (default `<workdir>/tfds`); how they are written and read back:
`transformer_jax.data.records`.
"""

from __future__ import annotations

import os
import tensorflow_datasets as tfds

from transformer_jax.data import records
from transformer_jax.data.config import DataConfig
from transformer_jax.data.number_words import NumberWords
from transformer_jax.data.parallel_text import parallel_text_builder
from transformer_jax.workdir import Workdir

Pairs = records.Pairs


def tfds_data_dir(data_config: DataConfig, workdir: str | None) -> str:
  if data_config.tfds_data_dir:
    return data_config.tfds_data_dir
  return os.fspath(Workdir(workdir).tfds) if workdir else os.path.expanduser("~/tensorflow_datasets")


def _tfds_translation_builder(data_config: DataConfig, data_dir: str) -> tuple[tfds.core.DatasetBuilder, str, str]:
  name = data_config.dataset
  source, target = data_config.source_lang, data_config.target_lang
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f"data.dataset={name!r} is not a known dataset ({e})") from None
  features = set(builder.info.features.keys())
  if not {source, target} <= features:
    raise ValueError(f"{name} has languages {sorted(features)}; data.source_lang={source!r} / "
                     f"data.target_lang={target!r} do not match")
  if data_config.download:
    builder.download_and_prepare()
  elif not builder.is_prepared():
    raise ValueError(f"{name} is not prepared in {data_dir}: prepare it there first (docs/reproducing.md) "
                     f"or pass --config.data.download=True on a machine with network")
  return builder, source, target


def get_builder(data_config: DataConfig, workdir: str | None = None) -> tuple[tfds.core.DatasetBuilder, str, str]:
  """The prepared tfds builder for `data_config.dataset`, plus its source and target feature keys."""
  data_dir = tfds_data_dir(data_config, workdir)
  name = data_config.dataset
  if name == "number_words":
    builder = records.prepare(NumberWords, config=data_config.builder_config or "default", data_dir=data_dir)
    return builder, "en", "de"
  if name == "parallel_text":
    if not data_config.dir:
      raise ValueError("data.dataset='parallel_text' needs --config.data.dir=DIRECTORY")
    source, target = data_config.source_lang, data_config.target_lang
    builder = parallel_text_builder(data_config.dir, source, target, data_dir,
                                    required_splits=(data_config.train_split,
                                                     *data_config.eval_splits))
    return builder, source, target
  return _tfds_translation_builder(data_config, data_dir)


def open_splits(data_config: DataConfig, splits: list[str],
                workdir: str | None = None) -> tuple[tfds.core.DatasetBuilder, str, str]:
  """The prepared builder (prepared and validated once) after checking that it has every split named."""
  builder, source_key, target_key = get_builder(data_config, workdir)
  available = set(builder.info.splits.keys())
  for split in splits:
    base_split = split.split("[")[0]
    if available and base_split not in available:
      raise ValueError(f"{data_config.dataset} has no split {base_split!r}; available: {sorted(available)}")
  return builder, source_key, target_key


def load_splits(data_config: DataConfig, splits: list[str], workdir: str | None = None) -> dict[str, Pairs]:
  """(source, target) text pairs of several splits, preparing (and validating) the dataset once.

  Split names follow tfds (slicing allowed: 'train[:1000]').
  """
  builder, source_key, target_key = open_splits(data_config, splits, workdir)
  return {split: records.read_pairs(builder, split, source_key, target_key) for split in splits}


def load_pairs(data_config: DataConfig, split: str, workdir: str | None = None) -> Pairs:
  """(source, target) text pairs of one split (see `load_splits`)."""
  return load_splits(data_config, [split], workdir)[split]
