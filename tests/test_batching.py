"""Length filters and eval batching (transformer_jax/data/batching.py); packed training batches: test_pipeline.py."""

import numpy as np
import pytest

from transformer_jax import config as C
from transformer_jax.data import batching

PAD = C.PAD_ID
# Special ids as in our vocabularies, and as in an OPUS-MT (Marian) one: </s> 0, <pad> the last id, which is
# also the decoder start. With Marian's ids, code that pads with 0 pads with EOS, a real token.
IDS = {"ours": dict(pad_id=C.PAD_ID, bos_id=C.BOS_ID, eos_id=C.EOS_ID),
       "marian": dict(pad_id=39, bos_id=39, eos_id=0)}


def _random_corpus(n, seed=0, vocab=40, src=(3, 14), tgt=(2, 10), eos=C.EOS_ID, low=4):
  """Token ids in [low, vocab - 1) (never a special id of `IDS`) ending with `eos`."""
  rs = np.random.RandomState(seed)
  sources = [np.append(rs.randint(low, vocab - 1, rs.randint(*src)), eos).astype(np.int32) for _ in range(n)]
  targets = [np.append(rs.randint(low, vocab - 1, rs.randint(*tgt)), eos).astype(np.int32) for _ in range(n)]
  return sources, targets



@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_eval_batches_keep_every_example_untruncated(ids):
  sources, targets = _random_corpus(100, src=(1, 60), eos=ids["eos_id"])
  seen = []
  for batch in batching.eval_batches(sources, targets, max_tokens=256, pad_id=ids["pad_id"]):
    assert batch["inputs"].shape[1] % 16 == 0
    for row in batch["inputs"]:
      seen.append(tuple(row[row != ids["pad_id"]]))
  assert sorted(seen) == sorted(tuple(s) for s in sources)


def test_length_sorted_batches_respect_budget_and_cover_all():
  lengths = [5, 100, 3, 17, 17, 40, 1, 64]
  batches = batching.length_sorted_batches(lengths, max_tokens=64, length_multiple=8)
  assert sorted(i for idx, _ in batches for i in idx) == list(range(len(lengths)))
  for idx, padded in batches:
    assert padded >= max(lengths[i] for i in idx)
    assert len(idx) == 1 or len(idx) * padded <= 64
