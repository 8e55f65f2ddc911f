"""Every experiment key at its default, as the `ConfigDict` the config files start from; recipes override only
what differs.

    from experiments.configs import default
    config = default.get_config()
    config.num_train_steps = 1500          # a recipe holds its deltas (nanoGPT config/*.py, MaxText base.yml)

The keys, their defaults and one-line meanings, and their rules live in the library's schema,
`transformer_jax/run/experiment_config.py` (`ExperimentConfig`, `DataConfig`, ..., `RULES`, `validate`); this file
only hands them to ml_collections. The config is locked by the programs, so a misspelt override
(`--config.no_such_key=3`) is refused; the programs convert it once with `ExperimentConfig.from_config_dict`.
"""

import ml_collections

from transformer_jax.run.experiment_config import ExperimentConfig


def get_config() -> ml_collections.ConfigDict:
  return ExperimentConfig().to_config_dict()
