"""Where a training run's numbers go: the trackers `config.trackers` lists, and `metrics.jsonl` always.

    writer = trackers.MetricWriter.open(config.tracker_options(), workdir, enabled=is_chief)  # wandb starts here
    writer.start(resolved_config, metric_tags)           # TensorBoard, metrics.jsonl; the config as hyperparameters
    writer.write(step, {"train/loss": 2.1, ...})         # scalars, to every tracker
    writer.write_samples(step, "validation", [(source, reference, hypothesis), ...])
    writer.close()                                       # the final validation metrics close the HParams session

A tracker is any class with the `Tracker` protocol's four methods and a constructor `(workdir, options)`, where
`options` is the config section named after it (`config.wandb` for "wandb"; {} where the config has none:
`ExperimentConfig.tracker_options`),
registered by name in `TRACKERS`. The constructor does what can be refused (a missing package, `wandb.init`)
and writes nothing else; `start` opens its files. Adding one: a class here, its name in `TRACKERS`, its package
in a pyproject extra, and (if it takes options) a section of its name in `ExperimentConfig`.

Trackers (`TRACKERS`), beside `metrics.jsonl` (`JsonlTracker`, always on: one JSON object per write):
  tensorboard  event files in `<workdir>/tensorboard/`, TensorBoard's record format written by its own
               `RecordWriter` (`tensorboard.summary.writer.record_writer`, the record framing
               `EventFileWriter` uses, without its TensorFlow file I/O): scalars (the `scalars` plugin), the resolved
               config as hyperparameters of the HParams plugin (`summary_v2.hparams_pb`, one value per
               flattened config key; its metrics are the run's `<eval split>/<metric>` scalars, so the HParams
               tab shows each run's last validation values), and sample translations as a text summary
               (`text` plugin: a markdown table source | reference | hypothesis).
  wandb        a Weights & Biases run (`pip install -e '.[wandb]'`) in `<workdir>/wandb/`, resumed by the id
               saved there: the same scalars (`run.log`), the config (`run.config`), the samples (a
               `wandb.Table`). `WANDB_MODE=offline` keeps everything on disk (`wandb sync` uploads it later).

No TensorFlow at import: the event file is opened through `etils.epath`, which does local file I/O itself
(TensorBoard's `EventFileWriter` goes through `tf.io.gfile`); a `gs://` workdir still goes through TensorFlow's
GCS file system (epath's backend for URIs when TensorFlow is installed). wandb is imported only when listed.
Start-up costs: docs/performance.md.

A tracker that cannot start (unknown name, package not installed or failing to import, `wandb.init` refused:
a bad API key, an unknown entity) raises `TrackerError` (one line) before the trainer writes anything of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import time
import uuid
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.scalar import metadata as scalars_metadata
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer import record_writer
from tensorboard.util import tensor_util

from transformer_jax.workdir import Workdir, is_local, to_jsonable

class TrackerError(ValueError):
  """A tracker that cannot start; the message is one line naming the tracker and what to do."""


class Tracker(Protocol):
  """Where a run's scalars, hyperparameters and sample translations go (process 0 only)."""

  def start(self, hparams: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    """Opens what the tracker writes; records the flattened resolved config (`flatten_hparams`) with the
    `<split>/<metric>` tags that judge the run."""

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    """Scalars of `step`, named `train/loss`, `validation/bleu`, ..."""

  def write_samples(self, step: int, tag: str, rows: Sequence[tuple[str, str, str]]) -> None:
    """Sample translations (source, reference, hypothesis) of `step` under `tag` (`<split>/samples`)."""

  def close(self) -> None:
    """Flushes and closes."""


def import_package(name: str, package: str):
  """The tracker `name`'s optional `package`, imported; TrackerError (one line) when it is not installed or its
  import fails (a broken install: e.g. wandb against another protobuf, wandb issue 11548)."""
  if importlib.util.find_spec(package) is None:
    raise TrackerError(f"--config.trackers includes {name!r} but the {package} package is not installed: "
                       f"pip install -e '.[{name}]'")
  try:
    return importlib.import_module(package)
  except Exception as error:  # pylint: disable=broad-except (whatever a broken install raises)
    message = " ".join(str(error).split())[:300]
    raise TrackerError(f"--config.trackers includes {name!r} but importing the {package} package failed "
                       f"({type(error).__name__}: {message}): repair or reinstall it, or drop {name!r}") from None


def flatten_hparams(config: Mapping, prefix: str = "") -> dict[str, bool | int | float | str]:
  """`{"model.d_model": 512, "data.eval_splits": "['validation']", ...}`: every leaf of a (resolved) config
  as an HParams value (bool, number or string; lists and None as their JSON text)."""
  flat = {}
  for key, value in to_jsonable(config).items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(flatten_hparams(value, name + "."))
    elif isinstance(value, (bool, int, float, str)):
      flat[name] = value
    else:
      flat[name] = json.dumps(value)
  return flat


def samples_markdown(rows: Iterable[tuple[str, str, str]]) -> str:
  """A markdown table `| source | reference | hypothesis |` (the text plugin renders markdown)."""
  def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
  lines = ["| source | reference | hypothesis |", "|---|---|---|"]
  lines += [f"| {cell(s)} | {cell(r)} | {cell(h)} |" for s, r, h in rows]
  return "\n".join(lines)


def event_file_name() -> str:
  """A new event file's name, as TensorBoard's writers name theirs (`events.out.tfevents.<seconds>.<host>.<pid>.
  <uid>`); TensorBoard reads a directory's files in name order."""
  return f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


class TensorBoardTracker:
  """Scalars, hyperparameters and text summaries as TensorBoard event files in `directory` (a new file per
  process that opens it, as `tensorboard.summary.writer.event_file_writer.EventFileWriter` writes them; every
  event is flushed when written)."""

  package = ""  # the core dependencies have it

  def __init__(self, workdir: Workdir, options: Mapping[str, Any]):
    del options  # none
    self._directory = workdir.tensorboard
    self._closing = contextlib.ExitStack()  # epath opens a gs:// file as a context manager

  def _open(self) -> None:
    self._directory.mkdir(parents=True, exist_ok=True)
    self._file = self._closing.enter_context((self._directory / event_file_name()).open("wb"))
    self._records = record_writer.RecordWriter(self._file)
    self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _add(self, event: event_pb2.Event) -> None:
    self._records.write(event.SerializeToString())
    self._file.flush()

  def _emit(self, summary: summary_pb2.Summary, step: int) -> None:
    self._add(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def start(self, hparams: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    self._open()
    config_pb = hparams_summary.hparams_config_pb(
        hparams=[hparams_summary.HParam(name) for name in sorted(hparams)],
        metrics=[hparams_summary.Metric(tag, display_name=tag) for tag in metric_tags])
    self._emit(config_pb, 0)
    self._emit(hparams_summary.hparams_pb(dict(hparams)), 0)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    summary = summary_pb2.Summary()
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=scalars_metadata.PLUGIN_NAME),
        data_class=summary_pb2.DataClass.DATA_CLASS_SCALAR)
    for tag, value in scalars.items():
      summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value)), metadata=metadata)
    self._emit(summary, step)

  def write_samples(self, step: int, tag: str, rows: Sequence[tuple[str, str, str]]) -> None:
    self._emit(text_summary.text_pb(tag, samples_markdown(rows)), step)

  def close(self) -> None:
    self._closing.close()


class WandbTracker:
  """A Weights & Biases run in `<workdir>/wandb/`, resumed across restarts by the run id saved there."""

  package = "wandb"  # the `wandb` extra

  def __init__(self, workdir: Workdir, options: Mapping[str, Any]):
    if not is_local(workdir.root):  # wandb writes its run files with local file I/O
      raise TrackerError(f"--config.trackers includes 'wandb', which keeps its run in a local directory, but the "
                         f"workdir {workdir.root} is not local: drop 'wandb' or use a local --workdir")
    wandb = import_package("wandb", self.package)  # an optional extra, imported only when listed
    self._wandb = wandb
    directory = workdir.wandb
    created = [p for p in (workdir.root, directory) if not p.exists()]
    id_file = directory / "run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    try:
      directory.mkdir(parents=True, exist_ok=True)
      self.run = wandb.init(project=options.get("project") or None, entity=options.get("entity") or None,
                            name=options.get("name") or None, dir=str(workdir.root), id=run_id, resume="allow",
                            settings=wandb.Settings(console="off", quiet=True))
    except Exception as error:  # wandb raises its own errors (UsageError, AuthenticationError, CommError, ...)
      for path in reversed(created):  # leave the workdir as it was
        shutil.rmtree(path, ignore_errors=True)
      raise TrackerError(f"--config.trackers includes 'wandb' but wandb.init failed: "
                         f"{type(error).__name__}: {error}") from None
    id_file.write_text(run_id)

  def start(self, hparams: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    del metric_tags  # W&B keeps the last value of every logged key in the run's summary
    self.run.config.update(dict(hparams), allow_val_change=True)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def write_samples(self, step: int, tag: str, rows: Sequence[tuple[str, str, str]]) -> None:
    table = self._wandb.Table(columns=["source", "reference", "hypothesis"], data=[list(r) for r in rows])
    self.run.log({tag: table}, step=int(step))

  def close(self) -> None:
    self.run.finish()


class JsonlTracker:
  """`metrics.jsonl` in the workdir: one JSON object `{"step", "time", **scalars}` per write, appended (a resumed
  run continues the file). Hyperparameters and samples are in `config.json` and the other trackers."""

  def __init__(self, workdir: Workdir, options: Mapping[str, Any]):
    del options  # none
    self._path, self._files, self._file = workdir.metrics_jsonl, contextlib.ExitStack(), None

  def start(self, hparams: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    del hparams, metric_tags
    # A context manager, not a file, for a gs:// path (epath's TensorFlow backend): entered, closed with the stack.
    self._file = self._files.enter_context(self._path.open("a", encoding="utf-8"))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self._file.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
    self._file.flush()

  def write_samples(self, step: int, tag: str, rows: Sequence[tuple[str, str, str]]) -> None:
    del step, tag, rows

  def close(self) -> None:
    self._files.close()


# The trackers `config.trackers` may list, by name; `metrics.jsonl` is always written besides them.
TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def check_trackers(names: Sequence[str]) -> None:
  """Raises TrackerError (one line) for an unknown tracker name or one whose package is not installed or does
  not import."""
  for name in names:
    if name not in TRACKERS:
      raise TrackerError(f"--config.trackers: unknown tracker {name!r}; one of {', '.join(map(repr, TRACKERS))}")
    if TRACKERS[name].package:
      import_package(name, TRACKERS[name].package)


class MetricWriter:
  """Fans scalars, hyperparameters and sample translations out to the run's trackers (`Tracker`): those
  `config.trackers` names, then `metrics.jsonl`. Process 0 only: `enabled=False` on the other hosts makes
  every method a no-op.

  `open` constructs the trackers (what can be refused, wandb's start, happens there) before the trainer writes
  anything; `start`, once the run's config is written, opens their files and records the config.
  """

  def __init__(self, trackers: Sequence[Tracker], enabled: bool = True):
    self.trackers, self.enabled = list(trackers), enabled

  @classmethod
  def open(cls, options: Mapping[str, Mapping[str, Any]], workdir: Workdir, enabled: bool = True) -> "MetricWriter":
    """The trackers named by `options`' keys, each constructed with its options (`config.tracker_options()`:
    the config section of its name), then `JsonlTracker`.

    Raises TrackerError (one line) when one cannot start; nothing of the trainer's is written then.
    """
    check_trackers(list(options))
    if not enabled:
      return cls([], enabled=False)
    trackers = [TRACKERS[name](workdir, tracker_options) for name, tracker_options in options.items()]
    return cls([*trackers, JsonlTracker(workdir, {})])

  def start(self, resolved_config: Mapping, metric_tags: Sequence[str]) -> None:
    """Opens each tracker's files and records the run's hyperparameters (the flattened resolved config) with
    the metrics that judge it."""
    hparams = flatten_hparams(resolved_config)
    for tracker in self.trackers:
      tracker.start(hparams, metric_tags)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    for tracker in self.trackers:
      tracker.write(step, scalars)

  def write_samples(self, step: int, split: str, rows: Sequence[tuple[str, str, str]]) -> None:
    """`rows` of (source, reference, hypothesis) as `<split>/samples`."""
    for tracker in self.trackers:
      tracker.write_samples(step, f"{split}/samples", rows)

  def close(self) -> None:
    for tracker in self.trackers:
      tracker.close()
    self.trackers = []
