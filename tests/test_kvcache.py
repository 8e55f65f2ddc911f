"""attention.kvcache: the decoder reaches the caches through typed entries, never by module or variable name.

A model whose attention submodules carry other names decodes exactly as the original (greedy, beam 4 with its
never-reordered cache, sampling, the toolkit's compiled decoding); per-row cache state that is not a kvcache
entry is refused before beam search could leave it behind its beam.
"""

import itertools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_decode import CFG, L, PARAMS, SRC, make_params, small
import helpers
from transformer_jax import decoding
from transformer_jax import model as model_lib
from transformer_jax import config as config_lib
from transformer_jax.attention import MultiHeadAttention, kvcache
from transformer_jax.decoding import inference
from transformer_jax.decoding.generate import DecodeOptions

RENAMES = {"self_attention": "masked_attention", "cross_attention": "source_attention"}


def _renamed_attention(config, is_cross=False, name=None):
  """`MultiHeadAttention` as model.py builds it, under another submodule name."""
  return MultiHeadAttention(config, is_cross=is_cross, name=RENAMES.get(name, name))


def _rename(tree):
  if not isinstance(tree, dict):
    return tree
  return {RENAMES.get(key, key): _rename(value) for key, value in tree.items()}


def _outputs(params):
  greedy = decoding.greedy_search(params, CFG, SRC, L)
  beam = decoding.beam_search(params, CFG, SRC, 4, 0.6, L, full_output=True)
  sampled = decoding.sample(params, CFG, SRC, jax.random.key(3), L, temperature=0.8, top_k=5)
  sources = [list(row[row != 0]) for row in np.asarray(SRC)]
  nbest = inference.decode_ids(params, CFG, sources, DecodeOptions(beam_size=4, nbest=3), extra_len=6)
  return jax.tree_util.tree_map(np.asarray, (greedy, beam, sampled)), nbest


def test_renamed_attention_submodules_decode_the_same(monkeypatch):
  expected, expected_nbest = _outputs(PARAMS)
  monkeypatch.setattr(model_lib, "MultiHeadAttention", _renamed_attention)
  renamed = _rename(PARAMS)
  assert "masked_attention" in renamed["decoder"]["layer_0"] and "self_attention" not in renamed["decoder"]["layer_0"]
  encoded = model_lib.Transformer(CFG).apply({"params": renamed}, SRC, method=model_lib.Transformer.encode)
  _, variables = model_lib.Transformer(CFG).apply(
      {"params": renamed}, encoded, SRC, jnp.full((SRC.shape[0], 1), CFG.bos_id), use_cache=True,
      max_decode_len=L, method=model_lib.Transformer.decode, mutable=["cache"])
  paths = helpers.cache_entries(variables["cache"], kvcache.SelfAttentionCache)
  assert [path[-2] for path in paths] == ["masked_attention"]  # the renamed model really keeps renamed caches
  assert [path[-2] for path in helpers.cache_entries(variables["cache"], kvcache.CrossAttentionCache)] == [
      "source_attention"]

  got, got_nbest = _outputs(renamed)
  for want, have in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got), strict=True):
    np.testing.assert_array_equal(have, want)  # bitwise: the same program, under other names
  assert got_nbest == expected_nbest


def _self_cache(rows, length=5):
  return kvcache.SelfAttentionCache.create(rows, 2, length, 3, jnp.float32, jnp.float32)


def test_split_finds_entries_by_type_wherever_they_sit():
  cache = {"anywhere": {"cross": {"x": kvcache.CrossAttentionCache(jnp.ones((2, 2, 3, 4)), jnp.ones((2, 2, 3, 4)))},
                        "self": {"y": _self_cache(2)}}, "counter": {"position": jnp.array(3)}}
  constant, changing = kvcache.split(cache)
  assert list(constant) == [("anywhere", "cross", "x")]
  assert sorted(changing) == [("anywhere", "self", "y"), ("counter", "position")]
  assert kvcache.merge(constant, changing)["counter"]["position"] == 3


def test_beam_form_refuses_per_row_state_it_could_not_reorder():
  with pytest.raises(ValueError, match="holds none"):
    kvcache.to_beams({("decoder", "mine", "keys"): jnp.zeros((8, 3))}, batch=2, beams=4)
  with pytest.raises(ValueError, match="decoder/mine/keys holds per-row state"):
    kvcache.to_beams({("decoder", "attn", "kv"): _self_cache(8), ("decoder", "mine", "keys"): jnp.zeros((8, 3))},
                     batch=2, beams=4)
  with pytest.raises(ValueError, match="expected batch \\* beams = 2 \\* 4"):
    kvcache.to_beams({("decoder", "attn", "kv"): _self_cache(6)}, batch=2, beams=4)


def test_reorder_beams_moves_only_the_ancestry_rows():
  changing = kvcache.to_beams({("a", "kv"): _self_cache(6), ("position",): jnp.array(2)}, batch=2, beams=3)
  entry = changing[("a", "kv")]
  ancestry = np.arange(2 * 3 * 5, dtype=np.int32).reshape(2, 3, 5)
  moved = tuple(k + 1.0 for k in entry.key)  # [batch, heads, head_dim, block * beams] per block
  changing[("a", "kv")] = entry.replace(ancestry=jnp.asarray(ancestry), key=moved)
  parent = np.array([[2, 2, 0], [1, 0, 1]], np.int32)
  out = kvcache.reorder_beams(changing, jnp.asarray(parent))
  np.testing.assert_array_equal(out[("a", "kv")].ancestry, ancestry[np.arange(2)[:, None], parent])
  for have, want in zip(out[("a", "kv")].key, moved, strict=True):
    np.testing.assert_array_equal(have, want)  # the K/V stay where they are
  assert out[("position",)] == 2


def _dense_attention(query, keys, values, keep):
  """softmax(q kᵀ / √d) v in NumPy float64: query [h, d], keys/values [n, h, d], keep [n] bool -> [h, d]."""
  logits = np.einsum("hd,nhd->hn", query, keys) / np.sqrt(query.shape[-1])
  logits = np.where(keep[None, :], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("hn,nhd->hd", weights / weights.sum(-1, keepdims=True), values)


@pytest.mark.parametrize("length, dtype", [(5, jnp.float32), (19, jnp.float32), (70, jnp.float32),
                                           (19, jnp.bfloat16)])  # one block; a partial last one; 8 blocks of 9
def test_beam_self_attention_cache_attends_over_each_beams_history(length, dtype):
  """Every step of `BeamSelfAttentionCache` (blocks of positions, only those written read) against attention
  over each beam's own history, rebuilt in NumPy from the random beam reorders applied between the steps
  (bfloat16: the cache and the inputs rounded, the reference in float64 on the rounded values)."""
  batch, beams, heads, head_dim = 2, 3, 2, 4
  rng = np.random.default_rng(length)
  tolerance = 2e-5 if dtype == jnp.float32 else 3e-2
  entry = kvcache.BeamSelfAttentionCache.from_self_attention(
      kvcache.SelfAttentionCache.create(batch * beams, heads, length, head_dim, dtype, dtype), batch, beams)
  attend = jax.jit(lambda e, q, k, v: e.attend(q, k, v))
  history = [[[] for _ in range(beams)] for _ in range(batch)]  # (key, value) of each beam's positions
  for step in range(length):
    q, k, v = (np.asarray(jnp.asarray(rng.normal(size=(batch * beams, 1, heads, head_dim)), dtype), np.float32)
               for _ in range(3))
    out, entry = attend(entry, *(jnp.asarray(x, dtype) for x in (q, k, v)))
    assert out.dtype == dtype
    for b in range(batch):
      for j in range(beams):
        row = b * beams + j
        history[b][j].append((k[row, 0], v[row, 0]))
        keys, values = (np.stack(x) for x in zip(*history[b][j]))
        want = _dense_attention(q[row, 0], keys, values, np.ones(len(keys), bool))
        np.testing.assert_allclose(np.asarray(out[row, 0], np.float32), want, rtol=tolerance, atol=tolerance)
    parent = rng.integers(0, beams, size=(batch, beams))
    entry = kvcache.reorder_beams({("a",): entry}, jnp.asarray(parent, jnp.int32))[("a",)]
    history = [[list(history[b][p]) for p in parent[b]] for b in range(batch)]
  assert len(entry.key) == -(-length // kvcache.prefix_block(length)) <= 8


def test_beam_cross_attention_cache_equals_attention_over_tiled_memory():
  """`BeamCrossAttentionCache` (one copy of a source's K/V for its beams) against `dot_product_attention`
  over the memory tiled to every beam row, padding masked; weights as `[rows, heads, 1, src_len]`."""
  from transformer_jax.attention.core import dot_product_attention
  batch, beams, heads, head_dim, src_len = 3, 4, 2, 8, 7
  rng = np.random.default_rng(0)
  memory_k, memory_v = (rng.normal(size=(batch, src_len, heads, head_dim)).astype(np.float32) for _ in range(2))
  valid = np.arange(src_len)[None, :] < np.array([[7], [4], [1]])  # [batch, src_len]
  entry = kvcache.share_across_beams(
      {("x",): kvcache.CrossAttentionCache.create(lambda: jnp.asarray(memory_k), lambda: jnp.asarray(memory_v))},
      beams)[("x",)]
  query = rng.normal(size=(batch * beams, 1, heads, head_dim)).astype(np.float32)
  mask = jnp.asarray(np.repeat(valid, beams, axis=0)[:, None, None, :])  # [rows, 1, 1, src_len]
  out, weights = entry.attend(jnp.asarray(query), mask)
  tiled = lambda x: jnp.asarray(np.repeat(x, beams, axis=0))  # noqa: E731
  want, want_weights = dot_product_attention(jnp.asarray(query), tiled(memory_k), tiled(memory_v), mask,
                                             return_weights=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5, atol=1e-7)
  assert not np.asarray(weights)[~np.repeat(valid, beams, axis=0)[:, None, None, :].repeat(heads, 1)].any()


# Every decoder self-attention scheme `ModelConfig` can express: the position kinds, relative positions, a window.
def _expressible(changes: dict) -> bool:
  try:
    small(**changes)
  except ValueError:  # e.g. position_embedding='none' without relative positions
    return False
  return True


SCHEMES = [changes for kind, relative, window in itertools.product(typing.get_args(config_lib.PositionKind), (0, 4),
                                                                   (0, 3))
           if _expressible(changes := dict(position_embedding=kind, max_relative_position=relative,
                                           attention_window=window))]


@pytest.mark.parametrize("changes", SCHEMES, ids=lambda c: "-".join(f"{k[:3]}{v}" for k, v in c.items()))
def test_the_beam_form_serves_exactly_the_schemes_it_is_proven_equal_on(changes, monkeypatch):
  """The allow-list: each scheme in `BEAM_FORM_SCHEMES` decodes beam 4 as the gathered cache does (the same
  tokens; scores to float32 rounding, the two forms sum the attention in another order); a
  scheme outside it is decoded with the gathered cache. A new scheme lands in this enumeration (it reads
  `ModelConfig`'s position kinds) and stays on the gathered cache until it is listed."""
  config = small(**changes)
  params = make_params(config, seed=0)
  scheme = kvcache.self_attention_scheme(config)
  assert kvcache.beam_form_applies(config, 4) == (scheme in kvcache.BEAM_FORM_SCHEMES)
  if scheme not in kvcache.BEAM_FORM_SCHEMES:
    return
  beam_form = decoding.beam_search(params, config, SRC, 4, 0.6, L, full_output=True)
  monkeypatch.setattr(kvcache, "beam_form_applies", lambda config, beams: False)
  jax.clear_caches()  # the search is traced again, now with the gathered cache
  gathered = decoding.beam_search(params, config, SRC, 4, 0.6, L, full_output=True)
  for have, want in zip(jax.tree_util.tree_leaves(beam_form), jax.tree_util.tree_leaves(gathered), strict=True):
    if jnp.issubdtype(have.dtype, jnp.floating):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(have, want)


def test_every_listed_scheme_is_one_the_enumeration_proves():
  assert len(SCHEMES) == 10  # 3 position kinds x relative or not x window or not, less 'none' without relative
  assert kvcache.BEAM_FORM_SCHEMES <= {kvcache.self_attention_scheme(small(**c)) for c in SCHEMES}
