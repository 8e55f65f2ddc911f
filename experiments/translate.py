r"""Translate text with a trained workdir: one output line per input line.

    echo "twenty-one" | python -m experiments.translate --workdir=DIR
    python -m experiments.translate --workdir=DIR --input=FILE --output=FILE [--beam_size=4] [--alpha=0.6]
        [--mbr_utility=chrf]

Empty input lines give empty output lines. `--checkpoint` takes a step number or a checkpoint directory
(e.g. one written by `experiments.average_checkpoints`).
"""

import sys

from absl import flags
from etils import epath
from tqdm import tqdm

from experiments import common, launch
from transformer_jax import inference

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("input", None, "Input text file (default: stdin).")
flags.DEFINE_string("output", None, "Output file (default: stdout).")
flags.DEFINE_integer("beam_size", 1, "Beam size; 1 = greedy (the paper uses 4).")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent ((5+|Y|)/6)^alpha (the paper uses 0.6).")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len.")
flags.DEFINE_string("mbr_utility", "", "'' = beam search's best; 'chrf' or 'bleu' = the minimum-Bayes-risk "
                    "choice from its beam_size-best list under that utility.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.mark_flags_as_required(["workdir"])
launch.check_flags(beam_size="decode.beam_size", alpha="decode.alpha", extra_len="decode.extra_len",
                   mbr_utility="decode.mbr_utility")
launch.check_mbr_beam()
launch.check_files_exist("input")
launch.check_output_files("output")


@common.program
def main():
  lines = common.read_lines(FLAGS.input)
  model_config, params, tokenizer = common.load_for_inference(FLAGS.workdir, FLAGS.checkpoint)
  with tqdm(total=len(lines), unit="sent", file=sys.stderr, disable=not FLAGS.input) as bar:
    outputs = inference.translate_texts(params, model_config, tokenizer, lines, beam_size=FLAGS.beam_size,
                                        alpha=FLAGS.alpha, extra_len=FLAGS.extra_len, mbr_utility=FLAGS.mbr_utility,
                                        target_lang=common.load_workdir_config(FLAGS.workdir).data.target_lang,
                                        progress=bar.update)
  with (epath.Path(FLAGS.output).open("w", encoding="utf-8") if FLAGS.output
        else open(sys.stdout.fileno(), "w", encoding="utf-8", closefd=False)) as stream:
    stream.writelines(line + "\n" for line in outputs)


if __name__ == "__main__":
  launch.run(main)
