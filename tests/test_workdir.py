"""The run directory (transformer_jax/workdir.py): layout, atomic JSON, config comparison."""

import json
import os

import pytest

from transformer_jax.config import tiny
from transformer_jax.workdir import Workdir, config_diff, read_json, to_jsonable, write_json_atomically


def test_layout_is_named_in_one_place(tmp_path):
  w = Workdir(tmp_path / "run")
  assert os.fspath(w.config_json) == str(tmp_path / "run" / "config.json")
  assert os.fspath(w.checkpoints) == str(tmp_path / "run" / "checkpoints")
  assert os.fspath(w.vocab) == str(tmp_path / "run" / "vocab" / "spm.model")
  assert os.fspath(w.token_ids("train")) == str(tmp_path / "run" / "data" / "train.ids")
  assert w.token_ids("train[:10%]").name == "train__10__.ids"
  assert {p.name for p in (w.tfds, w.metrics_jsonl, w.tensorboard, w.averaged, w.eval, w.final_eval_json)} == {
      "tfds", "metrics.jsonl", "tensorboard", "averaged", "eval", "final_eval.json"}
  assert {os.fspath(p.relative_to(w.root)) for p in (
      w.train_budget_json, w.train_lock, w.wall_clock_start_json, w.results_json, w.hypotheses("test2016"),
      w.tune_decoding_json, w.eval_prefix("data/newstest2014.en"))} == {
      "train_budget.json", "train.lock", "wall_clock_start.json", "results.json", "test2016.hyp",
      "eval/tune_decoding.json", "eval/newstest2014.en"}
  assert not (tmp_path / "run").exists()  # naming paths creates nothing


def test_atomic_json_and_missing_config(tmp_path):
  w = Workdir(tmp_path / "run")
  assert w.read_config() is None and read_json(tmp_path / "nope.json") is None
  with pytest.raises(FileNotFoundError, match="is .* the --workdir of a training run"):
    w.require_config()
  write_json_atomically(w.config_json, {"model": tiny(vocab_size=10), "b": (1, 2)})
  assert json.loads(w.config_json.read_text())["b"] == [1, 2]
  assert w.require_config()["model"]["d_model"] == 128
  assert sorted(os.listdir(tmp_path / "run")) == ["config.json"]  # no temporary file left


def test_config_and_budget_files_round_trip(tmp_path):
  w = Workdir(tmp_path / "run")
  w.write_config({"model": tiny(vocab_size=10), "seed": 0})
  assert w.require_config()["model"]["vocab_size"] == 10 and w.read_train_budget() is None
  w.write_train_budget({"num_train_steps": 7087, "cooldown_knots": ((6000, 0.375),)})
  assert w.read_train_budget() == {"num_train_steps": 7087, "cooldown_knots": [[6000, 0.375]]}
  assert sorted(os.listdir(w.root)) == ["config.json", "train_budget.json"]  # no temporary file left


def test_check_compatible_names_the_differing_keys(tmp_path):
  w = Workdir(tmp_path)
  write_json_atomically(w.config_json, {"model": {"d_model": 128}, "data": {"vocab_size": 256}})
  w.check_compatible({"model": {"d_model": 128}, "data": {"vocab_size": 512}}, keys=("model",))
  with pytest.raises(ValueError, match=r"data.vocab_size: saved 256, requested 512"):
    w.check_compatible({"model": {"d_model": 128}, "data": {"vocab_size": 512}}, keys=("data.vocab_size",))


def test_config_diff():
  saved = {"model": to_jsonable(tiny(vocab_size=1000)), "train": {"steps": 10}}
  assert config_diff(saved, {"model": tiny(vocab_size=1000), "train": {"steps": 99}}) == []
  requested = {"model": to_jsonable(tiny(vocab_size=1000, d_model=256, pre_ln=True)), "train": {"steps": 99}}
  assert config_diff(saved, requested) == ["model.d_model: saved 128, requested 256",
                                           "model.pre_ln: saved False, requested True"]
  assert config_diff(saved, requested, keys=("model.d_model", "train")) == [
      "model.d_model: saved 128, requested 256", "train.steps: saved 10, requested 99"]
  assert config_diff({"model": {"a": [1, 2]}}, {"model": {"a": (1, 2), "b": "x"}}) == [
      "model.b: saved <missing>, requested 'x'"]
  assert config_diff({"model": {"flag": 1}}, {"model": {"flag": True}}) == ["model.flag: saved 1, requested True"]


def test_a_saved_config_that_predates_a_model_option_counts_as_its_default(tmp_path):
  w = Workdir(tmp_path)
  old = to_jsonable(tiny(vocab_size=10))
  del old["activation"]  # a run saved before the option existed
  write_json_atomically(w.config_json, {"model": old})
  w.check_compatible({"model": tiny(vocab_size=10)}, keys=("model",), defaults={"model": tiny()})
  with pytest.raises(ValueError, match="model.activation: saved 'relu', requested 'swish'"):
    w.check_compatible({"model": tiny(vocab_size=10, activation="swish")}, keys=("model",),
                       defaults={"model": tiny()})
