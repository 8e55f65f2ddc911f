r"""Translate text with a trained workdir: one output line per input line (or one JSON object per input line).

    echo "twenty-one" | python -m experiments.translate --workdir=DIR
    python -m experiments.translate --workdir=DIR --input=FILE --output=FILE [--beam_size=4] [--alpha=0.6]
        [--mbr_utility=chrf] [--nbest=4 --output_format=jsonl] [--strategy=sample --top_p=0.9 --seed=1]
        [--prefix_file=FILE] [--constraints_file=FILE] [--print_alignment] [--ensemble=STEP_OR_DIR,...]

Empty input lines give empty output lines. `--checkpoint` takes a step number or a checkpoint directory
(e.g. one written by `experiments.average_checkpoints`). `--output_format=text` writes each input line's
`--nbest` hypotheses on `--nbest` lines (empty where fewer finished), with `--print_alignment` followed by a tab
and the Pharaoh alignment; `jsonl` writes per input line `{"line", "hypotheses": [{"text", "ids", "log_prob",
"score", "token_log_probs", "alignment"}], "finished"}` (beam search keeps going until `--nbest` hypotheses have
finished: `finished`, their count, is smaller only where the length limit left no room, also warned on stderr
with the count; `log_prob`: natural log, EOS included; `score`: length-normalised,
GNMT alpha; `token_log_probs`: one per token, then EOS's; with `--constraints_file`, `constraints_met`: whether
every phrase appears, false only where the length limit left no room, also warned on stderr). docs/decoding.md
has one example per flag.
"""

import json
import logging
import sys

from absl import flags
from etils import epath
from tqdm import tqdm

import launch
from experiments import decoding
from transformer_jax.decoding import alignment, constraints, inference
from transformer_jax.run import trained

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("input", None, "Input text file (default: stdin).")
flags.DEFINE_string("output", None, "Output file (default: stdout).")
flags.DEFINE_integer("beam_size", 1, "Beam size; 1 = greedy (the paper uses 4).")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent ((5+|Y|)/6)^alpha (the paper uses 0.6).")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len.")
flags.DEFINE_string("mbr_utility", "", "'' = beam search's order; 'chrf' or 'bleu' = the minimum-Bayes-risk "
                    "choice from its beam_size-best list under that utility first.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_enum("output_format", "text", ["text", "jsonl"], "text: the hypotheses' text; jsonl: with scores.")
flags.DEFINE_string("prefix_file", None, "Target prefixes, one per input line ('' = none): each output starts "
                    "with its prefix (forced), then decoding continues.")
flags.DEFINE_string("constraints_file", None, "Lexical constraints, one line per input line: tab-separated target "
                    "phrases that must appear in the output (constrained beam search with dynamic beam allocation, "
                    "Post & Vilar 2018; needs --strategy=beam and --beam_size >= 2).")
flags.DEFINE_bool("print_alignment", False, "Source-target token alignment from the cross-attention (Pharaoh i-j).")
decoding.define_flags(nbest=True)
flags.mark_flags_as_required(["workdir"])
launch.check_flags(beam_size="decode.beam_size", alpha="decode.alpha", extra_len="decode.extra_len")
launch.check_files_exist("input", "prefix_file", "constraints_file")
launch.check_output_files("output")


def _lines_per_input(flag: str, count: int, what: str) -> list[str] | None:
  """The lines of the file `--<flag>` names, one per input line (ValueError naming both counts otherwise)."""
  path = FLAGS[flag].value
  if not path:
    return None
  lines = launch.read_lines(path)
  if len(lines) != count:
    raise ValueError(f"--{flag}={path} has {len(lines)} lines but the input has {count}: one {what} per input "
                     "line is needed")
  return lines


def _read_prefixes(count: int):
  return _lines_per_input("prefix_file", count, "prefix")


def _read_constraints(count: int):
  lines = _lines_per_input("constraints_file", count, "line of tab-separated phrases")
  return None if lines is None else [[p for p in line.split("\t") if p.strip()] for line in lines]


def _check_combinations() -> None:
  if FLAGS.constraints_file and (FLAGS.strategy != "beam" or FLAGS.beam_size < 2):
    raise ValueError("--constraints_file needs beam search: --strategy=beam and --beam_size >= 2 (got "
                     f"--strategy={FLAGS.strategy}, --beam_size={FLAGS.beam_size})")


def _records(lines, lists, tokenizer, phrases):
  for i, (line, hyps) in enumerate(zip(lines, lists)):
    wanted = [tokenizer.encode(p, add_eos=False, target=True) for p in phrases[i]] if phrases else None
    records = []
    for h in hyps:
      record = {"text": tokenizer.decode(h.ids), "ids": h.ids, "log_prob": h.log_prob, "score": h.score,
                "token_log_probs": h.token_log_probs}
      if h.alignment is not None:
        record["alignment"] = alignment.pharaoh(h.alignment)
      if wanted is not None:
        record["constraints_met"] = constraints.satisfied(h.ids, wanted)
        if not record["constraints_met"]:
          logging.warning("line %d: the constraints %s could not all be met within the length limit", i + 1,
                          phrases[i])
      records.append(record)
    finished = sum(h.finished for h in hyps)
    if line.strip() and 1 < FLAGS.nbest and finished < FLAGS.nbest:
      logging.warning("line %d: %d of the %d hypotheses of --nbest finished within the length limit "
                      "(--extra_len=%d)", i + 1, finished, FLAGS.nbest, FLAGS.extra_len)
    yield {"line": i + 1, "source": line, "hypotheses": records, "finished": finished}


def _text_lines(records):
  for record in records:
    hyps = record["hypotheses"]
    for k in range(FLAGS.nbest):
      hyp = hyps[k] if k < len(hyps) else {"text": "", "alignment": ""}
      yield hyp["text"] + ("\t" + hyp.get("alignment", "") if FLAGS.print_alignment else "")


@launch.program
def main():
  lines = launch.read_lines(FLAGS.input)
  prefixes = _read_prefixes(len(lines))
  phrases = _read_constraints(len(lines))
  _check_combinations()
  options = decoding.options(FLAGS.beam_size, FLAGS.alpha, nbest=FLAGS.nbest, mbr_utility=FLAGS.mbr_utility,
                             alignment=FLAGS.print_alignment, token_log_probs=FLAGS.output_format == "jsonl")
  model_config, params_list, tokenizer = decoding.load_models(FLAGS.workdir, FLAGS.checkpoint)
  target_lang = trained.workdir_config(FLAGS.workdir).data.target_lang  # MBR's BLEU tokenises for it
  with tqdm(total=len(lines), unit="sent", file=sys.stderr, disable=not FLAGS.input) as bar:
    lists = inference.decode_texts(params_list, model_config, tokenizer, lines, options, prefixes=prefixes,
                                   constraints=phrases, seed=FLAGS.seed, extra_len=FLAGS.extra_len,
                                   target_lang=target_lang, progress=bar.update)
  records = list(_records(lines, lists, tokenizer, phrases))
  outputs = (json.dumps(r, ensure_ascii=False) for r in records) if FLAGS.output_format == "jsonl" else (
      _text_lines(records))
  with (epath.Path(FLAGS.output).open("w", encoding="utf-8") if FLAGS.output
        else open(sys.stdout.fileno(), "w", encoding="utf-8", closefd=False)) as stream:
    stream.writelines(line + "\n" for line in outputs)


if __name__ == "__main__":
  launch.run(main)
