"""Translating a corpus: streamed, split in output shards across hosts, resumable and exactly once.

    out/settings.json                the model and every option the shards were written with (a rerun must match)
    out/shards/part-00000-of-00008   translations of one fixed range of input lines, one line per input line
    out/manifest.json                written last: each shard's input range, line count and sha256
    out/{split}.{src} / {split}.{tgt}  optionally, the inputs and translations as a parallel corpus
                                     (`DataConfig` reads `{split}.{lang}` files: `data/parallel_text.py`)

The input (one file, or a directory of shard files read in name order) is cut into units of
`lines_per_shard` consecutive lines; unit u becomes output shard u. A process streams the lines of all its
units through one length-bucketed batcher over a fixed set of compiled shapes (`inference.decode_groups`: batches
stay full across unit boundaries, and a line's output does not depend on its batch), and writes each shard
atomically (`workdir.write_bytes_atomically`), so a shard exists whole or not at all; sampling and noise draw
from the global line number, so a shard's bytes do not depend on which process wrote it or when. A rerun
skips every finished shard; the remaining ones are dealt round-robin over the processes (`jax.distributed`:
process 0 lists what is done, every process agrees, `multihost`). Hence kill -9 of any process at any moment,
then the same command again, gives the bytes of one uninterrupted single-process run. Memory holds a few units
of lines at a time (the batcher's open ones), whatever the corpus size. Back-translation (Edunov et al., 2018;
Caswell et al., 2019): sampling or beam search, `noise` on the outputs, a `tag` in front of each output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from etils import epath

from transformer_jax import multihost
from transformer_jax.data import noise as noise_lib
from transformer_jax.data import parallel_text
from transformer_jax.decoding import generate, inference
from transformer_jax.workdir import (config_diff, open_atomically, read_json, to_jsonable, write_bytes_atomically,
                                     write_json_atomically)


class Unit(NamedTuple):
  """One output shard: `lines` lines of input file `file` from line `first_line` (0-based) on."""
  index: int
  file: int
  first_line: int
  lines: int
  global_first: int  # the corpus line number of its first line (what sampling and noise draw from)


class CorpusSettingsError(ValueError):
  """An output directory written with another model or other options than the ones asked for now."""


def input_files(path: str) -> list[epath.Path]:
  """`path` itself, or the visible files of the directory `path` in name order; ValueError when none."""
  root = epath.Path(path)
  if root.is_file():
    return [root]
  if not root.is_dir():
    raise FileNotFoundError(f"--input={path}: no such file or directory")
  files = sorted((p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")), key=lambda p: p.name)
  if not files:
    raise ValueError(f"--input={path}: the directory holds no files")
  return files


def count_lines(path: epath.Path) -> int:
  """Lines of a file as `parallel_text.iter_decoded_lines` yields them (streamed)."""
  with path.open("rb") as f:
    return sum(1 for _ in f)


def plan(line_counts: Sequence[int], lines_per_shard: int) -> list[Unit]:
  """The units of files of `line_counts` lines: each file cut into runs of `lines_per_shard` lines."""
  if lines_per_shard < 1:
    raise ValueError(f"lines_per_shard={lines_per_shard} must be >= 1")
  units, offset = [], 0
  for file, count in enumerate(line_counts):
    for first in range(0, count, lines_per_shard):
      units.append(Unit(len(units), file, first, min(lines_per_shard, count - first), offset + first))
    offset += count
  return units


class Layout:
  """The paths of an output directory (local or gs://)."""

  def __init__(self, root: str, shards: int):
    self.root = epath.Path(root)
    self.shards = shards

  @property
  def settings(self) -> epath.Path:
    return self.root / "settings.json"

  @property
  def manifest(self) -> epath.Path:
    return self.root / "manifest.json"

  def shard(self, index: int) -> epath.Path:
    return self.root / "shards" / f"part-{index:05d}-of-{self.shards:05d}"


def params_fingerprint(params: Any) -> str:
  """sha256 over every parameter's path, dtype, shape and bytes: another checkpoint gives another value."""
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    array = np.asarray(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


def check_settings(layout: Layout, settings: dict, output_flag: str = "--output_dir") -> None:
  """Refuses (CorpusSettingsError, one line naming each difference) an output directory written with other
  settings; writes `settings.json` on process 0 when there is none. Every process calls it."""
  saved = read_json(layout.settings)
  if saved is not None:
    differences = config_diff(saved, settings, keys=None)
    if differences:
      raise CorpusSettingsError(f"{output_flag}={layout.root} was written with other settings ("
                                f"{'; '.join(differences)}); translate into another directory or delete it")
    return
  if jax.process_index() == 0:
    write_json_atomically(layout.settings, settings)


def finished_units(layout: Layout, units: Sequence[Unit]) -> list[int]:
  """The units whose shard exists (a shard is written atomically: whole or absent), as process 0 sees them
  (every process gets the same list: `multihost.gather_json`)."""
  done = [u.index for u in units if layout.shard(u.index).exists()] if jax.process_index() == 0 else None
  return multihost.gather_json(done)[0]


def unit_lines(files: Sequence[epath.Path], units: Sequence[Unit]) -> Iterator[tuple[Unit, list[str]]]:
  """Each of `units` (in corpus order) with its input lines, the files streamed: one unit in memory."""
  for file, group in itertools.groupby(sorted(units), key=lambda u: u.file):
    path = files[file]
    with path.open("rb") as f:
      lines = parallel_text.iter_decoded_lines(f, str(path))
      position = 0
      for unit in group:
        next(itertools.islice(lines, unit.first_line - position, unit.first_line - position), None)
        yield unit, list(itertools.islice(lines, unit.lines))
        position = unit.first_line + unit.lines


@dataclasses.dataclass(frozen=True)
class Translator:
  """Lines -> output lines of one model and one set of options (`__call__(lines, first_index)`)."""
  params: Any
  model_config: Any
  tokenizer: Any
  options: generate.DecodeOptions
  seed: int = 0
  extra_len: int = 50
  max_tokens_per_batch: int = 4096
  noise: noise_lib.NoiseOptions = noise_lib.NoiseOptions()
  tag: str = ""

  def settings(self) -> dict:
    """What the outputs depend on (the model by fingerprint): `check_settings` compares it."""
    return {"model": {"config": to_jsonable(self.model_config), "params_sha256": params_fingerprint(self.params)},
            "decode": {**to_jsonable(self.options), "seed": self.seed, "extra_len": self.extra_len,
                       "max_tokens_per_batch": self.max_tokens_per_batch},
            "noise": to_jsonable(self.noise), "tag": self.tag}

  def __call__(self, lines: Sequence[str], first_index: int) -> tuple[list[str], int]:
    """The output line of each of `lines` (corpus lines `first_index`, ...) and the output tokens decoded."""
    (_, outputs, tokens), = self.stream([(None, lines, first_index)])
    return outputs, tokens

  def stream(self, units: Iterable[tuple[Any, Sequence[str], int]]) -> Iterator[tuple[Any, list[str], int]]:
    """`(key, output lines, output tokens)` of each `(key, lines, first_index)` of `units`, as each finishes:
    one length-bucketed batcher over them all (`inference.decode_groups`), so batches stay full across unit
    boundaries; a line's output is the same whichever lines share its batch."""
    groups = (((key, first), [[] if self.tokenizer.is_blank(t) else self.tokenizer.encode(t) for t in lines], first)
              for key, lines, first in units)
    for (key, first), lists in inference.decode_groups(
        self.params, self.model_config, groups, self.options, seed=self.seed, extra_len=self.extra_len,
        max_tokens_per_batch=self.max_tokens_per_batch):
      yield (key, *self._outputs(lists, first))

  def _outputs(self, lists, first_index: int) -> tuple[list[str], int]:
    outputs, tokens = [], 0
    for offset, hyps in enumerate(lists):
      if not hyps:
        outputs.append("")
        continue
      tokens += len(hyps[0].ids)
      text = noise_lib.add_noise(self.tokenizer.decode(hyps[0].ids), self.noise, self.seed, first_index + offset)
      outputs.append(f"{self.tag} {text}" if self.tag else text)
    return outputs, tokens


class Progress:
  """Logs `lines/total, lines/s, tokens/s, ETA` after each shard of this process."""

  def __init__(self, total_lines: int):
    self.total, self.lines, self.tokens, self.start = total_lines, 0, 0, time.time()

  def update(self, lines: int, tokens: int) -> str:
    self.lines += lines
    self.tokens += tokens
    seconds = max(time.time() - self.start, 1e-9)
    rate = self.lines / seconds
    eta = (self.total - self.lines) / rate if rate else float("inf")
    line = (f"process {jax.process_index()}: {self.lines}/{self.total} lines, {rate:.1f} lines/s, "
            f"{self.tokens / seconds:.0f} tokens/s, ETA {eta:.0f}s")
    logging.info("corpus: %s", line)
    return line


def write_shard(path: epath.Path, outputs: Sequence[str]) -> None:
  """One shard's lines, written atomically."""
  write_bytes_atomically(path, "".join(line + "\n" for line in outputs).encode("utf-8"))


def _sha256(path: epath.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def write_manifest(layout: Layout, files: Sequence[epath.Path], units: Sequence[Unit]) -> dict:
  """`manifest.json`: each shard's input range, lines and sha256 (raises FileNotFoundError for a missing one)."""
  shards = []
  for u in units:
    path = layout.shard(u.index)
    if not path.exists():
      raise FileNotFoundError(f"shard {path} is missing: rerun the same command to translate it")
    shards.append({"shard": path.name, "input": str(files[u.file]), "first_line": u.first_line, "lines": u.lines,
                   "sha256": _sha256(path)})
  manifest = {"lines": sum(u.lines for u in units), "shards": shards}
  write_json_atomically(layout.manifest, manifest)
  return manifest


def _concatenate(path: epath.Path, parts: Sequence[epath.Path]) -> None:
  """`parts` one after the other into `path` (a part not ending with a newline gets one), streamed, written
  atomically (`workdir.open_atomically`)."""
  with open_atomically(path) as out:
    for part in parts:
      last = b"\n"
      with part.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
          out.write(block)
          last = block[-1:]
      if last != b"\n":
        out.write(b"\n")


def write_parallel_corpus(layout: Layout, files: Sequence[epath.Path], units: Sequence[Unit], split: str,
                          input_lang: str, output_lang: str) -> tuple[epath.Path, epath.Path]:
  """`{split}.{input_lang}` (the inputs) and `{split}.{output_lang}` (the shards) in the output directory: the
  `{split}.{lang}` files a `DataConfig` with `data_dir` there reads (for back-translation: the synthetic side
  is the source)."""
  if input_lang == output_lang:
    raise ValueError(f"the parallel corpus needs two languages (both are {input_lang!r})")
  inputs, outputs = layout.root / f"{split}.{input_lang}", layout.root / f"{split}.{output_lang}"
  _concatenate(inputs, files)
  _concatenate(outputs, [layout.shard(u.index) for u in units])
  return inputs, outputs


class CorpusResult(NamedTuple):
  lines: int  # lines translated by this process in this run
  shards: int  # shards written by this process in this run
  skipped: int  # shards already finished before this run
  manifest: dict  # the manifest (every process gets it)


def translate_corpus(translator: Callable[[Sequence[str], int], tuple[list[str], int]], settings: dict,
                     input_path: str, output_dir: str, *, lines_per_shard: int = 10_000,
                     parallel_corpus: tuple[str, str, str] | None = None,
                     on_shard: Callable[[Unit], None] | None = None) -> CorpusResult:
  """Translates `input_path` (a file or a directory of files) into `output_dir`, on every process of the run.

  `translator(lines, first_index)` returns `(output lines, tokens)` (`Translator`); `settings` what its outputs
  depend on (`Translator.settings()`); `parallel_corpus` = (split, input language, output language) also writes
  `write_parallel_corpus`'s files. `on_shard` is called after each shard is written (tests, progress hooks).
  Every process calls this with the same arguments. Raises CorpusSettingsError for an `output_dir` written with
  other settings, ValueError / FileNotFoundError for bad input (before anything is written).
  """
  files = input_files(input_path)
  units = plan([count_lines(f) for f in files], lines_per_shard)
  layout = Layout(output_dir, len(units))
  settings = {**settings, "lines_per_shard": lines_per_shard,
              "inputs": [{"name": f.name, "lines": n} for f, n in zip(files, _unit_counts(files, units))]}
  check_settings(layout, settings)
  if jax.process_index() == 0:
    _remove_partial_writes(layout)
  multihost.sync_processes("corpus settings")
  done = set(finished_units(layout, units))
  remaining = [u for u in units if u.index not in done]
  mine = remaining[jax.process_index()::jax.process_count()]
  progress, lines = Progress(sum(u.lines for u in mine)), 0
  for unit, outputs, tokens in _translated_units(translator, unit_lines(files, mine)):
    write_shard(layout.shard(unit.index), outputs)
    progress.update(len(outputs), tokens)
    lines += len(outputs)
    if on_shard is not None:
      on_shard(unit)
  multihost.sync_processes("corpus shards")
  manifest = _finish(layout, files, units, parallel_corpus)
  return CorpusResult(lines, len(mine), len(done), manifest)


def _translated_units(translator, items: Iterable[tuple[Unit, list[str]]]) -> Iterator[tuple[Unit, list[str], int]]:
  """`(unit, outputs, tokens)` per unit, as each finishes: through `translator.stream` when it has one (batches
  shared across units: `Translator.stream`), else one `translator(lines, first_index)` call per unit."""
  if hasattr(translator, "stream"):
    yield from translator.stream((unit, texts, unit.global_first) for unit, texts in items)
    return
  for unit, texts in items:
    yield (unit, *translator(texts, unit.global_first))


def _remove_partial_writes(layout: Layout) -> None:
  """Deletes the temporary files of writes (shards, manifest, parallel corpus) that a killed process left; none
  is being written yet."""
  for directory in (layout.root, layout.root / "shards"):
    if directory.exists():
      for path in directory.glob("*.tmp"):
        path.unlink()


def _unit_counts(files: Sequence[epath.Path], units: Sequence[Unit]) -> list[int]:
  return [sum(u.lines for u in units if u.file == i) for i in range(len(files))]


def _finish(layout: Layout, files, units, parallel_corpus) -> dict:
  """Process 0 writes the manifest (and the parallel corpus); every process returns the manifest."""
  if jax.process_index() == 0:
    write_manifest(layout, files, units)
    if parallel_corpus is not None:
      write_parallel_corpus(layout, files, units, *parallel_corpus)
  multihost.sync_processes("corpus manifest")
  return read_json(layout.manifest)
