"""experiment_config: the typed schema against the ConfigDicts the programs build from the recipe files."""

import dataclasses
import importlib
import json

import ml_collections
import pytest

from transformer_jax.config import ModelConfig
from transformer_jax.run.experiment_config import RULES, ConfigError, DataConfig, ExperimentConfig, check_value
from transformer_jax.sharding import MeshConfig
from transformer_jax.workdir import to_jsonable


def _flat(tree: dict, prefix: str = "") -> dict:
  """`{"data.max_len": (64, int), ...}`: every leaf with its type (1 == 1.0 == True would hide a changed type)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = (value, type(value))
  return out


@pytest.mark.parametrize("recipe", ["default", "number_words", "multi30k"])
def test_recipe_round_trips_through_the_typed_config(recipe):
  """The typed config of a recipe file gives back its ConfigDict with every value (and its type) equal, and the
  same JSON (config.json, the saved checkpoint's config item) as the ConfigDict itself."""
  config_dict = importlib.import_module(f"experiments.configs.{recipe}").get_config()
  typed = ExperimentConfig.from_config_dict(config_dict)
  expected, back = _flat(config_dict.to_dict()), _flat(typed.to_config_dict().to_dict())
  assert len(expected) == len(back) > 90
  assert back == expected
  assert json.dumps(to_jsonable(typed), sort_keys=True) == json.dumps(to_jsonable(config_dict), sort_keys=True)
  assert typed.model == ModelConfig.from_mapping(config_dict.model)
  assert hash(typed) == hash(ExperimentConfig.from_config_dict(config_dict))  # frozen: a static jit argument


def test_multi30k_values_reach_the_typed_sections():
  typed = ExperimentConfig.from_config_dict(importlib.import_module("experiments.configs.multi30k").get_config())
  assert typed.data == dataclasses.replace(
      DataConfig(), dataset="parallel_text", dir="../shared/data/multi30k", builder_config="", vocab_size=6000,
      vocab_max_sentences=100_000, eval_splits=("val",), max_len=64, tokens_per_batch=2048)
  assert (typed.dropout_schedule, typed.cooldown_shape, typed.evals.bleu.every_steps) == (((2400, 0.2),), "1-sqrt", 400)
  assert typed.mesh == MeshConfig(data=-1, fsdp=1, tensor=1)


def test_every_rule_names_a_key_of_the_schema():
  config = ExperimentConfig()
  for key in RULES:
    value = config
    for part in key.split("."):
      value = getattr(value, part)  # AttributeError names a rule without a field
    check_value(key, value)  # every default satisfies its own rule


def test_from_config_dict_refuses_in_one_line_naming_the_key():
  config = ExperimentConfig().to_config_dict()
  config.data.max_len = 1
  with pytest.raises(ConfigError, match=r"^--config.data.max_len=1: must be an integer >= 2 and <= 2147483647$"):
    ExperimentConfig.from_config_dict(config)
  with pytest.raises(ConfigError, match=r"^--config.data.no_such_key: the config has no such key"):
    ExperimentConfig.from_config_dict({"data": {"no_such_key": 3}})
  with pytest.raises(ConfigError, match=r"^--config.model: d_model=100 is not divisible by num_heads=8$"):
    ExperimentConfig.from_config_dict({"model": {"d_model": 100}})
  with pytest.raises(ConfigError, match=r"^--config.decode.mbr_utility='chrf' chooses from beam search's n-best list"):
    ExperimentConfig.from_config_dict({"decode": {"mbr_utility": "chrf", "beam_size": 1}})


def test_from_saved_reads_a_config_json_as_before():
  """A saved config.json (tuples as lists, keys it predates, the import's provenance) reads as the typed config
  of the same values: lists as tuples, missing keys at their defaults, keys the schema lacks left out."""
  saved = to_jsonable(ExperimentConfig(dropout_schedule=((100, 0.2),), data=DataConfig(eval_splits=("a", "b"))))
  del saved["data"]["lowercase"], saved["early_stopping"]
  saved["imported_from"] = {"model": "Helsinki-NLP/opus-mt-en-de"}
  typed = ExperimentConfig.from_saved(json.loads(json.dumps(saved)))
  assert typed == ExperimentConfig(dropout_schedule=((100, 0.2),), data=DataConfig(eval_splits=("a", "b")))


def test_default_config_dict_is_generated_from_the_dataclasses():
  from experiments.configs import default
  assert isinstance(default.get_config(), ml_collections.ConfigDict)
  assert _flat(default.get_config().to_dict()) == _flat(dataclasses.asdict(ExperimentConfig()))
