r"""Score given translations with a trained workdir (forced decoding): per pair the model's log-probability.

    python -m experiments.score --workdir=DIR --source=test.en --target=test.de [--output=FILE]
        [--output_format=jsonl|tsv] [--checkpoint=STEP|DIR]

Per line pair: `log_prob` (natural log of p(target + EOS | source), the model's own, teacher forced:
`scoring.token_log_probs`, whose sum is `decode.sequence_log_probs`), `tokens` (target tokens, EOS included),
`perplexity` = exp(-log_prob / tokens) and, in JSONL, `token_log_probs` (one per token, then EOS's). TSV
writes `log_prob<TAB>tokens<TAB>perplexity`. A pair with a blank side scores `null` (JSONL) or empty fields
(TSV). For data filtering and quality estimation (fairseq `--score-reference`, CTranslate2 `score_batch`).
"""

import json
import math
import sys

from absl import flags
from etils import epath

import launch
from transformer_jax.decoding import inference
from transformer_jax.run import trained

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("source", None, "Source text file, one sentence per line.")
flags.DEFINE_string("target", None, "Target text file, aligned with --source.")
flags.DEFINE_string("output", None, "Output file (default: stdout).")
flags.DEFINE_enum("output_format", "jsonl", ["jsonl", "tsv"], "jsonl (with per-token log-probs) or tsv.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.mark_flags_as_required(["workdir", "source", "target"])
launch.check_files_exist("source", "target")
launch.check_output_files("output")


def _record(token_logps) -> dict:
  if not len(token_logps):
    return {"log_prob": None, "tokens": 0, "perplexity": None, "token_log_probs": []}
  log_prob = float(sum(float(x) for x in token_logps))
  return {"log_prob": log_prob, "tokens": len(token_logps), "perplexity": math.exp(-log_prob / len(token_logps)),
          "token_log_probs": [float(x) for x in token_logps]}


def _line(record: dict) -> str:
  if FLAGS.output_format == "jsonl":
    return json.dumps(record)
  if record["log_prob"] is None:
    return "\t\t"
  return f"{record['log_prob']:.6f}\t{record['tokens']}\t{record['perplexity']:.6f}"


@launch.program
def main():
  sources, targets = launch.read_lines(FLAGS.source), launch.read_lines(FLAGS.target)
  if len(sources) != len(targets):
    raise ValueError(f"{FLAGS.source} has {len(sources)} lines but {FLAGS.target} has {len(targets)} lines")
  model_config, params, tokenizer = trained.load(FLAGS.workdir, FLAGS.checkpoint)
  blank = [tokenizer.is_blank(s) or tokenizer.is_blank(t) for s, t in zip(sources, targets)]
  src_ids = [[] if b else tokenizer.encode(s) for s, b in zip(sources, blank)]
  tgt_ids = [[] if b else tokenizer.encode(t, target=True) for t, b in zip(targets, blank)]
  scores = inference.score_ids(params, model_config, src_ids, tgt_ids)
  records = [dict(line=i + 1, **_record(s)) for i, s in enumerate(scores)]
  with (epath.Path(FLAGS.output).open("w", encoding="utf-8") if FLAGS.output
        else open(sys.stdout.fileno(), "w", encoding="utf-8", closefd=False)) as stream:
    stream.writelines(_line(r) + "\n" for r in records)


if __name__ == "__main__":
  launch.run(main)
