"""The searches give the numbers they gave before they were rebuilt over a step function.

`tests/data/decode_reference.npz` holds greedy, beam and sampled outputs (tokens, scores, log-probs, steps) on
fixed random weights, written by this file's `__main__` from the implementation at commit 7ae5a38 (the
searches that built `Transformer(config)` themselves):

    git archive 7ae5a38 | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/test_decode_reference.py tests/data/decode_reference.npz

`reference_outputs` calls only the Transformer-level wrappers (`decoding.greedy_search`, `beam_search`,
`sample`), whose signatures both implementations share. Tokens and step counts must match exactly; scores
and log-probs to 1e-5 (the cached attention may sum in another order).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from test_decode import CFG, L, PARAMS, SRC, make_sources, small
from transformer_jax import decoding
from transformer_jax.model import Transformer

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "decode_reference.npz")


def _second_model():
  """Shared embeddings (tied logits), sinusoidal positions, 2+2 layers, plain random init."""
  cfg = small(vocab_size=24, num_encoder_layers=2, num_decoder_layers=2, share_embeddings=True)
  ids = jnp.ones((1, 4), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(3), ids, ids)["params"]
  return cfg, params, make_sources(2, 5, cfg.vocab_size, max_len=7)


def reference_outputs() -> dict:
  out = {}
  limits = jnp.array([1, 3, 5, L, 2, 7, L, 4], jnp.int32)
  out["greedy"] = decoding.greedy_search(PARAMS, CFG, SRC, L)
  out["greedy_limits"] = decoding.greedy_search(PARAMS, CFG, SRC, L, max_lengths=limits)
  for early_stop in ("best", "all", "none"):
    out[f"beam4_{early_stop}"] = decoding.beam_search(PARAMS, CFG, SRC, 4, 0.6, L, early_stop=early_stop,
                                                      full_output=True)
  out["beam3_limits"] = decoding.beam_search(PARAMS, CFG, SRC, 3, 1.0, L, max_lengths=limits, full_output=True)
  out["beam1"] = decoding.beam_search(PARAMS, CFG, SRC, 1, 0.6, L, full_output=True)
  out["sample_t15_k3"] = decoding.sample(PARAMS, CFG, SRC, jax.random.key(0), L, temperature=1.5, top_k=3)
  out["sample_t07"] = decoding.sample(PARAMS, CFG, SRC, jax.random.key(1), L, temperature=0.7)
  cfg, params, src = _second_model()
  out["tied_greedy"] = decoding.greedy_search(params, cfg, src, 12)
  out["tied_beam5"] = decoding.beam_search(params, cfg, src, 5, 0.6, 12, full_output=True)
  flat = {}
  for name, arrays in out.items():
    for i, array in enumerate(arrays):
      flat[f"{name}/{i}"] = np.asarray(array)
  return flat


def test_searches_match_the_saved_reference():
  saved = np.load(REFERENCE)
  now = reference_outputs()
  # Beam search's full output has since grown a fifth field, the per-token log-probs: they sum to field 2.
  new = {key for key in now if key.endswith("/4")}
  assert sorted(saved.files) == sorted(set(now) - new) and len(new) == 6
  for key in new:
    log_probs = now[key.replace("/4", "/2")]
    finite = np.isfinite(log_probs)
    np.testing.assert_allclose(now[key].sum(-1)[finite], log_probs[finite], rtol=1e-5, atol=1e-4, err_msg=key)
  for key in saved.files:
    if np.issubdtype(saved[key].dtype, np.integer):
      np.testing.assert_array_equal(now[key], saved[key], err_msg=key)
    else:
      np.testing.assert_allclose(now[key], saved[key], rtol=1e-5, atol=1e-5, err_msg=key)
  # The reference is not degenerate: hypotheses end at several lengths, beams differ from greedy.
  assert len(set((saved["greedy/0"] != 0).sum(-1).tolist())) >= 3
  assert (saved["beam4_best/0"][:, 0] != saved["greedy/0"]).any()
  assert len(set((saved["tied_beam5/0"][:, 0] != 0).sum(-1).tolist())) >= 2


if __name__ == "__main__":
  print("decode from", decoding.__file__)
  np.savez(sys.argv[1], **reference_outputs())
