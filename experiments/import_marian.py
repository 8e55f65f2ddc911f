r"""Import a Hugging Face Marian (OPUS-MT) model as a workdir that translate/evaluate/attention_map accept.

    python -m experiments.import_marian --model_dir=DIR --workdir=OUT

`DIR` is a `save_pretrained` directory (config.json, model.safetensors or pytorch_model.bin, source.spm,
target.spm, vocab.json). Unsupported variants (separate embeddings or vocabularies, pre-LN, learned positions,
...) and mismatched vocabulary files are refused with a one-line error; nothing is written then.
Needs the `interop` extra only for pytorch_model.bin weights (torch) and safetensors.
"""

from absl import flags

import launch
from transformer_jax.interop import marian
from transformer_jax.workdir import is_local

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "A save_pretrained MarianMTModel directory.")
flags.DEFINE_string("workdir", None, "The new workdir (must not exist or be empty).")
flags.mark_flags_as_required(["model_dir", "workdir"])


@launch.program
def main():
  if not is_local(FLAGS.workdir) or not is_local(FLAGS.model_dir):
    raise ValueError(f"--workdir={FLAGS.workdir} / --model_dir={FLAGS.model_dir}: the import reads and writes "
                     "local directories only (it renames a finished directory into place); import locally, then "
                     "copy the workdir up, e.g. gcloud storage cp -r")
  value = marian.import_to_workdir(FLAGS.model_dir, FLAGS.workdir)
  model = value["model"]
  print(f"Imported {FLAGS.model_dir} -> {FLAGS.workdir}: {model['num_encoder_layers']}+"
        f"{model['num_decoder_layers']} layers, d_model {model['d_model']}, vocabulary {model['vocab_size']}, "
        f"activation {model['activation']}")


if __name__ == "__main__":
  launch.run(main)
