"""config.ModelConfig.from_mapping: a ModelConfig from a run config's `model` section (ConfigDict or JSON)."""

import dataclasses

import ml_collections
import pytest

from experiments.configs import default
from transformer_jax.config import ModelConfig, base, tiny


def test_from_mapping_round_trips_every_field_and_applies_overrides():
  cfg = tiny(vocab_size=123, max_relative_position=4, ffn_glu=True)
  assert ModelConfig.from_mapping(dataclasses.asdict(cfg)) == cfg
  assert ModelConfig.from_mapping(ml_collections.ConfigDict(dataclasses.asdict(cfg)), vocab_size=77) == \
      cfg.replace(vocab_size=77)


def test_from_mapping_of_the_default_experiment_config_is_the_base_model():
  """default.py's `model` section is the paper's base model (Table 3) once the tokenizer sets the vocabulary."""
  assert ModelConfig.from_mapping(default.get_config().model, vocab_size=37000) == base(37000)
  assert ModelConfig.from_mapping({"d_model": 64, "num_heads": 4, "d_ff": 128}) == base(
      d_model=64, num_heads=4, d_ff=128)  # fields a saved config predates keep their defaults


def test_from_mapping_names_unknown_fields():
  with pytest.raises(ValueError, match=r"unknown fields \['d_modle'\]"):
    ModelConfig.from_mapping({"d_modle": 64})
