"""Every experiment key, once, with its default and a one-line meaning; recipes override only what differs.

    from experiments.configs import default
    config = default.get_config()
    config.num_train_steps = 1500          # a recipe holds its deltas (nanoGPT config/*.py, MaxText base.yml)

The library reads `config.x` and never guesses a default, so a recipe built on this file is complete, and a
misspelt override (`--config.no_such_key=3`) is refused by `ml_collections` (the config is locked).
`RULES` below says what every key allows; `validate(config)` checks a whole config (the programs call it
before anything is written) and `check_value` checks one program flag against the key it stands for.
`config.model` is `transformer_jax.ModelConfig` itself: its fields, defaults and meanings live there.
Defaults are the paper's (Vaswani et al., 2017, sections 5-6) where the paper has a value.
"""

import dataclasses
import math

import ml_collections

from transformer_jax import trackers
from transformer_jax.decoding import mbr
from transformer_jax import metrics as metrics_lib
from transformer_jax.config import ModelConfig
from transformer_jax.training.schedule import COOLDOWN_SHAPES, check_cooldown, check_dropout_schedule


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0                             # parameter init, dropout and batch order

  # Model: every ModelConfig field (Transformer base, Table 3); vocab_size is set from the trained vocabulary.
  config.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "number_words"        # number_words | parallel_text | a tfds WMT name, e.g. wmt14_translate/de-en
  config.data.builder_config = "default"      # tfds builder config (number_words only)
  config.data.dir = ""                        # parallel_text: the directory of {split}.{lang} files
  config.data.source_lang = "en"              # source language code (file suffix / tfds feature)
  config.data.target_lang = "de"              # target language code
  config.data.download = False                # let tfds download and prepare a WMT dataset (network, hours)
  config.data.tfds_data_dir = ""              # prepared tfds data; "" = <workdir>/tfds
  config.data.tokenizer = "sentencepiece"     # sentencepiece (ours, one shared model) | marian (an imported model)
  config.data.vocab_path = ""                 # SentencePiece model; "" = <workdir>/vocab/spm.model, trained on first run
  config.data.vocab_size = 37000              # one shared BPE vocabulary for both languages (section 5.1)
  config.data.vocab_model_type = "bpe"        # SentencePiece model type: bpe | unigram
  config.data.vocab_max_sentences = 2_000_000  # uniform sample of training lines (both sides) the vocabulary sees
  config.data.vocab_character_coverage = 1.0  # SentencePiece character_coverage
  config.data.train_split = "train"           # split trained on
  config.data.eval_splits = ("validation",)   # splits the evaluators score during training
  config.data.lowercase = False               # a case-folded vocabulary: text lowercased before SentencePiece, in
                                              # training and at every encode; outputs are lowercase and scored
                                              # against lowercased references (the Multi30k *.lc.norm.tok protocol)
  config.data.subword_alpha = 0.0             # > 0: a sampled segmentation of the training pairs every epoch; for
                                              # bpe the probability of skipping a merge (BPE-dropout, Provilkov et
                                              # al., 2020: 0.1), for unigram the smoothing (Kudo, 2018); 0 = off
  config.data.subword_from_epoch = 0          # the first epoch that samples (earlier ones: deterministic ids)
  config.data.max_len = 256                   # longest training pair kept (tokens per side), and the packed row length
  config.data.tokens_per_batch = 26_624       # packed slots per side per micro-batch, all devices (~25k tokens, sec. 5.1)

  # Optimisation (sections 5.3-5.4): Adam(0.9, 0.98, 1e-9), lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
  config.num_train_steps = 100_000            # optimizer updates
  config.warmup_steps = 4000                  # linear warm-up steps of the rsqrt schedule
  config.learning_rate = 1.0                  # multiplies the schedule
  config.cooldown_steps = 0                   # decay to 0 over the last N steps (not in the paper; 0 = off)
  config.cooldown_shape = "linear"            # how the cool-down's factor falls: linear | 1-sqrt (Hägele et al., 2024)
  config.cooldown_knots = ()                  # ((step, progress), ...): where a time budget moved the end of a
                                              # cool-down under way (schedule.cooldown); set by the budget, given
                                              # only to re-run a budgeted run at its fixed length
  config.dropout_schedule = ()                # ((step, rate), ...): model.dropout_rate from that update on, in
                                              # absolute steps (schedule.dropout_rate; () = model.dropout_rate)
  config.train_budget_minutes = 0.0           # > 0: fit num_train_steps (then a cap) to this much training time,
                                              # at the measured rate (training/budget.py; 0 = off)
  config.adam_b1 = 0.9                        # Adam beta1
  config.adam_b2 = 0.98                       # Adam beta2
  config.adam_eps = 1e-9                      # Adam epsilon
  config.weight_decay = 0.0                   # decoupled weight decay of the matrices, times the rate (AdamW,
                                              # optimizer.adam; not in the paper; 0 = off)
  config.ema_decay = 0.0                      # > 0: keep an exponential moving average of the parameters; the
                                              # final evaluation and translation use it, periodic validation the
                                              # trained parameters (optimizer.param_ema; not in the paper; 0 = off)
  config.label_smoothing = 0.1                # epsilon_ls (section 5.4)
  config.grad_accum_steps = 1                 # micro-batches per optimizer update

  # Devices: a ('data', 'fsdp', 'tensor') mesh, -1 = the remaining devices.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.num_cpu_devices = 0                  # host CPU devices the programs create (jax_num_cpu_devices); 0 = JAX's
                                              # default (one, or XLA_FLAGS' count). The mesh's data axis spans them.
  config.distributed = False                  # initialise jax.distributed (multi-host: TPU pods, SLURM)

  config.log_every_steps = 100                # training metrics to the log, metrics.jsonl and the trackers
  config.trackers = ("tensorboard",)          # where scalars, the config (HParams) and sample translations go,
                                              # besides metrics.jsonl: tensorboard | wandb (transformer_jax.trackers)
  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = "transformer_jax"    # W&B project (WANDB_MODE=offline keeps the run on disk)
  config.wandb.entity = ""                    # W&B entity (team or user); "" = the logged-in user's default
  config.wandb.name = ""                      # W&B run name; "" = W&B's generated one
  config.profile_steps = ()                   # (start, stop): a jax.profiler trace of these steps (both included)
                                              # in <workdir>/profile (transformer_jax.profiling; () = off)
  config.early_stopping = ()                  # (metric, patience, min_delta), e.g. ("validation/loss", 3, 0.0):
                                              # stop after `patience` evaluations of the metric without an
                                              # improvement > min_delta (transformer_jax.early_stopping; () = off)

  # Evaluators run on every `data.eval_splits` split; every_steps = 0 turns one off.
  config.evals = ml_collections.ConfigDict()
  config.evals.loss = ml_collections.ConfigDict()
  config.evals.loss.every_steps = 5000        # token-weighted loss, NLL, perplexity and accuracy
  config.evals.loss.tokens_per_batch = 16_384  # eval batch size (padded tokens)
  config.evals.attention = ml_collections.ConfigDict()
  config.evals.attention.every_steps = 5000   # attention entropy per layer/head, near-uniform heads (diagnostics)
  config.evals.attention.rows = 16            # on this many pairs of each split
  config.evals.bleu = ml_collections.ConfigDict()
  config.evals.bleu.every_steps = 0           # sacreBLEU/chrF of translations (a progress signal; alpha: decode.alpha)
  config.evals.bleu.max_examples = 1000       # the first examples of each split; 0 = all
  config.evals.bleu.beam_size = 1             # 1 = greedy
  config.evals.bleu.samples = 5               # translations (source, reference, hypothesis) sent to the trackers

  config.checkpoint_every_steps = 0           # save every N steps (0 = off)
  config.checkpoint_every_minutes = 10.0      # save every N minutes of wall time (section 6.1; 0 = off)
  config.checkpoint_keep = 5                  # newest checkpoints kept (enough to average decode.average_last)
  config.checkpoint_best_metric = ""          # also keep the best step by this eval metric, e.g. "validation/bleu"
  config.async_checkpointing = True           # write checkpoints in a background thread

  # Decoding for reported scores (section 6.1): beam 4, length penalty alpha 0.6, outputs up to input + 50.
  config.decode = ml_collections.ConfigDict()
  config.decode.beam_size = 4                 # 1 = greedy
  config.decode.alpha = 0.6                   # GNMT length penalty exponent
  config.decode.extra_len = 50                # output length limit: source length + extra_len
  config.decode.average_last = 5              # checkpoints averaged for the reported model (base 5, big 20)
  config.decode.mbr_utility = ""              # "" = beam search's best; "chrf"/"bleu" = MBR over its n-best

  # After `experiments.train`: translate a test split with `decode`, print exact match and BLEU.
  config.final_eval = ml_collections.ConfigDict()
  config.final_eval.split = "test"            # "" = skip
  config.final_eval.max_examples = 0          # 0 = the whole split
  return config


# ------------------------------------------------------------------------------------------------------------
# What each key allows: the one place the programs check their config (and their own flags) against.
# ------------------------------------------------------------------------------------------------------------

class ConfigError(ValueError):
  """A config value or flag outside what its key allows; the message is one line naming key and rule."""


def _integer(low: int | None = None):
  def check(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
    return ok, f"an integer >= {low}" if low is not None else "an integer"
  return check


def _number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = True):
  def check(value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (high is None or (value < high if high_open else value <= high))
    left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
    return ok, f"a finite number in {left}{low}, {'inf' if high is None else high}{right}"
  return check


def _one_of(*allowed):
  return lambda value: (value in allowed, f"one of {', '.join(map(repr, allowed))}")


def _text(nonempty: bool = True):
  return lambda value: (isinstance(value, str) and (bool(value.strip()) or not nonempty),
                        "a non-empty string" if nonempty else "a string")


def _mesh_axis(value):
  ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1)
  return ok, "a positive integer, or -1 for the remaining devices"


def _splits(value):
  ok = isinstance(value, (tuple, list)) and all(isinstance(s, str) and s.strip() for s in value)
  return ok, "a tuple of split names, e.g. \"('validation',)\""


def _step_pairs(second: str, example: str):
  """A tuple of (integer step, number) pairs, e.g. cool-down knots or dropout stages."""
  def check(value):
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(k, (tuple, list)) and len(k) == 2 and isinstance(k[0], int) and not isinstance(k[0], bool)
        and isinstance(k[1], (int, float)) and not isinstance(k[1], bool) for k in value)
    return ok, f"a tuple of (step, {second}) pairs, e.g. '{example}', or ()"
  return check


def _metric_name(value):
  ok = isinstance(value, str) and (value == "" or value.count("/") == 1)
  return ok, "'' or '<eval split>/<metric>', e.g. 'validation/bleu' or 'validation/loss'"


def _trackers(value):
  ok = isinstance(value, (tuple, list)) and len(set(value)) == len(value) and all(
      v in trackers.TRACKERS for v in value)
  return ok, f"a tuple of distinct tracker names from {trackers.TRACKERS}, e.g. \"('tensorboard', 'wandb')\""


def _profile_steps(value):
  ok = value in ((), []) or (isinstance(value, (tuple, list)) and len(value) == 2 and all(
      isinstance(v, int) and not isinstance(v, bool) for v in value) and 1 <= value[0] <= value[1])
  return ok, "() or (start, stop) steps with 1 <= start <= stop, e.g. '(5, 8)'"


def _early_stopping(value):
  ok = value in ((), []) or (
      isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[0], str)
      and value[0].count("/") == 1 and value[0].split("/")[1] in metrics_lib.METRIC_DIRECTIONS
      and isinstance(value[1], int) and not isinstance(value[1], bool) and value[1] >= 1
      and isinstance(value[2], (int, float)) and not isinstance(value[2], bool) and math.isfinite(value[2])
      and value[2] >= 0)
  return ok, ("() or (metric, patience >= 1, min_delta >= 0) with metric '<eval split>/<name>', name one of "
              f"{', '.join(sorted(metrics_lib.METRIC_DIRECTIONS))}, e.g. \"('validation/loss', 3, 0.0)\"")


RULES = {
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
    "decode.mbr_utility": _one_of("", *mbr.UTILITIES),
    "final_eval.split": _text(nonempty=False),
    "final_eval.max_examples": _integer(0),
}


def check_value(key: str, value, flag: str | None = None) -> None:
  """Raises ConfigError unless `value` is allowed for config key `key` (named as `flag` when given)."""
  ok, allowed = RULES[key](value)
  if not ok:
    raise ConfigError(f"{flag or '--config.' + key}={value!r}: must be {allowed}")


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks every key of a (recipe) config before anything is written; raises ConfigError (one line).

  `config.model` is checked by building `ModelConfig` from it (its own range checks), and the batch by
  `data.tokens_per_batch >= data.max_len` (at least one packed row per batch), subword sampling and
  lowercasing by `data.tokenizer == 'sentencepiece'`, `data.subword_from_epoch` by `data.subword_alpha > 0`,
  and MBR decoding by `decode.beam_size >= 2` (its n-best list).
  """
  for key in RULES:
    value = config
    for part in key.split("."):
      value = value[part]
    check_value(key, value)
  if config.data.tokens_per_batch < config.data.max_len:
    raise ConfigError(f"--config.data.tokens_per_batch={config.data.tokens_per_batch}: must be >= "
                      f"data.max_len ({config.data.max_len}), one packed row per batch at least")
  if config.data.subword_alpha and config.data.tokenizer != "sentencepiece":
    raise ConfigError(f"--config.data.subword_alpha={config.data.subword_alpha}: needs data.tokenizer="
                      f"'sentencepiece' (a {config.data.tokenizer!r} vocabulary cannot sample segmentations)")
  if config.data.subword_from_epoch and not config.data.subword_alpha:
    raise ConfigError(f"--config.data.subword_from_epoch={config.data.subword_from_epoch}: needs "
                      f"data.subword_alpha > 0 (it sets the epoch sampling starts from; with alpha 0 nothing samples)")
  if config.data.lowercase and config.data.tokenizer != "sentencepiece":
    raise ConfigError(f"--config.data.lowercase=True: needs data.tokenizer='sentencepiece' (a "
                      f"{config.data.tokenizer!r} vocabulary writes the case it was trained with)")
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
  _check_early_stopping(config)
  try:
    trackers.check_trackers(config.trackers)
  except trackers.TrackerError as error:
    raise ConfigError(str(error)) from None
  if config.decode.mbr_utility and config.decode.beam_size < 2:
    raise ConfigError(f"--config.decode.mbr_utility={config.decode.mbr_utility!r}: needs decode.beam_size >= 2 "
                      f"(MBR chooses from beam search's n-best list), got {config.decode.beam_size}")
  try:
    ModelConfig(**config.model.to_dict())
  except (TypeError, ValueError) as error:
    raise ConfigError(f"--config.model: {error}") from None


# The evaluator (its `every_steps` key) that logs each metric the early-stopping rule may watch.
_EVALUATOR_OF = {"loss": "loss", "nll": "loss", "perplexity": "loss", "accuracy": "loss", "bleu": "bleu",
                 "chrf": "bleu"}


def _check_early_stopping(config: ml_collections.ConfigDict) -> None:
  """The early-stopping metric must be logged during training: its split evaluated, its evaluator on."""
  if not config.early_stopping:
    return
  metric = config.early_stopping[0]
  split, name = metric.split("/")
  evaluator = _EVALUATOR_OF.get(name)
  if split not in config.data.eval_splits:
    raise ConfigError(f"--config.early_stopping={tuple(config.early_stopping)!r}: split {split!r} is not "
                      f"evaluated during training (data.eval_splits={tuple(config.data.eval_splits)!r})")
  if evaluator is None or not config.evals[evaluator].every_steps:
    raise ConfigError(f"--config.early_stopping={tuple(config.early_stopping)!r}: {name!r} is not logged during "
                      f"training" + (f"; set evals.{evaluator}.every_steps > 0" if evaluator else
                                     f"; one of {', '.join(sorted(_EVALUATOR_OF))}"))
