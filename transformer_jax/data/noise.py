"""Source-side noise for back-translation (Edunov et al., 2018, "Understanding Back-Translation at Scale", sec. 3).

Noised beam search: the beam-search output that becomes a synthetic source has (1) each word deleted with
probability `delete`, (2) each word replaced by a filler token with probability `filler`, and (3) the words
shuffled with each word moving at most `swap` positions (Lample et al., 2018: sort by `index + U(0, swap + 1)`).
Edunov et al. use delete 0.1, filler 0.1 (`<BLANK>`), swap 3. Words are whitespace-separated tokens of the
detokenised text. The noise of line `index` is drawn from `numpy.random.default_rng([seed, index])`, so a line's
noise is the same whatever the batching, the sharding or the process that translates it.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class NoiseOptions:
  """Edunov et al.'s three noises (all off by default); `check` raises ValueError naming a bad value."""
  delete: float = 0.0  # probability of deleting each word
  filler: float = 0.0  # probability of replacing each (kept) word with `filler_token`
  swap: int = 0  # the largest distance a word moves (0 = no shuffle)
  filler_token: str = "<BLANK>"

  def check(self) -> "NoiseOptions":
    for name in ("delete", "filler"):
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise ValueError(f"noise {name}={value} must be in [0, 1)")
    if self.swap < 0:
      raise ValueError(f"noise swap={self.swap} must be >= 0")
    if self.filler and not self.filler_token.strip():
      raise ValueError("the noise filler token must be a visible word")
    return self

  @property
  def active(self) -> bool:
    return bool(self.delete or self.filler or self.swap)


def add_noise(text: str, options: NoiseOptions, seed: int, index: int) -> str:
  """`text` with deletion, filler and local-swap noise (in that order), one space between words; a text whose
  words are all deleted keeps its first word (a blank synthetic source would carry no signal)."""
  if not options.active:
    return text
  words = text.split()
  if not words:
    return text
  rng = np.random.default_rng([seed, index])
  kept = [w for w, u in zip(words, rng.random(len(words))) if u >= options.delete] or words[:1]
  kept = [options.filler_token if u < options.filler else w for w, u in zip(kept, rng.random(len(kept)))]
  if options.swap:
    keys = np.arange(len(kept)) + rng.uniform(0, options.swap + 1, len(kept))
    kept = [kept[i] for i in np.argsort(keys, kind="stable")]
  return " ".join(kept)
