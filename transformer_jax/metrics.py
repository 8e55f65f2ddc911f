"""Translation quality with sacreBLEU: cased (or, for a case-folded vocabulary, lowercased) detokenised BLEU
and chrF with signatures, plus the paper-style
tokenised, compound-split BLEU (tensor2tensor's get_ende_bleu.sh) and the lowercased Moses-tokenised BLEU
that Multi30k papers report.

Every score first normalises hypotheses and references with `transformer_jax.data.normalize.normalize` (the
tokenizer's: BOM and zero-width characters dropped, Unicode spaces collapsed, NFC), so a reference that
looks the same as a hypothesis matches it whatever bytes an editor wrote. sacreBLEU itself does not
normalise Unicode; for references already in NFC without invisible characters (WMT, Multi30k) the scores
are sacreBLEU's own.
"""

from __future__ import annotations

import re
from typing import Sequence

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from transformer_jax.data.normalize import normalize

_COMPOUND = re.compile(r"(\S)-(\S)")

# Whether a lower ("min") or a higher ("max") value of each evaluation metric is better: the one table the
# trainer's early stopping (and any "best" rule) reads, so a direction is known, never guessed from a name.
# Keys are the metric part of `<split>/<metric>` as the evaluators log it (trainer.LossEvaluator: loss, nll,
# perplexity, accuracy; BleuEvaluator: bleu, chrf) and the final evaluation's exact_match.
METRIC_DIRECTIONS = {"loss": "min", "nll": "min", "perplexity": "min",
                     "accuracy": "max", "bleu": "max", "chrf": "max", "exact_match": "max"}


def metric_direction(name: str) -> str:
  """"min" or "max": the better direction of metric `name`, `<metric>` or `<split>/<metric>`
  (e.g. "validation/bleu" -> "max"), from `METRIC_DIRECTIONS`.

  Raises ValueError (one line naming the known metrics) for a metric whose direction the table does not hold.
  """
  metric = name.rsplit("/", 1)[-1]
  if metric not in METRIC_DIRECTIONS:
    raise ValueError(f"metric {name!r}: its direction is unknown; one of {', '.join(sorted(METRIC_DIRECTIONS))} "
                     "(with an eval split, e.g. 'validation/bleu')")
  return METRIC_DIRECTIONS[metric]


def sacrebleu_scores(hypotheses: Sequence[str], references: Sequence[str], *, lowercase: bool = False) -> dict:
  """Detokenised corpus BLEU and chrF (sacreBLEU defaults) with their signatures, on normalised text; cased
  unless `lowercase` (sacreBLEU's own `lowercase`, `case:lc` in the signature), which the outputs of a
  case-folded vocabulary need (`tokenizer.lowercase`, `data.lowercase`)."""
  hypotheses, references = _normalized(hypotheses, references)
  bleu = sacrebleu.metrics.BLEU(lowercase=lowercase)
  chrf = sacrebleu.metrics.CHRF(lowercase=lowercase)
  bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
  chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
  return {"bleu": bleu_score.score, "bleu_signature": str(bleu.get_signature()),
          "bleu_verbose": str(bleu_score), "chrf": chrf_score.score,
          "chrf_signature": str(chrf.get_signature())}


def moses_tokenize(lines: Sequence[str], lang: str, *, lowercase: bool = False, normalize: bool = False,
                   escape: bool = False) -> list[str]:
  """Moses tokenisation via sacremoses, after optional lowercasing and punctuation normalisation (in that order:
  lowercase.perl | normalize-punctuation.perl | tokenizer.perl). `escape` writes `"` `'` `&` `<` `>` `[` `]` `|`
  as tokenizer.perl's default entities (`&quot;` ...), as in Multi30k's lc.norm.tok references."""
  tokenizer = MosesTokenizer(lang=lang)
  normalizer = MosesPunctNormalizer(lang=lang) if normalize else None
  out = []
  for line in lines:
    if lowercase:
      line = line.lower()
    if normalizer is not None:
      line = normalizer.normalize(line)
    out.append(tokenizer.tokenize(line, return_str=True, escape=escape))
  return out


def split_compounds(line: str) -> str:
  """`Wort-Verbindung` -> `Wort ##AT##-##AT## Verbindung`, as tensor2tensor's get_ende_bleu.sh does."""
  return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str = "de",
                   compound_split: bool = True) -> float:
  """The paper-style BLEU: Moses-tokenised, compound-split, scored with `tokenize='none'`.

  Reads higher than cased detokenised sacreBLEU; for comparison with published numbers only.
  """
  hypotheses, references = _normalized(hypotheses, references)
  hyps, refs = moses_tokenize(hypotheses, lang), moses_tokenize(references, lang)
  if compound_split:
    hyps, refs = [split_compounds(h) for h in hyps], [split_compounds(r) for r in refs]
  return sacrebleu.corpus_bleu(hyps, [refs], tokenize="none").score


def lowercased_tokenized_bleu(hypotheses: Sequence[str], tokenized_references: Sequence[str],
                              lang: str = "de") -> float:
  """Multi30k-style BLEU: hypotheses lowercased, punctuation-normalised and Moses-tokenised with tokenizer.perl's
  default escaping, scored with `tokenize='none'` against references already processed that way (e.g.
  test_2016_flickr.lc.norm.tok.de, which this pipeline reproduces line for line from test2016.de)."""
  hypotheses, tokenized_references = _normalized(hypotheses, tokenized_references)
  hyps = moses_tokenize(hypotheses, lang, lowercase=True, normalize=True, escape=True)
  return sacrebleu.corpus_bleu(hyps, [list(tokenized_references)], tokenize="none").score


def exact_match(hypotheses: Sequence[str], references: Sequence[str], *, lowercase: bool = False) -> float:
  """Fraction (0..1) of hypotheses equal to their reference after normalisation (and lowercasing both when
  `lowercase`); 0.0 for no examples."""
  hypotheses, references = _normalized(hypotheses, references)
  if lowercase:
    hypotheses, references = [h.lower() for h in hypotheses], [r.lower() for r in references]
  return sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)


def _normalized(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[list[str], list[str]]:
  """Both sides normalised (`normalize`), after checking they have the same number of lines."""
  _check_aligned(hypotheses, references)
  return [normalize(h) for h in hypotheses], [normalize(r) for r in references]


def _check_aligned(hypotheses: Sequence[str], references: Sequence[str]) -> None:
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
