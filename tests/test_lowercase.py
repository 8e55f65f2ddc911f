"""Case-folded vocabularies (`data.lowercase`): the Multi30k protocol of training and scoring on lowercased text.

The vocabulary is trained on lowercased text and stamped so; every `encode` lowercases; the run's scores
(validation BLEU, `experiments.*`) compare against lowercased references; a vocabulary and a config that
disagree are refused in one line, as is resuming a workdir with the other setting.
"""

import dataclasses
import json

import pytest

from experiments.configs import default
from transformer_jax.data import datasets, normalize, tokenizer as tok_lib
from transformer_jax.decoding import inference
from transformer_jax.evaluation import metrics
from transformer_jax.run import evaluators, trainer
from transformer_jax.run.experiment_config import ConfigError, ExperimentConfig

GERMAN = ["Die Straße ist größer", "Fünf Äpfel für Müller", "Ein Café am Fluss", "ZWÖLF Öfen über Nacht"]
ENGLISH = ["The street is bigger", "Five apples for Miller", "A café by the river", "TWELVE ovens overnight"]


@pytest.fixture(scope="module")
def lowercased(tmp_path_factory):
  path = tmp_path_factory.mktemp("lc") / "spm.model"
  return tok_lib.train_tokenizer((GERMAN + ENGLISH) * 20, str(path), vocab_size=90, lowercase=True)


def test_a_lowercased_vocabulary_has_no_capitals_and_encodes_any_case_alike(lowercased):
  assert lowercased.lowercase and lowercased.normalization == normalize.VERSION
  pieces = lowercased.pieces(range(lowercased.vocab_size))
  assert not any(p != p.lower() for p in pieces)
  for text in GERMAN + ENGLISH:
    mixed = "".join(c.upper() if i % 2 and len(c.upper()) == 1 else c for i, c in enumerate(text))  # not ß -> SS
    assert lowercased.encode(text) == lowercased.encode(text.lower()) == lowercased.encode(mixed)
    assert lowercased.decode(lowercased.encode(text)) == text.lower()
  assert lowercased.decode(lowercased.encode("Die STRASSE die Straße")) == "die strasse die straße"  # ß stays ß
  assert lowercased.encode_batch(["Ein Café"])[0] == lowercased.encode("ein café")


def test_the_stamp_says_lowercase_and_old_stamps_read_as_cased(lowercased, tmp_path):
  with open(tok_lib.stamp_path(lowercased.path), encoding="utf-8") as f:
    stamp = json.load(f)
  assert stamp["lowercase"] is True and stamp["signature"] == normalize.signature(lowercase=True)
  assert stamp["signature"].endswith("/lowercase")
  assert tok_lib.Tokenizer(lowercased.path).lowercase  # read back from the stamp, not from the caller

  cased = tok_lib.train_tokenizer(GERMAN * 20, str(tmp_path / "cased" / "spm.model"), vocab_size=60)
  assert not cased.lowercase and cased.encode("Die Straße") != cased.encode("die straße")
  stamp_file = tok_lib.stamp_path(cased.path)
  with open(stamp_file, encoding="utf-8") as f:
    old = {k: v for k, v in json.load(f).items() if k != "lowercase"}  # a stamp from before the key
  with open(stamp_file, "w", encoding="utf-8") as f:
    json.dump(old, f)
  assert not tok_lib.Tokenizer(cased.path).lowercase
  with open(stamp_file, "w", encoding="utf-8") as f:
    json.dump(dict(old, lowercase="yes"), f)
  with pytest.raises(tok_lib.VocabularyError, match='"lowercase" must be true or false') as error:
    tok_lib.Tokenizer(cased.path)
  assert "\n" not in str(error.value)


def test_scores_of_a_lowercased_vocabulary_ignore_case():
  hyps, refs = ["die straße ist größer", "ein café am fluss"], ["Die Straße ist größer", "Ein Café am Fluss"]
  lc = metrics.sacrebleu_scores(hyps, refs, lowercase=True)
  assert lc["bleu"] == pytest.approx(100.0) and lc["chrf"] == pytest.approx(100.0)
  assert "case:lc" in lc["bleu_signature"] and "case:lc" in lc["chrf_signature"]
  cased = metrics.sacrebleu_scores(hyps, refs)
  assert cased["bleu"] < 100.0 and "case:mixed" in cased["bleu_signature"]
  assert metrics.exact_match(hyps, refs, lowercase=True) == 1.0 and metrics.exact_match(hyps, refs) == 0.0


def _corpus(directory):
  directory.mkdir()
  en = [f"{ENGLISH[i % 4]} number {i}" for i in range(40)]
  de = [f"{GERMAN[i % 4]} Nummer {i}" for i in range(40)]
  for split in ("train", "val"):
    for lang, lines in (("en", en), ("de", de)):
      (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return en, de


def _config(tmp_path, lowercase=True):
  config = default.get_config()
  config.data.update(dict(dataset="parallel_text", builder_config="", dir=str(tmp_path / "corpus"),
                          tfds_data_dir=str(tmp_path / "tfds"), vocab_size=90, eval_splits=("val",), max_len=32,
                          tokens_per_batch=256, vocab_max_sentences=1000, lowercase=lowercase))
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=16, d_ff=32, num_heads=2)
  config.num_train_steps, config.warmup_steps, config.log_every_steps = 2, 1, 1
  config.evals.loss.every_steps = config.evals.attention.every_steps = config.evals.bleu.every_steps = 0
  config.checkpoint_every_steps, config.async_checkpointing = 2, False
  config.final_eval.split = ""
  return config


def test_training_pairs_are_lowercased_and_a_mismatched_vocabulary_is_refused(tmp_path):
  en, de = _corpus(tmp_path / "corpus")
  cfg, work = ExperimentConfig.from_config_dict(_config(tmp_path)).data, str(tmp_path / "w")
  data = datasets.build_datasets(cfg, work, seed=0)
  tok = data.tokenizer
  assert tok.lowercase
  sources, targets = data.train.shards.read_all()
  assert sources[0].tolist() == tok.encode(en[0].lower())
  assert targets[3].tolist() == tok.encode(de[3].lower())
  assert data.eval_sets["val"].pairs[0] == (en[0], de[0])  # the texts stay as written; their ids are lowercased
  assert data.train.shards.manifest["normalization"] == normalize.signature(lowercase=True)
  # the same vocabulary (data.vocab_path of another run, or a changed flag) for a cased run
  cfg = dataclasses.replace(cfg, lowercase=False)
  with pytest.raises(tok_lib.VocabularyError, match=r"is a lowercased vocabulary but "
                                                    r"--config.data.lowercase=False") as error:
    datasets.open_tokenizer(cfg, work)
  assert "\n" not in str(error.value)


def test_validation_bleu_compares_lowercased_and_a_resume_cannot_change_the_case(tmp_path, monkeypatch):
  _corpus(tmp_path / "corpus")
  config, work = ExperimentConfig.from_config_dict(_config(tmp_path)), tmp_path / "run"
  trainer.train_and_evaluate(config, str(work))
  run = trainer.prepare(config, str(work))
  pairs = run.data.eval_sets["val"].pairs
  # An evaluator whose model writes the references lowercased, as a perfect case-folded model would.
  by_source = {s: t.lower() for s, t in pairs}
  monkeypatch.setattr(inference, "translate_texts", lambda p, m, tok, sources, **kw: [by_source[s] for s in sources])
  evaluator = evaluators.BleuEvaluator(1, 0, 1, 0.6, run.model_config, run.data.tokenizer, run.data.eval_sets,
                                       samples=2)
  evaluation = evaluator(None)
  assert evaluation.metrics["val/bleu"] == pytest.approx(100.0)
  # The evaluator returns its samples (the split's first pairs and their translations) and keeps nothing: a
  # second call returns an equal, separate evaluation.
  assert evaluation.samples == {"val": [(s, t, t.lower()) for s, t in pairs[:2]]}
  again = evaluator(None)
  assert again == evaluation and again.samples is not evaluation.samples
  run.writer.close()

  saved = (work / "config.json").read_bytes()
  cased = ExperimentConfig.from_config_dict(_config(tmp_path, lowercase=False))
  with pytest.raises(ValueError, match="data.lowercase: saved True, requested False"):
    trainer.train_and_evaluate(cased, str(work))
  assert (work / "config.json").read_bytes() == saved


def test_config_refuses_lowercasing_a_marian_vocabulary():
  config = default.get_config()
  config.data.update(dict(lowercase=True, tokenizer="marian"))
  with pytest.raises(ConfigError, match="data.lowercase=True: needs data.tokenizer='sentencepiece'"):
    ExperimentConfig.from_config_dict(config)
