"""Corpus translation (`transformer_jax.serving.corpus`, `experiments.translate_corpus`): shards, manifest, exactly once.

The cheap tests drive the library with a pure-Python translator; the slow one runs the program on a tiny trained
model in 2 processes joined by jax.distributed, kills one with SIGKILL part-way, restarts, and compares bytes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import helpers

from transformer_jax.serving import corpus
from transformer_jax.data import noise, parallel_text

REPO = helpers.REPO


def _fake_translator(lines, first_index):
  """Upper-cases and numbers each line with its corpus line number: any misplaced line shows."""
  return [f"{first_index + i}:{line.upper()}" if line.strip() else "" for i, line in enumerate(lines)], len(lines)


def _write_inputs(directory, lines, files):
  directory.mkdir()
  per = -(-len(lines) // files)
  for k in range(files):
    (directory / f"part{k}.txt").write_text("".join(f"{x}\n" for x in lines[k * per:(k + 1) * per]))
  return directory


LINES = [f"line {i}" if i % 13 else "" for i in range(50)]


def _tree_bytes(root):
  return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
          for d, _, names in os.walk(root) for f in names}


def test_plan_cuts_each_file_into_shards_with_global_line_numbers():
  units = corpus.plan([5, 0, 3], 2)
  assert [(u.file, u.first_line, u.lines, u.global_first) for u in units] == [
      (0, 0, 2, 0), (0, 2, 2, 2), (0, 4, 1, 4), (2, 0, 2, 5), (2, 2, 1, 7)]
  with pytest.raises(ValueError, match="lines_per_shard=0"):
    corpus.plan([1], 0)


def test_shards_manifest_and_parallel_corpus(tmp_path):
  inputs = _write_inputs(tmp_path / "in", LINES, 3)
  result = corpus.translate_corpus(_fake_translator, {"model": "m"}, str(inputs), str(tmp_path / "out"),
                                   lines_per_shard=7, parallel_corpus=("train", "de", "en"))
  expected = [f"{i}:{x.upper()}" if x else "" for i, x in enumerate(LINES)]
  assert (tmp_path / "out" / "train.en").read_text().splitlines() == expected
  assert (tmp_path / "out" / "train.de").read_text().splitlines() == LINES
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest == result.manifest and manifest["lines"] == 50 and result.lines == 50
  assert [s["lines"] for s in manifest["shards"]] == [7, 7, 3, 7, 7, 3, 7, 7, 2]
  assert len(os.listdir(tmp_path / "out" / "shards")) == 9


def test_an_interrupted_run_resumes_to_the_same_bytes_and_never_redoes_a_shard(tmp_path):
  inputs = _write_inputs(tmp_path / "in", LINES, 2)
  corpus.translate_corpus(_fake_translator, {}, str(inputs), str(tmp_path / "whole"), lines_per_shard=6)

  def crash_after_three(unit):
    if unit.index == 2:
      raise KeyboardInterrupt  # as a kill between two shards
  with pytest.raises(KeyboardInterrupt):
    corpus.translate_corpus(_fake_translator, {}, str(inputs), str(tmp_path / "out"), lines_per_shard=6,
                            on_shard=crash_after_three)
  assert not (tmp_path / "out" / "manifest.json").exists()
  (tmp_path / "out" / "manifest.json.1.tmp").write_text("{")  # what a kill in the middle of writes leaves
  (tmp_path / "out" / "shards" / "part-00003-of-00009.2.tmp").write_text("half")
  redone = []
  result = corpus.translate_corpus(_fake_translator, {}, str(inputs), str(tmp_path / "out"), lines_per_shard=6,
                                   on_shard=lambda u: redone.append(u.index))
  assert result.skipped == 3 and min(redone) == 3
  assert _tree_bytes(tmp_path / "out") == _tree_bytes(tmp_path / "whole")


class _HoldingTranslator:
  """A streaming translator (`Translator.stream`'s protocol) that holds two units and finishes them newest first,
  as a batcher shared across units can."""

  def stream(self, units):
    held = []
    for unit in units:
      held.append(unit)
      if len(held) == 2:
        for key, lines, first in reversed(held):
          yield (key, *_fake_translator(lines, first))
        held = []
    for key, lines, first in held:
      yield (key, *_fake_translator(lines, first))


def test_a_streaming_translator_finishing_units_out_of_order_writes_the_same_bytes(tmp_path):
  inputs = _write_inputs(tmp_path / "in", LINES, 2)
  corpus.translate_corpus(_fake_translator, {}, str(inputs), str(tmp_path / "one_by_one"), lines_per_shard=6)
  written = []
  corpus.translate_corpus(_HoldingTranslator(), {}, str(inputs), str(tmp_path / "streamed"), lines_per_shard=6,
                          on_shard=lambda u: written.append(u.index))
  assert written[:2] == [1, 0] and sorted(written) == list(range(10))
  assert _tree_bytes(tmp_path / "streamed") == _tree_bytes(tmp_path / "one_by_one")


def test_other_settings_against_an_existing_output_are_refused_in_one_line(tmp_path):
  inputs = _write_inputs(tmp_path / "in", LINES, 1)
  corpus.translate_corpus(_fake_translator, {"decode": {"beam_size": 4}}, str(inputs), str(tmp_path / "out"))
  before = _tree_bytes(tmp_path / "out")
  with pytest.raises(corpus.CorpusSettingsError, match=r"decode.beam_size: saved 4, requested 2") as error:
    corpus.translate_corpus(_fake_translator, {"decode": {"beam_size": 2}}, str(inputs), str(tmp_path / "out"))
  assert "\n" not in str(error.value)
  with pytest.raises(corpus.CorpusSettingsError, match="lines_per_shard: saved 10000, requested 5"):
    corpus.translate_corpus(_fake_translator, {"decode": {"beam_size": 4}}, str(inputs), str(tmp_path / "out"),
                            lines_per_shard=5)
  assert _tree_bytes(tmp_path / "out") == before


def test_noise_is_edunov_style_and_depends_only_on_seed_and_line():
  options = noise.NoiseOptions(delete=0.1, filler=0.1, swap=3).check()
  text = " ".join(f"w{i}" for i in range(400))
  noised = noise.add_noise(text, options, seed=1, index=7)
  assert noised == noise.add_noise(text, options, seed=1, index=7) != noise.add_noise(text, options, 1, 8)
  words = noised.split()
  assert 330 <= len(words) <= 390 and 15 <= words.count("<BLANK>") <= 60  # ~10% deleted, ~10% of the rest blanked
  swapped = noise.add_noise(text, noise.NoiseOptions(swap=3), 0, 0).split()
  assert swapped != text.split() and sorted(swapped) == sorted(text.split())
  assert max(abs(position - int(word[1:])) for position, word in enumerate(swapped)) <= 3  # Lample et al.
  assert noise.add_noise("", options, 0, 0) == ""
  with pytest.raises(ValueError, match="noise delete=1.5"):
    noise.NoiseOptions(delete=1.5).check()


# ---------------------------------------------------------------------------------------------------------------
# The program on a trained model: 2 processes, one killed with SIGKILL, restarted: the 1-process bytes.

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  helpers.train_tiny(workdir)
  return workdir


def _number_lines(count):
  from transformer_jax.data import number_words
  return [number_words.english(n * 7919 % 999_983 + 1) if n % 17 else "" for n in range(count)]


def _program(workdir, inputs, out, *extra):
  return [sys.executable, "-m", "experiments.translate_corpus", f"--workdir={workdir}", f"--input={inputs}",
          f"--output_dir={out}", "--lines_per_shard=25", "--beam_size=2", "--tag=<BT>", "--parallel_corpus=train",
          *extra]


def _distributed(workdir, inputs, out, port, *extra):
  return [subprocess.Popen(_program(workdir, inputs, out, "--distributed", f"--coordinator_address=localhost:{port}",
                                    "--num_processes=2", f"--process_id={i}", *extra),
                           cwd=REPO, env=helpers.program_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
          for i in range(2)]


@pytest.mark.slow
def test_two_processes_killed_and_restarted_write_the_bytes_of_one_process(trained, tmp_path):
  inputs = _write_inputs(tmp_path / "in", _number_lines(200), 8)
  subprocess.run(_program(trained, inputs, tmp_path / "one"), cwd=REPO, env=helpers.program_env(),
                 check=True, capture_output=True, timeout=300)
  out = tmp_path / "two"
  procs = _distributed(trained, inputs, out, helpers.free_port())
  first_of_process_1 = out / "shards" / "part-00001-of-00008"
  deadline = time.time() + 240
  while not first_of_process_1.exists() and time.time() < deadline:
    assert procs[1].poll() is None, procs[1].communicate()[0][-3000:]
    time.sleep(0.01)
  procs[1].send_signal(signal.SIGKILL)  # part-way: its first shard written, its others not yet
  procs[0].send_signal(signal.SIGKILL)  # and the other one wherever it was
  for proc in procs:
    proc.wait()
  assert not (out / "manifest.json").exists()
  kept = {name: os.stat(out / "shards" / name).st_ino for name in os.listdir(out / "shards")
          if not name.endswith(".tmp")}  # a shard being written when killed left only its temporary file
  assert 1 <= len(kept) < 8
  procs = _distributed(trained, inputs, out, helpers.free_port())
  outputs = [proc.communicate(timeout=300)[0] for proc in procs]
  assert all(proc.returncode == 0 for proc in procs), outputs[0][-2000:] + outputs[1][-2000:]
  assert all(os.stat(out / "shards" / name).st_ino == ino for name, ino in kept.items())  # never redone
  assert _tree_bytes(out) == _tree_bytes(tmp_path / "one")  # the killed writes' temporary files removed too
  pairs = list(parallel_text.iter_split(str(out), "train", "en", "de"))  # what a DataConfig with data_dir reads
  assert [source for source, _ in pairs] == _number_lines(200)
  assert all(target.startswith("<BT> ") == bool(source) for source, target in pairs), pairs[:3]
