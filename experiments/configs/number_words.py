"""The built-in task: English number words -> German number words (0..999,999), on a laptop CPU.

    python -m experiments.train --workdir=/tmp/number_words
    python -m experiments.train --config=experiments/configs/number_words.py --config.num_train_steps=100

Target: >= 98% exact match on held-out numbers in under 10 minutes on 2 CPU cores, training included.
"""

import dataclasses

import ml_collections

from transformer_jax import config as model_presets


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Model: the CPU preset, made smaller for this short task. vocab_size is set from the tokenizer.
  config.model = ml_collections.ConfigDict(dataclasses.asdict(model_presets.tiny(
      num_encoder_layers=2, num_decoder_layers=2, d_model=128, d_ff=512, num_heads=4, dropout_rate=0.0,
      max_len=64)))

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "number_words"
  config.data.builder_config = "default"
  config.data.tfds_data_dir = ""          # default: <workdir>/tfds
  config.data.vocab_path = ""             # default: <workdir>/vocab/spm.model
  config.data.vocab_size = 256
  config.data.vocab_model_type = "bpe"
  config.data.vocab_max_sentences = 100_000
  config.data.train_split = "train"
  config.data.eval_splits = ("validation",)
  config.data.test_split = "test"
  config.data.max_len = 64                # longest pair kept, and the packed row length
  config.data.tokens_per_batch = 2048     # slots per side per batch

  # Optimisation (section 5.3-5.4): Adam + the rsqrt schedule, label smoothing 0.1.
  config.num_train_steps = 1500
  config.warmup_steps = 300
  config.learning_rate = 1.0              # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.label_smoothing = 0.1
  config.grad_accum_steps = 1

  # Devices: a (data, fsdp, tensor) mesh, -1 = the remaining devices; multi-host via jax.distributed.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.distributed = False

  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.attention_diagnostics_rows = 16  # attention entropy per layer/head on this many eval pairs (0 = off)
  config.eval_tokens_per_batch = 8192
  config.checkpoint_every_steps = 500
  config.checkpoint_every_minutes = 0.0
  config.checkpoint_keep = 3
  config.checkpoint_best_metric = ""     # e.g. "validation/bleu" or "validation/loss": also keep the best
  config.async_checkpointing = True

  # Periodic validation BLEU (sacreBLEU on translations of the eval splits); 0 = off.
  config.bleu_every_steps = 0
  config.bleu_max_examples = 500
  config.bleu_beam_size = 1
  config.bleu_alpha = 0.6

  # After training: exact-match accuracy of greedy translations on the test split.
  config.final_eval = ml_collections.ConfigDict()
  config.final_eval.split = "test"
  config.final_eval.beam_size = 1
  config.final_eval.max_examples = 0      # 0 = the whole split
  return config
