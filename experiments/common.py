"""Shared glue for the absl programs: user-facing errors, loading a trained workdir, the final evaluation."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

from transformer_jax.data.tokenizer import Tokenizer, VocabularyError
from transformer_jax.training.loop import NonFiniteLossError

# Exceptions that mean "bad input or state": printed as one line, exit status 1, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, VocabularyError, NonFiniteLossError,
               UnicodeDecodeError)


_QUIET_LIBRARIES = ("/orbax/", "/tensorflow_datasets/", "/etils/", "/tensorstore/")


class _LibraryInfoFilter:
  """Drops INFO/DEBUG records of chatty libraries (orbax logs every save step by step) from absl logs."""

  def filter(self, record) -> bool:
    import logging
    if not any(p in record.pathname for p in _QUIET_LIBRARIES):
      return True
    # Orbax warns that a read-only checkpoint directory is read only every time one is opened.
    return record.levelno >= logging.WARNING and "is read only" not in record.getMessage()


def setup_logging() -> None:
  """Our own progress at INFO; orbax/tfds chatter only from WARNING up; no tfds progress bars."""
  from absl import logging as absl_logging
  import tensorflow_datasets as tfds
  absl_logging.set_verbosity(absl_logging.INFO)
  absl_logging.get_absl_handler().addFilter(_LibraryInfoFilter())
  tfds.disable_progress_bar()


def fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(1)


def read_lines(path: str | None) -> list[str]:
  """Lines of `path` (stdin when None) without line endings; invalid UTF-8 names the file and line."""
  from transformer_jax.data.parallel_text import decode_lines, read_lines as read_file_lines
  return read_file_lines(path) if path else decode_lines(sys.stdin.buffer, "<stdin>")


def load_workdir_config(workdir: str) -> dict:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} the --workdir of a training run?")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def load_for_inference(workdir: str, checkpoint: str | None = None):
  """(model_config, params, tokenizer) of a trained workdir; `checkpoint` = a step or a checkpoint dir."""
  from transformer_jax import checkpoint as checkpoint_lib
  from transformer_jax.data.input_pipeline import vocab_path
  from transformer_jax.training.loop import model_config_from
  import ml_collections

  config = ml_collections.ConfigDict(load_workdir_config(workdir))
  if config.data.get("tokenizer") == "marian":  # an imported Marian model (experiments.import_marian)
    from transformer_jax.interop.marian_vocab import MarianVocabulary
    tokenizer = MarianVocabulary(config.data.get("vocab_path") or os.path.join(workdir, "vocab"))
  else:
    tokenizer = Tokenizer(vocab_path(config.data, workdir))
  model_config = model_config_from(config, config.model.vocab_size)
  tokenizer.check_model_vocab(model_config.vocab_size)
  directory = os.path.join(workdir, "checkpoints")
  step = None
  if checkpoint:
    if checkpoint.isdigit():
      step = int(checkpoint)
    else:
      directory = checkpoint
  params = checkpoint_lib.restore_params(directory, model_config, step=step)
  return model_config, params, tokenizer


def translate_texts(model_config, params, tokenizer: Tokenizer, texts: Sequence[str], **kwargs) -> list[str]:
  """`transformer_jax.inference.translate_texts` (input order; empty lines stay empty)."""
  from transformer_jax import inference
  return inference.translate_texts(params, model_config, tokenizer, texts, **kwargs)


def report_final_eval(config: Any, workdir: str, result: dict) -> dict:
  """Translates the test split, prints a few samples and exact-match accuracy, writes final_eval.json."""
  from transformer_jax.data import sources
  final = config.get("final_eval")
  if not final or not final.get("split") or result["summary"].get("stopped_early"):
    return {}
  pairs = sources.load_pairs(config.data, final.split, workdir)
  if final.get("max_examples"):
    pairs = pairs[: final.max_examples]
  from transformer_jax import metrics
  decode = config.get("decode") or {}
  start = time.time()
  hyps = translate_texts(result["model_config"], result["state"].params, result["datasets"].tokenizer,
                         [s for s, _ in pairs], beam_size=final.get("beam_size", 1),
                         alpha=decode.get("alpha", 0.6), extra_len=decode.get("extra_len", 50))
  seconds = time.time() - start
  exact = sum(h == t for h, (_, t) in zip(hyps, pairs)) / max(len(pairs), 1)
  scores = metrics.sacrebleu_scores(hyps, [t for _, t in pairs])
  for (src, ref), hyp in list(zip(pairs, hyps))[:5]:
    print(f"  {src}\n    -> {hyp}   [{'ok' if hyp == ref else 'reference: ' + ref}]")
  report = {"split": final.split, "examples": len(pairs), "exact_match": exact, "bleu": scores["bleu"],
            "bleu_signature": scores["bleu_signature"], "translate_seconds": seconds,
            "train_minutes": result["summary"].get("train_minutes")}
  # BLEU needs 4-grams: with one-word references (the built-in task) it is 0 whatever the output.
  bleu = (f"; BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})"
          if any(" " in t for _, t in pairs) else "")
  print(f"Exact match on {len(pairs)} {final.split} examples: {100 * exact:.2f}%{bleu} "
        f"(translated in {seconds:.1f}s; training took {report['train_minutes']:.1f} min)")
  with open(os.path.join(workdir, "final_eval.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  return report
