"""Marian (Hugging Face) import/export and CTranslate2 export, checked against the independent implementations.

Every model here is built in the test: tiny random `MarianMTModel`s with SentencePiece models trained on a few
lines, and tiny models of ours. No hub access. Tolerance: 1e-4 max abs logit difference in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")

import flax.linen as nn  # noqa: E402

from transformer_jax import config as presets  # noqa: E402
from transformer_jax.decoding import inference  # noqa: E402
from transformer_jax.data import tokenizer as tokenizer_lib  # noqa: E402
from transformer_jax.data.tokenizer import VocabularyError  # noqa: E402
from transformer_jax.interop import ctranslate2 as ct2_lib  # noqa: E402
from transformer_jax.interop import marian  # noqa: E402
from transformer_jax.data.marian_vocab import MarianVocabulary  # noqa: E402
from transformer_jax.model import Transformer, sinusoid_table  # noqa: E402
from transformer_jax.training.steps import init_params  # noqa: E402
from transformer_jax.workdir import Workdir, to_jsonable  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGLISH = ["a man is riding a bike", "two dogs play in the snow", "the woman reads a book in the park",
           "children are playing football", "a red car is parked on the street", "people walk by the river",
           "a cat sleeps on the sofa", "the boy eats an apple", "a group of friends sing a song"]
GERMAN = ["ein mann fährt fahrrad", "zwei hunde spielen im schnee", "die frau liest ein buch im park",
          "kinder spielen fußball", "ein rotes auto parkt auf der straße", "leute gehen am fluss",
          "eine katze schläft auf dem sofa", "der junge isst einen apfel", "eine gruppe von freunden singt"]
SOURCES = ["a man reads a book", "two children play in the park", "the cat", "a red dog walks by the river"]


def _train_spm(lines, prefix, vocab_size=40):
  path = str(prefix) + ".txt"
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines * 3) + "\n")
  spm.SentencePieceTrainer.train(input=path, model_prefix=str(prefix), vocab_size=vocab_size,
                                 model_type="unigram", unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
                                 hard_vocab_limit=False, minloglevel=2)
  return str(prefix) + ".model"


def _marian_vocab(source_model, target_model) -> dict:
  """OPUS-MT layout: </s> 0, <unk> 1, the pieces of both sides, <pad> last (so model ids != spm ids)."""
  pieces = []
  for model in (source_model, target_model):
    sp = spm.SentencePieceProcessor(model_file=model)
    pieces += [sp.id_to_piece(i) for i in range(1, sp.get_piece_size())]
  vocab = {"</s>": 0, "<unk>": 1}
  for p in pieces:
    vocab.setdefault(p, len(vocab))
  vocab["<pad>"] = len(vocab)
  return vocab


def _perturb(module, scale=0.05, seed=0):
  """Random biases, LayerNorm parameters and logits bias (HF initialises them to 0/1)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      if p.requires_grad:
        p.add_(torch.randn(p.shape, generator=gen) * scale)
    module.final_logits_bias.copy_(torch.randn(module.final_logits_bias.shape, generator=gen) * 0.5)


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
  return build_marian_dir(tmp_path_factory.mktemp("marian"))


def build_marian_dir(root) -> str:
  """A saved random MarianMTModel (swish, 2+2 layers, d_model 32) with two SentencePiece models, under `root`."""
  src_model, tgt_model = _train_spm(ENGLISH, root / "src"), _train_spm(GERMAN, root / "tgt")
  vocab = _marian_vocab(src_model, tgt_model)
  pad = vocab["<pad>"]
  config = transformers.MarianConfig(
      vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
      encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
      activation_function="swish", max_position_embeddings=64, pad_token_id=pad, eos_token_id=0,
      decoder_start_token_id=pad, forced_eos_token_id=0, scale_embedding=True, init_std=0.2,
      share_encoder_decoder_embeddings=True)
  torch.manual_seed(0)
  model = transformers.MarianMTModel(config).eval()
  _perturb(model)
  out = root / "model"
  model.save_pretrained(out)
  tok = transformers.MarianTokenizer(src_model, tgt_model, _write_json(root / "vocab.json", vocab),
                                     source_lang="en", target_lang="de")
  tok.save_pretrained(out)
  return str(out)


def _write_json(path, value):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, ensure_ascii=False)
  return str(path)


def _padded(rows, pad):
  length = max(len(r) for r in rows)
  return np.array([r + [pad] * (length - len(r)) for r in rows], np.int32)


def _hf_logits(model, inputs, targets, pad, start):
  decoder_inputs = np.concatenate([np.full((len(targets), 1), start), targets[:, :-1]], axis=1)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(inputs, dtype=torch.long),
                attention_mask=torch.tensor(inputs != pad, dtype=torch.long),
                decoder_input_ids=torch.tensor(decoder_inputs, dtype=torch.long))
  return out.logits.numpy()


def _hf_greedy(model, source_ids, max_new_tokens, banned, eos):
  with torch.no_grad():
    out = model.generate(torch.tensor([source_ids]), num_beams=1, do_sample=False,
                         max_new_tokens=max_new_tokens, bad_words_ids=[[b] for b in banned],
                         forced_eos_token_id=None)
  tokens = out[0, 1:].tolist()  # without the decoder start token
  return tokens[: tokens.index(eos)] if eos in tokens else tokens


# ----------------------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------------------

def test_import_matches_pytorch_logits_and_greedy(marian_dir):
  config, params, vocab = marian.load_marian(marian_dir)
  assert (config.activation, config.position_layout, config.logits_bias) == ("swish", "halves", True)
  assert (config.pad_id, config.bos_id, config.eos_id) == (vocab.pad_id, vocab.pad_id, 0)
  hf_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
  sources = [vocab.encode(s) for s in SOURCES]
  assert sources == [hf_tok(s)["input_ids"] for s in SOURCES]  # the tokenizer adapter agrees with HF's
  assert any(vocab.unk_id in s for s in sources) is False

  model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  targets = [vocab.encode(s)[::-1][1:] + [0] for s in SOURCES]  # arbitrary target ids ending with EOS
  inputs, target_arr = _padded(sources, config.pad_id), _padded(targets, config.pad_id)
  expected = _hf_logits(model, inputs, target_arr, config.pad_id, config.bos_id)
  ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(target_arr)))
  valid = target_arr != config.pad_id
  assert np.abs(ours - expected)[valid].max() <= 1e-4
  assert np.abs(expected[valid]).max() > 1.0  # the logits are not trivially small

  extra = 6
  outputs = inference.translate_ids(params, config, sources, beam_size=1, extra_len=extra)
  for src, got in zip(sources, outputs):
    assert got == _hf_greedy(model, src, len(src) - 1 + extra, [config.pad_id], config.eos_id)
  assert any(len(o) > 0 for o in outputs)


def test_marian_vocabulary_decodes_with_the_target_model(marian_dir):
  vocab = MarianVocabulary(marian_dir)
  hf_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
  ids = [vocab.encoder[p] for p in ["▁ein", "▁mann"] if p in vocab.encoder] + [5, 7, vocab.pad_id]
  text = vocab.decode(ids + [vocab.eos_id, 9])  # stops at </s>, skips <pad>
  assert text == hf_tok.decode(ids, skip_special_tokens=True, use_source_tokenizer=False) and text
  assert vocab.vocab_size == len(json.load(open(os.path.join(marian_dir, "vocab.json"))))


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def our_spm(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ours") / "spm.model")
  tokenizer_lib.train_tokenizer(ENGLISH + GERMAN, path, vocab_size=60, model_type="bpe")
  return path


def _our_model(vocab_size, seed=0, **overrides):
  """Our tiny model with every parameter randomised (biases and LayerNorms included)."""
  config = presets.tiny(vocab_size=vocab_size, num_encoder_layers=2, num_decoder_layers=2, d_model=32,
                        d_ff=64, num_heads=4, max_len=64, **overrides)
  params = nn.unbox(init_params(config, jax.random.key(seed)))
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return config, jax.tree_util.tree_unflatten(treedef, leaves)


def test_halves_permutation_maps_the_tables():
  for d in (8, 9, 32):
    perm = marian.halves_permutation(d)
    np.testing.assert_array_equal(sinusoid_table(16, d)[:, perm], sinusoid_table(16, d, "halves"))


@pytest.mark.parametrize("overrides", [{}, dict(activation="swish", position_layout="halves", logits_bias=True,
                                                layer_norm_epsilon=1e-5)],
                         ids=["paper", "marian-options"])
def test_export_loads_in_transformers_with_our_logits_and_greedy(tmp_path, our_spm, overrides):
  tok = tokenizer_lib.Tokenizer(our_spm)
  config, params = _our_model(tok.vocab_size, **overrides)
  out = str(tmp_path / "marian")
  marian.save_marian(params, config, out, tokenizer_path=our_spm, source_lang="en", target_lang="de")
  model = transformers.MarianMTModel.from_pretrained(out).eval()
  hf_tok = transformers.MarianTokenizer.from_pretrained(out)
  sources = [tok.encode(s) for s in SOURCES]
  assert sources == [hf_tok(s)["input_ids"] for s in SOURCES]

  targets = [s[::-1][1:] + [config.eos_id] for s in sources]
  inputs, target_arr = _padded(sources, config.pad_id), _padded(targets, config.pad_id)
  expected = _hf_logits(model, inputs, target_arr, config.pad_id, config.bos_id)
  ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(target_arr)))
  valid = target_arr != config.pad_id
  # The paper preset's LayerNorm epsilon is 1e-6; MarianMTModel's is fixed at 1e-5.
  assert np.abs(ours - expected)[valid].max() <= 1e-4
  assert np.abs(expected[valid]).max() > 1.0

  extra = 6
  outputs = inference.translate_ids(params, config, sources, beam_size=1, extra_len=extra)
  for src, got in zip(sources, outputs):
    assert got == _hf_greedy(model, src, len(src) - 1 + extra, [config.pad_id, config.bos_id], config.eos_id)

  # The exported directory imports back to the same function.
  config2, params2, _ = marian.load_marian(out)
  again = np.asarray(Transformer(config2).apply({"params": params2}, jnp.asarray(inputs), jnp.asarray(target_arr)))
  assert np.abs(again - ours)[valid].max() <= 1e-4


def test_ctranslate2_export_scores_and_greedy_match(tmp_path, our_spm):
  tok = tokenizer_lib.Tokenizer(our_spm)
  config, params = _our_model(tok.vocab_size, seed=3)
  out = ct2_lib.export_ctranslate2(params, config, str(tmp_path / "ct2"), tokenizer_path=our_spm)
  assert {"model.bin", "config.json", "source.spm", "target.spm", "vocab.json"} <= set(os.listdir(out))
  translator = ct2_lib.translator(out)
  sources = [tok.encode(s) for s in SOURCES]
  pieces = [tok.pieces(s[:-1]) for s in sources]  # as documented: nothing appended (the model adds </s>)

  # Log-probabilities of given targets: CTranslate2's score_batch vs our log-softmax over the tokens our
  # searches may emit (the export bars pad and BOS by their output bias).
  targets = [s[::-1][1:] + [config.eos_id] for s in sources]
  scored = translator.score_batch(pieces, [tok.pieces(t[:-1]) for t in targets])
  inputs, target_arr = _padded(sources, config.pad_id), _padded(targets, config.pad_id)
  logits = Transformer(config).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(target_arr))
  logits = logits.at[..., jnp.asarray([config.pad_id, config.bos_id])].set(-jnp.inf)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  for r, (result, target) in enumerate(zip(scored, targets)):
    ours = log_probs[r, np.arange(len(target)), target]
    np.testing.assert_allclose(result.log_probs, ours, atol=1e-4)

  extra = 6
  outputs = inference.translate_ids(params, config, sources, beam_size=1, extra_len=extra)
  for src, src_pieces, got in zip(sources, pieces, outputs):
    result = translator.translate_batch([src_pieces], beam_size=1, max_decoding_length=len(src) - 1 + extra,
                                        min_decoding_length=0)
    assert result[0].hypotheses[0] == tok.pieces(got)


# ----------------------------------------------------------------------------------------------------------
# Bad input: one-line errors, nothing written
# ----------------------------------------------------------------------------------------------------------

def _copy_with(marian_dir, tmp_path, config_changes=None, remove=(), vocab_changes=None):
  import shutil
  out = tmp_path / "variant"
  shutil.copytree(marian_dir, out)
  if config_changes:
    path = out / "config.json"
    value = json.loads(path.read_text())
    value.update(config_changes)
    path.write_text(json.dumps(value))
  if vocab_changes:
    path = out / "vocab.json"
    value = json.loads(path.read_text())
    value.update(vocab_changes)
    path.write_text(json.dumps(value))
  for name in remove:
    os.remove(out / name)
  return str(out)


@pytest.mark.parametrize("change, error, message", [
    (dict(config_changes={"model_type": "bart"}), marian.UnsupportedModelError, "model_type='bart'"),
    (dict(config_changes={"share_encoder_decoder_embeddings": False}), marian.UnsupportedModelError,
     "separate source/target embeddings"),
    (dict(config_changes={"normalize_before": True}), marian.UnsupportedModelError, "pre-LN"),
    (dict(config_changes={"activation_function": "gelu"}), marian.UnsupportedModelError, "activation_function"),
    (dict(remove=["config.json"]), marian.UnsupportedModelError, "no config.json"),
    (dict(remove=["target.spm"]), VocabularyError, "missing target.spm"),
    (dict(vocab_changes={"extra_piece": 10_000}), VocabularyError, "vocab_size="),
    (dict(vocab_changes={"</s>": 5}), VocabularyError, "eos_token_id"),
])
def test_bad_marian_directories_are_refused(marian_dir, tmp_path, change, error, message):
  with pytest.raises(error, match=message):
    marian.load_marian(_copy_with(marian_dir, tmp_path, **change))


def test_import_program_refuses_with_one_line_and_writes_nothing(marian_dir, tmp_path):
  bad = _copy_with(marian_dir, tmp_path, config_changes={"share_encoder_decoder_embeddings": False})
  workdir = tmp_path / "workdir"
  proc = subprocess.run([sys.executable, "-m", "experiments.import_marian", f"--model_dir={bad}",
                         f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
  assert "separate source/target embeddings" in proc.stderr
  assert not workdir.exists()


def test_imported_workdir_loads_like_a_trained_one(marian_dir, tmp_path):
  from transformer_jax.run import trained
  workdir = str(tmp_path / "workdir")
  value = marian.import_to_workdir(marian_dir, workdir)
  layout = Workdir(workdir)  # written through the workdir's own layout and JSON writer
  assert sorted(os.listdir(workdir)) == sorted(path.name for path in (layout.config_json, layout.vocab_dir,
                                                                     layout.checkpoints))
  assert layout.require_config() == to_jsonable(value)
  model_config, params, tokenizer = trained.load(workdir)
  config, expected_params, vocab = marian.load_marian(marian_dir)
  assert model_config == config and isinstance(tokenizer, MarianVocabulary)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(expected_params)):
    np.testing.assert_array_equal(np.asarray(a), b)
  with pytest.raises(FileExistsError, match="not empty"):
    marian.import_to_workdir(marian_dir, workdir)


@pytest.mark.slow
def test_import_program_makes_a_workdir_that_translate_accepts(marian_dir, tmp_path):
  workdir = tmp_path / "workdir"
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", "experiments.import_marian", f"--model_dir={marian_dir}",
                         f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  proc = subprocess.run([sys.executable, "-m", "experiments.translate", f"--workdir={workdir}"], cwd=REPO,
                        input="\n".join(SOURCES) + "\n", capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  config, params, vocab = marian.load_marian(marian_dir)
  expected = inference.translate_texts(params, config, vocab, SOURCES, beam_size=1)
  assert proc.stdout.splitlines() == expected


def test_core_import_does_not_load_interop_dependencies():
  code = ("import sys, transformer_jax, transformer_jax.data.marian_vocab, transformer_jax.data.datasets; "
          "print(sorted(m for m in ('torch', 'transformers', 'ctranslate2') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
  assert out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("overrides, message", [(dict(position_embedding="learned"), "position_embedding=.learned."),
                                                (dict(max_relative_position=4), "relative positions"),
                                                (dict(attention_window=8), "local attention"),
                                                (dict(pre_ln=True), "pre-LN"),
                                                (dict(share_embeddings=False), "separate embeddings"),
                                                (dict(ffn_glu=True), "gated feed-forward")])
def test_export_refuses_what_marian_cannot_hold_and_writes_nothing(tmp_path, our_spm, overrides, message):
  config, params = _our_model(60, **overrides)
  out = tmp_path / "marian"
  with pytest.raises(marian.UnsupportedModelError, match=message):
    marian.save_marian(params, config, str(out), tokenizer_path=our_spm)
  assert not out.exists() and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------
# The `ctranslate2` bench section (make bench): its code runs, and it compares like with like
# ----------------------------------------------------------------------------------------------------------

def test_ctranslate2_bench_section_runs_on_a_tiny_model(our_spm):
  import argparse

  from benchmarks import common, ctranslate2_bench

  tokenizer = tokenizer_lib.Tokenizer(our_spm)
  config, params = _our_model(tokenizer.vocab_size)
  test_sources = [np.asarray(ids, np.int32) for ids in tokenizer.encode_batch(SOURCES)]
  corpus = common.Corpus("test", [], [], test_sources, tokenizer.vocab_size, our_spm, 0.0)
  args = argparse.Namespace(preset="tiny", sources=len(SOURCES), extra_len=6, threads=1, ct2_batch=4,
                            max_tokens=64, rounds=1)
  out = ctranslate2_bench.run(args, corpus, config, params)
  runners = [f"{who}_{search}" for who in ("ours", "ct2_float32", "ct2_int8") for search in ("greedy", "beam4")]
  for name in runners:
    assert out[name]["tokens_per_s"] > 0 and len(out[name]["times"]) == 1
  # Same model, same sources, same caps and bans: fp32 greedy emits the same number of tokens on both sides.
  assert out["ours_greedy"]["target_tokens"] == out["ct2_float32_greedy"]["target_tokens"]
  assert out["ours_vs_ct2_float32_beam4"] == pytest.approx(
      out["ours_beam4"]["tokens_per_s"] / out["ct2_float32_beam4"]["tokens_per_s"])
  # Fixed shapes: every output of every runner has exactly fixed_len tokens (EOS barred until then on both sides),
  # CTranslate2 timed in a fresh process of its own (the default) or in this one.
  args.fixed_sources, args.fixed_len = len(SOURCES), 5
  for ct2_process in ("own", "shared"):
    args.ct2_process = ct2_process
    fixed = ctranslate2_bench.run_fixed(args, corpus, config, params)
    assert fixed["ct2_process"] == ct2_process
    assert fixed["output_lengths_seen"] == {name: [5] for name in ("ours_greedy", "ct2_float32_greedy",
                                                                   "ours_beam4", "ct2_float32_beam4")}
    assert fixed["ours_vs_ct2_float32_beam4"] == pytest.approx(
        fixed["ours_beam4"]["tokens_per_s"] / fixed["ct2_float32_beam4"]["tokens_per_s"])
