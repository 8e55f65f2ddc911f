r"""Draw attention heatmaps (encoder self, decoder self, cross; every layer and head) for one sentence.

    python -m experiments.attention_map --workdir=DIR --source="twenty-one" [--target="einundzwanzig"] \
        --output=attention.png

Without --target the model's own greedy translation is used. Also prints, per layer and head, the mean
entropy of the attention distribution and which heads are near-uniform (`transformer_jax.evaluation.diagnostics`).
"""

import jax.numpy as jnp
from absl import flags

import launch
from transformer_jax.decoding import inference
from transformer_jax.evaluation import diagnostics, visualize
from transformer_jax.run import trained

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("source", None, "Source sentence.")
flags.DEFINE_string("target", None, "Target sentence (default: the model's greedy translation).")
flags.DEFINE_string("output", "attention.png", "PNG file to write.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
launch.check_output_files("output")
flags.mark_flags_as_required(["workdir", "source"])


def _draw() -> None:
  model_config, params, tokenizer = trained.load(FLAGS.workdir, FLAGS.checkpoint)
  target = FLAGS.target
  if target is None:
    target = inference.translate_texts(params, model_config, tokenizer, [FLAGS.source])[0]
  source_ids, target_ids = tokenizer.encode(FLAGS.source), tokenizer.encode(target, target=True)
  maps = visualize.attention_maps(params, model_config, source_ids, target_ids)
  visualize.plot_attention(maps, tokenizer.pieces(source_ids), tokenizer.pieces(target_ids), FLAGS.output)
  statistics = diagnostics.attention_statistics(params, model_config, jnp.asarray([source_ids], jnp.int32),
                                                jnp.asarray([target_ids], jnp.int32))
  print(f"{FLAGS.source} -> {target}\nwrote {FLAGS.output}")
  print(diagnostics.format_table(statistics))


main = launch.program(_draw)


if __name__ == "__main__":
  launch.run(main)
