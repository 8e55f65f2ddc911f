"""Multi30k EN->DE on a 2-core CPU: train, average the last checkpoints and evaluate in under an hour.

    python -m experiments.multi30k --workdir=runs/multi30k --config.data.dir=../shared/data/multi30k

(`experiments.multi30k` runs training, checkpoint averaging and test2016 scoring in one go; the plain
`experiments.train` with this config trains only.) The corpus is read from `data.dir`; nothing is copied.
Tuned on `val` only; test2016 is scored once per recipe change.
"""

import dataclasses

import ml_collections

from transformer_jax import config as model_presets


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # A small model (3+3 layers, d_model 256, d_ff 512), post-LN as in the paper; dropout 0.2 for 29k pairs.
  config.model = ml_collections.ConfigDict(dataclasses.asdict(model_presets.tiny(
      num_encoder_layers=3, num_decoder_layers=3, d_model=256, d_ff=512, num_heads=4, dropout_rate=0.2,
      max_len=160)))

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "parallel_text"
  config.data.dir = "../shared/data/multi30k"
  config.data.source_lang = "en"
  config.data.target_lang = "de"
  config.data.builder_config = ""
  config.data.tfds_data_dir = ""
  config.data.vocab_path = ""
  config.data.vocab_size = 6000           # one joint BPE vocabulary for both languages
  config.data.vocab_model_type = "bpe"
  config.data.vocab_max_sentences = 100_000
  config.data.train_split = "train"
  config.data.eval_splits = ("val",)
  config.data.test_split = "test2016"
  config.data.max_len = 128
  config.data.tokens_per_batch = 4096

  config.num_train_steps = 1600
  config.warmup_steps = 600
  config.learning_rate = 1.0
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.label_smoothing = 0.1
  config.grad_accum_steps = 1

  # Devices: a (data, fsdp, tensor) mesh, -1 = the remaining devices; multi-host via jax.distributed.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.distributed = False

  config.log_every_steps = 100
  config.eval_every_steps = 200
  config.attention_diagnostics_rows = 16  # attention entropy per layer/head on this many eval pairs (0 = off)
  config.eval_tokens_per_batch = 8192
  config.checkpoint_every_steps = 100
  config.checkpoint_every_minutes = 0.0
  config.checkpoint_keep = 5
  config.checkpoint_best_metric = ""
  config.async_checkpointing = True

  config.bleu_every_steps = 400
  config.bleu_max_examples = 1014
  config.bleu_beam_size = 1
  config.bleu_alpha = 0.6

  # After training: average the last checkpoints, then translate test2016 with beam search.
  config.final_eval = ml_collections.ConfigDict()
  config.final_eval.split = ""            # exact match makes no sense here; experiments.multi30k scores BLEU
  config.final_eval.beam_size = 5
  config.final_eval.max_examples = 0
  config.decode = ml_collections.ConfigDict(dict(beam_size=5, alpha=0.6, extra_len=50))
  config.average_last = 5
  return config
