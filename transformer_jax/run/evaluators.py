"""The evaluators of a training run: small objects that score parameters on the eval splits (big_vision's).

    evaluators = make_evaluators(config, model_config=..., tokenizer=..., eval_sets=..., eval_step=..., mesh=...)
    for evaluator in evaluators:
      if itstime(step, evaluator.every_steps, total):
        evaluation = evaluator(params)         # Evaluation(metrics={"<split>/<metric>": value}, samples=...)

Each is built with exactly what it needs (the model config, the eval splits, the compiled eval step and mesh,
the tokenizer), frozen, and called with the parameters to score: it returns what it found (`Evaluation`: the
metrics and, for BLEU, sample translations) and keeps nothing. `config.evals` lists them (`loss`, `attention`,
`bleu`), each with its own `every_steps` (0 = off). `logged_eval_metrics` says which `<split>/<metric>` names
they produce (from `metrics.METRICS`), for the trackers' HParams.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import sharding
from transformer_jax.config import ModelConfig
from transformer_jax.data import batching, datasets as datasets_lib
from transformer_jax.decoding import inference
from transformer_jax.evaluation import diagnostics, metrics as metrics_lib
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import steps



Sample = tuple[str, str, str]  # (source, reference, hypothesis) text


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """What evaluators return: `metrics` `{"<split>/<metric>": value}` and `samples` `{split: [(source, reference,
  hypothesis), ...]}` (the BLEU evaluator's first translations of each split, for the trackers; {} otherwise)."""

  metrics: dict[str, float]
  samples: dict[str, list[Sample]] = dataclasses.field(default_factory=dict)

  def merged(self, other: "Evaluation") -> "Evaluation":
    """Both evaluations' metrics and samples (`other`'s win where a name or split repeats)."""
    return Evaluation({**self.metrics, **other.metrics}, {**self.samples, **other.samples})


class Evaluator(Protocol):
  """Scores `params` on its eval splits; returns an `Evaluation` and keeps no state between calls."""

  name: str
  every_steps: int

  def __call__(self, params: Any) -> Evaluation:
    ...


def within_position_table(eval_set: datasets_lib.EvalSet, model_config: ModelConfig,
                          split: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """The eval pairs' (sources, targets) that fit the model's position table (`model.max_len` tokens a side,
  EOS included; all of them for a model without one); a warning counts the rest, which teacher forcing
  could not score (their positions would read past the table and give NaN)."""
  if model_config.position_embedding == "none":
    return eval_set.sources, eval_set.targets
  keep = batching.within_length(eval_set.sources, eval_set.targets, model_config.max_len)
  if len(keep) < len(eval_set.sources):
    logging.warning("eval %s: %d of %d pairs are longer than model.max_len=%d tokens and are not scored",
                    split, len(eval_set.sources) - len(keep), len(eval_set.sources), model_config.max_len)
  return [eval_set.sources[i] for i in keep], [eval_set.targets[i] for i in keep]


def _per_split(eval_sets: Mapping[str, datasets_lib.EvalSet], score) -> Evaluation:
  """The metrics `{"<split>/<metric>": value}` of `score(split, eval_set) -> {metric: value}` over the splits in
  order."""
  return Evaluation({f"{split}/{metric}": value for split, eval_set in eval_sets.items()
                     for metric, value in score(split, eval_set).items()})


@dataclasses.dataclass(frozen=True)
class LossEvaluator:
  """Token-weighted loss, NLL, perplexity and accuracy over each whole eval split (teacher forcing), summed by
  `eval_step` (`factories.make_eval_step`: `(params, batch) -> sums`) over batches of `tokens_per_batch`
  tokens sharded on `mesh` (padding rows added to split evenly)."""

  every_steps: int
  tokens_per_batch: int
  model_config: ModelConfig
  eval_sets: Mapping[str, datasets_lib.EvalSet]
  eval_step: Callable[[Any, dict], dict]
  mesh: jax.sharding.Mesh
  rules: tuple = sharding.LOGICAL_AXIS_RULES
  name: str = "loss"

  def __call__(self, params: Any) -> Evaluation:
    return _per_split(self.eval_sets, lambda split, eval_set: self.score(params, split, eval_set))

  def score(self, params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    """`{loss, nll, accuracy, token_count, perplexity}` of one split ({} when no pair fits the model)."""
    totals = None
    pad_id = self.model_config.pad_id
    sources, targets = within_position_table(eval_set, self.model_config, split)
    if not sources:
      return {}
    for batch in batching.eval_batches(sources, targets, self.tokens_per_batch, pad_id=pad_id):
      sums = self.eval_step(params, sharding.shard_batch(batch, self.mesh, self.rules, process_local=False,
                                                         pad_rows=True, pad_id=pad_id))
      totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    metrics = {k: float(v) for k, v in steps.metrics_from_sums(totals).items()}
    metrics["perplexity"] = float(math.exp(min(metrics["nll"], 50.0)))
    logging.info("eval %s: loss %.3f | nll %.3f | ppl %.2f | acc %.3f", split, metrics["loss"], metrics["nll"],
                 metrics["perplexity"], metrics["accuracy"])
    return metrics


@dataclasses.dataclass(frozen=True)
class BleuEvaluator:
  """sacreBLEU and chrF of translations (beam search, `beam_size`, length penalty `alpha`) of the first
  `max_examples` pairs (0 = all) of each eval split; the first `samples` (source, reference, hypothesis) of
  each split are returned with them (`Evaluation.samples`) for the trackers."""

  every_steps: int
  max_examples: int
  beam_size: int
  alpha: float
  model_config: ModelConfig
  tokenizer: Any                   # the run's `data.tokenizer` (its `lowercase` selects sacreBLEU's case:lc)
  eval_sets: Mapping[str, datasets_lib.EvalSet]
  samples: int = 0
  target_lang: str = ""  # BLEU's tokenizer follows it as sacreBLEU's does (`metrics.bleu_metric`)
  name: str = "bleu"

  def __call__(self, params: Any) -> Evaluation:
    metrics, samples = {}, {}
    for split, eval_set in self.eval_sets.items():
      scores, rows = self.score(params, split, eval_set)
      metrics.update({f"{split}/{metric}": value for metric, value in scores.items()})
      if rows:
        samples[split] = rows
    return Evaluation(metrics, samples)

  def score(self, params: Any, split: str,
            eval_set: datasets_lib.EvalSet) -> tuple[dict[str, float], list[Sample]]:
    """`{bleu, chrf}` of one split (sacreBLEU's 0-100 scale) and its first `samples` translations."""
    pairs = eval_set.pairs[: self.max_examples or None]
    hyps = inference.translate_texts(params, self.model_config, self.tokenizer, [s for s, _ in pairs],
                                     beam_size=self.beam_size, alpha=self.alpha)
    scores = metrics_lib.sacrebleu_scores(hyps, [t for _, t in pairs], lowercase=self.tokenizer.lowercase,
                                           target_lang=self.target_lang)
    logging.info("BLEU %s: %.2f (chrF %.2f) %s", split, scores["bleu"], scores["chrf"], scores["bleu_signature"])
    rows = [(s, t, h) for (s, t), h in zip(pairs[:self.samples], hyps)]
    return {"bleu": scores["bleu"], "chrf": scores["chrf"]}, rows


@dataclasses.dataclass(frozen=True)
class AttentionEvaluator:
  """Per layer and head, the mean entropy of the attention distributions and the share of near-uniform heads.

  On the first `rows` pairs of each eval split, teacher-forced (`transformer_jax.evaluation.diagnostics`); logged as
  `<split>/attention/<kind>/layer_<l>/head_<h>/entropy` and `<split>/attention/<kind>/near_uniform_share`.
  """

  every_steps: int
  rows: int
  model_config: ModelConfig
  eval_sets: Mapping[str, datasets_lib.EvalSet]
  name: str = "attention"

  def __call__(self, params: Any) -> Evaluation:
    return _per_split(self.eval_sets, lambda split, eval_set: self.score(params, split, eval_set))

  def score(self, params: Any, split: str, eval_set: datasets_lib.EvalSet) -> dict[str, float]:
    sources, targets = within_position_table(eval_set, self.model_config, split)
    if not self.rows or not sources:
      return {}
    batch = next(batching.eval_batches(sources[:self.rows], targets[:self.rows],
                                       max_tokens=1 << 30, pad_id=self.model_config.pad_id))
    statistics = _attention_statistics(params, self.model_config, jnp.asarray(batch["inputs"]),
                                       jnp.asarray(batch["targets"]))
    return diagnostics.summary_scalars(statistics)


_attention_statistics = jax.jit(diagnostics.attention_statistics, static_argnums=1)


def make_evaluators(config: ExperimentConfig, *, model_config: ModelConfig, tokenizer: Any,
                    eval_sets: Mapping[str, datasets_lib.EvalSet], eval_step: Callable[[Any, dict], dict],
                    mesh: jax.sharding.Mesh, rules: tuple = sharding.LOGICAL_AXIS_RULES) -> list[Evaluator]:
  """The evaluators `config.evals` lists (each runs every `every_steps` steps and at the end; 0 = off), over
  `eval_sets` (`Datasets.eval_sets`: split -> EvalSet) with the run's model config, tokenizer and eval step."""
  evals = config.evals
  return [LossEvaluator(evals.loss.every_steps, evals.loss.tokens_per_batch, model_config, eval_sets, eval_step,
                        mesh, rules),
          AttentionEvaluator(evals.attention.every_steps, evals.attention.rows, model_config, eval_sets),
          BleuEvaluator(evals.bleu.every_steps, evals.bleu.max_examples, evals.bleu.beam_size, config.decode.alpha,
                        model_config, tokenizer, eval_sets, evals.bleu.samples, config.data.target_lang)]


def logged_eval_metrics(config: ExperimentConfig) -> list[str]:
  """The `<split>/<metric>` tags the evaluators of `config` log (the HParams tab's metrics), `metrics.METRICS`'s
  order."""
  names = [name for name, metric in metrics_lib.METRICS.items()
           if metric.evaluator and getattr(config.evals, metric.evaluator).every_steps]
  return [f"{split}/{name}" for split in config.data.eval_splits for name in names]
