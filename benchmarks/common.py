"""Shared pieces of the benchmark suite: the trainer's step, corpus, analytic FLOPs, matmul probe, memory.

Every timed JAX training step of the suite (training sections, ablations, profile, sharding, scaling) comes
from `build_train_step`: the trainer's own `factories.create_state` + `factories.make_train_step` on a config
made by `train_config` (the schema's defaults, `ExperimentConfig()`, plus the preset's sizes), on a one-device mesh
or the caller's. `tests/test_benchmarks.py` proves it lowers to the program `python -m experiments.train`
runs. Everything else here is host-side and cheap; the sections in `sections.py` do the measuring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer_jax import config as presets
from transformer_jax import decoding, sharding
from transformer_jax.config import ModelConfig
from transformer_jax.data import number_words as nw
from transformer_jax.data import id_shards, pipeline
from transformer_jax.data import tokenizer as tok_lib
from transformer_jax.data.batching import filter_by_length
from transformer_jax.run import factories
from transformer_jax.run.experiment_config import DataConfig, ExperimentConfig
from transformer_jax.training import steps

PRESETS = {"tiny": presets.tiny, "base": presets.base, "big": presets.big}

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("BENCH_MULTI30K", REPO.parent / "shared" / "data" / "multi30k"))
CACHE = Path(os.environ.get("BENCH_CACHE", REPO / "runs" / "benchmarks" / "cache"))
VOCAB_SIZE = 8000  # shared SentencePiece BPE trained on multi30k train.en + train.de


# ----------------------------------------------------------------------------------------------------------
# The trainer's own compiled step
# ----------------------------------------------------------------------------------------------------------

def preset_config(preset: str, vocab_size: int, **overrides) -> ModelConfig:
  """The `ModelConfig` of a paper/CPU preset (`tiny`, `base`, `big`); ValueError names an unknown preset."""
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; one of {sorted(PRESETS)}")
  return PRESETS[preset](vocab_size=vocab_size, **overrides)


def train_config(model_config: ModelConfig) -> ExperimentConfig:
  """The default experiment config (`ExperimentConfig()`, what `experiments/configs/default.py` holds) with
  `config.model` set to `model_config` (the preset's sizes) and `data.vocab_size` to its vocabulary.

  Everything else (label smoothing 0.1, Adam(0.9, 0.98, 1e-9), the rsqrt schedule with 4000 warm-up steps,
  no gradient accumulation, seed 0) is the default recipe's, as `python -m experiments.train` would use it.
  """
  return ExperimentConfig(model=model_config, data=DataConfig(vocab_size=model_config.vocab_size))


@dataclasses.dataclass
class TrainStep:
  """A fresh train state and the trainer's compiled step for it: `step(state, batch, rng) -> (state, metrics)`."""

  state: steps.TrainState
  step: sharding.PartitionedFunction
  rng: jax.Array                 # the typed dropout key, split from `config.seed` as the trainer does
  model_config: ModelConfig
  mesh: jax.sharding.Mesh
  rules: tuple

  def shard(self, batch: dict) -> dict:
    """A host batch `{key: [rows, length] int32}` as the trainer hands it to the step (`shard_batch`)."""
    return sharding.shard_batch(batch, self.mesh, self.rules)


def build_train_step(config: ExperimentConfig, mesh: Optional[jax.sharding.Mesh] = None) -> TrainStep:
  """The train state and compiled step the trainer builds for `config` (no checkpoint).

  `config.model.vocab_size` must be set (the trainer takes it from the tokenizer); `mesh` defaults to the
  one-device mesh. The same calls as the trainer: `factories.model_config_from`,
  `sharding.validate_model_for_mesh`, `factories.create_state` with the first half of
  `split(key(config.seed))`, `factories.make_train_step`. Raises what those raise (ValueError on a model that
  does not divide over the mesh).
  """
  mesh = sharding.single_device_mesh() if mesh is None else mesh
  model_config = factories.model_config_from(config, config.model.vocab_size)
  rules = sharding.validate_model_for_mesh(model_config, mesh)
  init_rng, rng = jax.random.split(jax.random.key(config.seed))
  state = factories.create_state(config, model_config, mesh, init_rng, rules)
  step = factories.make_train_step(config, model_config, mesh, state, rules)
  return TrainStep(state=state, step=step, rng=rng, model_config=model_config, mesh=mesh, rules=rules)


def plain_batch(rows: int, length: int, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  """One plain batch: random ids in [4, vocab) on both sides, `[rows, length]` int32, no padding, no packing.

  The apples-to-apples kernel comparison: every framework gets full rows and needs no padding or segment
  masks (the decoder's causal mask only).
  """
  rng = np.random.default_rng(seed)
  return {side: rng.integers(4, vocab_size, (rows, length), dtype=np.int32) for side in ("inputs", "targets")}


# ----------------------------------------------------------------------------------------------------------
# Corpus: multi30k EN->DE tokenised with a SentencePiece model trained by the library, or number words
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Corpus:
  name: str
  sources: list  # int32 arrays, EOS included
  targets: list
  test_sources: list  # held-out sources for decoding
  vocab_size: int
  tokenizer_path: Optional[str]
  tokenize_s: float  # SentencePiece encode time of the training pairs (both sides)


def load_corpus(max_len: int = 512) -> Corpus:
  """multi30k train (29k pairs) tokenised with an 8k shared BPE (trained once, cached); number words if absent."""
  if (MULTI30K / "train.en").exists():
    read = lambda name: [l.rstrip("\n") for l in open(MULTI30K / name, encoding="utf-8")]  # noqa: E731
    en, de, test_en = read("train.en"), read("train.de"), read("test2016.en")
    name = "multi30k en-de"
  else:  # number words, built in-process (no tfds): the library's own toy task
    splits = nw.split_numbers(0, {"train": 29_000, "test": 1_000})
    en, de = [nw.english(int(n)) for n in splits["train"]], [nw.german(int(n)) for n in splits["train"]]
    test_en = [nw.english(int(n)) for n in splits["test"]]
    name = "number words"
  CACHE.mkdir(parents=True, exist_ok=True)
  path = CACHE / f"spm{VOCAB_SIZE}_{name.split()[0]}.model"
  tokenizer = (tok_lib.Tokenizer(str(path)) if path.exists()
               else tok_lib.train_tokenizer(en + de, str(path), VOCAB_SIZE))
  start = time.perf_counter()
  src = [np.asarray(x, np.int32) for x in tokenizer.encode_batch(en)]
  tgt = [np.asarray(x, np.int32) for x in tokenizer.encode_batch(de)]
  tokenize_s = time.perf_counter() - start
  src, tgt, _ = filter_by_length(src, tgt, max_len)
  test = [np.asarray(x, np.int32) for x in tokenizer.encode_batch(test_en)]
  return Corpus(name, src, tgt, test, tokenizer.vocab_size, str(path), tokenize_s)


def packed_stream(corpus: Corpus, tokens_per_batch: int, row_length: int, seed: int = 0) -> pipeline.TrainStream:
  """The trainer's input pipeline over `corpus`'s training ids (written once as id shards in the cache)."""
  key = {"corpus": corpus.name, "tokenizer": corpus.tokenizer_path, "pairs": len(corpus.sources),
         "target_tokens": int(sum(map(len, corpus.targets)))}
  directory = id_shards.key_directory(CACHE / "ids", key)
  shards = id_shards.IdShards.open(directory) or id_shards.write_id_arrays(
      directory, key, corpus.sources, corpus.targets, corpus.vocab_size)
  return pipeline.TrainStream(shards, tokens_per_batch=tokens_per_batch, row_length=row_length,
                              pad_id=presets.PAD_ID, seed=seed)


# ----------------------------------------------------------------------------------------------------------
# Analytic model FLOPs
# ----------------------------------------------------------------------------------------------------------

FLOPS_FORMULA = (
    "train FLOPs/step = 3 x forward (backward = 2 x forward); forward = 2 x MACs of the matmuls over every "
    "row slot (pad slots are computed too): per source slot N_enc(4d^2 + 2d d_ff + 2Ld) + N_dec 2d^2 (cross K,V); "
    "per target slot N_dec(4d^2 + 2Td + 2d^2 + 2Ld + 2d d_ff) + d V (tied logits). L, T = padded row "
    "lengths (full L x T score matrices, as computed). Embedding gathers, LayerNorm, softmax, loss, "
    "optimizer are not counted.")


def model_flops(cfg, rows: int, src_len: int, tgt_len: int, train: bool = True) -> dict:
  """Analytic FLOPs of one step on a `[rows, src_len]` / `[rows, tgt_len]` batch (see FLOPS_FORMULA)."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  ne, nd = cfg.num_encoder_layers, cfg.num_decoder_layers
  s_tok, t_tok = rows * src_len, rows * tgt_len
  dense = (s_tok * ne * (4 * d * d + 2 * d * f) + s_tok * nd * 2 * d * d
           + t_tok * nd * (4 * d * d + 2 * d * d + 2 * d * f))
  attention = s_tok * ne * 2 * src_len * d + t_tok * nd * (2 * tgt_len * d + 2 * src_len * d)
  logits = t_tok * d * v
  mult = 3 if train else 1
  total = 2 * mult * (dense + attention + logits)
  return {"total": total, "dense": 2 * mult * dense, "attention": 2 * mult * attention,
          "logits": 2 * mult * logits, "attention_share": attention / (dense + attention + logits)}


# ----------------------------------------------------------------------------------------------------------
# Machine limit: the fp32 matmul rate XLA reaches
# ----------------------------------------------------------------------------------------------------------

class MatmulProbe:
  """A jitted n x n fp32 matmul; `rate(reps)` is its median FLOP/s over `reps` timed calls."""

  def __init__(self, n: int = 2048):
    rng = np.random.default_rng(0)
    self.n = n
    self.a = jnp.asarray(rng.standard_normal((n, n), np.float32))
    self.b = jnp.asarray(rng.standard_normal((n, n), np.float32))
    self.fn = jax.jit(lambda a, b: a @ b)
    self.fn(self.a, self.b).block_until_ready()
    self.samples: list[float] = []

  def rate(self, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      self.fn(self.a, self.b).block_until_ready()
      times.append(time.perf_counter() - start)
    rate = 2 * self.n ** 3 / float(np.median(times))
    self.samples.append(rate)
    return rate

  def median(self) -> float:
    return float(np.median(self.samples)) if self.samples else float("nan")


# ----------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> Optional[int]:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def peak_rss_mb() -> float:
  """This process's peak resident set (VmHWM; ru_maxrss where /proc is unavailable), MiB."""
  kb = _status_kb("VmHWM")
  if kb is None:
    import resource
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return kb / 1024


def rss_mb() -> float:
  kb = _status_kb("VmRSS")
  return (kb or 0) / 1024


def reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


# ----------------------------------------------------------------------------------------------------------
# Machine facts
# ----------------------------------------------------------------------------------------------------------

def fixed_length_search(cfg: ModelConfig, beam: int, length: int):
  """The library's greedy (`beam` 1) or beam search with every output exactly `length` tokens (EOS barred until
  then by a `decoding.LogProbsFn`, as CTranslate2's `min_decoding_length`): jitted `(params, inputs [batch,
  src_len]) -> tokens [batch, length]`, the best hypothesis of each source."""
  ids = dict(bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
  no_eos = lambda logp, state: logp.at[:, cfg.eos_id].set(decoding.NEG_INF)  # noqa: E731

  def run(params, inputs):
    step = decoding.transformer_step_fn(params, cfg, inputs, length, copies=beam)
    common = dict(batch_size=inputs.shape[0], max_decode_len=length, log_probs_fn=no_eos, **ids)
    if beam == 1:
      return decoding.greedy_search_over(step.tokens_to_logits, step.cache, **common)[0]
    return decoding.beam_search_over(step.tokens_to_logits, step.cache, beam_size=beam, alpha=0.6,
                                     gather_cache=step.gather_cache, **common).tokens[:, 0]
  return jax.jit(run)


def median(xs: Sequence[float]) -> float:
  return float(np.median(xs)) if len(xs) else float("nan")


def dump_json(value, path: str) -> None:
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, default=float)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------------

flags.disclaim_key_flags()  # the flags `define_int_list` defines belong to the program that calls it (--help)

class _IntListParser(flags.ListParser):
  """absl's comma-separated list parser whose items are integers (`--lengths=64,128`)."""

  def __init__(self) -> None:
    super().__init__()
    self.syntactic_help = "a comma separated list of integers"

  def parse(self, argument) -> list[int]:
    items = super().parse(argument)
    try:
      return [int(item) for item in items]
    except (TypeError, ValueError):
      raise ValueError(f"comma-separated integers expected, got {argument!r}") from None

  def flag_type(self) -> str:
    return "comma separated list of integers"


def define_int_list(name: str, default: list[int], help_text: str) -> None:
  """An absl flag holding a list of integers, written comma-separated; a non-integer item is refused in one
  line by absl's flag parsing (`--name=...: comma-separated integers expected, got '...'`)."""
  flags.DEFINE(_IntListParser(), name, default, help_text, serializer=flags.CsvListSerializer(","))


def check_flag(name: str, parse: Callable[[Any], Any]) -> None:
  """Registers an absl validator for flag `name`: `parse(value)` must not raise ValueError, whose message
  (naming the flag) becomes absl's one-line refusal."""
  def validator(value) -> bool:
    try:
      parse(value)
    except ValueError as error:
      raise flags.ValidationError(str(error)) from None
    return True
  flags.register_validator(name, validator)
