"""The published-style Multi30k BLEU reproduces the references' own pipeline (lowercase.perl |
normalize-punctuation.perl -l de | tokenizer.perl -l de, with its default escaping)."""

import os

import pytest

from transformer_jax.evaluation import metrics

MULTI30K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "multi30k")


def test_hypotheses_are_escaped_as_tokenizer_perl_does():
  line = 'Ein "Kind" & sein Hund\'s [Ball].'
  assert metrics.moses_tokenize([line], "de", lowercase=True, normalize=True, escape=True) == [
      "ein &quot; kind &quot; &amp; sein hund &apos; s &#91; ball &#93; ."]
  # A hypothesis identical to its reference scores 100 only when both are escaped alike.
  reference = metrics.moses_tokenize([line], "de", lowercase=True, normalize=True, escape=True)
  assert metrics.lowercased_tokenized_bleu([line], reference) == pytest.approx(100.0)


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k is absent")
def test_cased_test2016_references_become_the_published_lc_norm_tok_file():
  with open(os.path.join(MULTI30K, "test2016.de"), encoding="utf-8") as f:
    cased = f.read().splitlines()
  with open(os.path.join(MULTI30K, "test_2016_flickr.lc.norm.tok.de"), encoding="utf-8") as f:
    published = f.read().splitlines()
  ours = metrics.moses_tokenize(cased, "de", lowercase=True, normalize=True, escape=True)
  assert [i for i, (a, b) in enumerate(zip(ours, published)) if a != b] == []
  assert metrics.lowercased_tokenized_bleu(cased, published) == pytest.approx(100.0)
