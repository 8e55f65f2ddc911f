"""bfloat16 training (bf16 activations/matmuls, float32 params, optimizer state, softmax and loss)."""

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from transformer_jax.config import tiny
from transformer_jax.data import number_words
from transformer_jax.data.id_shards import write_id_arrays
from transformer_jax.data.pipeline import TrainStream
from transformer_jax.data.tokenizer import encode_pairs, train_tokenizer
from transformer_jax import sharding
from transformer_jax.training import optimizer
from transformer_jax.training.partitioned import jit_train_step
from transformer_jax.training.state import create_train_state

STEPS = 150
# bf16 keeps 8 mantissa bits. After 150 steps (mid-descent, where small numeric differences move the two
# trajectories apart) the bf16 run's mean loss over the last 10 steps must be at most 5% above fp32's;
# ending lower is fine. Seen: fp32 1.643 vs bf16 1.504.
TOLERANCE = 0.05


def _train(dtype, batches_fn, vocab_size):
  cfg = tiny(vocab_size=vocab_size, num_encoder_layers=2, num_decoder_layers=2, d_model=64, d_ff=256,
             num_heads=4, dropout_rate=0.0, max_len=64, dtype=dtype)
  tx = optimizer.adam_with_schedule(cfg.d_model, warmup_steps=50, scale=1.0)
  state = create_train_state(cfg, tx, jax.random.key(0))
  step = jit_train_step(cfg, sharding.single_device_mesh(), sharding.shardings_of(state))
  batches = batches_fn()
  # LLVM -O2, as a user's run: the suite compiles at -O0 (conftest.py), and this test's time is its 300 steps.
  step = step.lower(state, batches[0], jax.random.key(1)).compile(
      compiler_options={"xla_backend_optimization_level": 2})
  losses = []
  for batch in batches:
    state, metrics = step(state, batch, jax.random.key(1))
    losses.append(float(metrics["loss"]))
  return state, losses


def test_bf16_training_on_the_builtin_task_tracks_fp32(tmp_path):
  pairs = [(number_words.english(n), number_words.german(n))
           for n in np.random.default_rng(0).choice(1_000_000, 4000, replace=False)]
  tok = train_tokenizer((s for p in pairs for s in p), str(tmp_path / "spm.model"), vocab_size=128)
  sources, targets = encode_pairs(tok, pairs)
  shards = write_id_arrays(epath.Path(tmp_path) / "ids", {"test": 1}, sources, targets, tok.vocab_size)

  def batches():
    it = TrainStream(shards, tokens_per_batch=1024, row_length=32, pad_id=tok.pad_id, seed=0)
    return [next(it) for _ in range(STEPS)]

  fp32_state, fp32 = _train("float32", batches, tok.vocab_size)
  bf16_state, bf16 = _train("bfloat16", batches, tok.vocab_size)
  assert fp32[-1] < 0.5 * fp32[0]  # it learned
  final_fp32, final_bf16 = np.mean(fp32[-10:]), np.mean(bf16[-10:])
  assert final_bf16 <= (1 + TOLERANCE) * final_fp32, (final_fp32, final_bf16)
  assert bf16[-1] < 0.5 * bf16[0]  # bf16 learned too
  # Parameters and optimizer state stay float32 under bf16 compute.
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(bf16_state.params))
  assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree_util.tree_leaves(bf16_state.opt_state))
