"""Minimum Bayes risk (MBR) selection from a beam's n-best list.

Beam search returns the hypothesis the model scores highest; MBR returns the one that agrees most with the
others, each weighted by the model's probability of it (Kumar & Byrne, 2004; Eikema & Aziz, 2020; Freitag et
al., 2022): `argmax_i Σ_j p(y_j | x) · u(y_i, y_j)` over the n-best list, with `p` the model's sequence
probabilities renormalised over the list (a softmax of their log-probs) and `u` a sentence-level metric with
`y_j` as the reference. The utilities are sacreBLEU's sentence chrF and BLEU (BLEU tokenised for the target
language as corpus BLEU is: `metrics.bleu_metric`). Whether it helps depends on the
model: on Multi30k val, chrF utility over the beam-5 list moved three runs' BLEU by +0.58, +0.29 and -0.48
against beam search's choice (docs/multi30k_runs.md), so choose it on a development split
(`experiments.tune_decoding --mbr_utilities=none,chrf`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import sacrebleu

from transformer_jax.evaluation import metrics

UTILITIES = ("chrf", "bleu")


def utility_fn(utility: str, target_lang: str = "") -> Callable[[str, str], float]:
  """`(hypothesis, pseudo_reference) -> score in [0, 100]` for `utility` ('chrf' or 'bleu').

  `target_lang` (`data.target_lang`) picks BLEU's tokenizer as sacreBLEU does (`tok:zh` for Chinese, ...);
  chrF needs none. Raises ValueError naming the allowed utilities, or a tokenizer that cannot load.
  """
  if utility == "chrf":
    metric = sacrebleu.metrics.CHRF()
  elif utility == "bleu":  # sentence-level: no zero 4-gram precision
    metric = metrics.bleu_metric(target_lang, effective_order=True)
  else:
    raise ValueError(f"MBR utility {utility!r}; expected one of {', '.join(UTILITIES)}")
  return lambda hypothesis, reference: metric.sentence_score(hypothesis, [reference]).score


def expected_utilities(candidates: Sequence[str], log_probs: Sequence[float],
                       utility: Callable[[str, str], float]) -> np.ndarray:
  """`[n]` float64: each candidate's utility against every candidate (itself included) as the reference,
  weighted by `softmax(log_probs)`.

  Args:
    candidates: the n-best texts, detokenised.
    log_probs: `[n]` the model's log-probability of each (the raw sum of its token log-probs, EOS included:
      `search.BeamSearchOutput.log_probs`), not length-normalised.
    utility: `(hypothesis, reference) -> float`, e.g. `utility_fn('chrf')`.

  Raises ValueError when the lengths differ, the list is empty or a log-prob is not finite.
  """
  log_probs = np.asarray(log_probs, np.float64)
  if len(candidates) != len(log_probs) or not len(candidates):
    raise ValueError(f"MBR needs one log-prob per candidate and at least one candidate, got "
                     f"{len(candidates)} candidates and {len(log_probs)} log-probs")
  if not np.all(np.isfinite(log_probs)):
    raise ValueError(f"MBR log-probs must be finite, got {log_probs.tolist()}")
  weights = np.exp(log_probs - log_probs.max())
  weights /= weights.sum()
  texts = list(candidates)
  gains = np.array([[utility(hyp, ref) for ref in texts] for hyp in texts])  # [n hypotheses, n references]
  return gains @ weights


def select(candidates: Sequence[str], log_probs: Sequence[float],
           utility: str | Callable[[str, str], float] = "chrf", target_lang: str = "") -> int:
  """Index of the MBR choice among `candidates` (the first of equals: beam order breaks ties).

  `utility` is 'chrf', 'bleu' (for `target_lang`) or a `utility_fn` already made (reused across sentences);
  see `expected_utilities` for the arguments and the errors raised.
  """
  if len(candidates) == 1:
    return 0
  utility = utility_fn(utility, target_lang) if isinstance(utility, str) else utility
  return int(np.argmax(expected_utilities(candidates, log_probs, utility)))
