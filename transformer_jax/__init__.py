"""transformer_jax: the Transformer of "Attention Is All You Need" as pure-functional Flax modules.

    >>> import transformer_jax as tj
    >>> config = tj.base(vocab_size=37000)
    >>> model = tj.Transformer(config)
    >>> variables = model.init(jax.random.key(0), inputs, targets)   # inputs [batch, src_len], targets [batch, tgt_len]
    >>> logits = model.apply(variables, inputs, targets)             # [batch, tgt_len, vocab]
"""

from transformer_jax.attention import MultiHeadAttention, dot_product_attention
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ModelConfig, base, big, tiny
from transformer_jax.model import Transformer, shift_right, sinusoid_table
from transformer_jax.sharding import partition
from transformer_jax.training import (TrainState, adam_with_schedule, create_train_state, eval_step, jit_eval_step,
                                      jit_train_step, label_smoothed_cross_entropy, normalized_loss, rsqrt_schedule,
                                      train_step)

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "ModelConfig", "MultiHeadAttention", "TrainState", "Transformer",
           "adam_with_schedule", "base", "big", "create_train_state", "dot_product_attention", "eval_step",
           "jit_eval_step", "jit_train_step", "label_smoothed_cross_entropy", "normalized_loss", "partition",
           "rsqrt_schedule", "shift_right", "sinusoid_table", "tiny", "train_step"]
__version__ = "0.1.0"
