"""The experiment schema: every key of a training run, once, with its default and a one-line meaning; its rules.

    config = ExperimentConfig.from_config_dict(config_dict)   # at a program's boundary: validated, typed
    config.data.max_len, config.evals.bleu.every_steps        # what the library reads (attributes, no defaults)
    default_config_dict = ExperimentConfig().to_config_dict()  # `experiments/configs/default.py`; recipes are deltas

Frozen dataclasses (as `ModelConfig`): `ExperimentConfig` holds the run's scalars and one section per group,
`model` (`config.ModelConfig`), `data` (`DataConfig`), `mesh` (`sharding.MeshConfig`), `wandb`, `evals`,
`decode`, `final_eval`. The programs keep ml_collections' `ConfigDict` on the command line (a locked config,
`--config.a.b=value` overrides: big_vision's configs) and convert it once; `to_config_dict` gives the
`ConfigDict` the config files start from, so each default lives here only (MaxText's `base.yml`, big_vision's
`configs/`). `RULES` says what every key allows, `validate` checks a whole config, `check_value` one program
flag against the key it stands for; each refusal is a `ConfigError` of one line naming the key.
Defaults are the paper's (Vaswani et al., 2017, sections 5-6) where the paper has a value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import ml_collections

from transformer_jax.config import INT32_MAX, ModelConfig, is_float32, is_int32
from transformer_jax.data.config import DataConfig
from transformer_jax.decoding import generate
from transformer_jax.evaluation import metrics as metrics_lib
from transformer_jax.run import trackers
from transformer_jax.sharding import MeshConfig
from transformer_jax.training.schedule import COOLDOWN_SHAPES, check_cooldown, check_dropout_schedule


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """The Weights & Biases run (`config.trackers` with "wandb")."""

  project: str = "transformer_jax"     # W&B project (WANDB_MODE=offline keeps the run on disk)
  entity: str = ""                     # W&B entity (team or user); "" = the logged-in user's default
  name: str = ""                       # W&B run name; "" = W&B's generated one


@dataclasses.dataclass(frozen=True)
class LossEvalConfig:
  every_steps: int = 5000              # token-weighted loss, NLL, perplexity and accuracy
  tokens_per_batch: int = 16_384       # eval batch size (padded tokens)


@dataclasses.dataclass(frozen=True)
class AttentionEvalConfig:
  every_steps: int = 5000              # attention entropy per layer/head, near-uniform heads (diagnostics)
  rows: int = 16                       # on this many pairs of each split


@dataclasses.dataclass(frozen=True)
class BleuEvalConfig:
  every_steps: int = 0                 # sacreBLEU/chrF of translations (a progress signal; alpha: decode.alpha)
  max_examples: int = 1000             # the first examples of each split; 0 = all
  beam_size: int = 1                   # 1 = greedy
  samples: int = 5                     # translations (source, reference, hypothesis) sent to the trackers


@dataclasses.dataclass(frozen=True)
class EvalsConfig:
  """Evaluators run on every `data.eval_splits` split; every_steps = 0 turns one off (`evaluators.py`)."""

  loss: LossEvalConfig = dataclasses.field(default_factory=LossEvalConfig)
  attention: AttentionEvalConfig = dataclasses.field(default_factory=AttentionEvalConfig)
  bleu: BleuEvalConfig = dataclasses.field(default_factory=BleuEvalConfig)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Decoding for reported scores (section 6.1): beam 4, length penalty alpha 0.6, outputs up to input + 50."""

  beam_size: int = 4                   # 1 = greedy
  alpha: float = 0.6                   # GNMT length penalty exponent
  extra_len: int = 50                  # output length limit: source length + extra_len
  average_last: int = 5                # checkpoints averaged for the reported model (base 5, big 20)
  mbr_utility: str = ""                # "" = beam search's best; "chrf"/"bleu" = MBR over its n-best


@dataclasses.dataclass(frozen=True)
class FinalEvalConfig:
  """After `experiments.train`: translate a test split with `decode`, print exact match and BLEU."""

  split: str = "test"                  # "" = skip
  max_examples: int = 0                # 0 = the whole split


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Every key of a training run (`python -m experiments.train`), in the order default.py listed them."""

  seed: int = 0                        # parameter init, dropout and batch order
  # Model: every ModelConfig field (Transformer base, Table 3); vocab_size is set from the trained vocabulary.
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)

  # Optimisation (sections 5.3-5.4): Adam(0.9, 0.98, 1e-9), lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
  num_train_steps: int = 100_000       # optimizer updates
  warmup_steps: int = 4000             # linear warm-up steps of the rsqrt schedule
  learning_rate: float = 1.0           # multiplies the schedule
  cooldown_steps: int = 0              # decay to 0 over the last N steps (not in the paper; 0 = off)
  cooldown_shape: str = "linear"       # how the cool-down's factor falls: linear | 1-sqrt (Hägele et al., 2024)
  cooldown_knots: tuple = ()           # ((step, progress), ...): where a time budget moved the end of a
                                       # cool-down under way (schedule.cooldown); set by the budget, given
                                       # only to re-run a budgeted run at its fixed length
  dropout_schedule: tuple = ()         # ((step, rate), ...): model.dropout_rate from that update on, in
                                       # absolute steps (schedule.dropout_rate; () = model.dropout_rate)
  train_budget_minutes: float = 0.0    # > 0: fit num_train_steps (then a cap) to this much training time,
                                       # at the measured rate (budget.py; 0 = off)
  adam_b1: float = 0.9                 # Adam beta1
  adam_b2: float = 0.98                # Adam beta2
  adam_eps: float = 1e-9               # Adam epsilon
  weight_decay: float = 0.0            # decoupled weight decay of the matrices, times the rate (AdamW,
                                       # optimizer.adam; not in the paper; 0 = off)
  ema_decay: float = 0.0               # > 0: keep an exponential moving average of the parameters; the
                                       # final evaluation and translation use it, periodic validation the
                                       # trained parameters (optimizer.param_ema; not in the paper; 0 = off)
  label_smoothing: float = 0.1         # epsilon_ls (section 5.4)
  grad_accum_steps: int = 1            # micro-batches per optimizer update

  # Devices: a ('data', 'fsdp', 'tensor') mesh, -1 = the remaining devices.
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  num_cpu_devices: int = 0             # host CPU devices the programs create (jax_num_cpu_devices); 0 = JAX's
                                       # default (one, or XLA_FLAGS' count). The mesh's data axis spans them.
  distributed: bool = False            # initialise jax.distributed (multi-host: TPU pods, SLURM)

  log_every_steps: int = 100           # training metrics to the log, metrics.jsonl and the trackers
  trackers: tuple[str, ...] = ("tensorboard",)  # where scalars, the config (HParams) and sample translations go,
                                       # besides metrics.jsonl: tensorboard | wandb (transformer_jax.run.trackers)
  wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
  profile_steps: tuple = ()            # (start, stop): a jax.profiler trace of these steps (both included)
                                       # in <workdir>/profile (transformer_jax.run.profiling; () = off)
  early_stopping: tuple = ()           # (metric, patience, min_delta), e.g. ("validation/loss", 3, 0.0):
                                       # stop after `patience` evaluations of the metric without an
                                       # improvement > min_delta (transformer_jax.run.early_stopping; () = off)
  evals: EvalsConfig = dataclasses.field(default_factory=EvalsConfig)

  checkpoint_every_steps: int = 0      # save every N steps (0 = off)
  checkpoint_every_minutes: float = 10.0  # save every N minutes of wall time (section 6.1; 0 = off)
  checkpoint_keep: int = 5             # newest checkpoints kept (enough to average decode.average_last)
  checkpoint_best_metric: str = ""     # also keep the best step by this eval metric, e.g. "validation/bleu"
  async_checkpointing: bool = True     # write checkpoints in a background thread

  decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
  final_eval: FinalEvalConfig = dataclasses.field(default_factory=FinalEvalConfig)

  @classmethod
  def from_config_dict(cls, values: ml_collections.ConfigDict | Mapping[str, Any]) -> ExperimentConfig:
    """The typed, validated config of a program's `ConfigDict` (or a nested mapping of the same keys): the
    one conversion at a program's boundary. Keys it lacks keep their defaults; lists become tuples.

    Raises ConfigError (one line naming the key): a key the schema does not have, a value its rule refuses
    (`RULES`, `validate`), a `model` section `ModelConfig` refuses.
    """
    config = _build(cls, _plain(values), "", strict=True)
    validate(config)
    return config

  @classmethod
  def from_saved(cls, saved: Mapping[str, Any]) -> ExperimentConfig:
    """The config a run saved (its `config.json`): keys it predates at their defaults, keys the schema no
    longer has (and `imported_from`, the provenance `imported_workdir` adds) left out; not re-validated.
    Raises ValueError for a `model` section `ModelConfig` refuses."""
    return _build(cls, _plain(saved), "", strict=False)

  def to_config_dict(self) -> ml_collections.ConfigDict:
    """This config as the `ConfigDict` the programs' config files start from (nested sections, same values)."""
    return ml_collections.ConfigDict(dataclasses.asdict(self))

  def replace(self, **changes) -> ExperimentConfig:
    return dataclasses.replace(self, **changes)

  def tracker_options(self) -> dict[str, dict[str, Any]]:
    """`{tracker: options}` for each of `trackers`: the section of the tracker's name (`wandb`) as a dict, {} for
    a tracker without one (`trackers.Tracker`)."""
    sections = {field.name for field in dataclasses.fields(self)}
    return {name: dataclasses.asdict(getattr(self, name)) if name in sections else {} for name in self.trackers}


def _plain(values: Any) -> dict:
  return values.to_dict() if hasattr(values, "to_dict") else dict(values)


def _tuples(value: Any) -> Any:
  """Lists (JSON's and some recipes' sequences) as tuples, nested ones too: a frozen config is hashable."""
  return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _build(cls: type, values: Mapping[str, Any], prefix: str, *, strict: bool) -> Any:
  """`cls(**values)`, nested sections built from their mappings (`model` through `ModelConfig.from_mapping`)."""
  defaults, names = cls(), {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown and strict:
    raise ConfigError(f"--config.{prefix}{unknown[0]}: the config has no such key; the keys are those of "
                      "transformer_jax/run/experiment_config.py")
  fields = {}
  for name in names & set(values):
    value, default = values[name], getattr(defaults, name)
    if isinstance(default, ModelConfig):
      try:
        value = ModelConfig.from_mapping(value)
      except (TypeError, ValueError) as error:
        if not strict:
          raise
        raise ConfigError(f"--config.model: {error}") from None
    elif dataclasses.is_dataclass(default):
      if not isinstance(value, Mapping):
        raise ConfigError(f"--config.{prefix}{name}={value!r}: must be a section of keys "
                          f"({type(default).__name__})")
      value = _build(type(default), value, f"{prefix}{name}.", strict=strict)
    fields[name] = _tuples(value)
  return cls(**fields)


# ------------------------------------------------------------------------------------------------------------
# What each key allows: the one place the programs check their config (and their own flags) against.
# ------------------------------------------------------------------------------------------------------------

class ConfigError(ValueError):
  """A config value or flag outside what its key allows; the message is one line naming key and rule."""




def _integer(low: int | None = None):
  def check(value):
    ok = is_int32(value, -INT32_MAX if low is None else low)
    return ok, (f"an integer >= {low} and <= {INT32_MAX}" if low is not None else
                f"an integer of magnitude <= {INT32_MAX}")
  return check


def _number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = True):
  def check(value):
    ok = is_float32(value)  # what reaches JAX is float32: a larger value would be inf there
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (high is None or (value < high if high_open else value <= high))
    left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
    return ok, f"a finite number in {left}{low}, {'inf' if high is None else high}{right} (float32)"
  return check


def _one_of(*allowed):
  return lambda value: (value in allowed, f"one of {', '.join(map(repr, allowed))}")


def _text(nonempty: bool = True):
  return lambda value: (isinstance(value, str) and (bool(value.strip()) or not nonempty),
                        "a non-empty string" if nonempty else "a string")


def _mesh_axis(value):
  ok = (isinstance(value, int) and not isinstance(value, bool) and value == -1) or is_int32(value, 1)
  return ok, f"an integer in [1, {INT32_MAX}], or -1 for the remaining devices"


def _splits(value):
  ok = isinstance(value, (tuple, list)) and all(isinstance(s, str) and s.strip() for s in value)
  return ok, "a tuple of split names, e.g. \"('validation',)\""


def _step_pairs(second: str, example: str):
  """A tuple of (integer step, number) pairs, e.g. cool-down knots or dropout stages."""
  def check(value):
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(k, (tuple, list)) and len(k) == 2 and is_int32(k[0]) and is_float32(k[1])
        for k in value)
    return ok, (f"a tuple of (step, {second}) pairs, e.g. '{example}', or () (steps integers in [0, "
                f"{INT32_MAX}], {second} finite)")
  return check


def _metric_name(value):
  ok = isinstance(value, str) and (value == "" or value.count("/") == 1)
  return ok, "'' or '<eval split>/<metric>', e.g. 'validation/bleu' or 'validation/loss'"


def _trackers(value):
  ok = isinstance(value, (tuple, list)) and len(set(value)) == len(value) and all(
      v in trackers.TRACKERS for v in value)
  return ok, f"a tuple of distinct tracker names from {tuple(trackers.TRACKERS)}, e.g. \"('tensorboard', 'wandb')\""


def _profile_steps(value):
  ok = value in ((), []) or (isinstance(value, (tuple, list)) and len(value) == 2 and all(
      is_int32(v, 1) for v in value) and value[0] <= value[1])
  return ok, f"() or (start, stop) steps with 1 <= start <= stop <= {INT32_MAX}, e.g. '(5, 8)'"


def _early_stopping(value):
  ok = value in ((), []) or (
      isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[0], str)
      and value[0].count("/") == 1 and value[0].split("/")[1] in metrics_lib.METRICS
      and is_int32(value[1], 1) and is_float32(value[2]) and value[2] >= 0)
  return ok, (f"() or (metric, patience in [1, {INT32_MAX}], min_delta a finite number >= 0 (float32)) with "
              "metric '<eval split>/<name>', name one of "
              f"{', '.join(sorted(metrics_lib.METRICS))}, e.g. \"('validation/loss', 3, 0.0)\"")


RULES: dict[str, Callable[[Any], tuple[bool, str]]] = {
    "seed": _integer(0),
    "data.dataset": _text(),
    "data.source_lang": _text(),
    "data.target_lang": _text(),
    "data.download": _one_of(False, True),
    "data.tokenizer": _one_of("sentencepiece", "marian"),
    "data.vocab_size": _integer(16),
    "data.vocab_model_type": _one_of("bpe", "unigram"),
    "data.vocab_max_sentences": _integer(1),
    "data.vocab_character_coverage": _number(0.0, 1.0, low_open=True, high_open=False),
    "data.train_split": _text(),
    "data.eval_splits": _splits,
    "data.lowercase": _one_of(False, True),
    "data.subword_alpha": _number(0.0, 1.0),
    "data.subword_from_epoch": _integer(0),
    "data.max_len": _integer(2),
    "data.tokens_per_batch": _integer(2),
    "num_train_steps": _integer(1),
    "warmup_steps": _integer(1),
    "learning_rate": _number(0.0, low_open=True),
    "cooldown_steps": _integer(0),
    "cooldown_shape": _one_of(*COOLDOWN_SHAPES),
    "cooldown_knots": _step_pairs("progress", "((3700, 0.42),)"),
    "dropout_schedule": _step_pairs("rate", "((3000, 0.2),)"),
    "train_budget_minutes": _number(0.0),
    "adam_b1": _number(0.0, 1.0),
    "adam_b2": _number(0.0, 1.0),
    "adam_eps": _number(0.0, low_open=True),
    "weight_decay": _number(0.0),
    "ema_decay": _number(0.0, 1.0),
    "label_smoothing": _number(0.0, 1.0),
    "grad_accum_steps": _integer(1),
    "mesh.data": _mesh_axis,
    "mesh.fsdp": _mesh_axis,
    "mesh.tensor": _mesh_axis,
    "num_cpu_devices": _integer(0),
    "distributed": _one_of(False, True),
    "log_every_steps": _integer(1),
    "trackers": _trackers,
    "wandb.project": _text(nonempty=False),
    "wandb.entity": _text(nonempty=False),
    "wandb.name": _text(nonempty=False),
    "profile_steps": _profile_steps,
    "early_stopping": _early_stopping,
    "evals.loss.every_steps": _integer(0),
    "evals.loss.tokens_per_batch": _integer(1),
    "evals.attention.every_steps": _integer(0),
    "evals.attention.rows": _integer(1),
    "evals.bleu.every_steps": _integer(0),
    "evals.bleu.max_examples": _integer(0),
    "evals.bleu.beam_size": _integer(1),
    "evals.bleu.samples": _integer(0),
    "checkpoint_every_steps": _integer(0),
    "checkpoint_every_minutes": _number(0.0),
    "checkpoint_keep": _integer(1),
    "checkpoint_best_metric": _metric_name,
    "async_checkpointing": _one_of(False, True),
    "decode.beam_size": _integer(1),
    "decode.alpha": _number(0.0),
    "decode.extra_len": _integer(0),
    "decode.average_last": _integer(1),
    "final_eval.split": _text(nonempty=False),
    "final_eval.max_examples": _integer(0),
}


def check_value(key: str, value: Any, flag: str | None = None) -> None:
  """Raises ConfigError unless `value` is allowed for config key `key` (named as `flag` when given)."""
  ok, allowed = RULES[key](value)
  if not ok:
    raise ConfigError(f"{flag or '--config.' + key}={value!r}: must be {allowed}")


def validate(config: ExperimentConfig) -> None:
  """Checks every key of a config before anything is written; raises ConfigError (one line).

  Each key against its rule (`RULES`), then the relations between keys: the batch by `data.tokens_per_batch >=
  data.max_len` (at least one packed row per batch), subword sampling and lowercasing by `data.tokenizer ==
  'sentencepiece'`, `data.subword_from_epoch` by `data.subword_alpha > 0`, the cool-down and dropout stages by
  the schedule, early stopping and the best checkpoint's metric by the evaluators, the decoding options by
  `generate.DecodeOptions.check` (the one check of decoding options: MBR's utility and beam among them).
  `config.model` was checked when it was built (`ModelConfig`'s own range checks).
  """
  for key in RULES:
    value = config
    for part in key.split("."):
      value = getattr(value, part)
    check_value(key, value)
  _check_data(config.data)
  _check_schedule(config)
  check_logged_metrics(config)
  try:
    trackers.check_trackers(config.trackers)
  except trackers.TrackerError as error:
    raise ConfigError(str(error)) from None
  decode_options(config.decode)


def decode_options(decode: DecodeConfig) -> generate.DecodeOptions:
  """The config's `decode` section as checked `DecodeOptions` (beam search); ConfigError names the key."""
  try:
    return generate.DecodeOptions(beam_size=decode.beam_size, alpha=float(decode.alpha),
                                  mbr_utility=decode.mbr_utility, token_log_probs=False).check()
  except ValueError as error:
    raise ConfigError(f"--config.decode.{error}") from None


def _check_data(data: DataConfig) -> None:
  if data.tokens_per_batch < data.max_len:
    raise ConfigError(f"--config.data.tokens_per_batch={data.tokens_per_batch}: must be >= "
                      f"data.max_len ({data.max_len}), one packed row per batch at least")
  if data.subword_alpha and data.tokenizer != "sentencepiece":
    raise ConfigError(f"--config.data.subword_alpha={data.subword_alpha}: needs data.tokenizer="
                      f"'sentencepiece' (a {data.tokenizer!r} vocabulary cannot sample segmentations)")
  if data.subword_from_epoch and not data.subword_alpha:
    raise ConfigError(f"--config.data.subword_from_epoch={data.subword_from_epoch}: needs "
                      f"data.subword_alpha > 0 (it sets the epoch sampling starts from; with alpha 0 nothing samples)")
  if data.lowercase and data.tokenizer != "sentencepiece":
    raise ConfigError(f"--config.data.lowercase=True: needs data.tokenizer='sentencepiece' (a "
                      f"{data.tokenizer!r} vocabulary writes the case it was trained with)")


def _check_schedule(config: ExperimentConfig) -> None:
  if config.profile_steps and config.profile_steps[0] > config.num_train_steps:
    raise ConfigError(f"--config.profile_steps={tuple(config.profile_steps)!r}: starts after the run's last step "
                      f"(num_train_steps={config.num_train_steps}); nothing would be traced")
  if config.cooldown_steps > config.num_train_steps:
    raise ConfigError(f"--config.cooldown_steps={config.cooldown_steps}: must be <= num_train_steps "
                      f"({config.num_train_steps})")
  try:
    check_cooldown(config.num_train_steps, config.cooldown_steps, config.cooldown_shape, config.cooldown_knots)
  except ValueError as error:
    raise ConfigError(f"--config.cooldown_knots={config.cooldown_knots!r}: {error}") from None
  try:
    check_dropout_schedule(config.dropout_schedule)
  except ValueError as error:
    raise ConfigError(f"--config.dropout_schedule={config.dropout_schedule!r}: {error}") from None


def check_logged_metrics(config: ExperimentConfig) -> None:
  """The metrics the run selects by (`checkpoint_best_metric`, `early_stopping`) must be logged during training:
  their split evaluated (`data.eval_splits`) and their evaluator on (`metrics.METRICS`); ConfigError otherwise."""
  if config.checkpoint_best_metric:
    _check_logged(config, f"--config.checkpoint_best_metric={config.checkpoint_best_metric!r}",
                  config.checkpoint_best_metric)
  if config.early_stopping:
    _check_logged(config, f"--config.early_stopping={tuple(config.early_stopping)!r}", config.early_stopping[0])


def _check_logged(config: ExperimentConfig, flag: str, metric: str) -> None:
  split, name = metric.split("/")
  if split not in config.data.eval_splits:
    raise ConfigError(f"{flag}: split {split!r} is not evaluated during training "
                      f"(data.eval_splits={tuple(config.data.eval_splits)!r})")
  logged = sorted(k for k, m in metrics_lib.METRICS.items() if m.evaluator)
  if name not in logged:
    raise ConfigError(f"{flag}: {name!r} is not logged during training; one of {', '.join(logged)}")
  evaluator = metrics_lib.METRICS[name].evaluator
  if not getattr(config.evals, evaluator).every_steps:
    raise ConfigError(f"{flag}: {name!r} is computed by the {evaluator} evaluator, which is off "
                      f"(evals.{evaluator}.every_steps=0); set evals.{evaluator}.every_steps > 0")
