"""Host-side batched translation of token-id sequences with the searches of `transformer_jax.decoding`.

`translate_ids` sorts the sources by length, groups them into batches whose source length is padded to a
bucket (8, 16, 24, 32, 48, 64, 96, 128, ...) and whose row count is fixed (a last, smaller batch of a bucket
is padded to a power of two), so a file of mixed lengths compiles one search per (bucket, row count) and not
one per batch. Results come back in input order. `compilation_count()` counts the traces (= compilations)
of the search functions, so tests can assert that batches of one bucket reuse the compiled search.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig
from transformer_jax.decoding import constraints as constraints_lib
from transformer_jax.decoding import generate, mbr, scoring

# Largest sampling seed: `jax.random.PRNGKey` keeps a seed's low 32 bits (without jax_enable_x64), so larger
# seeds would repeat smaller ones.
MAX_SEED = 2**32 - 1

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



def rows_bucket(n: int, rows: int) -> int:
  """The rows of a batch of `n` sources: a full batch keeps `rows`; a smaller one is padded to the next power of
  two (at most `rows`), so a file's batches compile few row counts."""
  return rows if n >= rows else min(rows, 1 << max(n - 1, 0).bit_length())


@functools.lru_cache(maxsize=None)
def _search_fn(config: ModelConfig, options: generate.DecodeOptions, max_decode_len: int, models: int = 1,
               with_prefix: bool = False, constraint_width: int = 0) -> Callable:
  """Jitted `(params_tuple, inputs, max_lengths, indices, seed, prefix_tokens, prefix_lengths) -> Hypotheses`
  (`generate.generate`), one per static setting; `indices` `[rows]` are the sources' input indices, whose keys
  `fold_in(PRNGKey(seed), index)` sampling draws from (the same outputs whatever the batching)."""
  def run(params_tuple, inputs, max_lengths, indices, seed, prefix_tokens, prefix_lengths, constraints=None):
    _TRACES[(options, max_decode_len, models, with_prefix, constraint_width) + tuple(inputs.shape)] += 1
    # int8 weights (`quantization.QuantizedParams`) are dequantized here, inside the compiled search.
    params_tuple = tuple(p.dequantize() if hasattr(p, "dequantize") else p for p in params_tuple)
    keys = None
    if options.random:
      base = jax.random.PRNGKey(seed)
      keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(indices)
    prefix = dict(prefix_tokens=prefix_tokens, prefix_lengths=prefix_lengths) if with_prefix else {}
    return generate.generate(params_tuple, config, inputs, max_lengths, options, max_decode_len, keys=keys,
                             constraints=constraints if constraint_width else None, **prefix)
  return jax.jit(run)


def search_program(config: ModelConfig, options: generate.DecodeOptions, max_decode_len: int) -> Callable:
  """The jitted search `decode_ids` dispatches a batch to (one model, no prefixes or constraints):
  `(params_tuple, inputs [rows, src_len] int32, max_lengths [rows], indices [rows], seed int32 scalar,
  prefix_tokens [rows, 0], prefix_lengths [rows]) -> generate.Hypotheses`; `transformer_jax.run.plan` lowers it for
  a TPU topology."""
  return _search_fn(config, options, max_decode_len)


class Hypothesis(NamedTuple):
  """One decoded hypothesis of `decode_ids`."""
  ids: list  # token ids, EOS excluded
  log_prob: float  # natural log, sum over the tokens and the final EOS (the model's own, or the ensemble's)
  score: float  # log_prob / ((5 + |Y|) / 6) ** alpha, |Y| counting EOS (`search.length_penalty`)
  token_log_probs: Optional[list]  # one float per token, then EOS's (if finished); None unless asked for
  alignment: Optional[list]  # source position of each token of `ids` (`alignment.pharaoh`), or None
  finished: bool = True  # False: the length limit cut it before EOS (returned only when nothing finished)


def _strip(tokens: np.ndarray, eos_id: int, pad_id: int) -> list[int]:
  out = []
  for tok in tokens.tolist():
    if tok == eos_id or tok == pad_id:
      break
    out.append(tok)
  return out


def translate_ids(params, config: ModelConfig, sources: Sequence[Sequence[int]], *, beam_size: int = 4,
                  alpha: float = 0.6, **kwargs) -> list[list[int]]:
  """The best hypothesis of each source (ids without EOS; `[]` for an empty source), in input order: `decode_ids`
  with beam search of `beam_size` (1 = greedy search, the paper: 4) and length penalty `alpha` (the paper: 0.6);
  `kwargs` as `decode_ids` (`extra_len`, `max_tokens_per_batch`, `batch_size`, `append_eos`, `progress`)."""
  options = generate.DecodeOptions(beam_size=beam_size, alpha=float(alpha), token_log_probs=False)
  return [hyps[0].ids if hyps else [] for hyps in decode_ids(params, config, sources, options, **kwargs)]


def decode_ids(params, config: ModelConfig, sources: Sequence[Sequence[int]],
               options: generate.DecodeOptions = generate.DecodeOptions(), *, prefixes: Optional[Sequence[Sequence[int]]] = None,
               constraints: Optional[Sequence[Sequence[Sequence[int]]]] = None,
               seed: int = 0, extra_len: int = 50, max_tokens_per_batch: int = 4096,
               batch_size: Optional[int] = None, append_eos: bool = True,
               progress: Optional[Callable[[int], None]] = None, first_index: int = 0) -> list[list[Hypothesis]]:
  """Decodes token-id sequences with every option of `generate.DecodeOptions`: per source its `Hypothesis` list.

  The front door of decoding (`decode_texts` is the same for text; `translate_ids` / `translate_texts` are
  one-line views of the two).

  Args:
    params: the model's (unboxed) parameters, or a list of several models' (an ensemble,
      `decoding.ensemble`; same `config` and vocabulary).
    sources: source token ids. Training feeds sources as `ids + [EOS]`, so with `append_eos` EOS is appended
      to each source that does not already end with it (`Tokenizer.encode` output, which ends with EOS, is
      taken as it is). An empty source gives `[]` and is not run through the model. Sources longer than
      `config.max_len` (EOS included) are truncated, with a warning.
    options: how to decode (`DecodeOptions.check` runs first; an MBR choice needs texts: `decode_texts`).
    prefixes: optional target ids (EOS excluded) per source that each output must start with (`[]` = none);
      each must leave room for one more token within the output limit.
    constraints: optional phrases (target ids, EOS excluded) per source that each output must contain, by
      lexically constrained beam search (`decoding.constraints`; beam search only); check the outputs
      with `constraints.satisfied` (a phrase that cannot fit the length limit leaves the output unfinished).
    seed: sampling's seed, in [0, MAX_SEED]; source i samples with `fold_in(PRNGKey(seed), first_index + i)`,
      whatever the batching (`first_index`: the line number of `sources[0]` in a corpus decoded in parts,
      `transformer_jax.serving.corpus`).
    extra_len: each output has at most `len(source) + extra_len` tokens, EOS included (the paper: 50), where
      `len(source)` counts the source ids before EOS is appended; also capped by `config.max_len`.
    max_tokens_per_batch: rows per batch = this // the padded source length (ignored if `batch_size`).
    batch_size: a fixed number of source rows per batch.
    progress: called after each batch with the number of sources it finished (e.g. `tqdm.update`).

  Each list is best first and holds the finished hypotheses (or, when none finished, the best one alone,
  `finished=False`); an empty source gives `[]`. Beam search keeps going until `options.nbest` have finished
  (`search.beam_search_over`'s `nbest`), so a list is shorter than `options.nbest` only where the length limit
  left no room for more. Raises ValueError for bad options or prefixes.
  """
  params_list = _checked(params, config, options, seed)
  if prefixes is not None and len(prefixes) != len(sources):
    raise ValueError(f"{len(prefixes)} prefixes for {len(sources)} sources: one per source is needed")
  if constraints is not None and len(constraints) != len(sources):
    raise ValueError(f"{len(constraints)} constraint lists for {len(sources)} sources: one per source is needed")
  rows = _search_all(tuple(params_list), config, sources, options, prefixes, seed, constraints, extra_len=extra_len,
                     max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size, append_eos=append_eos,
                     progress=progress, first_index=first_index)
  return [[] if row is None else _hypotheses(row, config) for row in rows]


def _checked(params, config: ModelConfig, options: generate.DecodeOptions, seed: int) -> list:
  """The models' parameters on the device, once the options (`DecodeOptions.check`), the beam's candidate count
  and the seed are known good; ValueError otherwise."""
  if options.check().mbr_utility:
    raise ValueError(f"mbr_utility={options.mbr_utility!r} chooses among texts: decode with decode_texts")
  if options.rows_per_source * config.vocab_size > np.iinfo(np.int32).max:
    raise ValueError(f"beam_size={options.beam_size}: beam search ranks beam_size x vocab_size "
                     f"({config.vocab_size}) candidates with int32 indices; beam_size must be <= "
                     f"{np.iinfo(np.int32).max // config.vocab_size}")
  if not 0 <= seed <= MAX_SEED:
    raise ValueError(f"seed={seed} must be an integer in [0, {MAX_SEED}] (a PRNG key's 32 bits)")
  return [jax.device_put(nn.unbox(p)) for p in (params if isinstance(params, (list, tuple)) else [params])]


def decode_groups(params, config: ModelConfig, groups: Iterable[tuple[Any, Sequence[Sequence[int]], int]],
                  options: generate.DecodeOptions, *, seed: int = 0, extra_len: int = 50,
                  max_tokens_per_batch: int = 4096, max_open_groups: int = 2
                  ) -> Iterator[tuple[Any, list[list[Hypothesis]]]]:
  """`decode_ids` over a stream of groups whose sources share length-bucketed batches across group boundaries.

  `groups` yields `(key, sources, first_index)` (token ids as `decode_ids` takes them; source i of a group
  samples with line number `first_index + i`); this yields `(key, per-source Hypothesis lists)` as each group's
  last source is decoded (groups can finish out of order). Batches fill from every open group, so a stream of
  small groups (`transformer_jax.serving.corpus`'s shards) runs the full batches of one `decode_ids` call over them all;
  at most `max_open_groups` (>= 1) groups wait for a batch at once (the oldest is flushed first), so memory is
  flat in the stream's length. A source's output does not depend on which other sources share its batch
  (row-wise arithmetic; a batch's shape is (bucket rows, bucket) as in `decode_ids`). Raises ValueError as
  `decode_ids` (one model; no prefixes or constraints).
  """
  params_list = _checked(params, config, options, seed)
  if max_open_groups < 1:
    raise ValueError(f"max_open_groups={max_open_groups} must be >= 1")
  batcher = _GroupBatcher(tuple(params_list), config, options, seed, extra_len, max_tokens_per_batch)
  for key, sources, first_index in groups:
    yield from batcher.add(key, sources, first_index)
    while batcher.open_groups() > max_open_groups:
      yield from batcher.flush_oldest()
  yield from batcher.flush_all()


class _GroupBatcher:
  """`decode_groups`'s state: per length bucket the pending sources of the open groups, and each open group's
  results; one batch in flight (dispatched before the previous one is read back, as `_search_all`)."""

  def __init__(self, params_tuple, config: ModelConfig, options, seed: int, extra_len: int, max_tokens: int):
    self.config, self.max_tokens = config, max_tokens
    self.run = functools.partial(_run_batch, params_tuple, config, options=options, extra_len=extra_len,
                                 prefixes=None, seed=seed)
    self.extra_len = extra_len
    self.pending: dict[int, list] = collections.defaultdict(list)  # bucket -> [(group, (index, ids, limit), i)]
    self.groups: dict[int, list] = {}  # group number -> [key, results, sources left], in arrival order
    self.count, self.in_flight = 0, None

  def open_groups(self) -> int:
    return len(self.groups)

  def _rows(self, bucket: int) -> int:
    return max(1, self.max_tokens // bucket)

  def add(self, key, sources, first_index: int) -> Iterator:
    number, self.count = self.count, self.count + 1
    prepared = prepare_sources(sources, self.config, self.extra_len, append_eos=True)
    self.groups[number] = [key, [None] * len(sources), len(prepared)]
    for i, ids, limit in prepared:
      self.pending[source_bucket(ids, self.config)].append((number, (first_index + i, ids, limit), i))
    if not prepared:
      yield from self._finish(number)
    for bucket in sorted(self.pending, reverse=True):
      while len(self.pending[bucket]) >= self._rows(bucket):
        yield from self._dispatch(bucket, self.pending[bucket][: self._rows(bucket)])

  def flush_oldest(self) -> Iterator:
    """Dispatches every pending source of the oldest open group (its batches filled up from younger groups)."""
    oldest = next(iter(self.groups))
    for bucket in sorted(self.pending, reverse=True):
      items = self.pending[bucket]
      while any(item[0] == oldest for item in items):
        items.sort(key=lambda item: item[0] != oldest)  # stable: the oldest group's sources first
        yield from self._dispatch(bucket, items[: self._rows(bucket)])
    yield from self._collect(None)

  def flush_all(self) -> Iterator:
    for bucket in sorted(self.pending, reverse=True):
      while self.pending[bucket]:
        yield from self._dispatch(bucket, self.pending[bucket][: self._rows(bucket)])
    yield from self._collect(None)

  def _dispatch(self, bucket: int, batch: list) -> Iterator:
    del self.pending[bucket][: len(batch)]
    future = self.run([item[1] for item in batch], bucket, self._rows(bucket))
    yield from self._collect((batch, future))

  def _collect(self, next_in_flight) -> Iterator:
    """Reads back the batch in flight (yielding the groups it finishes) and puts `next_in_flight` in its place."""
    done, self.in_flight = self.in_flight, next_in_flight
    if done is None:
      return
    batch, output = done
    output = jax.tree_util.tree_map(np.asarray, output)
    for r, (number, _, i) in enumerate(batch):
      group = self.groups[number]
      group[1][i] = _hypotheses(jax.tree_util.tree_map(lambda x: x[r], output), self.config)  # noqa: B023
      group[2] -= 1
      if group[2] == 0:
        yield from self._finish(number)

  def _finish(self, number: int) -> Iterator:
    key, results, _ = self.groups.pop(number)
    yield key, [[] if hyps is None else hyps for hyps in results]


def _hypotheses(row, config: ModelConfig) -> list[Hypothesis]:
  """One source's row of `generate.Hypotheses` (numpy) -> its finished hypotheses (or the best one alone)."""
  filled = [k for k in range(len(row.log_probs)) if np.isfinite(row.log_probs[k])]
  finished = [k for k in filled if np.any(row.tokens[k] == config.eos_id)] or filled[:1]
  out = []
  for k in finished:
    ids = _strip(row.tokens[k], config.eos_id, config.pad_id)
    emitted = len(ids) + int(len(ids) < row.tokens.shape[-1] and row.tokens[k][len(ids)] == config.eos_id)
    aligned = None if row.alignment is None else [int(x) for x in row.alignment[k][: len(ids)]]
    out.append(Hypothesis(ids, float(row.log_probs[k]), float(row.scores[k]),
                          None if row.token_log_probs is None else
                          [float(x) for x in row.token_log_probs[k][:emitted]], aligned,
                          finished=emitted > len(ids)))
  return out


def _search_all(params_tuple, config: ModelConfig, sources, options, prefixes, seed, constraints, *, extra_len,
                max_tokens_per_batch, batch_size, append_eos, progress, first_index=0) -> list:
  """Runs the search over every non-empty source in length buckets; each source's row of the search's
  `Hypotheses` (numpy) in input order, None for an empty source."""
  results: list = [None] * len(sources)
  prepared = prepare_sources(sources, config, extra_len, append_eos)
  if prefixes is not None:
    _check_prefixes(prepared, prefixes, config, extra_len)
  rows_for = lambda bucket: batch_size or max(1, max_tokens_per_batch // bucket)  # noqa: E731
  run = functools.partial(_run_batch, params_tuple, config, options=options, extra_len=extra_len,
                          prefixes=prefixes, seed=seed, constraints=constraints,
                          constraint_width=_constraint_width(constraints), first_index=first_index)
  # Dispatch the next batch before reading the previous one back, so host work overlaps the device.
  pending = None
  for batch in _group_by_bucket(prepared, config, rows_for) + [None]:
    future = None
    if batch is not None:
      bucket = source_bucket(batch[0][1], config)
      future = run(batch, bucket, rows_for(bucket))
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


def prepare_sources(sources: Sequence[Sequence[int]], config: ModelConfig, extra_len: int,
                     append_eos: bool) -> list[_Prepared]:
  """`(input index, ids fed to the encoder, output length limit)` of the non-empty sources, EOS appended (with
  `append_eos`) and truncated to `config.max_len`, longest first: how `decode_ids` batches them."""
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


def _check_prefixes(prepared: list[_Prepared], prefixes, config: ModelConfig, extra_len: int) -> None:
  """Raises ValueError (before any decoding) for a prefix that leaves no room for a token after it."""
  for i, ids, limit in prepared:
    limit = min(limit, source_bucket(ids, config) + extra_len, config.max_len)
    if len(prefixes[i]) >= limit:
      raise ValueError(f"the prefix of source {i + 1} has {len(prefixes[i])} tokens; its output may have at most "
                       f"{limit} (EOS included), so the prefix must be shorter")


def source_bucket(ids: Sequence[int], config: ModelConfig) -> int:
  """The padded source length a source of `ids` (EOS included) is batched at: `length_bucket`, capped by
  `config.max_len`."""
  return min(length_bucket(len(ids)), config.max_len)


def _group_by_bucket(prepared: list[_Prepared], config: ModelConfig, rows_for) -> list[list[_Prepared]]:
  """Consecutive sources of one length bucket, at most `rows_for(bucket)` per batch."""
  batches: list[list[_Prepared]] = []
  for item in prepared:
    bucket = source_bucket(item[1], config)
    if batches and source_bucket(batches[-1][0][1], config) == bucket and len(batches[-1]) < rows_for(bucket):
      batches[-1].append(item)
    else:
      batches.append([item])
  return batches


def _run_batch(params_tuple, config: ModelConfig, batch: list[_Prepared], bucket: int, rows: int, *,
               options: generate.DecodeOptions, extra_len: int, prefixes, seed: int, constraints=None,
               constraint_width: int = 0, first_index: int = 0):
  """Dispatches one padded batch `[rows bucket, bucket]` to the compiled search; returns its output (async)."""
  eos, pad = config.eos_id, config.pad_id
  max_decode_len = max(1, min(bucket + extra_len, config.max_len))
  n_rows = rows_bucket(len(batch), rows)
  inputs = np.full((n_rows, bucket), pad, np.int32)
  inputs[:, 0] = eos  # filler rows: a bare EOS source that stops after one token
  limits = np.ones((n_rows,), np.int32)
  indices = np.zeros((n_rows,), np.int32)
  prefix_tokens = np.full((n_rows, max_decode_len if prefixes is not None else 0), pad, np.int32)
  prefix_lengths = np.zeros((n_rows,), np.int32)
  for r, (i, ids, limit) in enumerate(batch):
    inputs[r, :] = pad
    inputs[r, : len(ids)] = ids
    limits[r] = min(limit, max_decode_len)
    indices[r] = first_index + i
    if prefixes is not None and len(prefixes[i]):
      prefix = [int(x) for x in prefixes[i]]
      prefix_tokens[r, : len(prefix)] = prefix
      prefix_lengths[r] = len(prefix)
  cons = None
  if constraint_width:
    phrases = [constraints[i] for i, _, _ in batch] + [[]] * (n_rows - len(batch))
    cons = jax.tree_util.tree_map(jnp.asarray, constraints_lib.pack(phrases, constraint_width))
  fn = _search_fn(config, options, max_decode_len, len(params_tuple), prefixes is not None, constraint_width)
  return fn(params_tuple, jnp.asarray(inputs), jnp.asarray(limits), jnp.asarray(indices), jnp.uint32(seed),
            jnp.asarray(prefix_tokens), jnp.asarray(prefix_lengths), cons)


def _constraint_width(constraints) -> int:
  """Constraint positions per row, one static width for the whole call (a length bucket): 0 without any."""
  if constraints is None:
    return 0
  return length_bucket(max([sum(len(p) for p in c) for c in constraints] + [1]))


def translate_texts(params, config: ModelConfig, tokenizer, texts: Sequence[str], *, beam_size: int = 1,
                    alpha: float = 0.6, mbr_utility: str = "", **kwargs) -> list[str]:
  """Detokenised translations of `texts` in input order (blank lines give empty lines): `decode_texts` with
  beam search of `beam_size` (1 = greedy search), length penalty `alpha`, and with `mbr_utility` ('chrf' or
  'bleu') the minimum-Bayes-risk choice from the `beam_size`-best list; `kwargs` as `decode_texts`."""
  options = generate.DecodeOptions(beam_size=beam_size, alpha=float(alpha), mbr_utility=mbr_utility,
                                   token_log_probs=False)
  return [tokenizer.decode(hyps[0].ids) if hyps else "" for hyps in
          decode_texts(params, config, tokenizer, texts, options, **kwargs)]


def decode_texts(params, config: ModelConfig, tokenizer, texts: Sequence[str],
                 options: generate.DecodeOptions = generate.DecodeOptions(), *,
                 prefixes: Optional[Sequence[str]] = None, constraints: Optional[Sequence[Sequence[str]]] = None,
                 target_lang: str = "", **kwargs) -> list[list[Hypothesis]]:
  """`decode_ids` of `texts`, with optional target `prefixes` (text, one per text; '' = none; encoded as
  targets, without EOS) and `constraints` (per text, its phrases as text). Per text its `Hypothesis` list (ids:
  detokenise with `tokenizer.decode`); `[]` for a blank line.

  `tokenizer` is a `transformer_jax.data.tokenizer.Tokenizer`: encode normalises each text as its vocabulary
  was trained (`transformer_jax.data.normalize`: BOM and zero-width characters dropped, spaces collapsed,
  NFC) and appends EOS; a line with nothing visible after that is blank. With `options.mbr_utility` each list
  is the `beam_size`-best list reordered with the minimum-Bayes-risk choice first (`decoding.mbr.select` over
  the detokenised texts; BLEU tokenised for `target_lang`), then cut to `options.nbest`. Raises ValueError as
  `decode_ids`, and for a prefix or phrase that the vocabulary cannot spell (it encodes to `<unk>`, which would
  be forced into the output and count as met), naming its line."""
  ids = [[] if tokenizer.is_blank(t) else tokenizer.encode(t) for t in texts]
  prefix_ids = None
  if prefixes is not None:
    prefix_ids = [[] if tokenizer.is_blank(p) else _forced_target(tokenizer, p, "prefix", i)
                  for i, p in enumerate(prefixes)]
  constraint_ids = None
  if constraints is not None:
    constraint_ids = [[_forced_target(tokenizer, p, "constraint", i) for p in phrases if not tokenizer.is_blank(p)]
                      for i, phrases in enumerate(constraints)]
  lists = decode_ids(params, config, ids, options.check().search_options, prefixes=prefix_ids,
                     constraints=constraint_ids, **kwargs)
  if not options.mbr_utility:
    return lists
  return [hyps[:options.nbest] for hyps in mbr_first(lists, tokenizer, options.mbr_utility, target_lang)]


def mbr_first(lists: Sequence[list[Hypothesis]], tokenizer, mbr_utility: str,
              target_lang: str = "") -> list[list[Hypothesis]]:
  """Each n-best list with its minimum-Bayes-risk choice under `mbr_utility` ('chrf' or 'bleu'; '' leaves the
  lists as they are) moved to the front (`decoding.mbr.select` over the detokenised texts, weighted by
  `log_prob`; BLEU tokenised for `target_lang`). Raises ValueError for another utility."""
  if not mbr_utility:
    return list(lists)
  utility = mbr.utility_fn(mbr_utility, target_lang)
  chosen = [mbr.select([tokenizer.decode(h.ids) for h in hyps], [h.log_prob for h in hyps], utility) if hyps else 0
            for hyps in lists]
  return [[hyps[k]] + hyps[:k] + hyps[k + 1:] if hyps else [] for hyps, k in zip(lists, chosen)]


def _forced_target(tokenizer, text: str, what: str, index: int) -> list[int]:
  """`text` as target ids (no EOS) that decoding is made to emit; ValueError if a piece is `<unk>`."""
  ids = tokenizer.encode(text, add_eos=False, target=True)
  unknown = getattr(tokenizer, "unk_id", None)
  if unknown is not None and unknown in ids:
    raise ValueError(f"the {what} {text!r} of line {index + 1} has characters outside the vocabulary (they encode "
                     "as <unk>, which decoding would be forced to emit): rephrase it or leave it out")
  return ids


def score_ids(params, config: ModelConfig, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], *,
              max_tokens_per_batch: int = 4096) -> list[np.ndarray]:
  """Forced decoding: per pair the log-probability of each target token, EOS included (`scoring`), float32.

  `sources` and `targets` are ids that end with EOS (`Tokenizer.encode`); an empty source or target gives an
  empty array. Batches group pairs of one (source bucket, target bucket) as `translate_ids` does (one
  compilation per bucket pair and row count). Raises ValueError for unequal counts or a sequence longer than
  `config.max_len`.
  """
  if len(sources) != len(targets):
    raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
  for side, seqs in (("source", sources), ("target", targets)):
    for i, ids in enumerate(seqs):
      if len(ids) > config.max_len:
        raise ValueError(f"{side} {i + 1} has {len(ids)} tokens, more than config.max_len={config.max_len}")
  params = jax.device_put(nn.unbox(params))
  results = [np.zeros((0,), np.float32)] * len(sources)
  order = [i for i in sorted(range(len(sources)), key=lambda i: (-len(sources[i]), -len(targets[i])))
           if len(sources[i]) and len(targets[i])]
  key = lambda i: (source_bucket(sources[i], config), source_bucket(targets[i], config))  # noqa: E731
  groups = [list(g) for _, g in itertools.groupby(order, key=key)]
  for group in groups:
    src_bucket, tgt_bucket = key(group[0])
    rows = max(1, max_tokens_per_batch // max(src_bucket, tgt_bucket))
    for start in range(0, len(group), rows):
      chunk = group[start:start + rows]
      n_rows = rows_bucket(len(chunk), rows)
      inputs = np.full((n_rows, src_bucket), config.pad_id, np.int32)
      outputs = np.full((n_rows, tgt_bucket), config.pad_id, np.int32)
      for r, i in enumerate(chunk):
        inputs[r, :len(sources[i])], outputs[r, :len(targets[i])] = sources[i], targets[i]
      logp = np.asarray(scoring.token_log_probs(params, config, jnp.asarray(inputs), jnp.asarray(outputs)))
      for r, i in enumerate(chunk):
        results[i] = logp[r, :len(targets[i])]
  return results
