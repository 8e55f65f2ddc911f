"""The built-in "number words" translation task.

Source sentences are English number words, targets are German number words,
for the integers 0..999_999::

    345_678 -> en: "three hundred forty-five thousand six hundred seventy-eight"
               de: "dreihundertfünfundvierzigtausendsechshundertachtundsiebzig"

English is lowercase, US style without "and", words joined by single spaces
and tens-units pairs hyphenated ("twenty-one", "one hundred five").  German is a
single lowercase word: "eins" only when the 1 ends the number ("hunderteins",
"tausendeins"), "ein" inside compounds ("einundzwanzig", "eintausend",
"einhunderteintausend"); always "einhundert"/"eintausend", never bare
"hundert"/"tausend".

The numbers are split into disjoint train/validation/test sets by a fixed-seed
permutation (`split_numbers`) and served as a tensorflow-datasets builder::

    builder = NumberWords(config='tiny', data_dir=DIR)
    builder.download_and_prepare()
    ds = builder.as_dataset(split='train')   # {'en': str, 'de': str}

or, as plain Python lists of (en, de) pairs, with `load_pairs` (prepared as
ArrayRecord and read without TensorFlow: `transformer_jax.data.records`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import tensorflow_datasets as tfds

from transformer_jax.data import records

MAX_NUMBER = 999_999
DEFAULT_SIZES = {'train': 200_000, 'validation': 2_000, 'test': 5_000}
TINY_SIZES = {'train': 2_000, 'validation': 200, 'test': 200}

_EN_ONES = ('zero one two three four five six seven eight nine ten eleven '
            'twelve thirteen fourteen fifteen sixteen seventeen eighteen '
            'nineteen').split()
_EN_TENS = ('', '', 'twenty', 'thirty', 'forty', 'fifty', 'sixty', 'seventy',
            'eighty', 'ninety')

_DE_ONES = ('null eins zwei drei vier fünf sechs sieben acht neun zehn elf '
            'zwölf dreizehn vierzehn fünfzehn sechzehn siebzehn achtzehn '
            'neunzehn').split()
_DE_TENS = ('', '', 'zwanzig', 'dreißig', 'vierzig', 'fünfzig', 'sechzig',
            'siebzig', 'achtzig', 'neunzig')


def _check(n: int) -> None:
  if not 0 <= n <= MAX_NUMBER:
    raise ValueError(f'number must be in [0, {MAX_NUMBER}], got {n!r}')


def _english_below_1000(n: int) -> list[str]:
  """Words for 1 <= n <= 999."""
  hundreds, rest = divmod(n, 100)
  words = [_EN_ONES[hundreds], 'hundred'] if hundreds else []
  if rest >= 20:
    tens, ones = divmod(rest, 10)
    words.append(f'{_EN_TENS[tens]}-{_EN_ONES[ones]}' if ones
                 else _EN_TENS[tens])
  elif rest:
    words.append(_EN_ONES[rest])
  return words


def english(n: int) -> str:
  """US English number words for 0 <= n <= 999_999, e.g. "one hundred five"."""
  _check(n)
  if n == 0:
    return 'zero'
  thousands, rest = divmod(n, 1000)
  words = _english_below_1000(thousands) + ['thousand'] if thousands else []
  if rest:
    words += _english_below_1000(rest)
  return ' '.join(words)


def _german_digit(d: int) -> str:
  """German 1..9 as it appears inside a compound ("ein", not "eins")."""
  return 'ein' if d == 1 else _DE_ONES[d]


def _german_below_1000(n: int, final: bool) -> str:
  """German word for 1 <= n <= 999; `final`: whether it ends the number."""
  hundreds, rest = divmod(n, 100)
  word = _german_digit(hundreds) + 'hundert' if hundreds else ''
  if rest == 1:
    word += 'eins' if final else 'ein'
  elif rest >= 20:
    tens, ones = divmod(rest, 10)
    word += (_german_digit(ones) + 'und' if ones else '') + _DE_TENS[tens]
  elif rest:
    word += _DE_ONES[rest]
  return word


def german(n: int) -> str:
  """German number word for 0 <= n <= 999_999, e.g. "einhunderteins"."""
  _check(n)
  if n == 0:
    return 'null'
  thousands, rest = divmod(n, 1000)
  word = ''
  if thousands:
    word = _german_below_1000(thousands, final=False) + 'tausend'
  if rest:
    word += _german_below_1000(rest, final=True)
  return word


def split_numbers(
    seed: int = 0, sizes: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
  """Disjoint sets of numbers in 0..999_999, one per split.

  A `np.random.default_rng(seed)` permutation of all numbers is cut into
  consecutive slices of `sizes[split]` numbers, in the order of `sizes`
  (default `DEFAULT_SIZES`: train 200_000, validation 2_000, test 5_000).
  """
  sizes = DEFAULT_SIZES if sizes is None else sizes
  if any(s < 0 for s in sizes.values()) or sum(sizes.values()) > MAX_NUMBER + 1:
    raise ValueError(f'invalid split sizes {dict(sizes)}')
  perm = np.random.default_rng(seed).permutation(MAX_NUMBER + 1)
  splits, start = {}, 0
  for name, size in sizes.items():
    splits[name] = perm[start:start + size]
    start += size
  return splits


@dataclasses.dataclass(eq=False)
class NumberWordsConfig(tfds.core.BuilderConfig):
  """Split sizes and permutation seed of a `NumberWords` config."""
  train: int = DEFAULT_SIZES['train']
  validation: int = DEFAULT_SIZES['validation']
  test: int = DEFAULT_SIZES['test']
  seed: int = 0
  # Numbers below 1000 are 0.1% of the range (~200 of 200k uniform train numbers) but carry every short
  # form ("twenty-one" -> "einundzwanzig", without "tausend"). The train split adds every number below
  # 1000 that validation and test do not hold (`small_complete`) and repeats each of its numbers below
  # 1000 `small_repeat` times.
  small_repeat: int = 20
  small_complete: bool = True

  @property
  def sizes(self) -> dict[str, int]:
    return {'train': self.train, 'validation': self.validation,
            'test': self.test}


class NumberWords(tfds.core.GeneratorBasedBuilder):
  """English -> German number words for 0..999_999 (no downloads).

  Features `{'en': Text, 'de': Text}` with `en = english(n)`,
  `de = german(n)`; examples are keyed by `n`. Splits `train`, `validation`
  and `test` hold the disjoint numbers of `split_numbers(config.seed,
  config.sizes)`, stored in tfds's deterministic key-hash order; `train` also
  holds every number below 1000 that validation and test do not
  (`config.small_complete`), each `config.small_repeat` times (keys `n/copy`).
  """

  VERSION = tfds.core.Version('1.2.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.',
                   '1.1.0': 'Train split repeats its numbers below 1000 (small_repeat times).',
                   '1.2.0': 'Train split holds every number below 1000 not held out (small_complete).'}
  BUILDER_CONFIGS = [
      NumberWordsConfig(name='default', description='200k/2k/5k numbers.',
                        **DEFAULT_SIZES),
      NumberWordsConfig(name='tiny', description='2k/200/200, for tests.',
                        small_repeat=1, small_complete=False, **TINY_SIZES),
  ]
  DEFAULT_CONFIG_NAME = 'default'

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description='English -> German number words for 0..999_999.',
        features=tfds.features.FeaturesDict({
            'en': tfds.features.Text(),
            'de': tfds.features.Text(),
        }),
        supervised_keys=('en', 'de'),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Everything is generated locally.
    config = self.builder_config
    splits = split_numbers(config.seed, config.sizes)
    if config.small_complete:
      held_out = np.concatenate([v for k, v in splits.items() if k != 'train'])
      missing = np.setdiff1d(np.arange(1000), np.concatenate([splits['train'], held_out]))
      splits['train'] = np.concatenate([splits['train'], missing])
    repeat = {'train': config.small_repeat}
    return {name: self._generate_examples(numbers, repeat.get(name, 1))
            for name, numbers in splits.items()}

  def _generate_examples(self, numbers, small_repeat: int = 1):
    for n in numbers.tolist():
      copies = small_repeat if n < 1000 else 1
      for copy in range(copies):
        yield f'{n}/{copy}', {'en': english(n), 'de': german(n)}


def load_pairs(split: str, config: str = 'default',
               data_dir: str | None = None) -> list[tuple[str, str]]:
  """(en, de) string pairs of `split`, in stored order; prepares if needed.

  `split` is any tfds split string ('train', 'test[:100]', ...); `data_dir`
  defaults to tfds's (~/tensorflow_datasets).
  """
  builder = records.prepare(NumberWords, config=config, data_dir=data_dir)
  return records.read_pairs(builder, split, 'en', 'de')
