r"""Export a workdir's model to a Hugging Face Marian directory or a CTranslate2 model directory.

    python -m experiments.export --workdir=DIR --format=marian --output=OUT
    python -m experiments.export --workdir=DIR --format=ctranslate2 --output=OUT [--quantization=int8]

The Marian directory loads with `MarianMTModel.from_pretrained` / `MarianTokenizer.from_pretrained`; the
CTranslate2 directory with `ctranslate2.Translator` (SentencePiece models included). Both translate as ours when
used as their documentation uses a Marian model (raw text to `MarianTokenizer`; `source.spm` pieces with nothing
appended to CTranslate2): what the runtime must add is written into the export (docs/interop.md, "What the
exported models add by themselves"). Needs the `interop` extra.
"""

import os

from absl import flags

import launch
from transformer_jax.interop import ctranslate2 as ct2
from transformer_jax.interop import marian
from transformer_jax.run import trained
from transformer_jax.workdir import is_local

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A training run's (or an imported model's) --workdir.")
flags.DEFINE_enum("format", None, ["marian", "ctranslate2"], "Output format.")
flags.DEFINE_string("output", None, "Output directory (must not exist or be empty).")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_string("quantization", None, "CTranslate2 weight type, e.g. int8 (default: float32).")
flags.mark_flags_as_required(["workdir", "format", "output"])


def tokenizer_files(tokenizer) -> str:
  """Our spm.model path, or the directory of an imported model's Marian tokenizer files."""
  return tokenizer.path


@launch.program
def main():
  if not is_local(FLAGS.output) or not is_local(FLAGS.workdir):
    raise ValueError(f"--output={FLAGS.output} / --workdir={FLAGS.workdir}: export reads and writes local "
                     "directories only (CTranslate2 and transformers load local files); copy the workdir down "
                     "first, e.g. gcloud storage cp -r")
  if os.path.exists(FLAGS.output) and not os.path.isdir(FLAGS.output):
    raise FileExistsError(f"--output={FLAGS.output} is a file; expected a new (or empty) directory")
  if os.path.isdir(FLAGS.output) and os.listdir(FLAGS.output):
    raise FileExistsError(f"{FLAGS.output} exists and is not empty; choose a new --output")
  model_config, params, tokenizer = trained.load(FLAGS.workdir, FLAGS.checkpoint)
  data = trained.workdir_config(FLAGS.workdir).data
  if FLAGS.format == "marian":
    marian.save_marian(params, model_config, FLAGS.output, tokenizer_path=tokenizer_files(tokenizer),
                       source_lang=data.source_lang, target_lang=data.target_lang)
  else:
    ct2.export_ctranslate2(params, model_config, FLAGS.output, tokenizer_path=tokenizer_files(tokenizer),
                           quantization=FLAGS.quantization)
  print(f"Exported {FLAGS.workdir} ({FLAGS.format}) -> {FLAGS.output}")
  if FLAGS.format == "ctranslate2":  # docs/interop.md, "What the exported models add by themselves"
    print(f"Feed ctranslate2.Translator the pieces of {os.path.join(FLAGS.output, 'source.spm')} with nothing "
          f"appended: the model adds </s> itself (contract: {os.path.join(FLAGS.output, ct2.EXPORT_INFO)})")


if __name__ == "__main__":
  launch.run(main)
