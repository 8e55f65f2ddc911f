"""transformer_jax.decoding.mbr: the expected utility over an n-best list and the choice it makes."""

import numpy as np
import pytest
import sacrebleu

from transformer_jax.decoding import mbr

CANDIDATES = ["a man is riding a red bike .", "a man rides a red bike .", "two dogs play in the snow ."]


def test_expected_utilities_are_posterior_weighted_sentence_chrf():
  log_probs = [-1.0, -2.0, -0.5]
  weights = np.exp(log_probs) / np.exp(log_probs).sum()
  expected = [sum(w * sacrebleu.sentence_chrf(h, [r]).score for w, r in zip(weights, CANDIDATES))
              for h in CANDIDATES]
  got = mbr.expected_utilities(CANDIDATES, log_probs, mbr.utility_fn("chrf"))
  np.testing.assert_allclose(got, expected, rtol=1e-9)


@pytest.mark.parametrize("utility", mbr.UTILITIES)
def test_select_prefers_consensus_over_the_single_most_probable(utility):
  # The outlier is the most probable hypothesis, but the two that agree hold more of the mass together.
  assert mbr.select(CANDIDATES, [-1.0, -1.1, -0.9], utility) in (0, 1)
  # When the outlier holds nearly all the mass, it is the choice.
  assert mbr.select(CANDIDATES, [-30.0, -30.0, 0.0], utility) == 2
  assert mbr.select(["only one"], [-3.0], utility) == 0


def test_ties_go_to_the_first_in_beam_order():
  assert mbr.select(["same text", "same text"], [-1.0, -1.0]) == 0


@pytest.mark.parametrize("args, needle", [
    ((CANDIDATES, [-1.0, -2.0]), "one log-prob per candidate"),
    (([], []), "at least one candidate"),
    ((CANDIDATES, [-1.0, float("-inf"), -2.0]), "must be finite"),
])
def test_bad_lists_raise(args, needle):
  with pytest.raises(ValueError, match=needle):
    mbr.expected_utilities(*args, mbr.utility_fn("chrf"))


def test_unknown_utility_names_the_allowed_ones():
  with pytest.raises(ValueError, match="MBR utility 'meteor'; expected one of chrf, bleu"):
    mbr.utility_fn("meteor")


ZH = ["一个男人骑着红色自行车。", "一个男人骑着一辆红色自行车。", "两只狗在雪地里玩耍。"]


def test_bleu_utility_tokenises_for_the_target_language_as_sacrebleu_does():
  """Chinese has no spaces: under 13a each sentence is one token and near-paraphrases share nothing; with
  `target_lang='zh'` the utility is sacreBLEU's `tok:zh` sentence BLEU, as the corpus BLEU of the same run."""
  log_probs = [-1.0, -1.1, -0.9]
  weights = np.exp(log_probs) / np.exp(log_probs).sum()
  expected = [sum(w * sacrebleu.sentence_bleu(h, [r], tokenize="zh", use_effective_order=True).score
                  for w, r in zip(weights, ZH)) for h in ZH]
  got = mbr.expected_utilities(ZH, log_probs, mbr.utility_fn("bleu", "zh"))
  np.testing.assert_allclose(got, expected, rtol=1e-9)
  assert mbr.select(ZH, log_probs, "bleu", target_lang="zh-Hans") in (0, 1)  # the two that agree
  assert mbr.select(ZH, log_probs, "bleu") == 2  # 13a: no overlap anywhere, so the most probable
