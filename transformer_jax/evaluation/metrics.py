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

import dataclasses
import re
from typing import Sequence

import sacrebleu

from transformer_jax.data.normalize import normalize

_COMPOUND = re.compile(r"(\S)-(\S)")

@dataclasses.dataclass(frozen=True)
class Metric:
  """What the run knows of an evaluation metric: which way it improves, and the evaluator (the `config.evals`
  section) that logs it during training ("": computed by the final evaluation only)."""
  higher_is_better: bool
  evaluator: str


# The one table of evaluation metrics, read by checkpoint selection (`checkpoint_best_metric`), early stopping,
# the config's checks (`experiment_config.check_logged_metric`) and the trackers' HParams metrics
# (`evaluators.logged_eval_metrics`); a metric not listed has no direction and cannot be a target.
METRICS = {
    "loss": Metric(False, "loss"),        # label-smoothed cross-entropy per target token (LossEvaluator)
    "nll": Metric(False, "loss"),         # negative log-likelihood per target token
    "perplexity": Metric(False, "loss"),  # exp(nll)
    "accuracy": Metric(True, "loss"),     # teacher-forced next-token accuracy
    "bleu": Metric(True, "bleu"),         # sacreBLEU (BleuEvaluator)
    "chrf": Metric(True, "bleu"),         # chrF (BleuEvaluator)
    "exact_match": Metric(True, ""),      # share of outputs equal to their reference (the final evaluation)
}


def higher_is_better(name: str) -> bool:
  """Whether metric `name` (`"bleu"`, or `"<split>/<metric>"` as logged, e.g. `"validation/perplexity"`)
  improves upwards, from `METRICS`, never from the spelling of the name.

  Raises:
    ValueError: a metric with no known direction (one line naming the known ones).
  """
  metric = name.rsplit("/", 1)[-1]
  if metric not in METRICS:
    raise ValueError(f"metric {name!r} has no known direction; known: {', '.join(sorted(METRICS))}")
  return METRICS[metric].higher_is_better


def metric_direction(name: str) -> str:
  """"max" or "min": `higher_is_better(name)` as the words early stopping logs (same ValueError)."""
  return "max" if higher_is_better(name) else "min"


def bleu_metric(target_lang: str = "", *, lowercase: bool = False,
                effective_order: bool = False) -> sacrebleu.metrics.BLEU:
  """sacreBLEU's BLEU with the tokenizer sacreBLEU itself picks for the target language (`trg_lang`, as its
  command line does from `-l src-trg`): `zh` for Chinese, `ja-mecab` for Japanese, `ko-mecab` for Korean,
  `13a` otherwise. `target_lang`: a language code (`data.target_lang`); a region or script subtag is ignored
  ("zh-Hans" -> "zh"); "" = unknown (13a). `effective_order`: sentence-level BLEU without a zero precision
  for n-gram orders a short sentence lacks (sacreBLEU's `sentence_score` option).

  Raises:
    ValueError: the tokenizer of that language cannot be loaded (ja-mecab / ko-mecab need the `sacrebleu[ja]` /
      `sacrebleu[ko]` extras).
  """
  language = target_lang.replace("_", "-").split("-")[0].lower()
  try:
    return sacrebleu.metrics.BLEU(lowercase=lowercase, trg_lang=language, effective_order=effective_order)
  except (ImportError, RuntimeError, OSError) as error:
    tokenizer = sacrebleu.metrics.BLEU._TOKENIZER_MAP.get(language, "13a")
    raise ValueError(f"target language {target_lang!r}: sacreBLEU's {tokenizer} tokenizer for it cannot load "
                     f"({error}); install sacrebleu[{language}]") from None


def sacrebleu_scores(hypotheses: Sequence[str], references: Sequence[str], *, lowercase: bool = False,
                     target_lang: str = "") -> dict:
  """Detokenised corpus BLEU and chrF (sacreBLEU defaults) with their signatures, on normalised text; cased
  unless `lowercase` (sacreBLEU's own `lowercase`, `case:lc` in the signature), which the outputs of a
  case-folded vocabulary need (`tokenizer.lowercase`, `data.lowercase`). BLEU's tokenizer follows
  `target_lang` as sacreBLEU's own choice does (`bleu_metric`: `tok:zh` for Chinese ...); chrF needs none."""
  hypotheses, references = _normalized(hypotheses, references)
  bleu = bleu_metric(target_lang, lowercase=lowercase)
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
  # pylint: disable-next=g-import-not-at-top (its regexes cost every program's start: docs/performance.md)
  from sacremoses import MosesPunctNormalizer, MosesTokenizer
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
