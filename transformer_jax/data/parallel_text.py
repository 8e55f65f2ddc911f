"""Parallel text as a tensorflow-datasets builder: a directory of `{split}.{lang}` files.

    data/train.en  data/train.de  data/val.en  data/val.de  data/test2016.en  data/test2016.de

Line N of `X.en` translates line N of `X.de` (UTF-8). The files are checked (line counts, UTF-8, missing
split files, a training file without a visible pair) before anything is built; the dataset is then built once
into the tfds data directory under a name that fingerprints the files' contents, so changed files rebuild and
unchanged ones are reused wherever the directory is. The dataset stores the lines as they are in the files (line
endings removed); they are normalised (`normalize`: BOM, zero-width characters, spaces, NFC) where they become ids,
by the vocabulary's `Tokenizer`, so a workdir whose vocabulary predates normalisation reads them as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from typing import Iterable, Iterator

import tensorflow_datasets as tfds
from etils import epath

from transformer_jax.data import normalize, records
from transformer_jax.workdir import absolute

_SPLIT_FILE = re.compile(r"^(\w+)\.([A-Za-z_-]+)$")
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # little- and big-endian (UTF-32 LE starts like UTF-16 LE)


class ParallelTextError(ValueError):
  """A parallel text directory that cannot be used: the message names the file (and line)."""


def discover_splits(directory: str, source_lang: str, target_lang: str) -> list[str]:
  """Split names that have both a `.{source_lang}` and a `.{target_lang}` file in `directory` (local or gs://)."""
  if not epath.Path(directory).is_dir():
    raise ParallelTextError(f"data directory {directory} does not exist")
  names: dict[str, set[str]] = {}
  for child in epath.Path(directory).iterdir():
    match = _SPLIT_FILE.match(child.name)
    if match:
      names.setdefault(match.group(1), set()).add(match.group(2))
  return sorted(s for s, langs in names.items() if {source_lang, target_lang} <= langs)


def split_files(directory: str, split: str, source_lang: str, target_lang: str) -> tuple[str, str]:
  """The two files of `split`; a missing one is named in the error."""
  paths = tuple(str(epath.Path(directory) / f"{split}.{lang}") for lang in (source_lang, target_lang))
  for path in paths:
    if not epath.Path(path).is_file():
      available = ", ".join(discover_splits(directory, source_lang, target_lang)) or "none"
      raise ParallelTextError(f"missing split file {path} (splits with both languages: {available})")
  return paths


def iter_decoded_lines(stream: Iterable[bytes], name: str) -> Iterator[str]:
  """UTF-8 lines of a binary stream without line endings, one at a time; invalid UTF-8 names `name` and the line.

  A UTF-8 byte-order mark is kept (the tokenizer's normalisation drops it); a UTF-16/32 one is refused by
  name, since its text would otherwise fail as "invalid UTF-8" on an arbitrary line. Lines end with LF or
  CR LF; a carriage return inside a line (a file with classic-Mac CR-only line endings reads as one line)
  is refused with the line number rather than read as a space.
  """
  for number, raw in enumerate(stream, start=1):
    if number == 1 and raw.startswith(_UTF16_BOMS):
      raise ParallelTextError(f"{name}:1: UTF-16 or UTF-32 text (byte-order mark {raw[:2].hex(' ')}); only "
                              f"UTF-8 is read: convert it first, e.g. iconv -f UTF-16 -t UTF-8")
    try:
      line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
      raise ParallelTextError(f"{name}:{number}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    if "\r" in line:
      raise ParallelTextError(f"{name}:{number}: carriage return inside the line (CR-only line endings?); "
                              f"lines must end with LF or CR LF")
    yield line


def decode_lines(stream: Iterable[bytes], name: str) -> list[str]:
  """Every line of `iter_decoded_lines(stream, name)` (same checks), as a list."""
  return list(iter_decoded_lines(stream, name))


def read_lines(path: str) -> list[str]:
  """Lines of a UTF-8 file (local or gs://) without line endings; invalid UTF-8 names the file and line."""
  with epath.Path(path).open("rb") as f:
    return decode_lines(f, path)


def iter_split(directory: str, split: str, source_lang: str, target_lang: str) -> Iterator[tuple[str, str]]:
  """The checked (source, target) pairs of one split, in file order, streamed: memory does not grow with the
  files. Raises ParallelTextError (naming both files and their line counts) when one file ends first, after
  yielding the pairs before that line."""
  source_path, target_path = split_files(directory, split, source_lang, target_lang)
  with epath.Path(source_path).open("rb") as fs, epath.Path(target_path).open("rb") as ft:
    pairs = itertools.zip_longest(iter_decoded_lines(fs, source_path), iter_decoded_lines(ft, target_path))
    for count, (source, target) in enumerate(pairs):
      if source is None or target is None:
        more = 1 + sum(1 for _ in pairs)
        n_src, n_tgt = (count, count + more) if source is None else (count + more, count)
        raise ParallelTextError(f"{source_path} has {n_src} lines but {target_path} has {n_tgt} lines")
      yield source, target


def check_split(directory: str, split: str, source_lang: str, target_lang: str, training: bool) -> None:
  """Reads `split` through `iter_split`'s checks in constant memory; a training split needs a non-blank pair."""
  visible = False
  for source, target in iter_split(directory, split, source_lang, target_lang):
    visible = visible or (not normalize.is_blank(source) and not normalize.is_blank(target))
  if training and not visible:
    raise ParallelTextError(f"training files {epath.Path(directory) / split}.{{{source_lang},{target_lang}}} "
                            f"hold no non-blank pairs")


def fingerprint(directory: str, splits: list[str], langs: tuple[str, str]) -> str:
  """16 hex digits of SHA-256 over the split files' names and bytes: the same text gives the same name wherever
  the directory is and whenever it was written (a copied, moved or remounted corpus is reused), and an edited
  file gives a new one (the only full read of a prepared corpus; its cost: docs/performance.md)."""
  digest = hashlib.sha256()
  for split in splits:
    for lang in langs:
      file_digest = hashlib.sha256()
      with (epath.Path(directory) / f"{split}.{lang}").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          file_digest.update(block)
      digest.update(f"{split}.{lang}:{file_digest.hexdigest()}\n".encode())
  return digest.hexdigest()[:16]


@dataclasses.dataclass
class ParallelTextConfig(tfds.core.BuilderConfig):
  directory: str = ""
  source_lang: str = "en"
  target_lang: str = "de"
  splits: tuple[str, ...] = ()


class ParallelText(tfds.core.GeneratorBasedBuilder):
  """A tfds dataset over a directory of `{split}.{lang}` files (features: the two language codes)."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({cfg.source_lang: tfds.features.Text(),
                                             cfg.target_lang: tfds.features.Text()}),
        supervised_keys=(cfg.source_lang, cfg.target_lang),
        disable_shuffling=True)  # keep file order: outputs must align with references

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {split: self._generate_examples(split) for split in self.builder_config.splits}

  def _generate_examples(self, split):
    cfg = self.builder_config
    for index, (source, target) in enumerate(iter_split(cfg.directory, split, cfg.source_lang,
                                                        cfg.target_lang)):
      yield index, {cfg.source_lang: source, cfg.target_lang: target}


def parallel_text_builder(directory: str, source_lang: str, target_lang: str, data_dir: str,
                          required_splits: tuple[str, ...] = ("train",)) -> ParallelText:
  """Checks the files, then returns the prepared builder (built on first use, reused afterwards)."""
  for split in required_splits:
    split_files(directory, split, source_lang, target_lang)
  splits = discover_splits(directory, source_lang, target_lang)
  name = f"{source_lang}_{target_lang}_{fingerprint(directory, splits, (source_lang, target_lang))}"
  config = ParallelTextConfig(name=name, version="1.0.0", directory=str(absolute(directory)),
                              source_lang=source_lang, target_lang=target_lang, splits=tuple(splits),
                              description=f"{directory} ({source_lang}->{target_lang})")
  if not ParallelText(config=config, data_dir=data_dir).is_prepared():
    # Validate everything before writing anything; a prepared name fingerprints bytes that passed already.
    for split in splits:
      check_split(directory, split, source_lang, target_lang, training=split == required_splits[0])
  return records.prepare(ParallelText, config=config, data_dir=data_dir)
