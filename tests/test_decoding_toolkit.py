"""The decoding toolkit through the programs (`translate`, `score`) and the library pieces under them:
n-best lists with scores, sampling (top-p, seeds), forced scoring, prefixes, alignments, ensembles, bad
combinations. Numbers are checked against the model's teacher-forced log-probs and NumPy recomputations."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_experiments import TINY_OVERRIDES, _run
from transformer_jax import decoding
from transformer_jax.decoding import ensemble, generate, inference, mbr, scoring
from transformer_jax.model import Transformer
from transformer_jax.run import trained
from transformer_jax.training import loss as loss_lib

TINY = [*TINY_OVERRIDES, "--config.final_eval.split="]
LINES = ["twenty-one", "five", "", "three hundred forty-five", "one hundred one thousand one", "seven"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = tmp_path_factory.mktemp("run")
  _run(["experiments.train", f"--workdir={wd}", *TINY])
  return str(wd)


@pytest.fixture(scope="module")
def model(workdir):
  return trained.load(workdir, None)


def _translate(workdir, *flags, lines=LINES):
  return _run(["experiments.translate", f"--workdir={workdir}", *flags], stdin="\n".join(lines) + "\n").stdout


def _jsonl(text):
  return [json.loads(line) for line in text.splitlines()]


def _teacher_forced(model, source: str, ids: list[int], finished: bool = True) -> np.ndarray:
  """Per-token log-probs of `ids + [EOS]` given `source`, straight from the model (decoding.sequence_log_probs'
  terms); without the EOS term unless `finished` (a hypothesis stopped at the length limit never emitted it)."""
  config, params, tokenizer = model
  src = jnp.asarray([tokenizer.encode(source)], jnp.int32)
  tgt = jnp.asarray([ids + [config.eos_id]], jnp.int32)
  total = float(decoding.sequence_log_probs(params, config, src, tgt)[0])
  per_token = np.asarray(scoring.token_log_probs(params, config, src, tgt))[0]
  assert per_token.sum() == pytest.approx(total, abs=1e-4)
  return per_token if finished else per_token[:len(ids)]


def _finished(hypothesis: dict) -> bool:
  """Whether a printed hypothesis ended with EOS (its token_log_probs hold the EOS term) or at the length limit."""
  return len(hypothesis["token_log_probs"]) == len(hypothesis["ids"]) + 1


# -- 1. n-best lists with scores ---------------------------------------------------------------------------

def test_nbest_jsonl_is_sorted_scored_and_its_first_is_todays_output(workdir, model):
  records = _jsonl(_translate(workdir, "--beam_size=4", "--nbest=4", "--output_format=jsonl", "--alpha=0.6"))
  today = _translate(workdir, "--beam_size=4").split("\n")
  config = model[0]
  assert [r["line"] for r in records] == list(range(1, len(LINES) + 1)) and records[2]["hypotheses"] == []
  assert sum(len(r["hypotheses"]) for r in records) >= 12  # mostly full lists
  for record, line in zip(records, today):
    hyps = record["hypotheses"]
    if not hyps:
      continue
    assert hyps[0]["text"] == line
    assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
    for h in hyps:
      expected = _teacher_forced(model, record["source"], h["ids"], _finished(h))
      assert h["log_prob"] == pytest.approx(float(expected.sum()), abs=1e-4)
      np.testing.assert_allclose(h["token_log_probs"], expected, atol=1e-4)
      assert h["score"] == pytest.approx(h["log_prob"] / decoding.length_penalty(len(expected), 0.6), abs=1e-5)
      assert config.eos_id not in h["ids"]


@pytest.mark.slow
def test_nbest_text_writes_n_lines_per_input_line(workdir):
  out = _translate(workdir, "--beam_size=3", "--nbest=2").split("\n")[:-1]
  records = _jsonl(_translate(workdir, "--beam_size=3", "--nbest=2", "--output_format=jsonl"))
  assert len(out) == 2 * len(LINES)
  for i, record in enumerate(records):
    texts = [h["text"] for h in record["hypotheses"]]
    assert out[2 * i: 2 * i + 2] == texts + [""] * (2 - len(texts))


# -- 2. sampling --------------------------------------------------------------------------------------------

def test_nucleus_truncation_matches_numpy():
  rng = np.random.default_rng(0)
  scaled = rng.normal(size=(5, 11)).astype(np.float32) * 2
  scaled[0, 3] = -np.inf
  for top_p in (0.05, 0.3, 0.7, 0.95):
    got = np.asarray(decoding.truncate(jnp.asarray(scaled), 0, top_p))
    for row, out in zip(scaled, got):
      probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
      order = np.argsort(-probs, kind="stable")
      keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]  # smallest set reaching top_p
      assert set(np.flatnonzero(np.isfinite(out))) == set(keep.tolist()), top_p
      np.testing.assert_array_equal(out[keep], row[keep])


def test_top_p_one_is_plain_sampling_top_p_to_zero_is_greedy_and_seeds_reproduce(workdir):
  plain = _translate(workdir, "--strategy=sample", "--seed=3")
  assert _translate(workdir, "--strategy=sample", "--seed=3", "--top_p=1.0") == plain
  assert _translate(workdir, "--strategy=sample", "--seed=4") != plain
  assert _translate(workdir, "--strategy=sample", "--seed=3", "--top_p=1e-6") == _translate(
      workdir, "--strategy=greedy")


def test_same_seed_same_samples_whatever_the_batching(model):
  config, params, tokenizer = model
  ids = [tokenizer.encode(t) for t in LINES if t] * 3
  options = generate.DecodeOptions(strategy="sample", temperature=1.5, top_k=20, top_p=0.9)
  runs = [inference.decode_ids(params, config, ids, options, seed=7, batch_size=b) for b in (1, 3, 16)]
  texts = [[h[0].ids for h in run] for run in runs]
  assert texts[0] == texts[1] == texts[2]
  assert len({tuple(t) for t in texts[0]}) > len(LINES) - 1  # copies of one line sample differently


# -- 3. forced scoring --------------------------------------------------------------------------------------

def test_score_program_equals_sequence_log_probs_and_the_teacher_forced_loss(workdir, model, tmp_path):
  config, params, tokenizer = model
  sources = ["twenty-one", "five", "", "three hundred forty-five"]
  targets = ["einundzwanzig", "fünf", "sieben", "dreihundertfünfundvierzig"]
  (tmp_path / "s").write_text("\n".join(sources) + "\n")
  (tmp_path / "t").write_text("\n".join(targets) + "\n")
  args = ["experiments.score", f"--workdir={workdir}", f"--source={tmp_path}/s", f"--target={tmp_path}/t"]
  records = _jsonl(_run(args).stdout)
  tsv = [line.split("\t") for line in _run(args + ["--output_format=tsv"]).stdout.splitlines()]
  assert records[2]["log_prob"] is None and tsv[2] == ["", "", ""]
  total, count = 0.0, 0
  for src, tgt, record, row in zip(sources, targets, records, tsv):
    if not src:
      continue
    ids = tokenizer.encode(tgt, target=True)
    expected = _teacher_forced(model, src, ids[:-1])
    assert record["log_prob"] == pytest.approx(float(expected.sum()), abs=1e-4)
    np.testing.assert_allclose(record["token_log_probs"], expected, atol=1e-5)
    assert record["perplexity"] == pytest.approx(np.exp(-expected.sum() / len(ids)), rel=1e-5)
    assert float(row[0]) == pytest.approx(record["log_prob"], abs=1e-5) and int(row[1]) == len(ids)
    logits = Transformer(config).apply({"params": params}, jnp.asarray([tokenizer.encode(src)]),
                                       jnp.asarray([ids]))
    loss = float(loss_lib.normalized_loss(logits, jnp.asarray([ids]), 0.0, pad_id=config.pad_id))
    assert loss == pytest.approx(-record["log_prob"] / len(ids), rel=1e-5)  # the training loss, unsmoothed
    total, count = total + record["log_prob"], count + len(ids)
  assert count > 0


# -- bad combinations: one line, before any decoding ----------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--strategy=sample", "--top_p=0"], "--top_p=0.0 must be in (0, 1]"),
    (["--strategy=sample", "--top_p=1.5"], "--top_p=1.5 must be in (0, 1]"),
    (["--beam_size=2", "--nbest=3"], "--nbest=3 must be in [1, 2]"),
    (["--strategy=sample", "--nbest=2"], "--nbest=2 must be in [1, 1]"),
    (["--top_p=0.5"], "--top_p=0.5 applies to strategy='sample' only"),
    (["--strategy=sample", "--temperature=0"], "--temperature=0.0 must be a finite number > 0"),
    (["--strategy=nucleus"], "--strategy"),
    (["--sampling=sample"], "--sampling is now --strategy"),
    (["--strategy=greedy", "--mbr_utility=chrf"], "--mbr_utility='chrf' chooses from beam search's n-best list"),
])
def test_bad_decoding_flags_are_one_line_errors(workdir, flags, needle):
  result = _run(["experiments.translate", f"--workdir={workdir}", *flags], stdin="five\n", check=False)
  lines = result.stderr.strip().splitlines()
  assert result.returncode != 0 and lines[-1].startswith("error: ") and needle in lines[-1], result.stderr[-2000:]
  assert result.stdout == ""


# -- 4. prefixes and alignments -----------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--beam_size=4"], pytest.param(["--strategy=greedy"], marks=pytest.mark.slow)])
def test_prefix_is_the_start_of_every_output(workdir, model, tmp_path, flags):
  _, _, tokenizer = model
  prefixes = ["zwei", "", "", "drei hundert", "eins", "sieben"]
  (tmp_path / "p").write_text("\n".join(prefixes) + "\n")
  records = _jsonl(_translate(workdir, *flags, f"--prefix_file={tmp_path}/p", "--output_format=jsonl"))
  plain = _jsonl(_translate(workdir, *flags, "--output_format=jsonl"))
  for record, prefix, without in zip(records, prefixes, plain):
    if not record["source"]:
      assert record["hypotheses"] == []
      continue
    ids = record["hypotheses"][0]["ids"]
    forced = tokenizer.encode(prefix, add_eos=False, target=True) if prefix else []
    assert ids[: len(forced)] == forced
    if not prefix:
      assert record["hypotheses"] == without["hypotheses"]
    expected = _teacher_forced(model, record["source"], ids,  # the prefix's tokens keep the model's log-probs
                               _finished(record["hypotheses"][0]))
    assert record["hypotheses"][0]["log_prob"] == pytest.approx(float(expected.sum()), abs=1e-4)
  assert any(p and not r["hypotheses"][0]["text"].startswith(p) for p, r in zip(prefixes, plain) if r["hypotheses"])


def test_alignment_has_one_link_per_target_token_into_the_source(workdir, model):
  _, _, tokenizer = model
  records = _jsonl(_translate(workdir, "--beam_size=2", "--print_alignment", "--output_format=jsonl"))
  text = _translate(workdir, "--beam_size=2", "--print_alignment").split("\n")
  for record, line in zip(records, text):
    if not record["hypotheses"]:
      assert line == "\t"
      continue
    hyp = record["hypotheses"][0]
    links = [tuple(map(int, link.split("-"))) for link in hyp["alignment"].split()]
    assert [j for _, j in links] == list(range(len(hyp["ids"])))
    source_len = len(tokenizer.encode(record["source"])) - 1  # EOS is never aligned to
    assert all(0 <= i < source_len for i, _ in links)
    assert line == hyp["text"] + "\t" + hyp["alignment"]


def test_prefix_file_of_another_length_is_refused(workdir, tmp_path):
  (tmp_path / "p").write_text("a\nb\n")
  result = _run(["experiments.translate", f"--workdir={workdir}", f"--prefix_file={tmp_path}/p"],
                stdin="five\n", check=False)
  assert result.returncode != 0 and result.stdout == ""
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: --prefix_file={tmp_path}/p has 2 lines but the input has 1: one prefix per input line is needed")


# -- 5. ensembles --------------------------------------------------------------------------------------------

def _numpy_ensemble_log_probs(models, source: str, ids: list[int], finished: bool = True) -> float:
  """NumPy: sum over t of the renormalised mean of the models' log-probs, pad and BOS impossible; the EOS term
  only for a `finished` hypothesis (one that stopped at the length limit never emitted it)."""
  config, _, tokenizer = models[0]
  src = jnp.asarray([tokenizer.encode(source)], jnp.int32)
  tgt = jnp.asarray([ids + [config.eos_id]], jnp.int32)
  logps = []
  for _, params, _ in models:
    logits = np.asarray(Transformer(config).apply({"params": params}, src, tgt))[0].astype(np.float64)
    logps.append(logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                 - logits.max(-1, keepdims=True))
  mean = np.mean(logps, axis=0)
  mean = mean - np.log(np.exp(mean - mean.max(-1, keepdims=True)).sum(-1, keepdims=True)) - mean.max(-1, keepdims=True)
  steps = len(ids) + int(finished)
  return float(mean[np.arange(steps), np.asarray(tgt)[0][:steps]].sum())


def test_ensemble_of_a_model_with_itself_is_the_model_and_of_two_is_the_mean(workdir, model):
  single = _jsonl(_translate(workdir, "--beam_size=3", "--checkpoint=30", "--output_format=jsonl"))
  itself = _jsonl(_translate(workdir, "--beam_size=3", "--checkpoint=30", "--ensemble=30", "--output_format=jsonl"))
  two = _jsonl(_translate(workdir, "--beam_size=3", "--checkpoint=30", "--ensemble=20", "--output_format=jsonl"))
  other = trained.load(workdir, "20")
  differs = 0
  for a, b, c in zip(single, itself, two):
    if not a["hypotheses"]:
      continue
    assert [h["ids"] for h in a["hypotheses"]] == [h["ids"] for h in b["hypotheses"]]
    assert b["hypotheses"][0]["log_prob"] == pytest.approx(a["hypotheses"][0]["log_prob"], abs=1e-4)
    hyp = c["hypotheses"][0]
    assert hyp["log_prob"] == pytest.approx(
        _numpy_ensemble_log_probs([model, other], c["source"], hyp["ids"], _finished(hyp)), abs=1e-4)
    differs += abs(hyp["log_prob"] - a["hypotheses"][0]["log_prob"]) > 1e-3
  assert differs >= 3


def test_ensemble_of_one_step_is_that_step(model):
  config, params, tokenizer = model
  ids = [tokenizer.encode(t) for t in LINES if t]
  options = generate.DecodeOptions(strategy="beam", beam_size=2, nbest=2)
  assert inference.decode_ids([params], config, ids, options) == inference.decode_ids(params, config, ids, options)
  step = decoding.transformer_step_fn(params, config, jnp.asarray([ids[0]]), 8)
  assert ensemble.ensemble_step([step]) is step


def test_mbr_puts_its_choice_first_in_the_n_best_list_and_keeps_blank_lines(model):
  config, params, tokenizer = model
  plain = generate.DecodeOptions(beam_size=3, nbest=3, token_log_probs=False)
  lists = inference.decode_texts(params, config, tokenizer, LINES, plain)
  chosen = inference.decode_texts(params, config, tokenizer, LINES,
                                  dataclasses.replace(plain, mbr_utility="chrf", nbest=2))
  for hyps, mbr_hyps in zip(lists, chosen):
    if not hyps:
      assert mbr_hyps == []  # a blank line stays blank
      continue
    k = mbr.select([tokenizer.decode(h.ids) for h in hyps], [h.log_prob for h in hyps], "chrf")
    assert mbr_hyps == ([hyps[k]] + hyps[:k] + hyps[k + 1:])[:2]
  assert inference.translate_texts(params, config, tokenizer, LINES, beam_size=3, mbr_utility="chrf") == [
      tokenizer.decode(h[0].ids) if h else "" for h in chosen]


@pytest.mark.slow
def test_ensemble_of_another_architecture_is_refused(workdir, tmp_path):
  deeper = tmp_path / "deeper"
  _run(["experiments.train", f"--workdir={deeper}", *TINY, "--config.model.num_decoder_layers=2",
        "--config.num_train_steps=10"])
  result = _run(["experiments.translate", f"--workdir={workdir}", f"--ensemble={deeper}"], stdin="five\n",
                check=False)
  last = result.stderr.strip().splitlines()[-1]
  assert result.returncode != 0 and result.stdout == ""
  assert last.startswith(f"error: --ensemble={deeper}: another architecture") and "one architecture" in last


# -- 7. evaluate and tune_decoding take the decoding flags --------------------------------------------------

@pytest.mark.slow
def test_tune_decoding_ensemble_row_agrees_with_evaluate_ensemble(workdir, tmp_path):
  sources, references = ["twenty-one", "five", "seven", "one hundred one"], ["einundzwanzig", "fünf", "sieben",
                                                                              "einhunderteins"]
  (tmp_path / "s").write_text("\n".join(sources) + "\n")
  (tmp_path / "r").write_text("\n".join(references) + "\n")
  files = [f"--source={tmp_path}/s", f"--reference={tmp_path}/r"]
  _run(["experiments.tune_decoding", f"--workdir={workdir}", *files, "--average_last=2", "--ensemble_last=2",
        "--beam_sizes=2", "--alphas=0.6", f"--report={tmp_path}/report.json"])
  rows = json.loads((tmp_path / "report.json").read_text())["rows"]
  ensemble_row = [r for r in rows if r.get("ensemble_last") == 2][0]
  assert ensemble_row["steps"] == [20, 30] and [r.get("average_last") for r in rows] == [2, None]
  _run(["experiments.evaluate", f"--workdir={workdir}", *files, "--beam_size=2", "--alpha=0.6", "--checkpoint=20",
        "--ensemble=30", f"--output_prefix={tmp_path}/eval"])
  assert json.loads((tmp_path / "eval.json").read_text())["bleu"] == pytest.approx(ensemble_row["bleu"])
  bad = _run(["experiments.tune_decoding", f"--workdir={workdir}", *files, "--ensemble_last=1"], check=False)
  assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
      "error: --ensemble_last=1: '1' is not an integer >= 2")


# -- 6. lexical constraints through the program --------------------------------------------------------------

def test_constraints_file_puts_every_phrase_in_every_output(workdir, model, tmp_path):
  _, _, tokenizer = model
  phrases = ["neun\tsieben", "", "", "zwanzig", "drei\tvier", "acht"]
  (tmp_path / "c").write_text("\n".join(phrases) + "\n")
  records = _jsonl(_translate(workdir, "--beam_size=4", "--nbest=2", f"--constraints_file={tmp_path}/c",
                              "--output_format=jsonl"))
  for record, line in zip(records, phrases):
    wanted = [tokenizer.encode(p, add_eos=False, target=True) for p in line.split("\t") if p]
    for hyp in record["hypotheses"]:
      ids = hyp["ids"]
      assert hyp["constraints_met"]
      assert all(any(ids[i:i + len(w)] == w for i in range(len(ids))) for w in wanted)
      expected = _teacher_forced(model, record["source"], ids, _finished(hyp))
      assert hyp["log_prob"] == pytest.approx(float(expected.sum()), abs=1e-4)


def test_constraints_with_sampling_are_refused(workdir, tmp_path):
  (tmp_path / "c").write_text("neun\n")
  result = _run(["experiments.translate", f"--workdir={workdir}", "--strategy=sample",
                 f"--constraints_file={tmp_path}/c"], stdin="five\n", check=False)
  assert result.returncode != 0 and result.stdout == ""
  assert result.stderr.strip().splitlines()[-1].startswith("error: --constraints_file needs beam search")
