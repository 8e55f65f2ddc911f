"""Training's pure pieces: the paper's schedule, optimizer and loss, the train state and the train/eval steps.

Nothing here imports anything above `model` and `sharding`; the orchestration is `transformer_jax.run.trainer`.
The train state is born sharded (`state.create_train_state`) and the steps run partitioned
(`partitioned.jit_train_step` / `jit_eval_step`) through `sharding.partition`, the one jit road.
"""

from transformer_jax.training.loss import label_smoothed_cross_entropy, normalized_loss, token_weights
from transformer_jax.training.optimizer import adam, adam_with_schedule, ema_params, param_ema
from transformer_jax.training.partitioned import jit_eval_step, jit_train_step
from transformer_jax.training.schedule import cooldown, cooldown_progress, dropout_rate, rsqrt_schedule
from transformer_jax.training.state import create_train_state
from transformer_jax.training.steps import TrainState, eval_step, init_params, metrics_from_sums, train_step

__all__ = ["TrainState", "adam", "adam_with_schedule", "cooldown", "cooldown_progress", "create_train_state",
           "dropout_rate", "ema_params", "eval_step", "init_params", "jit_eval_step", "jit_train_step",
           "label_smoothed_cross_entropy", "metrics_from_sums", "normalized_loss", "param_ema", "rsqrt_schedule",
           "token_weights", "train_step"]
