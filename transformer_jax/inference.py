"""Host-side batched translation of token-id sequences with the searches of `transformer_jax.decode`.

`translate_ids` sorts the sources by length, groups them into batches whose source length is padded to a
bucket (8, 16, 24, 32, 48, 64, 96, 128, ...) and whose row count is fixed (a last, smaller batch of a bucket
is padded to a power of two), so a file of mixed lengths compiles one search per (bucket, row count) and not
one per batch. Results come back in input order. `compilation_count()` counts the traces (= compilations)
of the search functions, so tests can assert that batches of one bucket reuse the compiled search.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import decode, mbr
from transformer_jax.config import ModelConfig

# Number of traces of each search function, keyed like `_search_fn` plus the traced shapes.
_TRACES: collections.Counter = collections.Counter()


def compilation_count() -> int:
  """How many times `translate_ids` has traced (and so compiled) a search function in this process."""
  return sum(_TRACES.values())


def compilation_keys() -> dict:
  """The traced (search, shape) keys and how often each was traced (more than once means a cache miss)."""
  return dict(_TRACES)


def _buckets():
  """8, 16, then 24, 32, 48, 64, 96, 128, ...: at most 50% padding beyond 16 tokens."""
  yield 8
  yield 16
  base = 16
  while True:
    yield base * 3 // 2
    base *= 2
    yield base


def length_bucket(length: int) -> int:
  """Smallest bucket >= length from 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... (x1.5 / x1.33 steps)."""
  for b in _buckets():
    if b >= length:
      return b
  raise AssertionError("unreachable")



def _rows_bucket(n: int, rows: int) -> int:
  """A full batch keeps `rows`; a smaller one is padded to the next power of two (at most `rows`)."""
  return rows if n >= rows else min(rows, 1 << max(n - 1, 0).bit_length())


@functools.lru_cache(maxsize=None)
def _search_fn(config: ModelConfig, beam_size: int, alpha: float, max_decode_len: int,
               n_best: bool = False) -> Callable:
  """Jitted `(params, inputs, max_lengths) ->` the best tokens `[rows, max_decode_len]`, or with `n_best` the
  whole beam `(tokens [rows, beam_size, max_decode_len], log_probs [rows, beam_size])`; one per static setting."""
  def search(params, inputs, max_lengths):
    _TRACES[(beam_size, alpha, max_decode_len, n_best) + tuple(inputs.shape)] += 1  # runs only while tracing
    if beam_size == 1:
      tokens, _ = decode.greedy_search(params, config, inputs, max_decode_len, max_lengths=max_lengths)
      return tokens
    out = decode.beam_search(params, config, inputs, beam_size, alpha, max_decode_len,
                             max_lengths=max_lengths, full_output=True)
    return (out.tokens, out.log_probs) if n_best else out.tokens[:, 0]
  return jax.jit(search)


def _strip(tokens: np.ndarray, eos_id: int, pad_id: int) -> list[int]:
  out = []
  for tok in tokens.tolist():
    if tok == eos_id or tok == pad_id:
      break
    out.append(tok)
  return out


def translate_ids(params, config: ModelConfig, sources: Sequence[Sequence[int]], *, beam_size: int = 4,
                  alpha: float = 0.6, extra_len: int = 50, max_tokens_per_batch: int = 4096,
                  batch_size: Optional[int] = None, append_eos: bool = True,
                  progress: Optional[Callable[[int], None]] = None) -> list[list[int]]:
  """Translates token-id sequences; returns the best hypothesis of each, without EOS, in input order.

  Args:
    params: the model's (unboxed) parameters.
    config: the model's `ModelConfig`.
    sources: source token ids. Training feeds sources as `ids + [EOS]`, so with `append_eos` EOS is appended
      to each source that does not already end with it (`Tokenizer.encode` output, which ends with EOS, is
      taken as it is). An empty source gives an empty output and is not run through the model.
    beam_size: 1 runs greedy search; more runs beam search (the paper: 4).
    alpha: GNMT length-penalty exponent (the paper: 0.6); unused by greedy search.
    extra_len: each output has at most `len(source) + extra_len` tokens, EOS included (the paper: 50), where
      `len(source)` counts the source ids before EOS is appended; also capped by `config.max_len`.
    max_tokens_per_batch: rows per batch = this // the padded source length (ignored if `batch_size`).
    batch_size: a fixed number of source rows per batch.
    progress: called after each batch with the number of sources it finished (e.g. `tqdm.update`).

  Sources longer than `config.max_len` (EOS included) are truncated, with a warning.
  """
  rows = _search_all(params, config, sources, beam_size=beam_size, alpha=alpha, extra_len=extra_len,
                     max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size, append_eos=append_eos,
                     progress=progress, n_best=False)
  return [[] if row is None else _strip(row, config.eos_id, config.pad_id) for row in rows]


def n_best_ids(params, config: ModelConfig, sources: Sequence[Sequence[int]], *, beam_size: int = 4,
               alpha: float = 0.6, extra_len: int = 50, max_tokens_per_batch: int = 4096,
               batch_size: Optional[int] = None, append_eos: bool = True,
               progress: Optional[Callable[[int], None]] = None) -> list[list[tuple[list[int], float]]]:
  """Beam search's whole n-best list of each source: `[(ids without EOS, log_prob), ...]`, best first.

  The order is beam search's (length-penalised score, `alpha`); `log_prob` is the model's raw log-probability
  of the hypothesis (float, natural log, EOS included; `decode.BeamSearchOutput.log_probs`), what MBR
  weighs (`transformer_jax.mbr`). Each list holds the finished hypotheses (those that emitted EOS, at most
  `beam_size`): the unfinished ones the search ranks after them (stopped early, or at the length limit) have
  the log-probability of a prefix, so they are dropped, unless no hypothesis finished: then the list is the
  best one alone. An empty source gives `[]`. Arguments and batching as `translate_ids`; raises ValueError unless
  `beam_size >= 2` (greedy search has no list).
  """
  if beam_size < 2:
    raise ValueError(f"beam_size={beam_size}: an n-best list needs beam search (beam_size >= 2)")
  rows = _search_all(params, config, sources, beam_size=beam_size, alpha=alpha, extra_len=extra_len,
                     max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size, append_eos=append_eos,
                     progress=progress, n_best=True)
  out = []
  for row in rows:
    if row is None:
      out.append([])
      continue
    tokens, log_probs = row  # [beam, max_decode_len], [beam]
    filled = [k for k in range(len(log_probs)) if np.isfinite(log_probs[k])]
    finished = [k for k in filled if np.any(tokens[k] == config.eos_id)] or filled[:1]
    out.append([(_strip(tokens[k], config.eos_id, config.pad_id), float(log_probs[k])) for k in finished])
  return out


def _search_all(params, config: ModelConfig, sources, *, beam_size, alpha, extra_len, max_tokens_per_batch,
                batch_size, append_eos, progress, n_best: bool) -> list:
  """Runs the search over every non-empty source in length buckets; each source's row of the search's
  output (numpy; a `(tokens, log_probs)` pair with `n_best`) in input order, None for an empty source."""
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size} must be >= 1")
  params = jax.device_put(nn.unbox(params))
  results: list = [None] * len(sources)
  prepared = _prepare_sources(sources, config, extra_len, append_eos)
  rows_for = lambda bucket: batch_size or max(1, max_tokens_per_batch // bucket)  # noqa: E731
  # Dispatch the next batch before reading the previous one back, so host work overlaps the device.
  pending = None
  for batch in _group_by_bucket(prepared, config, rows_for) + [None]:
    future = None
    if batch is not None:
      bucket = _bucket_of(batch[0][1], config)
      future = _run_batch(params, config, batch, bucket, rows_for(bucket), beam_size, alpha, extra_len, n_best)
    if pending is not None:
      done_batch, output = pending
      output = jax.tree_util.tree_map(np.asarray, output)
      for r, (i, _, _) in enumerate(done_batch):
        results[i] = jax.tree_util.tree_map(lambda x: x[r], output)  # noqa: B023
      if progress is not None:
        progress(len(done_batch))
    pending = (batch, future) if batch is not None else None
  return results


_Prepared = tuple[int, list[int], int]  # (input index, ids fed to the encoder, output length limit)


def _prepare_sources(sources: Sequence[Sequence[int]], config: ModelConfig, extra_len: int,
                     append_eos: bool) -> list[_Prepared]:
  """The non-empty sources with EOS appended and truncated to `config.max_len`, longest first."""
  eos = config.eos_id
  prepared = []
  for i, src in enumerate(sources):
    ids = [int(x) for x in src]
    if not ids:
      continue
    given = len(ids) - 1 if ids[-1] == eos else len(ids)
    if append_eos and ids[-1] != eos:
      ids.append(eos)
    if len(ids) > config.max_len:
      logging.warning("source %d has %d tokens; truncated to config.max_len=%d", i, len(ids), config.max_len)
      ids = ids[: config.max_len - 1] + [eos] if append_eos else ids[: config.max_len]
    prepared.append((i, ids, given + extra_len))
  # Longest first: memory problems show at once and the batches of a bucket are contiguous.
  prepared.sort(key=lambda item: -len(item[1]))
  return prepared


def _bucket_of(ids: list[int], config: ModelConfig) -> int:
  return min(length_bucket(len(ids)), config.max_len)


def _group_by_bucket(prepared: list[_Prepared], config: ModelConfig, rows_for) -> list[list[_Prepared]]:
  """Consecutive sources of one length bucket, at most `rows_for(bucket)` per batch."""
  batches: list[list[_Prepared]] = []
  for item in prepared:
    bucket = _bucket_of(item[1], config)
    if batches and _bucket_of(batches[-1][0][1], config) == bucket and len(batches[-1]) < rows_for(bucket):
      batches[-1].append(item)
    else:
      batches.append([item])
  return batches


def _run_batch(params, config: ModelConfig, batch: list[_Prepared], bucket: int, rows: int, beam_size: int,
               alpha: float, extra_len: int, n_best: bool = False):
  """Dispatches one padded batch `[rows bucket, bucket]` to the compiled search; returns its output (async)."""
  eos, pad = config.eos_id, config.pad_id
  max_decode_len = max(1, min(bucket + extra_len, config.max_len))
  n_rows = _rows_bucket(len(batch), rows)
  inputs = np.full((n_rows, bucket), pad, np.int32)
  inputs[:, 0] = eos  # filler rows: a bare EOS source that stops after one token
  limits = np.ones((n_rows,), np.int32)
  for r, (_, ids, limit) in enumerate(batch):
    inputs[r, :] = pad
    inputs[r, : len(ids)] = ids
    limits[r] = min(limit, max_decode_len)
  fn = _search_fn(config, beam_size, float(alpha), max_decode_len, n_best)
  return fn(params, jnp.asarray(inputs), jnp.asarray(limits))


def translate_texts(params, config: ModelConfig, tokenizer, texts: Sequence[str], *, beam_size: int = 1,
                    alpha: float = 0.6, extra_len: int = 50, mbr_utility: str = "", target_lang: str = "",
                    progress: Callable[[int], None] | None = None, **kwargs) -> list[str]:
  """Detokenised translations of `texts` in input order; blank lines give empty lines.

  `tokenizer` is a `transformer_jax.data.tokenizer.Tokenizer`: encode normalises each text as its vocabulary
  was trained (`transformer_jax.data.normalize`: BOM and zero-width characters dropped, spaces collapsed,
  NFC) and appends EOS; decode stops at EOS. A line with nothing visible after that is blank.

  `mbr_utility` '' returns beam search's best hypothesis; 'chrf' or 'bleu' returns the minimum-Bayes-risk
  choice from its `beam_size`-best list under that sentence-level utility (`n_best_texts`, then `choose`),
  which needs `beam_size >= 2`; BLEU tokenises for `target_lang` (`metrics.bleu_metric`). Raises ValueError
  for another utility or a smaller beam.
  """
  if mbr_utility:
    mbr.utility_fn(mbr_utility, target_lang)  # raises on an unknown utility before anything is decoded
    return choose(n_best_texts(params, config, tokenizer, texts, beam_size=beam_size, alpha=alpha,
                               extra_len=extra_len, progress=progress, **kwargs), mbr_utility, target_lang)
  ids = [[] if tokenizer.is_blank(t) else tokenizer.encode(t) for t in texts]
  outputs = translate_ids(params, config, ids, beam_size=beam_size, alpha=alpha, extra_len=extra_len,
                          progress=progress, **kwargs)
  return [tokenizer.decode(o) if src else "" for o, src in zip(outputs, ids)]


def n_best_texts(params, config: ModelConfig, tokenizer, texts: Sequence[str], *, beam_size: int = 4,
                 alpha: float = 0.6, extra_len: int = 50, progress: Callable[[int], None] | None = None,
                 **kwargs) -> list[list[tuple[str, float]]]:
  """`n_best_ids` of `texts`, detokenised: per text `[(translation, log_prob), ...]`, best first; `[]` for a
  blank line. Encoding as `translate_texts`; raises ValueError unless `beam_size >= 2`."""
  ids = [[] if tokenizer.is_blank(t) else tokenizer.encode(t) for t in texts]
  lists = n_best_ids(params, config, ids, beam_size=beam_size, alpha=alpha, extra_len=extra_len,
                     progress=progress, **kwargs)
  return [[(tokenizer.decode(c), log_prob) for c, log_prob in candidates] for candidates in lists]


def choose(n_best: Sequence[Sequence[tuple[str, float]]], mbr_utility: str = "",
           target_lang: str = "") -> list[str]:
  """One translation per `n_best_texts` list: the first (beam search's best) with `mbr_utility` '', else the
  minimum-Bayes-risk choice under 'chrf' or 'bleu' for `target_lang` (`transformer_jax.mbr.select`); '' for
  an empty list. Raises ValueError for another utility."""
  if not mbr_utility:
    return [candidates[0][0] if candidates else "" for candidates in n_best]
  utility = mbr.utility_fn(mbr_utility, target_lang)
  outputs = []
  for candidates in n_best:
    texts = [text for text, _ in candidates]
    outputs.append(texts[mbr.select(texts, [lp for _, lp in candidates], utility)] if texts else "")
  return outputs
