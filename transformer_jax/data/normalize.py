"""The one text normalisation: text that looks the same gives the same ids and the same scores.

Applied by `Tokenizer` (so to every text that becomes ids: the vocabulary's training sample, training and
eval pairs of every dataset, `translate`/`evaluate` input, attention maps), by `metrics` (to hypotheses and
references before BLEU, chrF and exact match) and by the readers' blank-line test. Version 1, in order:

1. **Drop invisible characters** (`DROPPED`): the byte-order mark U+FEFF (a file signature, not content;
   Unicode 15, section 23.8), zero-width space U+200B, zero-width non-joiner/joiner U+200C/U+200D, word
   joiner U+2060, soft hyphen U+00AD, Mongolian vowel separator U+180E, the bidirectional marks,
   embeddings, overrides and isolates (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), the invisible
   math operators U+2061-U+2064, the deprecated format characters U+206A-U+206F, the Hangul fillers U+3164
   and U+FFA0 (blank on their own), the shorthand and musical format controls (U+1BCA0-U+1BCA3,
   U+1D173-U+1D17A), and the C0/C1 control characters that are not whitespace. They render as nothing in
   en/de/fr text and arrive by copy-paste from web pages and Windows editors. SentencePiece's
   `nmt_nfkc` rule maps U+200B, U+200E, U+200F and U+FEFF to a space and removes controls; Moses'
   `remove-non-printing-char.perl` maps every `\\p{C}` to a space. We drop instead of spacing, because a
   character that renders as nothing must not split a word ("twenty\\u200b-one" is "twenty-one"). Known
   cost: ZWNJ/ZWJ are orthographic in Persian and Indic scripts and join emoji sequences. Of Unicode's
   Default_Ignorable_Code_Point characters we keep only those that change how a visible neighbour is drawn
   or ordered: variation selectors (U+FE00-U+FE0F, U+E0100-U+E01EF, U+180B-U+180F: emoji/CJK/Mongolian
   glyph choice), tag characters (U+E0001, U+E0020-U+E007F: emoji subdivision flags), the combining
   grapheme joiner U+034F (it blocks canonical reordering, so NFC depends on it), the conjoining Hangul
   fillers U+115F/U+1160 and the Khmer inherent vowels U+17B4/U+17B5 (parts of syllables). Visible format
   characters (Arabic number signs) stay.
2. **Unicode spaces and line/paragraph separators -> one space, runs collapsed, ends stripped**: every
   character with the Unicode White_Space property (tab, LF, VT, FF, CR, U+0085, NBSP U+00A0, U+1680,
   U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000). NFKC (and so `nmt_nfkc`) maps these spaces to
   U+0020; sacreBLEU's `13a` tokeniser and SentencePiece's `remove_extra_whitespaces` collapse and strip
   runs.
3. **Unicode NFC** (canonical composition, `unicodedata.normalize("NFC", ...)`): "e" + U+0301 and "é"
   become the same character, as the W3C Character Model (charmod-norm) recommends for text exchange. Not
   NFKC: compatibility folding changes visible content ("ﬁ" -> "fi", "²" -> "2", "™" -> "TM"), so a
   detokenised output would no longer reproduce its input.

Dropping comes before NFC (a dropped U+200B between "e" and U+0301 must not block their composition), which
makes `normalize` idempotent. A line is blank when nothing is left (`is_blank`): "\\ufeff", "\\u200b \\u00a0".

Version 0 (`LEGACY_VERSION`) is no normalisation: vocabularies trained before version 1 carry no stamp and
keep encoding text exactly as they were trained (see `tokenizer.read_normalization`). NFC depends on the
Unicode database of the running Python (`unicodedata.unidata_version`) only for characters assigned after
it; `signature()` names it so token-id caches written under another database are not reused.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable

VERSION = 1
LEGACY_VERSION = 0
KNOWN_VERSIONS = (LEGACY_VERSION, VERSION)

_INVISIBLE = [0xFEFF, 0x200B, 0x200C, 0x200D, 0x2060, 0x00AD, 0x180E, 0x061C, 0x200E, 0x200F,
              *range(0x202A, 0x202F), *range(0x2066, 0x206A), *range(0x2061, 0x2065), *range(0x206A, 0x2070),
              0x3164, 0xFFA0, *range(0x1BCA0, 0x1BCA4), *range(0x1D173, 0x1D17B)]
# C0/C1 controls except the White_Space ones (tab, LF, VT, FF, CR, NEL U+0085), which step 2 maps. This
# drops U+001C-U+001F, which Python's str.split() (used in step 2) would otherwise treat as whitespace.
_CONTROLS = [c for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\t\n\v\f\r\x85"]
DROPPED = frozenset(map(chr, _INVISIBLE + _CONTROLS))
_DROPPED_RE = re.compile("[" + "".join(re.escape(c) for c in sorted(DROPPED)) + "]")
_PRINTABLE_DROPPED = frozenset(c for c in DROPPED if c.isprintable())  # the Hangul fillers (category Lo)


def normalize(text: str) -> str:
  """`text` normalised (version 1): invisible characters dropped, spaces collapsed and stripped, NFC.

  Args:
    text: one line or sentence (a `str`; line endings inside it become spaces).
  Returns:
    The normalised `str`; "" when nothing visible is left. Idempotent: `normalize(normalize(t))` equals
    `normalize(t)`.
  """
  if text.isprintable() and not any(c in text for c in _PRINTABLE_DROPPED):
    # The common case, at C speed: no control, format or separator character (str.isprintable is False for
    # categories C* and Z* except U+0020), so only runs of U+0020 and spaces at the ends can need work.
    if "  " in text or text[:1] == " " or text[-1:] == " ":
      text = " ".join(text.split())
  else:
    text = " ".join(_DROPPED_RE.sub("", text).split())
  if text.isascii():  # ASCII is NFC already (the common case for en/de/fr punctuation and digits)
    return text
  return unicodedata.normalize("NFC", text)


def is_blank(text: str) -> bool:
  """True when `text` has nothing visible (empty, whitespace, BOM, zero-width characters only)."""
  return not normalize(text)


def _identity(text: str) -> str:
  return text


def normalizer(version: int, lowercase: bool = False) -> Callable[[str], str]:
  """The normalising function of `version` (0: none, as before version 1; 1: `normalize`), followed by
  `str.lower` when `lowercase` (a case-folded vocabulary, `data.lowercase`: Unicode lowercase mapping as Moses'
  lowercase.perl, so German "ß" stays; not `str.casefold`, which would write "ss").

  Raises:
    ValueError: for a version this library does not know (e.g. a vocabulary from a newer release).
  """
  if version == VERSION:
    base = normalize
  elif version == LEGACY_VERSION:
    base = _identity
  else:
    raise ValueError(f"text normalisation version {version!r} is unknown to this transformer_jax "
                     f"(known: {', '.join(map(str, KNOWN_VERSIONS))}); upgrade transformer_jax")
  return (lambda text: base(text).lower()) if lowercase else base


def signature(version: int = VERSION, lowercase: bool = False) -> str:
  """A string naming what `normalizer(version, lowercase)` does here, e.g. 'nfc-v1/unicode-14.0.0',
  'nfc-v1/unicode-14.0.0/lowercase' or 'none'."""
  normalizer(version)  # validates
  name = "none" if version == LEGACY_VERSION else f"nfc-v{version}/unicode-{unicodedata.unidata_version}"
  return f"{name}/lowercase" if lowercase else name
