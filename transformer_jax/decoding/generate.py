"""How to decode (`DecodeOptions`, every strategy's options, checked in one place) and one compiled decoding of a
batch with all of them (`generate`), for the host-side batching of `decoding.inference`.

`DecodeOptions` says how to decode: greedy search, beam search or sampling (temperature, top-k, nucleus top-p),
how many hypotheses to return, a minimum-Bayes-risk choice among them, alignments, per-token log-probs; it is
the only place these options are checked (`check`). What is decoded besides the sources (an ensemble's models,
forced prefixes, lexical constraints, the sampling seed) are arguments of `inference.decode_ids`.
`generate(...)` is the traced body: the Transformer's step for one model or an ensemble (`decoding.ensemble`),
an optional forced prefix (`decoding.prefix`), the searches of `decoding.search`, then the alignment of the
returned hypotheses (`decoding.alignment`). Everything runs inside one jitted function per static setting and
shape; `decoding.inference` compiles it once per (length bucket, row count).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig
from transformer_jax.decoding import alignment, ensemble, mbr, prefix, search
from transformer_jax.decoding import constraints as constraints_lib
from transformer_jax.decoding import step as step_lib

Array = jax.Array

STRATEGIES = ("greedy", "beam", "sample")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode (static and hashable: the compiled search is keyed by `search_options`).

  strategy: 'greedy' (greedy search), 'beam' (beam search; `beam_size=1` is greedy search) or 'sample'
    (ancestral sampling).
  beam_size, alpha: beam width and GNMT length-penalty exponent (alpha also normalises every returned score).
  nbest: hypotheses returned per source (<= beam_size; 1 for greedy search and sampling).
  temperature, top_k, top_p: sampling's distribution `softmax(logits / T)`, truncated to the k most probable
    tokens (0 = all), then to the nucleus of probability `top_p` (1 = all); `search.truncate`. 'sample' only.
  mbr_utility: '' keeps beam search's order; 'chrf' or 'bleu' puts the minimum-Bayes-risk choice of the
    `beam_size`-best list under that sentence utility first (`decoding.mbr`; host side, on texts:
    `inference.decode_texts`). Needs beam search with `beam_size >= 2`.
  alignment: also return each target token's source position (`alignment.cross_attention_alignment`).
  token_log_probs: also return each token's log-prob; off, the search carries no per-token buffers (plain
    beam search then costs what it did before the toolkit) and `Hypotheses.token_log_probs` is None.
  """
  strategy: str = "beam"
  beam_size: int = 4
  alpha: float = 0.6
  nbest: int = 1
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  mbr_utility: str = ""
  alignment: bool = False
  token_log_probs: bool = True

  def check(self) -> "DecodeOptions":
    """Returns self; raises ValueError naming the bad option (before anything is decoded).

    The one place every decoding option is checked (programs, the config's `decode` section and the server
    call it). Each message starts with the option's name and value (`top_p=1.5 must be ...`), so a caller adds
    its own prefix: `--` for a flag of the same name, `--config.decode.` for the config.
    """
    if self.strategy not in STRATEGIES:
      raise ValueError(f"strategy={self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if self.beam_size < 1:
      raise ValueError(f"beam_size={self.beam_size} must be >= 1")
    if self.nbest < 1 or self.nbest > self.rows_per_source:
      raise ValueError(f"nbest={self.nbest} must be in [1, {self.rows_per_source}] (n-best lists come from beam "
                       f"search: nbest <= beam_size; greedy search and sampling give 1; strategy={self.strategy!r}, "
                       f"beam_size={self.beam_size})")
    search.check_sampling(self.temperature, self.top_k, self.top_p)
    if self.strategy != "sample":
      for name, default in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
        if getattr(self, name) != default:
          raise ValueError(f"{name}={getattr(self, name)} applies to strategy='sample' only "
                           f"(strategy={self.strategy!r})")
    if self.mbr_utility:
      if self.mbr_utility not in mbr.UTILITIES:
        raise ValueError(f"mbr_utility={self.mbr_utility!r}; expected '' or one of {', '.join(mbr.UTILITIES)}")
      if not self.beam or self.beam_size < 2:
        raise ValueError(f"mbr_utility={self.mbr_utility!r} chooses from beam search's n-best list: it needs "
                         f"strategy='beam' and beam_size >= 2 (got strategy={self.strategy!r}, "
                         f"beam_size={self.beam_size})")
    return self

  @property
  def beam(self) -> bool:
    """Whether beam search runs (`strategy='beam'` with `beam_size > 1`)."""
    return self.strategy == "beam" and self.beam_size > 1

  @property
  def random(self) -> bool:
    """Whether the strategy draws random numbers (each source then gets its own key: `inference.decode_ids`)."""
    return self.strategy == "sample"

  @property
  def rows_per_source(self) -> int:
    return self.beam_size if self.beam else 1

  @property
  def search_options(self) -> "DecodeOptions":
    """The options the compiled search sees: MBR's host-side choice left out, its whole beam-size list kept."""
    if not self.mbr_utility:
      return self
    return dataclasses.replace(self, mbr_utility="", nbest=self.beam_size)


class Hypotheses(NamedTuple):
  """A batch's decoded hypotheses, best first (`n` = `DecodeOptions.nbest`)."""
  tokens: Array  # [batch, n, max_decode_len] int32 (EOS then pad at the end)
  log_probs: Array  # [batch, n] float32: sum of the token log-probs, EOS included; -inf for an empty slot
  scores: Array  # [batch, n] float32: log_probs / ((5 + |Y|) / 6) ** alpha, |Y| counting EOS
  token_log_probs: Optional[Array]  # [batch, n, max_decode_len] float32, 0 after the last token (or None)
  alignment: Optional[Array]  # [batch, n, max_decode_len] int32 source positions, or None


def generate(params_list: Sequence, config: ModelConfig, inputs: Array, max_lengths: Array, options: DecodeOptions,
           max_decode_len: int, *, keys: Optional[Array] = None, prefix_tokens: Optional[Array] = None,
           prefix_lengths: Optional[Array] = None,
           constraints: Optional[constraints_lib.Constraints] = None) -> Hypotheses:
  """Decodes `inputs` `[batch, src_len]` with one model or the ensemble of `params_list` (trace under jit).

  `max_lengths` `[batch]` caps each output (EOS included); `keys` `[batch, 2]` uint32 are sampling's per-source
  keys (needed for 'sample'); `prefix_tokens` `[batch, P]` int32 with `prefix_lengths` `[batch]` force each
  output's start; `constraints` (`[batch, C]` each, beam search only) are phrases every output must contain
  (`constraints.DynamicBeamAllocation`). Returns `Hypotheses`.
  """
  copies = options.rows_per_source
  steps = [step_lib.transformer_step_fn(p, config, inputs, max_decode_len, copies=copies) for p in params_list]
  step = ensemble.ensemble_step(steps)
  log_probs_fn = None
  if prefix_tokens is not None:
    log_probs_fn = prefix.forced_prefix(search.repeat_rows(prefix_tokens, copies),
                                        search.repeat_rows(prefix_lengths, copies))
  ids = dict(bos_id=config.bos_id, eos_id=config.eos_id, pad_id=config.pad_id)
  common = dict(batch_size=inputs.shape[0], max_decode_len=max_decode_len, max_lengths=max_lengths,
                log_probs_fn=log_probs_fn, **ids)
  if options.beam:
    selector = None if constraints is None else constraints_lib.DynamicBeamAllocation(constraints, config.eos_id)
    out = search.beam_search_over(step.tokens_to_logits, step.cache, beam_size=options.beam_size,
                                  alpha=options.alpha, gather_cache=step.gather_cache, selector=selector,
                                  per_token=options.token_log_probs, nbest=options.nbest, **common)
    n = options.nbest
    per_token = None if out.token_log_probs is None else out.token_log_probs[:, :n]
    hyps = Hypotheses(out.tokens[:, :n], out.log_probs[:, :n], out.scores[:, :n], per_token, None)
  else:
    if constraints is not None:
      raise ValueError("lexical constraints need beam search (strategy='beam', beam_size >= 2)")
    common["full_output"] = options.token_log_probs  # a SequenceOutput, else (tokens, log_probs)
    if options.strategy == "sample":
      out = search.sample_over(step.tokens_to_logits, step.cache, keys, temperature=options.temperature,
                               top_k=options.top_k, top_p=options.top_p, **common)
    else:
      out = search.greedy_search_over(step.tokens_to_logits, step.cache, **common)
    tokens, log_probs = out[0], out[1]
    scores = log_probs / search.length_penalty(jnp.maximum(jnp.sum(tokens != config.pad_id, axis=-1), 1),
                                               options.alpha)
    per_token = out.token_log_probs[:, None] if options.token_log_probs else None
    hyps = Hypotheses(tokens[:, None], log_probs[:, None], scores[:, None], per_token, None)
  if options.alignment:
    batch, n, length = hyps.tokens.shape
    aligned = alignment.cross_attention_alignment([nn.unbox(p) for p in params_list], config,
                                                  search.repeat_rows(inputs, n), hyps.tokens.reshape(batch * n, length))
    hyps = hyps._replace(alignment=aligned.reshape(batch, n, length))
  return hyps
