"""The training loop: data, state, jitted steps, logging, evaluation and checkpoints for one config.

`train_and_evaluate(config, workdir)` is what `python -m experiments.train` runs; it takes an
`ml_collections.ConfigDict` (see `experiments/configs/`) and never reads flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig
from transformer_jax.data import input_pipeline
from transformer_jax.training import schedule as schedule_lib
from transformer_jax.training import steps


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or Inf."""


def model_config_from(config: Any, vocab_size: int) -> ModelConfig:
  """`ModelConfig` from `config.model` with the vocabulary size of the run's tokenizer."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  values = {k: v for k, v in config.model.to_dict().items() if k in fields}
  unknown = set(config.model.to_dict()) - fields
  if unknown:
    raise ValueError(f"config.model has unknown fields {sorted(unknown)}; ModelConfig fields are {sorted(fields)}")
  values["vocab_size"] = vocab_size
  return ModelConfig(**values)


def _format_eta(seconds: float) -> str:
  seconds = max(0, int(seconds))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class MetricWriter:
  """Scalars to TensorBoard event files (tensorboardX) and a JSON-lines log in the workdir."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    from tensorboardX import SummaryWriter
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def evaluate_loss(eval_fn, params, eval_set, max_tokens: int) -> dict[str, float]:
  """Token-weighted loss, NLL, perplexity and accuracy over a whole eval set."""
  from transformer_jax.data.pipeline import eval_batches
  totals = None
  for batch in eval_batches(eval_set.sources, eval_set.targets, max_tokens):
    sums = eval_fn(params, batch)
    totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
  metrics = {k: float(v) for k, v in steps.metrics_from_sums(totals).items()}
  metrics["perplexity"] = float(math.exp(min(metrics["nll"], 50.0)))
  return metrics


def evaluate_attention(params, model_config: ModelConfig, eval_set, rows: int) -> dict[str, float]:
  """Attention entropy per layer/head and the share of near-uniform heads on the first `rows` eval pairs."""
  from transformer_jax import diagnostics
  from transformer_jax.data.pipeline import eval_batches
  batch = next(eval_batches(eval_set.sources[:rows], eval_set.targets[:rows], max_tokens=1 << 30))
  statistics = jax.jit(diagnostics.attention_statistics, static_argnums=1)(
      params, model_config, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]))
  return diagnostics.summary_scalars(statistics)


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json_atomically(path: str, value: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def _check_compatible(saved: dict, requested: dict, workdir: str, keys) -> None:
  from transformer_jax.checkpoint import config_diff
  diffs = config_diff(saved, requested, keys=keys)
  if diffs:
    raise ValueError(f"{workdir} holds a run with an incompatible config ({'; '.join(diffs)}); use another "
                     f"--workdir or the saved values")


class _StopSignal:
  """SIGTERM/SIGINT set a flag; the loop finishes the current step, saves a checkpoint and stops.

  On multi-host runs JAX's preemption sync point (`jax.distributed` with the preemption service) is also
  consulted, so every host stops at the same step.
  """

  def __init__(self):
    import signal
    self.signal_name = None
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. in a notebook worker): no handler
        pass

  def _handle(self, signum, frame):
    import signal
    del frame
    self.signal_name = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    if self.signal_name is not None:
      return True
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      try:
        if multihost_utils.reached_preemption_sync_point(step):
          self.signal_name = "preemption notice"
          return True
      except RuntimeError:  # preemption service not enabled
        pass
    return False

  def restore(self) -> None:
    import signal
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def next_batch(batches, accum: int) -> dict:
  """One batch, or `accum` consecutive batches stacked to `[accum, rows, length]` for accumulation."""
  if accum == 1:
    return next(batches)
  parts = [next(batches) for _ in range(accum)]
  return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


def evaluate_bleu(params, model_config: ModelConfig, tokenizer, eval_set, config: Any) -> dict:
  """sacreBLEU of greedy/beam translations of (the first `bleu_max_examples` of) an eval set."""
  from transformer_jax import inference, metrics
  pairs = eval_set.pairs[: config.get("bleu_max_examples") or None]
  hyps = inference.translate_texts(params, model_config, tokenizer, [s for s, _ in pairs],
                                   beam_size=config.get("bleu_beam_size", 1), alpha=config.get("bleu_alpha", 0.6))
  return metrics.sacrebleu_scores(hyps, [t for _, t in pairs])


def train_and_evaluate(config: Any, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the final metrics."""
  from transformer_jax import checkpoint as checkpoint_lib
  from transformer_jax import sharding

  sharding.maybe_initialize_distributed(config.get("distributed", False))
  os.makedirs(workdir, exist_ok=True)
  is_chief = jax.process_index() == 0
  saved_config = _read_json(os.path.join(workdir, "config.json"))
  if saved_config is not None:  # refuse before anything in the workdir is touched
    _check_compatible(saved_config, config.to_dict(), workdir, keys=("data.vocab_size", "data.dataset"))
  data = input_pipeline.build_datasets(config.data, workdir, seed=config.seed,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count())
  model_config = model_config_from(config, data.tokenizer.vocab_size)
  config.model.vocab_size = model_config.vocab_size
  resolved = config.to_dict()
  if saved_config is not None:
    _check_compatible(saved_config, resolved, workdir, keys=("model",))
  if is_chief:
    _write_json_atomically(os.path.join(workdir, "config.json"), resolved)
  src_eff, tgt_eff = data.train.padding_efficiency()
  logging.info("Model: %s", model_config)
  logging.info("Packed batches: %d rows x %d slots; padding efficiency source %.1f%%, target %.1f%%",
               data.train.rows_per_batch, data.train.row_length, 100 * src_eff, 100 * tgt_eff)

  learning_rate_fn = schedule_lib.rsqrt_schedule(model_config.d_model, config.warmup_steps,
                                                 config.learning_rate)
  tx = schedule_lib.adam_with_schedule(model_config.d_model, config.warmup_steps, config.learning_rate,
                                       b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  rng = jax.random.key(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  mesh = sharding.mesh_from_config(config.get("mesh"))
  rules = sharding.LOGICAL_AXIS_RULES
  state, state_shardings = sharding.create_sharded_train_state(model_config, tx, init_rng, mesh, rules)
  logging.info("Mesh %s over %d devices; train state %.1f MiB per device", dict(mesh.shape), mesh.size,
               max(sharding.per_device_bytes(state).values()) / 2**20)

  best_metric = config.get("checkpoint_best_metric") or None
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint_keep,
                                     best_metric=best_metric,
                                     best_mode="min" if best_metric and best_metric.endswith("loss") else "max",
                                     enable_async_checkpointing=config.get("async_checkpointing", True))
  start_step = 0
  restored = ckpt.restore_latest_complete(state) if ckpt.latest_step() is not None else None
  if restored is not None:
    state, start_step = restored.state, int(restored.step)
    if restored.rng is not None:
      train_rng = jax.random.wrap_key_data(restored.rng) if not jnp.issubdtype(
          restored.rng.dtype, jax.dtypes.prng_key) else restored.rng
    data.train.set_state(restored.data_state)
    logging.info("Resumed from the checkpoint at step %d in %s (data position %s)", start_step,
                 ckpt.directory, restored.data_state)

  accum = config.get("grad_accum_steps", 1)
  train_step = sharding.jit_sharded_train_step(model_config, mesh, state_shardings, rules,
                                               label_smoothing=config.label_smoothing, grad_accum_steps=accum,
                                               learning_rate_fn=learning_rate_fn)
  eval_sharded = sharding.jit_sharded_eval_step(model_config, mesh, state_shardings.params, rules,
                                                label_smoothing=config.label_smoothing)
  eval_step = lambda params, batch: eval_sharded(
      params, sharding.shard_batch(batch, mesh, rules, process_local=False, pad_rows=True))
  writer = MetricWriter(workdir, enabled=is_chief)
  num_steps = config.num_train_steps
  logging.info("Training %d parameters for %d steps (from step %d)",
               sum(x.size for x in jax.tree_util.tree_leaves(state.params)), num_steps, start_step)

  pending: list[tuple[int, dict]] = []
  last_log_time, last_log_step = time.time(), start_step
  last_ckpt_time = time.time()
  train_start = time.time()
  summary: dict[str, Any] = {}
  stop = _StopSignal()
  step = start_step
  try:
    for step in range(start_step + 1, num_steps + 1):
      batch = sharding.shard_batch(next_batch(data.train, accum), mesh, rules)
      state, metrics = train_step(state, batch, train_rng)
      pending.append((step, metrics))

      if step % config.log_every_steps == 0 or step == num_steps:
        fetched = jax.device_get([m for _, m in pending])
        for (s, _), m in zip(pending, fetched):
          if not np.isfinite(m["loss"]):
            raise NonFiniteLossError(f"training loss is {m['loss']} at step {s}; stopping "
                                     f"(last checkpoint: step {ckpt.latest_step()})")
        now = time.time()
        tokens = sum(float(m["token_count"]) for m in fetched)
        steps_per_s = (step - last_log_step) / (now - last_log_time)
        scalars = {k: float(np.mean([m[k] for m in fetched])) for k in ("loss", "nll", "accuracy", "grad_norm")}
        scalars.update(learning_rate=float(fetched[-1]["learning_rate"]),
                       tokens_per_s=tokens / (now - last_log_time), steps_per_s=steps_per_s)
        writer.write(step, {f"train/{k}": v for k, v in scalars.items()})
        logging.info("step %d/%d | loss %.3f | acc %.3f | lr %.2e | %.0f tok/s | %.2f steps/s | eta %s",
                     step, num_steps, scalars["loss"], scalars["accuracy"], scalars["learning_rate"],
                     scalars["tokens_per_s"], steps_per_s, _format_eta((num_steps - step) / steps_per_s))
        summary["train"] = scalars
        pending, last_log_time, last_log_step = [], now, step

      eval_metrics = {}
      if config.eval_every_steps and (step % config.eval_every_steps == 0 or step == num_steps):
        for name, eval_set in data.eval_sets.items():
          metrics = evaluate_loss(eval_step, state.params, eval_set, config.eval_tokens_per_batch)
          logging.info("eval %s at step %d: loss %.3f | nll %.3f | ppl %.2f | acc %.3f", name, step,
                       metrics["loss"], metrics["nll"], metrics["perplexity"], metrics["accuracy"])
          eval_metrics.update({f"{name}/{k}": v for k, v in metrics.items()})
          diagnostics_rows = config.get("attention_diagnostics_rows", 16)  # 0 = off
          if diagnostics_rows:
            attention = evaluate_attention(state.params, model_config, eval_set, diagnostics_rows)
            eval_metrics.update({f"{name}/{k}": v for k, v in attention.items()})
      bleu_every = config.get("bleu_every_steps", 0)
      if bleu_every and (step % bleu_every == 0 or step == num_steps):
        for name, eval_set in data.eval_sets.items():
          scores = evaluate_bleu(state.params, model_config, data.tokenizer, eval_set, config)
          logging.info("BLEU %s at step %d: %.2f (chrF %.2f) %s", name, step, scores["bleu"], scores["chrf"],
                       scores["bleu_signature"])
          eval_metrics.update({f"{name}/bleu": scores["bleu"], f"{name}/chrf": scores["chrf"]})
      if eval_metrics:
        writer.write(step, eval_metrics)
        summary.setdefault("eval", {}).update(eval_metrics)

      by_steps = config.checkpoint_every_steps and step % config.checkpoint_every_steps == 0
      # Wall-clock saves are checked at logging steps (already a host sync point) and decided by process 0:
      # hosts' clocks differ, and a save only some hosts enter never completes.
      by_time = bool(config.checkpoint_every_minutes) and step % config.log_every_steps == 0 and (
          sharding.agree_across_hosts(time.time() - last_ckpt_time >= 60 * config.checkpoint_every_minutes))
      stopping = stop.requested(step)
      if by_steps or by_time or stopping or step == num_steps:
        ckpt.save(step, state, train_rng, data.train.get_state(), resolved,
                  metrics=eval_metrics if best_metric and best_metric in eval_metrics else None)
        last_ckpt_time = time.time()
      if stopping:
        logging.warning("Received %s: saved the checkpoint of step %d; stopping. Re-run to resume.",
                        stop.signal_name, step)
        summary["stopped_early"] = True
        break

  finally:
    stop.restore()
    ckpt.wait()
    ckpt.close()
  summary["final_step"] = step
  summary["train_minutes"] = (time.time() - train_start) / 60
  writer.close()
  return {"state": state, "model_config": model_config, "datasets": data, "summary": summary}
