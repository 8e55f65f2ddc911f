"""Translation quality with sacreBLEU: cased detokenised BLEU and chrF with signatures, plus the paper-style
tokenised, compound-split BLEU (tensor2tensor's get_ende_bleu.sh) and the lowercased Moses-tokenised BLEU
that Multi30k papers report.
"""

from __future__ import annotations

import re
from typing import Sequence

import sacrebleu

_COMPOUND = re.compile(r"(\S)-(\S)")


def sacrebleu_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
  """Cased, detokenised corpus BLEU and chrF (sacreBLEU defaults) with their signatures."""
  _check_aligned(hypotheses, references)
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
  chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
  return {"bleu": bleu_score.score, "bleu_signature": str(bleu.get_signature()),
          "bleu_verbose": str(bleu_score), "chrf": chrf_score.score,
          "chrf_signature": str(chrf.get_signature())}


def moses_tokenize(lines: Sequence[str], lang: str, *, lowercase: bool = False,
                   normalize: bool = False) -> list[str]:
  """Moses punctuation normalisation (optional) and tokenisation via sacremoses, with escaping off."""
  from sacremoses import MosesPunctNormalizer, MosesTokenizer
  tokenizer = MosesTokenizer(lang=lang)
  normalizer = MosesPunctNormalizer(lang=lang) if normalize else None
  out = []
  for line in lines:
    if normalizer is not None:
      line = normalizer.normalize(line)
    if lowercase:
      line = line.lower()
    out.append(tokenizer.tokenize(line, return_str=True, escape=False))
  return out


def split_compounds(line: str) -> str:
  """`Wort-Verbindung` -> `Wort ##AT##-##AT## Verbindung`, as tensor2tensor's get_ende_bleu.sh does."""
  return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str = "de",
                   compound_split: bool = True) -> float:
  """The paper-style BLEU: Moses-tokenised, compound-split, scored with `tokenize='none'`.

  Reads higher than cased detokenised sacreBLEU; for comparison with published numbers only.
  """
  _check_aligned(hypotheses, references)
  hyps, refs = moses_tokenize(hypotheses, lang), moses_tokenize(references, lang)
  if compound_split:
    hyps, refs = [split_compounds(h) for h in hyps], [split_compounds(r) for r in refs]
  return sacrebleu.corpus_bleu(hyps, [refs], tokenize="none").score


def lowercased_tokenized_bleu(hypotheses: Sequence[str], tokenized_references: Sequence[str],
                              lang: str = "de") -> float:
  """Multi30k-style BLEU: hypotheses lowercased, punctuation-normalised and Moses-tokenised, scored with
  `tokenize='none'` against references already processed that way (e.g. test_2016_flickr.lc.norm.tok.de)."""
  _check_aligned(hypotheses, tokenized_references)
  hyps = moses_tokenize(hypotheses, lang, lowercase=True, normalize=True)
  return sacrebleu.corpus_bleu(hyps, [list(tokenized_references)], tokenize="none").score


def _check_aligned(hypotheses: Sequence[str], references: Sequence[str]) -> None:
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
