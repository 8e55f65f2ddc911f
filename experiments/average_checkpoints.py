r"""Average the parameters of the last N checkpoints (the paper: last 5 for base, last 20 for big).

    python -m experiments.average_checkpoints --workdir=DIR --last=5 --output=DIR/averaged
    python -m experiments.translate --workdir=DIR --checkpoint=DIR/averaged < input.txt

The output directory is a checkpoint directory like `<workdir>/checkpoints`, accepted by translate and
evaluate through `--checkpoint`.
"""

import os

from absl import flags
from etils import epath

import launch
from transformer_jax.run import checkpoint as checkpoint_lib, trained
from transformer_jax.workdir import Workdir, absolute

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_integer("last", None, "Average the newest N checkpoints (default: the run's "
                     "config.decode.average_last).")
flags.DEFINE_list("steps", None, "Explicit steps to average instead of --last.")
flags.DEFINE_string("output", None, "Output checkpoint directory (default: <workdir>/averaged).")
flags.mark_flags_as_required(["workdir"])
launch.check_flags(last="decode.average_last")


def _steps() -> list[int] | None:
  """`--steps` as integers, each once (ValueError naming the flag otherwise)."""
  if not FLAGS.steps:
    return None
  given = ",".join(FLAGS.steps)
  bad = [s for s in FLAGS.steps if not s.strip().isdigit()]
  if bad:
    raise ValueError(f"--steps={given}: {bad[0]!r} is not a step (a non-negative integer)")
  steps = [int(s) for s in FLAGS.steps]
  twice = sorted({s for s in steps if steps.count(s) > 1})
  if twice:
    raise ValueError(f"--steps={given}: step {twice[0]} is given twice; each checkpoint is averaged once")
  return steps


@launch.program
def main():
  source = os.fspath(Workdir(FLAGS.workdir).checkpoints)
  output = FLAGS.output or os.fspath(Workdir(FLAGS.workdir).averaged)
  if not epath.Path(source).is_dir():
    raise FileNotFoundError(f"{source} not found: is {FLAGS.workdir} the --workdir of a training run?")
  if absolute(output) == absolute(source):
    raise ValueError("--output must not be the run's own checkpoint directory")
  if epath.Path(output).exists() and not epath.Path(output).is_dir():
    raise ValueError(f"--output={output} is a file; expected a checkpoint directory (new, or one of averages)")
  steps = _steps()
  last = FLAGS.last or trained.workdir_config(FLAGS.workdir).decode.average_last
  step = checkpoint_lib.average_checkpoints(source, steps, last_n=None if steps else last,
                                            output_directory=output)
  print(f"wrote the average of {'steps ' + ','.join(map(str, steps)) if steps else f'the last {last} checkpoints'}"
        f" as step {step} in {output}")


if __name__ == "__main__":
  launch.run(main)
