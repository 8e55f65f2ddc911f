"""Tests for the built-in English -> German number-words task."""

import numpy as np
import pytest

from transformer_jax.data import number_words as nw

ENGLISH = {
    0: 'zero',
    21: 'twenty-one',
    105: 'one hundred five',
    345_678: 'three hundred forty-five thousand six hundred seventy-eight',
    1_000: 'one thousand',
    12_000: 'twelve thousand',
    19: 'nineteen',
    40: 'forty',
    90: 'ninety',
    100_000: 'one hundred thousand',
    # Hand-checked extras.
    17: 'seventeen',
    70: 'seventy',
    99: 'ninety-nine',
    100: 'one hundred',
    110: 'one hundred ten',
    1_001: 'one thousand one',
    21_000: 'twenty-one thousand',
    999_999: 'nine hundred ninety-nine thousand nine hundred ninety-nine',
    500_100: 'five hundred thousand one hundred',
    300_001: 'three hundred thousand one',
    11_011: 'eleven thousand eleven',
}

GERMAN = {
    0: 'null',
    1: 'eins',
    21: 'einundzwanzig',
    100: 'einhundert',
    101: 'einhunderteins',
    1_000: 'eintausend',
    1_001: 'eintausendeins',
    21_000: 'einundzwanzigtausend',
    101_000: 'einhunderteintausend',
    16: 'sechzehn',
    17: 'siebzehn',
    60: 'sechzig',
    70: 'siebzig',
    30: 'dreißig',
    345_678: 'dreihundertfünfundvierzigtausendsechshundertachtundsiebzig',
    11: 'elf',
    12: 'zwölf',
    13: 'dreizehn',
    20: 'zwanzig',
    40: 'vierzig',
    50: 'fünfzig',
    80: 'achtzig',
    90: 'neunzig',
    2_000: 'zweitausend',
    101_001: 'einhunderteintausendeins',
    # Hand-checked extras.
    99: 'neunundneunzig',
    110: 'einhundertzehn',
    606: 'sechshundertsechs',
    999_999: 'neunhundertneunundneunzigtausendneunhundertneunundneunzig',
    500_100: 'fünfhunderttausendeinhundert',
    300_001: 'dreihunderttausendeins',
    11_011: 'elftausendelf',
    761_031: 'siebenhunderteinundsechzigtausendeinunddreißig',
}


@pytest.mark.parametrize('n, words', sorted(ENGLISH.items()))
def test_english(n, words):
  assert nw.english(n) == words


@pytest.mark.parametrize('n, word', sorted(GERMAN.items()))
def test_german(n, word):
  assert nw.german(n) == word


def test_format_over_all_numbers():
  english = [nw.english(n) for n in range(nw.MAX_NUMBER + 1)]
  german = [nw.german(n) for n in range(nw.MAX_NUMBER + 1)]
  assert len(set(english)) == len(set(german)) == nw.MAX_NUMBER + 1
  for en, de in zip(english, german):
    assert ' and ' not in en and en == en.lower() and en == en.strip()
    assert '  ' not in en
    assert ' ' not in de and de == de.lower()
    assert not de.startswith(('hundert', 'tausend'))
    assert 'tausendhundert' not in de and not de.endswith('ein')


@pytest.mark.parametrize('fn', [nw.english, nw.german])
@pytest.mark.parametrize('n', [-1, 1_000_000])
def test_out_of_range(fn, n):
  with pytest.raises(ValueError, match=str(n)):
    fn(n)


def test_split_numbers():
  sizes = {'train': 1_000, 'validation': 100, 'test': 50}
  splits = nw.split_numbers(seed=3, sizes=sizes)
  assert {k: len(v) for k, v in splits.items()} == sizes
  union = np.concatenate(list(splits.values()))
  assert len(np.unique(union)) == len(union)
  assert union.min() >= 0 and union.max() <= nw.MAX_NUMBER
  again = nw.split_numbers(seed=3, sizes=sizes)
  for k in sizes:
    np.testing.assert_array_equal(splits[k], again[k])
  other = nw.split_numbers(seed=4, sizes=sizes)
  assert not np.array_equal(splits['train'], other['train'])


def test_split_numbers_default_sizes():
  splits = nw.split_numbers()
  assert {k: len(v) for k, v in splits.items()} == nw.DEFAULT_SIZES
  union = np.concatenate(list(splits.values()))
  assert len(np.unique(union)) == len(union)


def test_split_numbers_too_many():
  with pytest.raises(ValueError):
    nw.split_numbers(sizes={'train': 1_000_000, 'test': 1})


def test_tiny_builder(tmp_path):
  builder = nw.NumberWords(config='tiny', data_dir=str(tmp_path))
  builder.download_and_prepare()
  assert builder.info.name == 'number_words'
  assert str(builder.info.version) == '1.2.0'
  assert builder.info.supervised_keys == ('en', 'de')
  expected = nw.split_numbers(0, nw.TINY_SIZES)
  for split, numbers in expected.items():
    assert builder.info.splits[split].num_examples == len(numbers)
    pairs = nw.load_pairs(split, config='tiny', data_dir=str(tmp_path))
    assert sorted(pairs) == sorted(
        (nw.english(n), nw.german(n)) for n in numbers.tolist())
    ds = builder.as_dataset(split=split, shuffle_files=False)
    stored = [(ex['en'].decode(), ex['de'].decode())
              for ex in ds.as_numpy_iterator()]
    assert pairs == stored


@pytest.mark.parametrize('complete', [False, True])
def test_train_split_repeats_small_numbers(tmp_path, complete):
  """Numbers below 1000 carry the short forms; the train split repeats them (and, with small_complete,
  holds every one that validation and test do not), other splits do not."""
  config = nw.NumberWordsConfig(name=f'repeat3_{complete}', train=3000, validation=300, test=300, seed=1,
                                small_repeat=3, small_complete=complete)
  builder = nw.NumberWords(config=config, data_dir=str(tmp_path))
  builder.download_and_prepare()
  splits = nw.split_numbers(1, config.sizes)
  small = int(np.sum(splits['train'] < 1000))
  held_out = {int(n) for split in ('validation', 'test') for n in splits[split] if n < 1000}
  assert small > 0
  pairs = nw.load_pairs('train', config=config, data_dir=str(tmp_path))
  small_words = {nw.english(n) for n in range(1000)}
  train_small = [en for en, _ in pairs if en in small_words]
  if complete:
    assert len(pairs) == 3000 - small + 3 * (1000 - len(held_out))
    assert set(train_small) == {nw.english(n) for n in range(1000) if n not in held_out}
  else:
    assert len(pairs) == 3000 + 2 * small
  assert all(train_small.count(en) == 3 for en in set(train_small))
  assert not held_out & {n for n in range(1000) if nw.english(n) in set(train_small)}
  assert builder.info.splits['test'].num_examples == 300
