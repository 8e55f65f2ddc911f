"""Subword regularisation of the training split: every epoch sees its own segmentation of every pair.

With `data.subword_alpha > 0` the training pairs are re-encoded at the start of every epoch with sampling
switched on (`Tokenizer.sample_batch`): for the BPE vocabularies trained here each merge is skipped with
probability `alpha` (BPE-dropout: Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword
Regularization", 0.1 on both sides there), for a unigram vocabulary a segmentation is drawn from the lattice
(Kudo, 2018). Evaluation, decoding and the token cache keep the deterministic segmentation.

Epoch e's draw is seeded with `(seed, e)`: within one process the same seed gives the same ids, and the batch
order stays a pure function of `(seed, epoch)`. Across processes it is not reproducible: SentencePiece 0.2's
sampled ids for the same seed differed from process to process (measured on 2026-12-03, with hash randomisation
and ASLR off too). Hence, on several hosts, process 0 draws and the others receive its ids (`share`:
`sharding.ragged_from_first_process`, which the trainer passes), so every host packs the same epoch plan and
takes its own rows of the same batches; without it each host would pack its own draw and the hosts' rows would
repeat some pairs and miss others. A resumed run restores its position `{epoch, index}` exactly but draws other
segmentations (of the same distribution) for the epochs it replays or starts. A sampled segmentation is longer (1.2x the
tokens at alpha 0.05, 1.4x at 0.1 on Multi30k with 6k pieces), so one that no longer fits a row of
`max_len` is replaced by the pair's deterministic ids; `SampledSegmentations.last_fallbacks` counts them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np

from transformer_jax.data import tokenizer as tokenizer_lib

# `share(draw)`: runs `draw()` on process 0 only and returns its id arrays on every process (a collective).
Share = Callable[[Callable[[], Sequence[Sequence[int]]]], Sequence[np.ndarray]]

_STREAM = 0x5357  # separates these seeds from the batch order's `default_rng([seed, epoch])`


def epoch_seed(seed: int, epoch: int) -> int:
  """SentencePiece's sampling seed for `epoch` of a run with `seed`: a uint32 below 2**32 - 1."""
  return int(np.random.SeedSequence([seed, epoch, _STREAM]).generate_state(1)[0]) % (2**32 - 1)


class SampledSegmentations:
  """`epoch -> (sources, targets)`: sampled int32 id arrays `[len]` (EOS included) of the training pairs.

  Args:
    tokenizer: the run's SentencePiece `Tokenizer` (a Marian vocabulary cannot sample).
    pairs: the (source, target) training texts, aligned with `sources`/`targets`.
    sources, targets: their deterministic ids, each at most `max_len` long (the fallbacks).
    alpha: the sampling parameter, in (0, 1).
    seed: the run's seed.
    max_len: the row length; a sampled side longer than it falls back to the deterministic pair.
    share: None (one process), or a collective `share(draw) -> ids` that runs `draw()` on process 0 only and
      returns its int32 arrays on every process (`sharding.ragged_from_first_process`).
    from_epoch: the first epoch that samples; the epochs before it get the deterministic ids, so a run is
      the unregularised one up to there (a late regulariser, as `config.dropout_schedule`).

  Raises:
    ValueError: `pairs` and the ids differ in length, `alpha` is outside (0, 1), or `from_epoch` < 0.
  """

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer, pairs: Sequence[tuple[str, str]],
               sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], *, alpha: float, seed: int,
               max_len: int, share: Share | None = None, from_epoch: int = 0):
    if not len(pairs) == len(sources) == len(targets):
      raise ValueError(f"{len(pairs)} texts for {len(sources)} sources and {len(targets)} targets")
    if not 0.0 < alpha < 1.0:
      raise ValueError(f"data.subword_alpha={alpha}: must be in (0, 1)")
    if from_epoch < 0:
      raise ValueError(f"data.subword_from_epoch={from_epoch}: must be >= 0")
    self.tokenizer, self.pairs, self.alpha, self.seed, self.max_len = tokenizer, list(pairs), alpha, seed, max_len
    self.sources, self.targets = list(sources), list(targets)
    self.share, self.from_epoch = share, from_epoch
    self.last_fallbacks = 0

  def __call__(self, epoch: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if epoch < self.from_epoch:
      self.last_fallbacks = 0
      return self.sources, self.targets
    start = time.perf_counter()
    def draw():  # [2 * pairs] id lists: source, target, source, ...
      return self.tokenizer.sample_batch([t for p in self.pairs for t in p], self.alpha,
                                         epoch_seed(self.seed, epoch))

    sampled = self.share(draw) if self.share is not None else draw()
    sources, targets, fallbacks = [], [], 0
    for i in range(len(self.pairs)):
      source, target = sampled[2 * i], sampled[2 * i + 1]
      if len(source) > self.max_len or len(target) > self.max_len:
        sources.append(self.sources[i])
        targets.append(self.targets[i])
        fallbacks += 1
      else:
        sources.append(np.asarray(source, np.int32))
        targets.append(np.asarray(target, np.int32))
    self.last_fallbacks = fallbacks
    tokens = sum(map(len, sources)) + sum(map(len, targets))
    base = sum(map(len, self.sources)) + sum(map(len, self.targets))
    logging.info("Epoch %d: sampled segmentations (alpha %g) of %d pairs in %.1fs, %.2fx the deterministic "
                 "tokens; %d pairs over max_len=%d kept their deterministic ids", epoch, self.alpha,
                 len(self.pairs), time.perf_counter() - start, tokens / base, fallbacks, self.max_len)
    return sources, targets
