r"""Choose the decoding settings on a development split: checkpoints averaged x beam size x α x MBR utility.

    python -m experiments.tune_decoding --workdir=DIR --source=val.en --reference=val.de \
        [--average_last=1,5,10,ema] [--beam_sizes=4,5] [--alphas=0.4,0.6,0.8,1.0] [--mbr_utilities=none,chrf]
        [--ensemble_last=2] [--extra_len=50] [--report=FILE]

For every number of checkpoints N in `--average_last` (the newest N of the run, averaged as
`experiments.average_checkpoints` does, into a temporary directory; 1 = the newest checkpoint alone; `ema` = the
moving average of the parameters a run with `ema_decay` > 0 keeps, from its newest checkpoint) and every
beam size, α and MBR utility (`none` = beam search's best; `chrf`/`bleu` = the minimum-Bayes-risk choice from
the beam's n-best list, `transformer_jax.decoding.mbr`), translates `--source` and scores cased sacreBLEU against
`--reference`; prints one table row per setting and the best one, and writes every row as JSON to `--report`
(default `<workdir>/eval/tune_decoding.json`; the utilities of one beam size and α choose from one n-best list,
decoded once, and share its seconds). Greedy (beam 1) ignores α and MBR. Score a test set once, afterwards, with
the chosen settings (`experiments.evaluate`); tuning on it would fit the test set. `--ensemble_last=N` adds,
per beam size and α, the ensemble of the newest N checkpoints (`transformer_jax.decoding.ensemble`: per-step
log-probs averaged in one compiled search), to set beside the average of their weights.
"""

import os
import tempfile
import time

from absl import flags

import launch
from transformer_jax.decoding import generate, inference, mbr
from transformer_jax.evaluation import metrics
from transformer_jax.run import checkpoint as checkpoint_lib, trained
from transformer_jax.run import experiment_config
from transformer_jax.workdir import Workdir, write_json_atomically

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("source", None, "Development source text, one sentence per line.")
flags.DEFINE_string("reference", None, "Development references, aligned with --source.")
flags.DEFINE_list("average_last", ["1"], "Numbers of newest checkpoints to average (1 = the newest alone); "
                  "'ema' = the moving average of the parameters in the newest (a run with ema_decay > 0).")
flags.DEFINE_list("beam_sizes", ["4"], "Beam sizes (1 = greedy).")
flags.DEFINE_list("alphas", ["0.6"], "GNMT length penalty exponents.")
flags.DEFINE_list("mbr_utilities", ["none"], "MBR utilities: none (the beam's best), chrf, bleu.")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len.")
flags.DEFINE_list("ensemble_last", [], "Also decode the ensemble of the newest N checkpoints (per-step log-probs "
                  "averaged, transformer_jax.decoding.ensemble), for each N given (>= 2), beside their weight average.")
flags.DEFINE_string("report", None, "JSON file for every row (default: <workdir>/eval/tune_decoding.json).")
flags.mark_flags_as_required(["workdir", "source", "reference"])
launch.check_flags(extra_len="decode.extra_len")
launch.check_files_exist("source", "reference")
launch.check_output_files("report")


def _grid() -> tuple[list[int | str], list[int], list[float], list[str]]:
  """The four flag lists as numbers (`ema` kept as is in `--average_last`) and utilities ('' for none), each
  non-empty and checked against its config key's rule (one-line errors)."""
  def parse(values, kind, key, flag, words=()):
    _check_nonempty(values, flag)
    out = []
    for value in values:
      if value in words:
        out.append(value)
        continue
      try:
        out.append(kind(value))
      except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise ValueError(f"--{flag}={','.join(values)}: {value!r} is not {wanted}") from None
      experiment_config.check_value(key, out[-1], f"--{flag}")
    return out

  return (parse(FLAGS.average_last, int, "decode.average_last", "average_last", words=("ema",)),
          parse(FLAGS.beam_sizes, int, "decode.beam_size", "beam_sizes"),
          parse(FLAGS.alphas, float, "decode.alpha", "alphas"),
          _utilities())


def _check_nonempty(values: list, flag: str) -> None:
  if not values:
    raise ValueError(f"--{flag} is empty: give at least one value")


def _utilities() -> list[str]:
  """`--mbr_utilities` as `decode.mbr_utility` values: 'none' -> ''."""
  _check_nonempty(FLAGS.mbr_utilities, "mbr_utilities")
  for value in FLAGS.mbr_utilities:
    if value != "none" and value not in mbr.UTILITIES:
      raise ValueError(f"--mbr_utilities={','.join(FLAGS.mbr_utilities)}: {value!r} is not one of none, "
                       f"{', '.join(mbr.UTILITIES)}")
  return ["" if value == "none" else value for value in FLAGS.mbr_utilities]


def _params_of_newest(workdir: str, n: int | str, scratch: str):
  """(model_config, params, tokenizer) with the mean of the newest `n` checkpoints' parameters, or for
  `n == "ema"` the moving average of the parameters in the newest checkpoint (a run with `ema_decay` > 0)."""
  if n == "ema":
    return trained.load(workdir, ema=True)
  if n == 1:
    return trained.load(workdir, ema=False)
  output = os.path.join(scratch, f"average_{n}")
  checkpoint_lib.average_checkpoints(os.fspath(Workdir(workdir).checkpoints), last_n=n, output_directory=output)
  return trained.load(workdir, output)


def _ensemble_counts() -> list[int]:
  """`--ensemble_last` as integers >= 2 (one-line ValueError otherwise)."""
  for value in FLAGS.ensemble_last:
    if not value.isdigit() or int(value) < 2:
      raise ValueError(f"--ensemble_last={','.join(FLAGS.ensemble_last)}: {value!r} is not an integer >= 2")
  return [int(v) for v in FLAGS.ensemble_last]


def _ensemble_rows(counts, beams, alphas, sources, references, target_lang: str) -> list[dict]:
  """One row per `--ensemble_last` N and (beam, alpha): the ensemble of the newest N checkpoints."""
  with checkpoint_lib.Checkpointer(os.fspath(Workdir(FLAGS.workdir).checkpoints), read_only=True) as checkpointer:
    steps = checkpointer.all_steps()
  rows = []
  for n in counts:
    models = [trained.load(FLAGS.workdir, str(step), ema=False) for step in steps[-n:]]
    model_config, tokenizer = models[0][0], models[0][2]
    for beam, alpha in [(b, a) for b in beams for a in (alphas if b > 1 else alphas[:1])]:
      start = time.perf_counter()
      options = generate.DecodeOptions(beam_size=beam, alpha=alpha, token_log_probs=False)
      lists = inference.decode_texts([m[1] for m in models], model_config, tokenizer, sources, options,
                                     extra_len=FLAGS.extra_len)
      seconds = time.perf_counter() - start
      hypotheses = [tokenizer.decode(hyps[0].ids) if hyps else "" for hyps in lists]
      scores = metrics.sacrebleu_scores(hypotheses, references, lowercase=tokenizer.lowercase,
                                        target_lang=target_lang)
      rows.append({"ensemble_last": n, "steps": steps[-n:], "beam_size": beam, "alpha": alpha if beam > 1 else None,
                   "mbr_utility": "", "bleu": scores["bleu"], "chrf": scores["chrf"], "seconds": seconds,
                   "bleu_signature": scores["bleu_signature"]})
      print(f"ensemble of the newest {n} ({steps[-n:]}) | beam {beam:>2} | alpha {alpha if beam > 1 else '-':>4} | "
            f"BLEU {scores['bleu']:6.2f} | chrF {scores['chrf']:6.2f} | {seconds:6.1f}s", flush=True)
  return rows


@launch.program
def main():
  sources, references = launch.read_lines(FLAGS.source), launch.read_lines(FLAGS.reference)
  if len(sources) != len(references):
    raise ValueError(f"{FLAGS.source} has {len(sources)} lines but {FLAGS.reference} has {len(references)}")
  averages, beams, alphas, utilities = _grid()
  ensembles = _ensemble_counts()
  target_lang = trained.workdir_config(FLAGS.workdir).data.target_lang
  metrics.bleu_metric(target_lang)  # BLEU's tokenizer for the target language loads, before any decoding
  if "ema" in averages and not trained.workdir_config(FLAGS.workdir).ema_decay:
    raise ValueError(f"--average_last={','.join(FLAGS.average_last)}: {FLAGS.workdir} was trained without a moving "
                     "average of the parameters (config.ema_decay 0)")
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    for n in averages:
      model_config, params, tokenizer = _params_of_newest(FLAGS.workdir, n, scratch)
      for beam, alpha in [(b, a) for b in beams for a in (alphas if b > 1 else alphas[:1])]:  # greedy: one row
        start = time.perf_counter()
        if beam == 1 or utilities == [""]:
          outputs = {"": inference.translate_texts(params, model_config, tokenizer, sources, beam_size=beam,
                                                   alpha=alpha, extra_len=FLAGS.extra_len)}
        else:  # one n-best list per setting; each utility chooses from the same lists
          lists = inference.decode_texts(params, model_config, tokenizer, sources,
                                         generate.DecodeOptions(beam_size=beam, alpha=alpha, nbest=beam,
                                                                token_log_probs=False), extra_len=FLAGS.extra_len)
          outputs = {utility: [tokenizer.decode(hyps[0].ids) if hyps else "" for hyps in
                               inference.mbr_first(lists, tokenizer, utility, target_lang)] for utility in utilities}
        seconds = time.perf_counter() - start
        for utility, hypotheses in outputs.items():
          scores = metrics.sacrebleu_scores(hypotheses, references, lowercase=tokenizer.lowercase,
                                            target_lang=target_lang)
          rows.append({"average_last": n, "beam_size": beam, "alpha": alpha if beam > 1 else None,
                       "mbr_utility": utility, "bleu": scores["bleu"], "chrf": scores["chrf"],
                       "seconds": seconds, "bleu_signature": scores["bleu_signature"]})
          print(f"average_last {n:>3} | beam {beam:>2} | alpha {alpha if beam > 1 else '-':>4} | "
                f"mbr {utility or '-':>4} | BLEU {scores['bleu']:6.2f} | chrF {scores['chrf']:6.2f} | "
                f"{seconds:6.1f}s", flush=True)
  rows += _ensemble_rows(ensembles, beams, alphas, sources, references, target_lang)
  best = max(rows, key=lambda r: r["bleu"])
  weights = (f"average_last {best['average_last']}" if "average_last" in best
             else f"ensemble of the newest {best['ensemble_last']}")
  print(f"best on {os.path.basename(FLAGS.source)}: {weights}, beam {best['beam_size']}, "
        f"alpha {best['alpha']}, mbr {best['mbr_utility'] or 'none'} -> BLEU {best['bleu']:.2f} "
        f"({best['bleu_signature']})")
  report = FLAGS.report or os.fspath(Workdir(FLAGS.workdir).tune_decoding_json)
  write_json_atomically(report, {"source": FLAGS.source, "reference": FLAGS.reference, "rows": rows, "best": best})


if __name__ == "__main__":
  launch.run(main)
