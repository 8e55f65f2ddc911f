"""The final evaluation a training program prints and writes: `final_eval.split` translated with `config.decode`."""

import time

from transformer_jax.data import sources
from transformer_jax.decoding import inference
from transformer_jax.evaluation import metrics
from transformer_jax.run import factories, trainer
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.workdir import Workdir, write_json_atomically


def report_final_eval(config: ExperimentConfig, workdir: str, result: trainer.TrainResult) -> dict:
  """Translates `final_eval.split` with `config.decode`, prints samples, exact match and BLEU; writes final_eval.json."""
  final = config.final_eval
  if not final.split or result.stopped_early:
    return {}
  pairs = sources.load_pairs(config.data, final.split, workdir)
  if final.max_examples:
    pairs = pairs[: final.max_examples]
  start = time.time()
  hyps = inference.translate_texts(factories.inference_params(config, result.state), result.model_config,
                                   result.datasets.tokenizer,
                                   [s for s, _ in pairs], beam_size=config.decode.beam_size,
                                   alpha=config.decode.alpha, extra_len=config.decode.extra_len,
                                   mbr_utility=config.decode.mbr_utility,
                                   target_lang=config.data.target_lang)
  seconds = time.time() - start
  lowercase = result.datasets.tokenizer.lowercase  # a case-folded vocabulary writes lowercase
  exact = metrics.exact_match(hyps, [t for _, t in pairs], lowercase=lowercase)  # both sides normalised, as BLEU's
  scores = metrics.sacrebleu_scores(hyps, [t for _, t in pairs], lowercase=lowercase,
                                    target_lang=config.data.target_lang)
  for (src, ref), hyp in list(zip(pairs, hyps))[:5]:
    correct = metrics.exact_match([hyp], [ref], lowercase=lowercase) == 1.0  # as the score counts it
    print(f"  {src}\n    -> {hyp}   [{'ok' if correct else 'reference: ' + ref}]")
  report = {"split": final.split, "examples": len(pairs), "exact_match": exact, "bleu": scores["bleu"],
            "bleu_signature": scores["bleu_signature"], "translate_seconds": seconds,
            "train_minutes": result.train_minutes, "final_step": result.final_step}
  if result.early_stopping:
    report["early_stopping"] = result.early_stopping
  # BLEU needs 4-grams: with one-word references (the built-in task) it is 0 whatever the output.
  bleu = (f"; BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})"
          if any(" " in t for _, t in pairs) else "")
  print(f"Exact match on {len(pairs)} {final.split} examples: {100 * exact:.2f}%{bleu} "
        f"(translated in {seconds:.1f}s; training took {result.train_minutes:.1f} min)")
  if result.early_stopping.get("stopped_at_step"):
    print(f"Early stopping ended training at step {result.final_step}: {result.early_stopping['metric']} best "
          f"{result.early_stopping['best']:.4g} at step {result.early_stopping['best_step']}")
  write_json_atomically(Workdir(workdir).final_eval_json, report)
  return report
