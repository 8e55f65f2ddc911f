"""From a data config to what the trainer consumes: the shared vocabulary, packed train batches, eval sets.

text (tfds) -> normalise (`normalize`, inside the tokenizer) -> SentencePiece ids (+EOS) -> drop blank /
over-long pairs (counted, logged) -> packed batches. The training split's ids are cached in `<workdir>/data/`
(`token_cache`, keyed by the vocabulary and its normalisation), so a restart skips the text, unless
`data.subword_alpha > 0` samples a new segmentation of the texts every epoch (`subword_sampling`).

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
from etils import epath

from transformer_jax.data import batching, normalize, records, sources, subword_sampling, token_cache
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data.marian_vocab import TOKENIZER_NAME as MARIAN_TOKENIZER
from transformer_jax.data.marian_vocab import MarianVocabulary
from transformer_jax.workdir import Workdir


@dataclasses.dataclass
class EvalSet:
  """One evaluation split: the raw text pairs and their ids (EOS included), in stored order."""

  pairs: list[tuple[str, str]]
  sources: list[np.ndarray]
  targets: list[np.ndarray]


@dataclasses.dataclass
class Datasets:
  tokenizer: tokenizer_lib.TextTokenizer
  train: batching.PackedBatches
  eval_sets: dict[str, EvalSet]
  stats: dict[str, Any]


def vocab_path(data_config: Any, workdir: str) -> str:
  """The vocabulary this run uses: `data.vocab_path` if given, else `<workdir>/vocab/spm.model`, or for
  `data.tokenizer="marian"` the directory `<workdir>/vocab` (source.spm, target.spm, vocab.json)."""
  if data_config.vocab_path:
    return data_config.vocab_path
  run_dir = Workdir(workdir)
  return os.fspath(run_dir.vocab_dir if data_config.tokenizer == MARIAN_TOKENIZER else run_dir.vocab)


def lowercase(data_config: Any) -> bool:
  """`data.lowercase`: the run's vocabulary is case-folded (False for configs written before the key existed)."""
  return bool(getattr(data_config, "lowercase", False))


def open_tokenizer(data_config: Any, workdir: str) -> tokenizer_lib.TextTokenizer:
  """The run's existing vocabulary (`vocab_path`): a `Tokenizer`, or a `MarianVocabulary` for
  `data.tokenizer="marian"`. Raises `VocabularyError` (one line) when it is missing or unreadable, or when it
  is case-folded and `data.lowercase` is not set, or the other way round."""
  path = vocab_path(data_config, workdir)
  if data_config.tokenizer == MARIAN_TOKENIZER:
    return MarianVocabulary(path)
  tokenizer = tokenizer_lib.Tokenizer(path)
  if tokenizer.lowercase != lowercase(data_config):
    kind = "a lowercased" if tokenizer.lowercase else "a cased"
    raise tokenizer_lib.VocabularyError(
        f"{path} is {kind} vocabulary but --config.data.lowercase={lowercase(data_config)}; set "
        f"data.lowercase={tokenizer.lowercase} or use another vocabulary")
  return tokenizer


def skip_blank(pairs, is_blank=normalize.is_blank):
  """Pairs whose source or target has nothing visible are skipped in training; returns (kept, n).

  `is_blank` is the vocabulary's (`Tokenizer.is_blank`): empty, whitespace, BOM or zero-width characters
  only; for a vocabulary from before normalisation, whitespace only.
  """
  kept = [(s, t) for s, t in pairs if not is_blank(s) and not is_blank(t)]
  return kept, len(pairs) - len(kept)


def load_tokenizer(data_config: Any, workdir: str, train_pairs=None) -> tokenizer_lib.TextTokenizer:
  """Loads the run's vocabulary, training a SentencePiece one on both sides of the training split the first
  time; a Marian tokenizer is only ever loaded (`open_tokenizer`)."""
  path = vocab_path(data_config, workdir)
  if data_config.tokenizer == MARIAN_TOKENIZER or epath.Path(path).exists():
    return open_tokenizer(data_config, workdir)

  def texts():
    for s, t in train_pairs:
      yield s
      yield t

  return tokenizer_lib.load_or_train_tokenizer(
      path, texts, data_config.vocab_size, model_type=data_config.vocab_model_type,
      max_sentences=data_config.vocab_max_sentences, character_coverage=data_config.vocab_character_coverage,
      lowercase=lowercase(data_config))


def build_eval_set(tokenizer: tokenizer_lib.TextTokenizer, pairs) -> EvalSet:
  """Eval splits keep every pair (blank ones as empty sequences) so outputs stay aligned with inputs."""
  srcs, tgts = tokenizer_lib.encode_pairs(tokenizer, pairs)
  return EvalSet(list(pairs), srcs, tgts)


def build_datasets(data_config: Any, workdir: str, *, seed: int, process_index: int = 0, process_count: int = 1,
                   share_across_processes: Callable | None = None) -> Datasets:
  """Vocabulary + packed training iterator + evaluation sets for `data_config` (see experiment configs).

  `share_across_processes`: with `data.subword_alpha > 0` on several processes, the collective that gives every
  process process 0's sampled segmentations (`sharding.ragged_from_first_process`; `SampledSegmentations`).
  Raises ValueError when it is missing there (each host would pack its own draw), and for the data errors below.
  """
  eval_names = list(data_config.eval_splits)
  split = data_config.train_split
  # One dataset preparation (and, for local text, one validation of the files) for every split.
  builder, source_key, target_key = sources.open_splits(data_config, [split, *eval_names], workdir)
  cache_file = os.fspath(Workdir(workdir).token_ids(split))
  key = lambda: token_cache.cache_key(builder.info.full_name, split, source_key, target_key,  # noqa: E731
                                      vocab_path(data_config, workdir),
                                      normalize.signature(tok.normalization, tok.lowercase))
  cached, tok = None, None
  if data_config.tokenizer == MARIAN_TOKENIZER or epath.Path(vocab_path(data_config, workdir)).exists():
    tok = open_tokenizer(data_config, workdir)
    start = time.perf_counter()
    cached = token_cache.load(cache_file, key())
    if cached:
      logging.info("Loaded the token ids of %d %s pairs from %s in %.1fs", len(cached[0]), split, cache_file,
                   time.perf_counter() - start)
  alpha = float(data_config.subword_alpha)
  train_pairs = None
  if cached:
    srcs, tgts, blank = cached
  if not cached or alpha:  # the texts: to encode them, or to sample their segmentations every epoch
    start = time.perf_counter()
    train_pairs, blank = skip_blank(records.read_pairs(builder, split, source_key, target_key),
                                    tok.is_blank if tok else normalize.is_blank)
    if not train_pairs:
      raise ValueError(f"training split {split!r} of {data_config.dataset} has no non-blank pairs")
  if not cached:
    tok = tok or load_tokenizer(data_config, workdir, train_pairs)
    srcs, tgts = tokenizer_lib.encode_pairs(tok, train_pairs)
    logging.info("Read and encoded %d %s pairs in %.1fs", len(srcs), split, time.perf_counter() - start)
    if process_index == 0:  # one writer for a shared workdir
      token_cache.save(cache_file, key(), srcs, tgts, blank)
  keep = batching.within_length(srcs, tgts, data_config.max_len)
  too_long = len(srcs) - len(keep)
  segmentations = None
  if alpha:
    if not hasattr(tok, "sample_batch"):
      raise ValueError(f"data.subword_alpha={alpha} needs data.tokenizer='sentencepiece' (a "
                       f"{type(tok).__name__} cannot sample segmentations)")
    if process_count > 1 and share_across_processes is None:
      raise ValueError(f"data.subword_alpha={alpha} on {process_count} processes needs share_across_processes "
                       "(sharding.ragged_from_first_process): SentencePiece's sampling differs between processes")
    if len(train_pairs) != len(srcs):
      raise ValueError(f"{cache_file} holds {len(srcs)} pairs but {split!r} has {len(train_pairs)}: remove it")
    segmentations = subword_sampling.SampledSegmentations(
        tok, [train_pairs[i] for i in keep], [srcs[i] for i in keep], [tgts[i] for i in keep], alpha=alpha,
        seed=seed, max_len=data_config.max_len, share=share_across_processes,
        from_epoch=int(data_config.subword_from_epoch))
  srcs, tgts = [srcs[i] for i in keep], [tgts[i] for i in keep]
  batching.log_drop_counts("train", too_long, blank, len(srcs), data_config.max_len)
  train = batching.PackedBatches(srcs, tgts, tokens_per_batch=data_config.tokens_per_batch,
                                 row_length=data_config.max_len, pad_id=tok.pad_id, seed=seed,
                                 process_index=process_index, process_count=process_count,
                                 segmentations=segmentations,
                                 plan_settings={"subword_alpha": alpha,
                                                "subword_from_epoch": int(data_config.subword_from_epoch)})
  eval_sets = {}
  for name in eval_names:
    eval_sets[name] = build_eval_set(tok, records.read_pairs(builder, name, source_key, target_key))
  stats = {"train_pairs": len(srcs), "dropped_long": too_long, "skipped_blank": blank}
  return Datasets(tok, train, eval_sets, stats)
