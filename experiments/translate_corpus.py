r"""Translate a corpus into output shards: streamed, across hosts, resumable and exactly once (docs/serving.md).

    python -m experiments.translate_corpus --workdir=DIR --input=FILE_OR_DIR --output_dir=OUT [--beam_size=4]
        [--lines_per_shard=10000] [--strategy=sample --top_k=10 --seed=1] [--noise_delete=0.1
        --noise_filler=0.1 --noise_swap=3] [--tag='<BT>'] [--parallel_corpus=train] [--quantize=int8]
        [--distributed [--coordinator_address=HOST:PORT --num_processes=N --process_id=I]]

Writes OUT/shards/part-*, OUT/settings.json and, once every shard exists, OUT/manifest.json (with
--parallel_corpus=SPLIT also OUT/SPLIT.<source lang> = the inputs and OUT/SPLIT.<target lang> = the outputs:
a `data_dir` a training config reads). Rerun the same command after any interruption: finished shards are
kept, the rest translated, and the result is the bytes of one uninterrupted run. Another model or other
options against an existing OUT are refused. With --distributed every process runs this same command (each
with its --process_id) and translates its share of the shards (`transformer_jax.corpus`).
"""

import jax
from absl import flags

import launch
from experiments import decoding
from transformer_jax import multihost
from transformer_jax.data import noise
from transformer_jax.run import trained
from transformer_jax.serving import corpus

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_string("input", None, "A text file, or a directory of text files (read in name order); local or gs://.")
flags.DEFINE_string("output_dir", None, "Where the shards, settings.json and manifest.json go; local or gs://.")
flags.DEFINE_integer("lines_per_shard", 10_000, "Input lines per output shard (the unit of work and of resumption).")
flags.DEFINE_integer("beam_size", 1, "Beam size; 1 = greedy (the paper uses 4).")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent ((5+|Y|)/6)^alpha (the paper uses 0.6).")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len.")
flags.DEFINE_integer("max_tokens_per_batch", 4096, "Rows per batch = this // the padded source length.")
flags.DEFINE_float("noise_delete", 0.0, "Noised back-translation (Edunov et al., 2018): delete each output word "
                   "with this probability (they use 0.1).")
flags.DEFINE_float("noise_filler", 0.0, "Replace each output word with --noise_filler_token with this probability "
                   "(they use 0.1).")
flags.DEFINE_integer("noise_swap", 0, "Shuffle output words, each moving at most this far (they use 3).")
flags.DEFINE_string("noise_filler_token", "<BLANK>", "The filler word of --noise_filler.")
flags.DEFINE_string("tag", "", "Tagged back-translation (Caswell et al., 2019): this word, then a space, in front "
                    "of every non-empty output, e.g. '<BT>'.")
flags.DEFINE_string("parallel_corpus", "", "Also write OUT/<this>.<lang> for both languages (a split name).")
flags.DEFINE_bool("distributed", False, "Join the processes of this command with jax.distributed.")
flags.DEFINE_string("coordinator_address", None, "With --distributed: process 0's HOST:PORT (default: detected).")
flags.DEFINE_integer("num_processes", None, "With --distributed: how many processes (default: detected).")
flags.DEFINE_integer("process_id", None, "With --distributed: this process's id (default: detected).")
decoding.define_flags(nbest=False)
flags.mark_flags_as_required(["workdir", "input", "output_dir"])
launch.check_flags(beam_size="decode.beam_size", alpha="decode.alpha", extra_len="decode.extra_len")
launch.check_ranges(lines_per_shard=(1, 2147483647), max_tokens_per_batch=(1, 2147483647), noise_swap=(0, 2147483647),
                    num_processes=(1, 2147483647), process_id=(0, 2147483647))
flags.register_validator("parallel_corpus", lambda v: not v or v.isidentifier(),
                         message="--parallel_corpus must be a split name (letters, digits, underscores)")


def _initialize_distributed() -> None:
  if not FLAGS.distributed:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; accelerators use their own
  given = {"coordinator_address": FLAGS.coordinator_address, "num_processes": FLAGS.num_processes,
           "process_id": FLAGS.process_id}
  multihost.maybe_initialize_distributed(True, **{k: v for k, v in given.items() if v is not None})


def _translator() -> corpus.Translator:
  options = decoding.options(FLAGS.beam_size, FLAGS.alpha)
  noise_options = noise.NoiseOptions(FLAGS.noise_delete, FLAGS.noise_filler, FLAGS.noise_swap,
                                     FLAGS.noise_filler_token).check()
  model_config, params_list, tokenizer = decoding.load_models(FLAGS.workdir, FLAGS.checkpoint)
  return corpus.Translator(params_list if len(params_list) > 1 else params_list[0], model_config, tokenizer,
                           options, seed=FLAGS.seed, extra_len=FLAGS.extra_len,
                           max_tokens_per_batch=FLAGS.max_tokens_per_batch, noise=noise_options, tag=FLAGS.tag.strip())


@launch.program
def main():
  _initialize_distributed()
  translator = _translator()
  data = trained.workdir_config(FLAGS.workdir).data
  parallel = (FLAGS.parallel_corpus, data.source_lang, data.target_lang) if FLAGS.parallel_corpus else None
  settings = {**translator.settings(), "quantize": FLAGS.quantize}
  result = corpus.translate_corpus(translator, settings, FLAGS.input, FLAGS.output_dir,
                                   lines_per_shard=FLAGS.lines_per_shard, parallel_corpus=parallel)
  print(f"process {jax.process_index()}: translated {result.lines} lines into {result.shards} shards "
        f"({result.skipped} already finished); {result.manifest['lines']} lines in "
        f"{len(result.manifest['shards'])} shards: {FLAGS.output_dir}/manifest.json")


if __name__ == "__main__":
  launch.run(main)
