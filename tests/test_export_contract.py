"""The exported models used the way their runtimes document them translate as ours does.

CTranslate2: source pieces from the exported `source.spm` applied to raw text, nothing appended (its Marian
guide), `translate_batch` with no `suppress_sequences`. Hugging Face: `MarianTokenizer(text)` then `generate` with
the exported generation config. Texts include what our normalisation changes (no-break and zero-width spaces,
a byte-order mark, decomposed accents, a compatibility singleton, capitals for a lowercased vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

import flax.linen as nn  # noqa: E402
import sentencepiece as spm  # noqa: E402

from transformer_jax import config as presets  # noqa: E402
from transformer_jax.decoding import inference  # noqa: E402
from transformer_jax.data import normalize, spm_export  # noqa: E402
from transformer_jax.data import tokenizer as tokenizer_lib  # noqa: E402
from transformer_jax.interop import ctranslate2 as ct2_lib  # noqa: E402
from transformer_jax.interop import marian  # noqa: E402
from transformer_jax.model import Transformer  # noqa: E402
from transformer_jax.training.steps import init_params  # noqa: E402

TRAIN = ["a man is riding a bike", "two dogs play in the snow", "the woman reads a book in the café",
         "children are playing football", "a red car is parked on the street", "people walk by the river",
         "ein mann fährt fahrrad", "zwei hunde spielen im schnee", "die frau liest ein buch im café",
         "Ärger über Öl und Übel", "Ångström"]
# What a user types: each one differs from its normalised form.
RAW = ["a man reads a book", "two\u00a0children  play in the park ", "\ufeffthe cat", "a red dog\u200b walks",
       "the cafe\u0301 by the river", "A\u0308rger u\u0308ber \u212bngstro\u0308m", "people\twalk",
       "the woman\u2003reads"]
# Odd texts of other kinds, for the normaliser alone.
ODD = ["\u1100\u1161\u11a8", "u\u0308\u0301 \u01d8", "x\u00ad\u2060y", "\u3000\u3000z", "\u2028line\u2029",
       "\uff21\uff22", "\U0001F600 \u0130stanbul", "e\u0301\u0301", "\u00e9\u0301"]


EOS_BIAS = 3.0


def _our_model(vocab_size, seed=0, **overrides):
  """A random model whose output bias favours EOS, so that some outputs end before their cap and some run
  to it (the beam comparison needs both kinds)."""
  config = presets.tiny(**{**dict(vocab_size=vocab_size, num_encoder_layers=2, num_decoder_layers=2, d_model=32,
                                  d_ff=64, num_heads=4, max_len=24, logits_bias=True), **overrides})
  params = nn.unbox(init_params(config, jax.random.key(seed)))
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  params = jax.tree_util.tree_unflatten(treedef, leaves)
  params["decoder"]["logits_bias"] = params["decoder"]["logits_bias"].at[config.eos_id].add(EOS_BIAS)
  return config, params


@pytest.fixture(scope="module", params=[False, True], ids=["cased", "lowercased"])
def vocab(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vocab") / "spm.model")
  tokenizer_lib.train_tokenizer(TRAIN * 3, path, vocab_size=80, model_type="bpe", lowercase=request.param)
  return path


@pytest.fixture(scope="module")
def exported(vocab, tmp_path_factory):
  tok = tokenizer_lib.Tokenizer(vocab)
  config, params = _our_model(tok.vocab_size)
  root = tmp_path_factory.mktemp("exported")
  ct2_dir = ct2_lib.export_ctranslate2(params, config, str(root / "ct2"), tokenizer_path=vocab)
  marian.save_marian(params, config, str(root / "marian"), tokenizer_path=vocab, source_lang="en",
                     target_lang="de")
  return tok, config, params, ct2_dir, str(root / "marian")


def test_exported_sentencepiece_normalises_as_our_tokenizer(vocab, tmp_path):
  tok = tokenizer_lib.Tokenizer(vocab)
  out = str(tmp_path / "source.spm")
  spm_export.with_normalization(vocab, out, version=tok.normalization, lowercase=tok.lowercase)
  processor = spm.SentencePieceProcessor(model_file=out)
  norm = normalize.normalizer(tok.normalization, tok.lowercase)
  for text in RAW + ODD + TRAIN:
    assert processor.encode(text) == tok.encode(text, add_eos=False), repr(text)
    assert processor.normalize(text) == ("\u2581" + norm(text).replace(" ", "\u2581") if norm(text) else ""), text
  # The vocabulary itself is unchanged.
  original = spm.SentencePieceProcessor(model_file=vocab)
  assert [processor.id_to_piece(i) for i in range(processor.get_piece_size())] == [
      original.id_to_piece(i) for i in range(original.get_piece_size())]


def test_ctranslate2_export_writes_its_contract(exported):
  tok, config, _, ct2_dir, _ = exported
  ct2_config = json.load(open(os.path.join(ct2_dir, "config.json")))
  assert ct2_config["add_source_eos"] is True and ct2_config["add_source_bos"] is False
  assert ct2_config["decoder_start_token"] == tok.pieces([config.bos_id])[0]
  info = json.load(open(os.path.join(ct2_dir, ct2_lib.EXPORT_INFO)))
  assert info["max_decoding_length"] == config.max_len and info["position_table"] >= marian.EXPORT_POSITIONS


@pytest.mark.parametrize("beam", [1, 4])
def test_ctranslate2_used_as_documented_translates_as_ours(exported, beam):
  tok, config, params, ct2_dir, _ = exported
  translator = ct2_lib.translator(ct2_dir)
  pieces = ct2_lib.source_pieces(ct2_dir, RAW)
  assert pieces == [tok.pieces(tok.encode(t, add_eos=False)) for t in RAW]
  assert all(p[-1:] != ["</s>"] for p in pieces)  # nothing appended by the caller
  extra = 7
  ours = inference.translate_ids(params, config, [tok.encode(t) for t in RAW], beam_size=beam, alpha=0.0,
                                 extra_len=extra)
  # min_decoding_length 0: this random model may end at once, which CTranslate2's default (1) bars.
  theirs = ct2_lib.translate_pieces(translator, pieces, beam_size=beam, extra_len=extra, max_len=config.max_len,
                                    min_decoding_length=0)
  caps = [min(len(p) + extra, config.max_len) for p in pieces]
  ended = [i for i, (a, b, cap) in enumerate(zip(ours, theirs, caps)) if len(a) < cap and len(b) < cap]
  assert ended  # some outputs end with EOS (the bias makes EOS likely)
  if beam == 1:
    assert theirs == [tok.pieces(o) for o in ours]
  else:  # at the cap the two beams keep different unfinished candidates (a search choice, not the export's)
    assert [theirs[i] for i in ended] == [tok.pieces(ours[i]) for i in ended]
  # Pad and BOS are never emitted without the caller banning them; a random model's outputs run to the cap.
  assert not {tok.pieces([config.pad_id])[0], tok.pieces([config.bos_id])[0]} & {p for t in theirs for p in t}


def test_ctranslate2_decodes_past_the_trained_positions_without_error(exported):
  """CTranslate2's default cap (256) exceeds the model's max_len (24): the sinusoids are extended, so decoding
  300 steps raises nothing (`end_token` pad: never emitted, so no row stops), and the first tokens are ours."""
  tok, config, params, ct2_dir, _ = exported
  translator = ct2_lib.translator(ct2_dir)
  pieces = ct2_lib.source_pieces(ct2_dir, RAW)
  long = translator.translate_batch(pieces, beam_size=1, max_decoding_length=300, min_decoding_length=0,
                                    end_token=tok.pieces([config.pad_id]))
  ours = inference.translate_ids(params, config, [tok.encode(t) for t in RAW], beam_size=1, extra_len=500)
  eos = tok.pieces([config.eos_id])
  for result, mine in zip(long, ours):
    got = result.hypotheses[0]
    assert len(got) == 300
    assert got[: len(mine) + 1] == tok.pieces(mine) + (eos if len(mine) < config.max_len else got[len(mine):][:1])


def test_ctranslate2_scores_are_our_log_softmax_without_pad_and_bos(exported):
  tok, config, params, ct2_dir, _ = exported
  translator = ct2_lib.translator(ct2_dir)
  sources = [tok.encode(t) for t in RAW[:4]]
  targets = [s[::-1][1:] + [config.eos_id] for s in sources]
  scored = translator.score_batch(ct2_lib.source_pieces(ct2_dir, RAW[:4]), [tok.pieces(t[:-1]) for t in targets])
  for source, target, result in zip(sources, targets, scored):
    logits = Transformer(config).apply({"params": params}, jnp.asarray([source]), jnp.asarray([target]))[0]
    logits = logits.at[:, jnp.asarray([config.pad_id, config.bos_id])].set(-jnp.inf)
    expected = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(target)), target]
    np.testing.assert_allclose(result.log_probs, expected, atol=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_marian_export_through_marian_tokenizer_and_generate_translates_as_ours(exported, beam):
  tok, config, params, _, marian_dir = exported
  hf_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
  model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  texts = [t for t in RAW if t]
  batch = [hf_tok(t)["input_ids"] for t in texts]
  assert batch == [tok.encode(t) for t in texts]
  ours = inference.translate_ids(params, config, batch, beam_size=beam, alpha=0.0, extra_len=500)
  for text, mine in zip(texts, ours):
    with torch.no_grad():
      out = model.generate(**hf_tok([text], return_tensors="pt"), num_beams=beam)
    got = hf_tok.decode(out[0], skip_special_tokens=True)
    assert got == tok.decode(mine), text


def test_marian_export_generates_past_the_trained_positions_and_imports_back_unchanged(exported):
  """`generate` with a cap above the model's max_len (24) reads the extended sinusoids (no index error) and its
  first tokens are ours; the importer restores the trained max_len from the exported config."""
  tok, config, params, _, marian_dir = exported
  hf_config = json.load(open(os.path.join(marian_dir, "config.json")))
  assert hf_config["max_position_embeddings"] == marian.EXPORT_POSITIONS
  assert marian.model_config_from_marian(hf_config) == dataclasses.replace(  # Marian's epsilon and layout
      config, layer_norm_epsilon=marian.MARIAN_LAYER_NORM_EPSILON, position_layout="halves")
  hf_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
  model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  texts = [t for t in RAW if t]
  ours = inference.translate_ids(params, config, [tok.encode(t) for t in texts], beam_size=1, extra_len=500)
  for text, mine in zip(texts, ours):
    with torch.no_grad():  # pad never ends a row: every row runs the 300 steps
      out = model.generate(**hf_tok([text], return_tensors="pt"), max_new_tokens=300, min_new_tokens=300)
    got = out[0, 1:].tolist()
    assert len(got) == 300
    assert got[: len(mine)] == list(mine), text


# -- relative positions (Shaw et al.): CTranslate2's relative_position_keys / _values ------------------------

# A few dozen sources, short and long (up to the 2k+1 = 9 distances and past them).
SOURCES = RAW + TRAIN + [f"{a} and {b}" for a, b in zip(TRAIN, TRAIN[3:] + TRAIN[:3])] + [
    " ".join(TRAIN[i:i + 2]) for i in range(0, len(TRAIN) - 1, 2)]


@pytest.fixture(scope="module", params=[False, True], ids=["keys", "keys+values"])
def relative_exported(vocab, request, tmp_path_factory):
  tok = tokenizer_lib.Tokenizer(vocab)
  config, params = _our_model(tok.vocab_size, max_relative_position=4, relative_values=request.param,
                              position_embedding="none", max_len=64)
  ct2_dir = ct2_lib.export_ctranslate2(params, config, str(tmp_path_factory.mktemp("rel") / "ct2"),
                                       tokenizer_path=vocab)
  return tok, config, params, ct2_dir


@pytest.mark.parametrize("beam", [1, 4])
def test_ctranslate2_relative_positions_translate_as_ours(relative_exported, beam):
  tok, config, params, ct2_dir = relative_exported
  assert len(SOURCES) >= 30
  pieces = ct2_lib.source_pieces(ct2_dir, SOURCES)
  ours = [tok.pieces(o) for o in inference.translate_ids(params, config, [tok.encode(t) for t in SOURCES],
                                                          beam_size=beam, alpha=0.0, extra_len=7)]
  theirs = ct2_lib.translate_pieces(ct2_lib.translator(ct2_dir), pieces, beam_size=beam, extra_len=7,
                                    max_len=config.max_len, min_decoding_length=0)
  caps = [min(len(p) + 7, config.max_len) for p in pieces]
  ended = [i for i, (a, b, cap) in enumerate(zip(ours, theirs, caps)) if len(a) < cap and len(b) < cap]
  assert len(ended) >= 5 and max(len(pieces[i]) for i in ended) > 2 * config.max_relative_position + 1
  if beam == 1:
    assert theirs == ours
  else:  # the two beams prune differently; on this flat random model a few ended outputs differ, each runtime
    # sometimes keeping the higher-scoring one (measured: 32/35), while any one output's score agrees (below)
    same = sum(theirs[i] == ours[i] for i in ended)
    assert same >= 0.8 * len(ended), (same, len(ended))
  info = json.load(open(os.path.join(ct2_dir, ct2_lib.EXPORT_INFO)))
  assert info["position_table"].startswith("none: relative positions")


def test_ctranslate2_relative_scores_are_our_log_softmax(relative_exported):
  tok, config, params, ct2_dir = relative_exported
  sources = [tok.encode(t) for t in SOURCES[-4:]]
  targets = [s[::-1][1:] + [config.eos_id] for s in sources]
  scored = ct2_lib.translator(ct2_dir).score_batch(ct2_lib.source_pieces(ct2_dir, SOURCES[-4:]),
                                                   [tok.pieces(t[:-1]) for t in targets])
  for source, target, result in zip(sources, targets, scored):
    logits = Transformer(config).apply({"params": params}, jnp.asarray([source]), jnp.asarray([target]))[0]
    logits = logits.at[:, jnp.asarray([config.pad_id, config.bos_id])].set(-jnp.inf)
    expected = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(target)), target]
    np.testing.assert_allclose(result.log_probs, expected, atol=1e-4)


def test_ctranslate2_refuses_relative_with_absolute_positions(vocab, tmp_path):
  """CTranslate2 builds no position encoder where relative keys exist: such a model would compute another
  function, so the export refuses it and writes nothing."""
  config, params = _our_model(tokenizer_lib.Tokenizer(vocab).vocab_size, max_relative_position=4)
  with pytest.raises(marian.UnsupportedModelError, match="position_embedding='sinusoidal'"):
    ct2_lib.export_ctranslate2(params, config, str(tmp_path / "ct2"), tokenizer_path=vocab)
  assert os.listdir(tmp_path) == []


# -- the comparison program, through its command line ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  from tests.test_experiments import TINY_OVERRIDES, _run
  workdir = tmp_path_factory.mktemp("tiny") / "w"
  _run(["experiments.train", f"--workdir={workdir}", *TINY_OVERRIDES, "--config.final_eval.split="])
  return workdir


def test_compare_program_feeds_ctranslate2_as_documented_and_says_so(tiny_run, tmp_path):
  from tests.test_experiments import _run
  source = tmp_path / "in.txt"
  source.write_text("twenty-one\nthree hundred\u00a0five\nnine hundred ninety-nine thousand\n", encoding="utf-8")
  report = tmp_path / "report.json"
  result = _run(["experiments.compare_ctranslate2", f"--workdir={tiny_run}", f"--input={source}",
                 f"--ct2_dir={tmp_path}/ct2", f"--marian_dir={tmp_path}/marian", "--beam_sizes=1",
                 f"--report={report}"])
  assert "no </s> appended): 3/3 sources have our pieces" in result.stdout
  runs = json.loads(report.read_text())["runs"]
  assert {(r["runtime"], r["identical"]) for r in runs} == {("ctranslate2", 3), ("marian", 3)}


def test_compare_program_refuses_a_directory_that_is_not_a_ctranslate2_model(tiny_run, tmp_path):
  from tests.test_experiments import _one_line_error, _run
  source = tmp_path / "in.txt"
  source.write_text("five\n", encoding="utf-8")
  for ct2_dir, needle in ((tiny_run / "vocab", "is not a CTranslate2 model directory"),
                          (source, "is a file")):
    result = _run(["experiments.compare_ctranslate2", f"--workdir={tiny_run}", f"--input={source}",
                   f"--ct2_dir={ct2_dir}", "--beam_sizes=1"], check=False)
    _one_line_error(result, needle)
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "model.bin").write_bytes(os.urandom(512))  # a model.bin CTranslate2 itself cannot read
  _one_line_error(_run(["experiments.compare_ctranslate2", f"--workdir={tiny_run}", f"--input={source}",
                        f"--ct2_dir={bad}", "--beam_sizes=1"], check=False), "not a CTranslate2 model")
