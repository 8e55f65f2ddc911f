"""The run directory of one experiment, in one place: its layout, atomic JSON writes and config comparison.

    <workdir>/
      config.json             the resolved experiment config (written by process 0 before training starts)
      train_budget.json       the run length a time budget set (`budget.py`), when one was given
      checkpoints/<step>/     orbax checkpoints (`transformer_jax.run.checkpoint`)
      vocab/spm.model         the SentencePiece vocabulary (unless `data.vocab_path` names another), and
      vocab/spm.normalization.json  the text normalisation it was trained with (`data.tokenizer.stamp_path`);
      vocab/source.spm, target.spm, vocab.json  instead, for an imported Marian model (`data.tokenizer` "marian")
      data/<split>.ids/       the training split's token ids, sharded ArrayRecord files (`data.id_shards`)
      tfds/                   tfds-prepared datasets (unless `data.tfds_data_dir` names another; TFRecord on gs://)
      metrics.jsonl           one JSON object per logged step: {"step", "time", "train/loss", ...}
      tensorboard/            TensorBoard event files: the same scalars, the config as HParams, sample translations
      wandb/                  the Weights & Biases run (`config.trackers` with "wandb"): run_id, offline-run-*/
      profile/plugins/profile/<time>/<host>.xplane.pb  the `jax.profiler` trace of `config.profile_steps`
                              (`tensorboard --logdir=<workdir>` shows it in the profile plugin)
      early_stopping.json     the early-stopping metric's value at every evaluation (`config.early_stopping`)
      averaged/<step>/        averaged checkpoint (`experiments.average_checkpoints`)
      eval/<source>.hyp, .json  hypotheses and scores of `experiments.evaluate` (`eval_prefix`)
      eval/tune_decoding.json every row of `experiments.tune_decoding`
      final_eval.json         the test-split report of `experiments.train`
      train.lock              while a training run owns the workdir: its pid and host (`owner_lock`)
      wall_clock_start.json   when `experiments.multi30k` first started in this workdir (its wall time counts from it)
      results.json            the Multi30k recipe's report (`experiments.multi30k`: scores, minutes, steps/s, host)
      <split>.hyp             that recipe's hypotheses of the test split (test2016.hyp), one line per sentence

A workdir written by an importer (`experiments.import_marian`) has the same layout: `config.json` names the
model and its tokenizer, `data.dataset` is `IMPORTED_DATASET` (no training data yet) and checkpoint 0 holds
the imported parameters; `experiments.train` fine-tunes it from there (`imported_workdir.config_for_workdir`).

Every path goes through `etils.epath`, the path type orbax and tfds use, so a `gs://bucket/run` workdir works
as a local one: epath hands `gs://` to TensorFlow's GCS filesystem (`tf.io.gfile`), orbax's arrays go through
tensorstore's `gcs` driver. Tested against a local GCS API server (`tests/test_gcs.py`). `is_local` tells the
two kinds apart where a library opens local files only (ArrayRecord, zip writing, SentencePiece's trainer);
`absolute` is epath's `absolute()` without its bug on `gs://` URIs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import uuid
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

import numpy as np
from etils import epath

from transformer_jax.config import RUNTIME_FIELDS, ModelConfig

PathLike = str | os.PathLike

# `data.dataset` of a workdir that holds an imported model no training run has used yet (its config.json and
# the config item of its checkpoint say so): a fine-tune may choose any dataset and starts a fresh optimizer.
IMPORTED_DATASET = "marian_import"

# Keys of a run's saved config that must match to reuse its workdir (`Workdir.check_compatible`), the one home of
# that rule. The data keys fix the vocabulary: a workdir is reused (`trainer`, checked before the datasets are
# built), and a checkpoint is translated with another workdir's tokenizer (`trained.check_checkpoint_vocabulary`),
# only where they match; a config saved before `data.tokenizer` existed used SentencePiece (`DATA_DEFAULTS`).
# The model keys are checked once the vocabulary fixes the model's size.
DATA_KEYS = ("data.vocab_size", "data.dataset", "data.tokenizer", "data.lowercase")
DATA_DEFAULTS = {"data": {"tokenizer": "sentencepiece", "lowercase": False}}
MODEL_KEYS = ("model",)
# In a workdir holding an imported model no run has trained yet (`imported_workdir`), the first fine-tune may
# choose its dataset and the model's run-time fields (`config.RUNTIME_FIELDS`, e.g. dropout); these must match.
IMPORTED_DATA_KEYS = ("data.vocab_size", "data.tokenizer")
IMPORTED_MODEL_KEYS = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                            if f.name not in RUNTIME_FIELDS)

TRAIN_LOCK = "train.lock"  # the training owner's lock file (`owner_lock`), also an object name on gs://


@dataclasses.dataclass(frozen=True)
class Workdir:
  """The paths of one run directory (nothing is created until something is written)."""

  root: epath.Path

  def __init__(self, root: PathLike):
    object.__setattr__(self, "root", epath.Path(root))

  @property
  def config_json(self) -> epath.Path:
    return self.root / "config.json"

  def write_config(self, config: Mapping[str, Any]) -> None:
    """Writes `config.json` (a mapping of sections, its values through `to_jsonable`), atomically."""
    write_json_atomically(self.config_json, config)

  @property
  def train_budget_json(self) -> epath.Path:
    return self.root / "train_budget.json"

  def read_train_budget(self) -> dict | None:
    """The saved time-budget decision (`train_budget.json`: the fields of `budget.BudgetDecision`, tuples
    as lists), or None when there is none."""
    return read_json(self.train_budget_json)

  def write_train_budget(self, decision: Any) -> None:
    """Saves a time-budget decision (a `BudgetDecision` or a mapping of its fields) as `train_budget.json`,
    atomically (written by process 0 only: the budget's decisions agree across hosts)."""
    write_json_atomically(self.train_budget_json, decision)

  @property
  def checkpoints(self) -> epath.Path:
    return self.root / "checkpoints"

  @property
  def vocab_dir(self) -> epath.Path:
    return self.root / "vocab"

  @property
  def vocab(self) -> epath.Path:
    return self.vocab_dir / "spm.model"

  def token_ids(self, split: str) -> epath.Path:
    """`data/<split>.ids/`, the id shards (`data.id_shards`; characters other than letters, digits, `.` and `-`
    become `_`)."""
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in split)
    return self.root / "data" / f"{safe}.ids"

  @property
  def tfds(self) -> epath.Path:
    return self.root / "tfds"

  @property
  def metrics_jsonl(self) -> epath.Path:
    return self.root / "metrics.jsonl"

  @property
  def tensorboard(self) -> epath.Path:
    return self.root / "tensorboard"

  @property
  def wandb(self) -> epath.Path:
    return self.root / "wandb"

  @property
  def profile(self) -> epath.Path:
    return self.root / "profile"

  @property
  def early_stopping_json(self) -> epath.Path:
    return self.root / "early_stopping.json"

  @property
  def averaged(self) -> epath.Path:
    return self.root / "averaged"

  @property
  def eval(self) -> epath.Path:
    return self.root / "eval"

  def eval_prefix(self, source: PathLike) -> epath.Path:
    """`eval/<file name of source>`: `experiments.evaluate` writes `<prefix>.hyp` and `<prefix>.json` there."""
    return self.eval / epath.Path(source).name

  @property
  def tune_decoding_json(self) -> epath.Path:
    return self.eval / "tune_decoding.json"

  @property
  def final_eval_json(self) -> epath.Path:
    return self.root / "final_eval.json"

  @property
  def train_lock(self) -> epath.Path:
    return self.root / TRAIN_LOCK

  @property
  def wall_clock_start_json(self) -> epath.Path:
    return self.root / "wall_clock_start.json"

  @property
  def results_json(self) -> epath.Path:
    return self.root / "results.json"

  def hypotheses(self, split: str) -> epath.Path:
    """`<split>.hyp`: the Multi30k recipe's hypotheses of a test split, one line per sentence."""
    return self.root / f"{split}.hyp"

  def create(self) -> None:
    """Makes the run directory (and its parents).

    Raises FileNotFoundError naming the bucket when the root is in a Cloud Storage bucket that does not exist
    (or cannot be read): TensorFlow's `makedirs` would otherwise walk up to the missing bucket without end.
    """
    if not is_local(self.root):
      scheme, rest = os.fspath(self.root).split("://", 1)
      bucket = epath.Path(f"{scheme}://{rest.split('/')[0]}")
      if not bucket.exists():
        raise FileNotFoundError(f"{bucket} does not exist or cannot be read (workdir {self.root}): create the "
                                f"bucket first, e.g. gcloud storage buckets create {bucket}")
    self.root.mkdir(parents=True, exist_ok=True)

  def read_config(self) -> dict | None:
    """The saved `config.json`, or None when this is not (yet) a run directory.

    Raises ValueError (one line naming the file) for a `config.json` that is not JSON or not a run's (no
    "model" section: e.g. a CTranslate2 or Hugging Face model directory given as a workdir).
    """
    try:
      saved = read_json(self.config_json)
    except (ValueError, UnicodeDecodeError) as error:
      raise ValueError(f"{self.config_json} is not valid JSON ({error}): is {self.root} a transformer_jax "
                       "workdir?") from None
    if saved is not None and not (isinstance(saved, dict) and isinstance(saved.get("model"), dict)):
      raise ValueError(f"{self.config_json} is not a transformer_jax run's config (no 'model' section): "
                       f"{self.root} looks like another kind of directory (a CTranslate2 or Hugging Face model?), "
                       "not a --workdir")
    return saved

  def require_config(self) -> dict:
    """The saved `config.json`; FileNotFoundError naming the path when the workdir holds no run."""
    config = self.read_config()
    if config is None:
      raise FileNotFoundError(f"{self.config_json} not found: is {self.root} the --workdir of a training run?")
    return config

  def check_compatible(self, requested: Mapping, keys: Sequence[str], defaults: Mapping | None = None) -> None:
    """Refuses (ValueError, naming each differing key) a config that differs from the saved one under `keys`.

    `defaults` fill the keys a saved config predates (a run saved before a model option existed ran with
    that option's default), so adding an option does not lock old workdirs out.
    """
    saved = self.read_config()
    if saved is None:
      return
    diffs = config_diff(_fill(saved, to_jsonable(defaults or {})), requested, keys=keys)
    if diffs:
      raise ValueError(f"{self.root} holds a run with an incompatible config ({'; '.join(diffs)}); use another "
                       "--workdir or the saved values")


def _fill(saved: Mapping, defaults: Mapping) -> dict:
  """`saved` with the keys it lacks taken from `defaults`, recursively."""
  filled = dict(saved)
  for key, value in defaults.items():
    if key not in filled:
      filled[key] = value
    elif isinstance(value, Mapping) and isinstance(filled[key], Mapping):
      filled[key] = _fill(filled[key], value)
  return filled


def read_json(path: PathLike) -> Any:
  """The JSON value in `path`, or None when the file does not exist."""
  path = epath.Path(path)
  if not path.exists():
    return None
  return json.loads(path.read_text(encoding="utf-8"))


def is_local(path: PathLike) -> bool:
  """True for a path of the local filesystem, False for a URI such as `gs://bucket/run`."""
  return "://" not in os.fspath(path)


def absolute(path: PathLike) -> epath.Path:
  """`path` made absolute against the current directory when local; a `gs://` URI as it is (epath's own
  `absolute()` would prefix it with the current directory)."""
  path = epath.Path(path)
  return path.absolute() if is_local(path) else path


@contextlib.contextmanager
def open_atomically(path: PathLike) -> Iterator[BinaryIO]:
  """A binary file to stream into `path`: written to a temporary file (one per writer, `<name>.<uuid>.tmp`) and
  renamed over `path` when the block ends without an error (else removed), so readers never see half a file. On
  Cloud Storage, where a rename is a copy, each object still appears whole or not at all."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f"{path.name}.{uuid.uuid4().hex}.tmp"
  try:
    with tmp.open("wb") as out:
      yield out
    tmp.replace(path)
  finally:
    if tmp.exists():
      tmp.unlink()


def write_bytes_atomically(path: PathLike, data: bytes) -> None:
  """Writes `data` to `path` through `open_atomically`: readers never see half a file."""
  with open_atomically(path) as out:
    out.write(data)


def write_json_atomically(path: PathLike, value: Any) -> None:
  """Writes `value` as indented JSON through a temporary file and a rename: readers never see half a file."""
  write_bytes_atomically(path, json.dumps(to_jsonable(value), indent=2, sort_keys=True).encode("utf-8"))


def to_jsonable(value: Any) -> Any:
  """A JSON-serialisable deep copy: dataclasses/mappings -> dicts, tuples -> lists, numpy/jax scalars -> Python.

  The copy also decouples saved JSON from the caller's objects, which matters for asynchronous checkpoint
  saves (their JSON items are written in a background thread after `save` returns).
  """
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
  if hasattr(value, "to_dict") and callable(value.to_dict):  # ml_collections.ConfigDict
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(k): to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_jsonable(v) for v in value]
  if isinstance(value, (str, bool, int, float)) or value is None:
    return value
  if isinstance(value, np.dtype):
    return str(value)
  if hasattr(value, "__array__"):  # numpy / jax arrays and scalars
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()
  return str(value)  # e.g. jnp dtypes, enums, paths


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    flat = {}
    for key, value in tree.items():
      flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    if not tree and prefix:
      flat[prefix] = {}
    return flat
  return {prefix: tree}


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, bool) or isinstance(b, bool):  # True == 1 in Python; not for a config.
    return type(a) is type(b) and a == b
  return a == b


def _format(value: Any) -> str:
  return "<missing>" if value is _MISSING else repr(value)


def config_diff(saved: Mapping, requested: Mapping, keys: Sequence[str] | None = ("model",)) -> list[str]:
  """Differences between two config dicts, as `"model.d_model: saved 128, requested 256"` lines.

  Only entries at or under the dotted prefixes in `keys` are compared (None: everything). Both sides go
  through `to_jsonable` first, so tuples equal lists and dataclasses (e.g. `ModelConfig`) equal their dicts.
  An empty list means compatible.
  """
  flat_saved = _flatten(to_jsonable(saved))
  flat_requested = _flatten(to_jsonable(requested))

  def selected(name: str) -> bool:
    return keys is None or any(name == k or name.startswith(k + ".") for k in keys)

  messages = []
  for name in sorted(set(flat_saved) | set(flat_requested)):
    if not selected(name):
      continue
    a = flat_saved.get(name, _MISSING)
    b = flat_requested.get(name, _MISSING)
    if a is _MISSING or b is _MISSING or not _same(a, b):
      messages.append(f"{name}: saved {_format(a)}, requested {_format(b)}")
  return messages
