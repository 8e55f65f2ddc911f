"""The built-in task: English number words -> German number words (0..999,999), on a laptop CPU.

    python -m experiments.train --workdir=/tmp/number_words
    python -m experiments.train --config=experiments/configs/number_words.py --config.num_train_steps=100

Target: >= 98% exact match on held-out numbers in under 10 minutes on 2 CPU cores, training included.
Only what differs from `default.py`.
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()

  # Model: a 2+2-layer d_model 128 model, no dropout (the task has no noise). vocab_size: from the tokenizer.
  config.model.update(num_encoder_layers=2, num_decoder_layers=2, d_model=128, d_ff=512, num_heads=4,
                      dropout_rate=0.0, max_len=64)

  config.data.dataset = "number_words"
  config.data.vocab_size = 256
  config.data.vocab_max_sentences = 100_000
  config.data.max_len = 64
  config.data.tokens_per_batch = 2048

  config.num_train_steps = 1500
  config.warmup_steps = 300

  config.evals.loss.every_steps = 500
  config.evals.attention.every_steps = 500
  config.evals.loss.tokens_per_batch = 8192
  config.evals.bleu.max_examples = 500
  config.checkpoint_every_steps = 500
  config.checkpoint_every_minutes = 0.0
  config.checkpoint_keep = 3

  # After training: exact-match accuracy of greedy translations on the test split.
  config.decode.beam_size = 1
  return config
