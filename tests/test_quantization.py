"""Weight-only int8 (`transformer_jax.decoding.quantization`, qwix): bytes, round trip, and the search run on int8 weights."""

import flax.linen as nn
import jax
import numpy as np
import pytest
import qwix

from transformer_jax.config import ModelConfig
from transformer_jax.decoding import generate, inference, quantization
from transformer_jax.training.steps import init_params


@pytest.fixture(scope="module")
def params_and_config():
  config = ModelConfig(vocab_size=512, d_model=64, d_ff=128, num_heads=4, num_encoder_layers=1,
                       num_decoder_layers=1, max_len=32)
  return nn.unbox(init_params(config, jax.random.key(0))), config


def test_int8_is_at_least_3_5x_smaller_and_each_channel_within_half_a_step(params_and_config):
  params, _ = params_and_config
  quantized = quantization.quantize_params(params, "int8")
  ratio = quantization.parameter_bytes(params) / quantization.parameter_bytes(quantized)
  assert ratio >= 3.5, ratio
  leaves = jax.tree_util.tree_leaves(quantized.tree, is_leaf=lambda x: isinstance(x, qwix.QArray))
  assert any(isinstance(x, qwix.QArray) and x.qvalue.dtype == np.int8 for x in leaves)
  for path, original in jax.tree_util.tree_flatten_with_path(params)[0]:
    restored = np.asarray(jax.tree_util.tree_flatten_with_path(quantized.dequantize())[0][
        [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]].index(path)][1])
    original = np.asarray(original)
    assert restored.shape == original.shape and restored.dtype == np.float32
    axes = quantization._channel_axes(jax.tree_util.keystr(path), original.ndim)
    if axes is not None:  # absmax per channel / 127 is one step; rounding is within half of it (+ float slack)
      contracted = tuple(a for a in range(original.ndim) if a not in axes)
      step = np.max(np.abs(original), axis=contracted, keepdims=True) / 127
      assert np.all(np.abs(restored - original) <= step * 0.5 + 1e-6), jax.tree_util.keystr(path)
    else:
      np.testing.assert_array_equal(restored, original)


def test_the_search_on_int8_weights_equals_the_search_on_their_dequantized_floats(params_and_config):
  params, config = params_and_config
  quantized = quantization.quantize_params(params, "int8")
  sources = [[5, 6, 7, 8, 3], [9, 10, 3], [11, 3]]
  options = generate.DecodeOptions(strategy="beam", beam_size=2, token_log_probs=False)
  on_int8 = inference.decode_ids(quantized, config, sources, options, extra_len=6)
  on_floats = inference.decode_ids(quantized.dequantize(), config, sources, options, extra_len=6)
  assert [[h.ids for h in hyps] for hyps in on_int8] == [[h.ids for h in hyps] for hyps in on_floats]
  np.testing.assert_allclose([h[0].log_prob for h in on_int8], [h[0].log_prob for h in on_floats], rtol=1e-5)


def test_no_quantization_returns_the_parameters_and_an_unknown_mode_is_refused(params_and_config):
  params, _ = params_and_config
  assert quantization.quantize_params(params, "") is params
  with pytest.raises(ValueError, match="--quantize='int4'; expected one of '', 'int8'"):
    quantization.quantize_params(params, "int4")
