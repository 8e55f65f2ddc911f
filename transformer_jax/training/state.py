"""The train state's construction: a fresh `steps.TrainState` born in its sharded layout on a device mesh.

The state's type and the model's initial parameters are `training/steps.py`; the mesh, the logical axis rules
and the placement helpers this module uses are `transformer_jax/sharding.py`. t5x builds its train state the
same way (`jax.eval_shape` of the initialisation for the partition specs, then the initialisation jitted with
those `out_shardings`: no full copy on one device first).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from transformer_jax import sharding
from transformer_jax.config import ModelConfig
from transformer_jax.model import Transformer
from transformer_jax.training import steps


def create_train_state(model_config: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
                       mesh: Optional[Mesh] = None, rules: sharding.LogicalRules = sharding.LOGICAL_AXIS_RULES
                       ) -> steps.TrainState:
  """A fresh `TrainState` (float32 params, the optimizer state of `tx`) born in its sharded layout on `mesh`.

  `mesh=None` is the one-device mesh (`sharding.single_device_mesh`): the unsharded case is not a separate road.
  `jax.eval_shape` of the initialisation gives the boxed (logically named) abstract state; its partition
  specs, mapped through `rules`, give the `NamedSharding` of every parameter. The optimizer state follows
  the parameters (Adam's mu/nu are built from the boxed parameters, so they carry the same names); leaves
  without names (step, Adam's count) are replicated. Initialisation is jitted with those `out_shardings`,
  so each device only ever materialises its own shards; the values do not depend on the mesh (threefry
  bits are sharding-independent). `sharding.shardings_of(state)` gives the tree of shardings the jitted steps
  take (`training/partitioned.py`).
  Raises ValueError when the model does not divide over the mesh (`sharding.validate_model_for_mesh`,
  `sharding.check_divisible`).
  """
  mesh = sharding.single_device_mesh() if mesh is None else mesh
  rules = sharding.validate_model_for_mesh(model_config, mesh, rules)
  boxed_state, abstract, shardings = _state_layout(model_config, tx, rng, mesh, rules)
  with nn.logical_axis_rules(rules):
    return jax.jit(lambda key: nn.unbox(boxed_state(key)), out_shardings=shardings)(rng)


def abstract_train_state(model_config: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array, mesh: Mesh,
                         rules: sharding.LogicalRules = sharding.LOGICAL_AXIS_RULES) -> steps.TrainState:
  """The `TrainState` `create_train_state` would build, as `jax.ShapeDtypeStruct`s with its shardings on
  `mesh`: nothing is initialised or placed, so `mesh` may hold compile-only devices (a TPU topology,
  `accelerators.tpu_topology`). The compiled steps lower on it exactly as on the real state. Raises what
  `create_train_state` raises."""
  rules = sharding.validate_model_for_mesh(model_config, mesh, rules)
  _, abstract, shardings = _state_layout(model_config, tx, rng, mesh, rules)
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                nn.unbox(abstract), shardings)


def _state_layout(model_config: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array, mesh: Mesh,
                  rules: sharding.LogicalRules):
  """(the boxed state's initialisation `key -> state`, its abstract value, its shardings on `mesh`)."""
  apply_fn = Transformer(model_config).apply

  def boxed_state(key):
    params = steps.init_params(model_config, key)
    return steps.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)

  abstract = jax.eval_shape(boxed_state, rng)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  sharding.check_divisible(nn.unbox(abstract), shardings)
  return boxed_state, abstract, shardings
