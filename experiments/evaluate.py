r"""Translate a source file and score it against a reference with sacreBLEU.

    python -m experiments.evaluate --workdir=DIR --source=test.en --reference=test.de [--beam_size=4]
        [--alpha=0.6] [--mbr_utility=chrf] [--tokenized_bleu] [--lc_tok_reference=test.lc.norm.tok.de]
        [--checkpoint=STEP|DIR] [--ensemble=STEP_OR_DIR,...] [--strategy=sample --top_p=0.9 --seed=1]

Prints cased detokenised BLEU with its signature and chrF; `--tokenized_bleu` adds the paper-style score
(Moses-tokenised, compound-split); `--lc_tok_reference` adds the Multi30k-style lowercased tokenised score.
Hypotheses and scores are written next to each other: `<output_prefix>.hyp` and `<output_prefix>.json`.
"""

import json
import os
import sys
import time

from absl import flags
from etils import epath
from tqdm import tqdm

import launch
from experiments import decoding
from transformer_jax.decoding import inference
from transformer_jax.evaluation import metrics
from transformer_jax.run import trained
from transformer_jax.workdir import Workdir

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("source", None, "Source text file, one sentence per line.")
flags.DEFINE_string("reference", None, "Reference translations, aligned with --source.")
flags.DEFINE_integer("beam_size", 4, "Beam size (the paper: 4).")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent (the paper: 0.6).")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len (the paper: 50).")
flags.DEFINE_string("mbr_utility", "", "'' = beam search's best; 'chrf' or 'bleu' = the minimum-Bayes-risk "
                    "choice from its beam_size-best list under that utility.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_bool("tokenized_bleu", False, "Also report tokenised, compound-split BLEU (paper style).")
flags.DEFINE_string("target_lang", None, "Target language: BLEU's tokenizer as sacreBLEU picks it (zh, ja-mecab, "
                    "ko-mecab, else 13a) and Moses tokenisation (default: the run's data.target_lang).")
flags.DEFINE_string("lc_tok_reference", None,
                    "Lowercased, normalised, tokenised reference (Multi30k style) for an extra score.")
flags.DEFINE_string("output_prefix", None, "Where to write .hyp and .json (default: <workdir>/eval/<source>).")
decoding.define_flags(nbest=False)
flags.mark_flags_as_required(["workdir", "source", "reference"])
launch.check_flags(beam_size="decode.beam_size", alpha="decode.alpha", extra_len="decode.extra_len")
launch.check_files_exist("source", "reference", "lc_tok_reference")


def _read_inputs():
  sources, references = launch.read_lines(FLAGS.source), launch.read_lines(FLAGS.reference)
  if len(sources) != len(references):
    raise ValueError(f"{FLAGS.source} has {len(sources)} lines but {FLAGS.reference} has {len(references)} lines")
  lc_refs = launch.read_lines(FLAGS.lc_tok_reference) if FLAGS.lc_tok_reference else None
  if lc_refs is not None and len(lc_refs) != len(sources):
    raise ValueError(f"{FLAGS.lc_tok_reference} has {len(lc_refs)} lines, expected {len(sources)}")
  return sources, references, lc_refs


def _scores(hypotheses, references, lc_refs, target_lang: str, lowercase: bool) -> dict:
  scores = metrics.sacrebleu_scores(hypotheses, references, lowercase=lowercase, target_lang=target_lang)
  if FLAGS.tokenized_bleu:
    # Compound splitting is tensor2tensor's German-specific step (get_ende_bleu.sh).
    scores["tokenized_bleu"] = metrics.tokenized_bleu(hypotheses, references, lang=target_lang,
                                                      compound_split=target_lang == "de")
  if lc_refs is not None:
    scores["lc_tok_bleu"] = metrics.lowercased_tokenized_bleu(hypotheses, lc_refs, lang=target_lang)
  return scores


def _evaluate() -> None:
  sources, references, lc_refs = _read_inputs()
  options = decoding.options(FLAGS.beam_size, FLAGS.alpha, mbr_utility=FLAGS.mbr_utility)
  model_config, params_list, tokenizer = decoding.load_models(FLAGS.workdir, FLAGS.checkpoint)
  target_lang = FLAGS.target_lang or trained.workdir_config(FLAGS.workdir).data.target_lang
  metrics.bleu_metric(target_lang)  # its tokenizer loads, before anything is translated
  start = time.time()
  with tqdm(total=len(sources), unit="sent", file=sys.stderr) as bar:
    lists = inference.decode_texts(params_list, model_config, tokenizer, sources, options, seed=FLAGS.seed,
                                   extra_len=FLAGS.extra_len, target_lang=target_lang, progress=bar.update)
  hypotheses = [tokenizer.decode(hyps[0].ids) if hyps else "" for hyps in lists]
  seconds = time.time() - start
  scores = _scores(hypotheses, references, lc_refs, target_lang, tokenizer.lowercase)
  scores.update(sentences=len(sources), seconds=seconds, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha,
                mbr_utility=FLAGS.mbr_utility, strategy=FLAGS.strategy, ensemble=FLAGS.ensemble,
                checkpoint=FLAGS.checkpoint or "latest")
  prefix = FLAGS.output_prefix or os.fspath(Workdir(FLAGS.workdir).eval_prefix(FLAGS.source))
  epath.Path(prefix + ".hyp").parent.mkdir(parents=True, exist_ok=True)
  epath.Path(prefix + ".hyp").write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
  epath.Path(prefix + ".json").write_text(json.dumps(scores, indent=2), encoding="utf-8")
  print(f"BLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})")
  print(f"chrF {scores['chrf']:.2f}  ({scores['chrf_signature']})")
  if "tokenized_bleu" in scores:
    print(f"tokenized compound-split BLEU {scores['tokenized_bleu']:.2f}  (paper style; not comparable to sacreBLEU)")
  if "lc_tok_bleu" in scores:
    print(f"lowercased tokenized BLEU {scores['lc_tok_bleu']:.2f}  (against {FLAGS.lc_tok_reference})")
  print(f"{len(sources)} sentences in {seconds:.1f}s; hypotheses: {prefix}.hyp; scores: {prefix}.json")


main = launch.program(_evaluate)


if __name__ == "__main__":
  launch.run(main)
