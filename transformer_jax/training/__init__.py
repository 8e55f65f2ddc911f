"""Training: the paper's schedule and loss, the train state and the pure train/eval steps."""

from transformer_jax.training.loss import label_smoothed_cross_entropy, normalized_loss, token_weights
from transformer_jax.training.schedule import adam_with_schedule, rsqrt_schedule
from transformer_jax.training.steps import (TrainState, create_train_state, eval_step, init_params,
                                            jit_eval_step, jit_train_step, metrics_from_sums, train_step)
