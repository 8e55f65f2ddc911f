r"""Train a Transformer from an ml_collections config file.

    python -m experiments.train --workdir=DIR [--config=experiments/configs/NAME.py] [--config.a.b=value ...]

With no --config the built-in number-words task is trained. Re-running with the same --workdir resumes from
its latest checkpoint. A --workdir made by `experiments.import_marian` is fine-tuned: its model and tokenizer
come from the workdir, and a --config.model.* flag that contradicts them is refused (docs/interop.md).
"""

import os

from absl import flags
from ml_collections import config_flags

import launch
from transformer_jax.run import imported_workdir, trainer
from transformer_jax.run.experiment_config import ExperimentConfig

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "number_words.py")

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, vocabulary, config and TensorBoard events.")
launch.define_config_flag(_DEFAULT_CONFIG, "Experiment config file (default: the built-in number-words task).")
flags.mark_flags_as_required(["workdir"])


@launch.program
def main():
  # An imported model's workdir fixes the model and tokenizer; the flags given must agree with them.
  config = imported_workdir.config_for_workdir(ExperimentConfig.from_config_dict(FLAGS.config), FLAGS.workdir,
                                               explicit=config_flags.get_override_values(FLAGS["config"]))
  result = trainer.train_and_evaluate(config, FLAGS.workdir)
  launch.report_final_eval(config, FLAGS.workdir, result)


if __name__ == "__main__":
  launch.run(main)
