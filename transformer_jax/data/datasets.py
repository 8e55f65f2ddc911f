"""From a data config to what the trainer consumes: the shared vocabulary, packed train batches, eval sets.

text (tfds) -> normalise (`normalize`, inside the tokenizer) -> SentencePiece ids (+EOS), blank pairs skipped
(counted) -> sharded ArrayRecord files in `<workdir>/data/<split>.ids/` (`pipeline`, keyed like `token_cache`: the
dataset, the vocabulary and its normalisation), written once -> grain: over-long pairs dropped (counted,
logged), shuffled by (seed, epoch), this process's share, packed (`pipeline.TrainStream`); with
`data.subword_alpha > 0` the pipeline samples a new segmentation of every pair it reads (`subword_sampling`).

`data.tokenizer` chooses the vocabulary: "sentencepiece" (ours: `<workdir>/vocab/spm.model`, trained on the
training split the first time) or "marian" (an imported model's `source.spm`/`target.spm`/`vocab.json` in
`<workdir>/vocab/`, never trained here). Batches are padded with the tokenizer's `pad_id`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from transformer_jax.data import batching, id_shards, normalize, pipeline, records, sources, token_cache
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data.config import DataConfig
from transformer_jax.data.marian_vocab import TOKENIZER_NAME as MARIAN_TOKENIZER
from transformer_jax.data.marian_vocab import MarianVocabulary
from transformer_jax.workdir import Workdir, is_local


@dataclasses.dataclass
class EvalSet:
  """One evaluation split: the raw text pairs and their ids (EOS included), in stored order."""

  pairs: list[tuple[str, str]]
  sources: list[np.ndarray]
  targets: list[np.ndarray]


@dataclasses.dataclass
class Datasets:
  tokenizer: tokenizer_lib.TextTokenizer
  train: pipeline.TrainStream
  eval_sets: dict[str, EvalSet]
  stats: dict[str, Any]


def vocab_path(data_config: DataConfig, workdir: str) -> str:
  """The vocabulary this run uses: `data.vocab_path` if given, else `<workdir>/vocab/spm.model`, or for
  `data.tokenizer="marian"` the directory `<workdir>/vocab` (source.spm, target.spm, vocab.json)."""
  if data_config.vocab_path:
    return data_config.vocab_path
  run_dir = Workdir(workdir)
  return os.fspath(run_dir.vocab_dir if data_config.tokenizer == MARIAN_TOKENIZER else run_dir.vocab)


def open_tokenizer(data_config: DataConfig, workdir: str) -> tokenizer_lib.TextTokenizer:
  """The run's existing vocabulary (`vocab_path`): a `Tokenizer`, or a `MarianVocabulary` for
  `data.tokenizer="marian"`. Raises `VocabularyError` (one line) when it is missing or unreadable, or when it
  is case-folded and `data.lowercase` is not set, or the other way round."""
  path = vocab_path(data_config, workdir)
  if data_config.tokenizer == MARIAN_TOKENIZER:
    return MarianVocabulary(path)
  tokenizer = tokenizer_lib.Tokenizer(path)
  if tokenizer.lowercase != data_config.lowercase:
    kind = "a lowercased" if tokenizer.lowercase else "a cased"
    raise tokenizer_lib.VocabularyError(
        f"{path} is {kind} vocabulary but --config.data.lowercase={data_config.lowercase}; set "
        f"data.lowercase={tokenizer.lowercase} or use another vocabulary")
  return tokenizer


def load_tokenizer(data_config: DataConfig, workdir: str, train_pairs=None) -> tokenizer_lib.TextTokenizer:
  """Loads the run's vocabulary, training a SentencePiece one on both sides of the training split the first
  time; a Marian tokenizer is only ever loaded (`open_tokenizer`).

  The vocabulary sees the pairs training keeps: a pair with a blank side (`normalize.is_blank`) is skipped
  whole, as the id shards skip it, so blank lines, CRLF endings and a BOM leave the vocabulary as it is.
  """
  path = vocab_path(data_config, workdir)
  if data_config.tokenizer == MARIAN_TOKENIZER or epath.Path(path).exists():
    return open_tokenizer(data_config, workdir)

  def texts():
    for s, t in train_pairs:
      if normalize.is_blank(s) or normalize.is_blank(t):
        continue
      yield s
      yield t

  return tokenizer_lib.load_or_train_tokenizer(
      path, texts, data_config.vocab_size, model_type=data_config.vocab_model_type,
      max_sentences=data_config.vocab_max_sentences, character_coverage=data_config.vocab_character_coverage,
      lowercase=data_config.lowercase)


def build_eval_set(tokenizer: tokenizer_lib.TextTokenizer, pairs) -> EvalSet:
  """Eval splits keep every pair (blank ones as empty sequences) so outputs stay aligned with inputs."""
  srcs, tgts = tokenizer_lib.encode_pairs(tokenizer, pairs)
  return EvalSet(list(pairs), srcs, tgts)


def ids_root(workdir: str, split: str) -> epath.Path:
  """Where the training split's id shards live: `<workdir>/data/<split>.ids/`, or, for a workdir on Cloud
  Storage (ArrayRecord reads and writes local files only), `~/.cache/transformer_jax/ids/<split>.ids/` (the
  shards sit in a subdirectory named by their key, so runs never read another's ids)."""
  path = Workdir(workdir).token_ids(split)
  if is_local(path):
    return path
  return epath.Path(os.path.expanduser("~/.cache/transformer_jax/ids")) / path.name


def prepare_ids(data_config: DataConfig, workdir: str, builder, source_key: str, target_key: str, *,
                process_index: int = 0, process_count: int = 1,
                barrier: Callable[[str], None] | None = None) -> tuple[tokenizer_lib.TextTokenizer,
                                                                      id_shards.IdShards]:
  """The run's vocabulary and the training split's id shards, made the first time (`id_shards.write_shards`).

  A missing SentencePiece vocabulary is trained by process 0 on an evenly spaced sample of
  `data.vocab_max_sentences` lines (`pipeline.evenly_spaced_splits`: the corpus is not read for it), the other
  processes wait at `barrier`; then every process writes its shards, waits, and writes any shard it still
  cannot see (workdirs that are not shared). Every process calls `barrier("vocabulary")`, then
  `barrier("token ids")`, whatever it finds on disk. Raises ValueError when the split has no non-blank pair.
  """
  split = data_config.train_split
  read = lambda s: records.read_pairs(builder, s, source_key, target_key)  # noqa: E731
  try:
    pairs = builder.info.splits[split].num_examples
  except KeyError:  # no split metadata (tfds.testing.mock_data): count by reading
    pairs = len(read(split))
  # Every process passes both barriers whatever it finds on disk: which files exist depends on when each one
  # looks (process 0 may have written the vocabulary already), and the processes must meet the same barriers.
  vocab_missing = not (data_config.tokenizer == MARIAN_TOKENIZER or
                       epath.Path(vocab_path(data_config, workdir)).exists())
  if vocab_missing and process_index == 0:
    sample = pipeline.evenly_spaced_splits(split, pairs, -(-data_config.vocab_max_sentences // 2))
    load_tokenizer(data_config, workdir, pipeline.iterate_pairs(read, sample))
  if barrier:
    barrier("vocabulary")
  tok = open_tokenizer(data_config, workdir)
  key = token_cache.cache_key(builder.info.full_name, split, source_key, target_key,
                              vocab_path(data_config, workdir), normalize.signature(tok.normalization, tok.lowercase))
  directory = id_shards.key_directory(ids_root(workdir, split), key)
  shards = id_shards.IdShards.open(directory, key)
  shard_splits = tfds.even_splits(split, max(1, -(-pairs // id_shards.SHARD_PAIRS)))
  start, wrote = time.perf_counter(), 0
  if shards is None:
    wrote = id_shards.write_shards(directory, key, shard_splits, read, tok, process_index=process_index,
                                  process_count=process_count)
  if barrier:
    barrier("token ids")
  if shards is None:
    if barrier:  # the shards of processes whose files this one cannot see (workdirs that are not shared)
      wrote += id_shards.write_shards(directory, key, shard_splits, read, tok, only_mine=False)
    shards = id_shards.IdShards.open(directory, key)
    logging.info("Tokenised %d of the %d shards of %s into %s in %.1fs", wrote, len(shard_splits), split,
                 directory, time.perf_counter() - start)
  if shards is None:  # every shard was written: only another writer of other ids in this directory gets here
    raise ValueError(f"id shards at {directory} are incomplete or were written for other data after this process "
                     f"wrote them; remove that directory and rerun")
  if not len(shards.lengths):
    raise ValueError(f"training split {split!r} of {data_config.dataset} has no non-blank pairs")
  return tok, shards


def build_datasets(data_config: DataConfig, workdir: str, *, seed: int, process_index: int = 0,
                   process_count: int = 1, barrier: Callable[[str], None] | None = None) -> Datasets:
  """Vocabulary + this process's packed training stream + evaluation sets for `data_config`.

  `barrier(name)`: on several processes, waits until every process got there (the trainer passes
  `multihost.sync_processes`): the vocabulary is trained by process 0 alone, the id shards by all.
  Raises ValueError for the data errors (`prepare_ids`, `pipeline.TrainStream`).
  """
  eval_names = list(data_config.eval_splits)
  split = data_config.train_split
  # One dataset preparation (and, for local text, one validation of the files) for every split.
  builder, source_key, target_key = sources.open_splits(data_config, [split, *eval_names], workdir)
  tok, shards = prepare_ids(data_config, workdir, builder, source_key, target_key, process_index=process_index,
                            process_count=process_count, barrier=barrier)
  if not len(shards.kept(data_config.max_len)):
    longest = int(shards.lengths.max(axis=1).min())
    raise ValueError(f"training split {split!r} of {data_config.dataset}: every one of its {len(shards.lengths)} "
                     f"non-blank pairs was dropped for its length (the shortest has {longest} tokens on its longer "
                     f"side, EOS included; --config.data.max_len={data_config.max_len}): raise data.max_len (and "
                     "model.max_len) to at least that")
  alpha = float(data_config.subword_alpha)
  if alpha and not hasattr(tok, "sample_batch"):
    raise ValueError(f"data.subword_alpha={alpha} needs data.tokenizer='sentencepiece' (a "
                     f"{type(tok).__name__} cannot sample segmentations)")
  train = pipeline.TrainStream(shards, tokens_per_batch=data_config.tokens_per_batch,
                               row_length=data_config.max_len, pad_id=tok.pad_id, seed=seed,
                               process_index=process_index, process_count=process_count,
                               sampling=(tok, alpha, int(data_config.subword_from_epoch)) if alpha else None)
  kept = len(train.kept)
  too_long = len(shards.lengths) - kept
  batching.log_drop_counts("train", too_long, shards.skipped_blank, kept, data_config.max_len)
  eval_sets = {}
  for name in eval_names:
    eval_sets[name] = build_eval_set(tok, records.read_pairs(builder, name, source_key, target_key))
  stats = {"train_pairs": kept, "dropped_long": too_long, "skipped_blank": shards.skipped_blank}
  return Datasets(tok, train, eval_sets, stats)
