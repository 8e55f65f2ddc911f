"""Decoding: searches over any step function, the Transformer's step, and translation around them.

Each module one job, each importing only the ones above it in this list:

  search.py       greedy / beam / sampling searches over `tokens_to_logits` (model-agnostic, one while_loop)
  step.py         the Transformer as a step function (encode once, KV cache) and its jitted searches
  prefix.py       forced target prefixes (a log-prob hook of any search)
  constraints.py  lexically constrained beam search (dynamic beam allocation, a beam selector)
  ensemble.py     several step functions decoding as one
  alignment.py    a source position per target token from the cross-attention
  scoring.py      forced decoding: the model's log-probs of given targets
  generate.py     one compiled decoding of a batch with every option above (`DecodeOptions`)
  mbr.py          minimum-Bayes-risk choice from an n-best list (host side)
  inference.py    host-side batching and bucketing, n-best lists, detokenising, MBR

The names below are the public API of the searches; the other modules are imported as modules
(`from transformer_jax.decoding import inference`).
"""

from transformer_jax.decoding.search import (NEG_INF, BeamSearchOutput, BeamSelector, DecodingState, LogProbsFn,
                                             SequenceOutput, TokensToLogits, beam_search_over, gather_beams,
                                             greedy_search_over, length_penalty, repeat_rows, sample_over, truncate)
from transformer_jax.decoding.step import (TransformerStep, beam_search, beam_search_uncached, greedy_search,
                                           greedy_search_uncached, sample, transformer_step_fn)
from transformer_jax.decoding.scoring import sequence_log_probs, token_log_probs

__all__ = ["NEG_INF", "BeamSearchOutput", "BeamSelector", "DecodingState", "LogProbsFn", "SequenceOutput",
           "TokensToLogits", "TransformerStep", "beam_search", "beam_search_over", "beam_search_uncached",
           "gather_beams", "greedy_search", "greedy_search_over", "greedy_search_uncached", "length_penalty",
           "repeat_rows", "sample", "sample_over", "sequence_log_probs", "token_log_probs", "transformer_step_fn",
           "truncate"]
