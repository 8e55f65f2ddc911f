"""A run as researchers see it: TensorBoard (scalars, HParams, sample translations), W&B offline, a profile.

One tiny number-words run (12 steps, both trackers, `profile_steps=(5, 8)`) is read back with TensorBoard's own
event reader, wandb's own record type and `jax.profiler.ProfileData`, against the run's metrics.jsonl.
"""

import glob
import json
import os
import re
import struct
import subprocess
import sys

import jax
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.util import tensor_util

import helpers
from benchmarks import profile as profile_bench
from transformer_jax.data import sources
from transformer_jax.run import evaluators, trackers, trainer
from transformer_jax.run.experiment_config import ConfigError, ExperimentConfig
from transformer_jax.workdir import Workdir

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the wandb extra: pip install -e '.[wandb]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, PROFILE = 12, (5, 8)


def _config(tmp_path):
  config = helpers.tiny_number_words_config(tmp_path)
  config.num_train_steps, config.warmup_steps, config.log_every_steps = STEPS, 2, 1
  config.evals.loss.every_steps = 6
  config.evals.attention.every_steps = 6
  config.evals.bleu.update(every_steps=6, max_examples=8, samples=3)
  config.checkpoint_every_steps = 0
  config.trackers = ("tensorboard", "wandb")
  config.profile_steps = PROFILE
  return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("tracked")
  config = ExperimentConfig.from_config_dict(_config(tmp_path))
  os.environ["WANDB_MODE"] = "offline"  # nothing reaches a network
  try:
    result = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  finally:
    del os.environ["WANDB_MODE"]
  rows = [json.loads(line) for line in Workdir(tmp_path / "run").metrics_jsonl.read_text().splitlines()]
  return config, Workdir(tmp_path / "run"), result, rows


def _jsonl_series(rows, tag):
  return [(r["step"], r[tag]) for r in rows if tag in r]


def test_tensorboard_shows_hparams_scalars_attention_and_sample_translations(run):
  config, workdir, result, rows = run
  events = event_accumulator.EventAccumulator(str(workdir.tensorboard), size_guidance={"tensors": 0})
  events.Reload()
  # Scalars: the same series as metrics.jsonl, attention diagnostics included.
  for tag in ("train/loss", "validation/loss", "validation/bleu",
              "validation/attention/cross/near_uniform_share"):
    logged = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
    assert logged == [(s, pytest.approx(v, rel=1e-6)) for s, v in _jsonl_series(rows, tag)] and logged
  # HParams: the resolved config (config.json), and the validation metrics as the experiment's metrics.
  content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
  start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
  saved = workdir.require_config()
  assert start.hparams["model.d_model"].number_value == saved["model"]["d_model"] == 32
  assert start.hparams["model.vocab_size"].number_value == result.model_config.vocab_size
  assert start.hparams["data.dataset"].string_value == "number_words"
  assert start.hparams["profile_steps"].string_value == "[5, 8]"
  assert set(start.hparams) == set(trackers.flatten_hparams(saved))
  experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
  assert [m.name.tag for m in experiment.metric_infos] == evaluators.logged_eval_metrics(config)
  assert "validation/bleu" in [m.name.tag for m in experiment.metric_infos]
  # Sample translations at each BLEU evaluation (6 and 12): the validation split's first pairs.
  pairs = sources.load_pairs(config.data, "validation", str(workdir.root))[:3]
  texts = events.Tensors("validation/samples")
  assert [e.step for e in texts] == [6, 12]
  table = tensor_util.make_ndarray(texts[-1].tensor_proto).item().decode()
  lines = table.splitlines()
  assert lines[0] == "| source | reference | hypothesis |" and len(lines) == 2 + 3
  for line, (source, reference) in zip(lines[2:], pairs):
    assert line.startswith(f"| {source} | {reference} | ")


def _wandb_records(directory):
  """The protobuf records (wandb's own `Record`) of the run's `.wandb` file: LevelDB log blocks of 32 KiB
  after a 7-byte `:W&B` header, each record split into FULL / FIRST, MIDDLE, LAST chunks."""
  (path,) = glob.glob(os.path.join(directory, "offline-run-*", "run-*.wandb"))
  data, block, pos, records, pending = open(path, "rb").read(), 32768, 7, [], b""
  assert data[:4] == b":W&B"
  while pos + 7 <= len(data):
    if block - pos % block < 7:
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      record = wandb_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
  return records


def test_wandb_offline_run_holds_the_same_scalars_config_and_samples(run):
  _, workdir, _, rows = run
  history = {}
  config = {}
  for record in _wandb_records(str(workdir.wandb)):
    if record.HasField("history"):
      items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
      history.setdefault(items["_step"], {}).update(items)
    if record.HasField("config"):
      config.update({i.key: json.loads(i.value_json) for i in record.config.update})
  for tag in ("train/loss", "train/learning_rate", "validation/loss", "validation/bleu"):
    series = [(s, h[tag]) for s, h in sorted(history.items()) if tag in h]
    assert series == [(s, pytest.approx(v, rel=1e-6)) for s, v in _jsonl_series(rows, tag)] and series
  # The samples, as a wandb.Table of 3 rows (its file under files/media/table/) at each BLEU evaluation.
  assert [(s, h["validation/samples/nrows"]) for s, h in sorted(history.items())
          if "validation/samples/nrows" in h] == [(6, 3), (12, 3)]
  assert config["model.d_model"] == 32 and config["data.dataset"] == "number_words"
  assert (workdir.wandb / "run_id").read_text() in str(glob.glob(str(workdir.wandb / "offline-run-*")))


def test_profile_traces_exactly_the_chosen_steps_of_the_train_step(run):
  _, workdir, _, _ = run
  (path,) = glob.glob(str(workdir.profile / "plugins" / "profile" / "*" / "*.xplane.pb"))
  planes = jax.profiler.ProfileData.from_file(path).planes
  step_nums, modules = [], set()
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if event.name == "train" and "step_num" in stats:
          step_nums.append(int(stats["step_num"]))
        if "hlo_module" in stats:
          modules.add(stats["hlo_module"])
  assert step_nums == list(range(PROFILE[0], PROFILE[1] + 1))
  assert "jit_train_step" in modules  # the XLA ops of the trainer's compiled step, named by their module
  # The benchmark's reader reads the same trace: the step's ops (fusions, matmuls) by HLO instruction name.
  ops = {name for _, _, _, name in profile_bench.op_events(str(workdir.profile))}
  assert any(name.startswith(("fusion", "ynn_fusion", "dot")) for name in ops)


def test_a_tracker_that_cannot_start_is_one_line_and_nothing_is_written(tmp_path, monkeypatch):
  config = _config(tmp_path)
  config.trackers = ("tensorboard", "mlflow")
  with pytest.raises(ConfigError, match=r"^--config.trackers=\('tensorboard', 'mlflow'\): must be a tuple "
                     r"of distinct tracker names from \('tensorboard', 'wandb'\)"):
    ExperimentConfig.from_config_dict(config)
  with pytest.raises(trackers.TrackerError, match=r"unknown tracker 'mlflow'; one of 'tensorboard', 'wandb'"):
    trackers.check_trackers(config.trackers)  # the library's own check (a config that skipped validation)
  config.trackers = ("wandb",)
  real_find_spec = trackers.importlib.util.find_spec
  monkeypatch.setattr(trackers.importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
  with pytest.raises(ConfigError, match=r"the wandb package is not installed: pip install -e '.\[wandb\]'"):
    ExperimentConfig.from_config_dict(config)
  monkeypatch.undo()
  # A bad API key: wandb refuses it (locally, before any request); the trainer says so before writing.
  monkeypatch.setenv("WANDB_MODE", "online")
  monkeypatch.setenv("WANDB_API_KEY", "bad")
  pytest.importorskip("wandb").teardown()  # wandb keeps the settings of an earlier run of this process
  with pytest.raises(trackers.TrackerError, match=r"^--config.trackers includes 'wandb' but wandb.init failed: "
                     r"AuthenticationError: .*API key") as error:
    trainer.train_and_evaluate(ExperimentConfig.from_config_dict(config), str(tmp_path / "run"))
  assert "\n" not in str(error.value)
  assert not (tmp_path / "run").exists()


def test_the_train_program_refuses_an_unknown_tracker_in_one_line(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path / 'run'}",
                           "--config.trackers=('tensorboard', 'neptune')"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: --config.trackers=('tensorboard', 'neptune'): must be a tuple of distinct tracker names from "
      "('tensorboard', 'wandb'), e.g. \"('tensorboard', 'wandb')\"")
  assert not (tmp_path / "run").exists()


def test_tensorboard_events_are_written_without_importing_tensorflow(tmp_path):
  """The event file of a local workdir is written with TensorBoard's record writer and local file I/O: opening
  it once imported TensorFlow (`tf.io.gfile`), 5 s of every training run's start; TensorBoard reads it back."""
  code = ("import sys; from transformer_jax.run import trackers; from transformer_jax.workdir import Workdir\n"
          f"writer = trackers.MetricWriter.open({{'tensorboard': {{}}}}, Workdir({str(tmp_path / 'run')!r}))\n"
          "writer.start({'model': {'d_model': 32}}, ['validation/loss'])\n"
          "writer.write(3, {'train/loss': 2.5, 'validation/loss': 2.75})\n"
          "writer.write_samples(3, 'validation', [('five', 'fünf', 'fünf')])\n"
          "writer.close()\n"
          "print('tensorflow imported:', 'tensorflow' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1] == "tensorflow imported: False"
  events = event_accumulator.EventAccumulator(str(Workdir(tmp_path / "run").tensorboard),
                                              size_guidance={"tensors": 0})
  events.Reload()
  assert [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors("train/loss")] == [
      (3, 2.5)]
  assert "validation/samples" in events.Tags()["tensors"]
  assert events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)


class _RecordingTracker:
  """A tracker of the `Tracker` protocol that records its calls (what a new tracker implements)."""
  package = ""
  calls: list = []

  def __init__(self, workdir, options):
    self.calls.append(("init", dict(options)))

  def start(self, hparams, metric_tags):
    self.calls.append(("start", hparams["model.d_model"], tuple(metric_tags)))

  def write(self, step, scalars):
    self.calls.append(("write", step, dict(scalars)))

  def write_samples(self, step, tag, rows):
    self.calls.append(("samples", step, tag, list(rows)))

  def close(self):
    self.calls.append(("close",))


def test_a_new_tracker_is_a_class_in_the_registry_with_its_config_section_as_options(tmp_path, monkeypatch):
  """The writer names no tracker: a class of the protocol registered in `TRACKERS` receives the config section
  of its name and every call, beside metrics.jsonl; the trainer names no tracker either."""
  monkeypatch.setitem(trackers.TRACKERS, "recording", _RecordingTracker)
  monkeypatch.setattr(_RecordingTracker, "calls", [])
  (tmp_path / "run").mkdir()  # the trainer creates the workdir before `start`
  writer = trackers.MetricWriter.open({"recording": {"project": "p"}}, Workdir(str(tmp_path / "run")))
  writer.start({"model": {"d_model": 32}}, ["validation/bleu"])
  writer.write(3, {"train/loss": 2.5})
  writer.write_samples(3, "validation", [("five", "fünf", "fünf")])
  writer.close()
  assert _RecordingTracker.calls == [("init", {"project": "p"}), ("start", 32, ("validation/bleu",)),
                                     ("write", 3, {"train/loss": 2.5}),
                                     ("samples", 3, "validation/samples", [("five", "fünf", "fünf")]), ("close",)]
  assert [json.loads(line)["train/loss"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [2.5]
  trainer_source = open(trainer.__file__).read()
  assert not re.search(r"wandb|tensorboard|TensorBoard", trainer_source)
  config = ExperimentConfig().replace(trackers=("tensorboard", "wandb"))
  assert config.tracker_options() == {"tensorboard": {}, "wandb": {"project": "transformer_jax", "entity": "",
                                                                   "name": ""}}
