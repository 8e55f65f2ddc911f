"""Subword regularisation of the training split: every epoch sees its own segmentation of every pair.

With `data.subword_alpha > 0` every training pair is re-encoded, where the input pipeline reads it
(`pipeline.TrainStream`, in grain's map), with sampling switched on (`Tokenizer.sample_batch`): for the BPE
vocabularies trained here each merge is skipped with probability `alpha` (BPE-dropout: Provilkov et al., 2020,
"BPE-Dropout: Simple and Effective Subword Regularization", 0.1 on both sides there), for a unigram vocabulary a
segmentation is drawn from the lattice (Kudo, 2018). Evaluation, decoding and the stored token ids keep the
deterministic segmentation.

Element `k` of a process's stream is sampled with a seed drawn from `(seed, process, k)`: within one process the
same run gives the same ids, so a resumed run replays them. Across processes SentencePiece's sampled ids for the
same seed differ (SentencePiece 0.2, measured on 2026-12-03), which no longer matters: each process samples only
the pairs of its own share and packs them itself. A sampled segmentation is longer (1.2x the tokens at alpha
0.05, 1.4x at 0.1 on Multi30k with 6k pieces), so one that no longer fits a row of `max_len` is replaced by the
pair's deterministic ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_STREAM = 0x5357  # separates these seeds from the batch order's


def element_seed(seed: int, process_index: int, k: int) -> int:
  """SentencePiece's sampling seed for element `k` of process `process_index`'s stream: a uint32 below 2**32 - 1."""
  return int(np.random.SeedSequence([seed, process_index, k, _STREAM]).generate_state(1)[0]) % (2**32 - 1)


class PairSampler:
  """`(k, pair) -> pair`: element `k` of a process's stream with sampled int32 ids `[len]` (EOS included).

  Args:
    tokenizer: the run's SentencePiece `Tokenizer` (a Marian vocabulary cannot sample).
    alpha: the sampling parameter, in (0, 1).
    seed: the run's seed; process_index: this process (its stream's seeds differ from the others').
    share: this process's pairs per epoch (element k is in epoch k // share).
    from_epoch: the first epoch that samples; the epochs before it keep the deterministic ids, so a run is
      the unregularised one up to there (a late regulariser, as `config.dropout_schedule`).
    max_len: the row length; a sampled side longer than it falls back to the deterministic pair.

  The pair is `{"inputs", "targets", "texts"}` (`id_shards.decode_record(..., texts=True)`); "texts" is dropped.

  Raises:
    ValueError: `alpha` is outside (0, 1), or `from_epoch` < 0.
  """

  def __init__(self, tokenizer: Any, *, alpha: float, seed: int, process_index: int, share: int,
               from_epoch: int, max_len: int):
    if not 0.0 < alpha < 1.0:
      raise ValueError(f"data.subword_alpha={alpha}: must be in (0, 1)")
    if from_epoch < 0:
      raise ValueError(f"data.subword_from_epoch={from_epoch}: must be >= 0")
    self.tokenizer, self.alpha, self.seed, self.process_index = tokenizer, alpha, seed, process_index
    self.share, self.from_epoch, self.max_len = share, from_epoch, max_len

  def __call__(self, k: int, pair: dict) -> dict[str, np.ndarray]:
    pair = dict(pair)
    texts = pair.pop("texts")
    if k // self.share < self.from_epoch:
      return pair
    source, target = self.tokenizer.sample_batch(list(texts), self.alpha,
                                                 element_seed(self.seed, self.process_index, k))
    if len(source) > self.max_len or len(target) > self.max_len:
      return pair
    return {"inputs": np.asarray(source, np.int32), "targets": np.asarray(target, np.int32)}
