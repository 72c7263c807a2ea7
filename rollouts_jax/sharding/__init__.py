"""Meshes, the logical-axis rules table, and sharded state for one or many devices.

JAX's own sharding is the distributed engine: a `jax.sharding.Mesh` with axes
`data`, `fsdp` and `tensor`, `NamedSharding`s derived from the logical axis names
that `models.param_axes` puts on every parameter, and `jax.jit` with in/out
shardings. Nothing here moves bytes by itself.

One rules table maps logical names to mesh axes; three presets cover the usual cases:

| logical name | `pure_dp` | `fsdp` | `fsdp_tp` |
|--------------|-----------|--------|-----------|
| `batch`      | (data, fsdp) | (data, fsdp) | (data, fsdp) |
| `embed`      | -         | fsdp   | fsdp      |
| `vocab`, `mlp`, `heads`, `kv_heads` | - | - | tensor |
| `layers`, `norm`, `seq`, `head_dim` | - | - | - |

Typical use (see docs/sharding.md for multi-host launches):

mesh = make_mesh((2, 2, 2))
rules = get_rules("fsdp_tp")
params = sharded_init(cfg, jax.random.key(0), mesh, rules)
tokens = shard_batch(np_tokens, mesh)
logits = models.forward(cfg, params, tokens)

Since `models.forward` and the sampler are `jax.jit` functions, sharded inputs are
all XLA needs to partition them. Inside `use_rules(mesh, rules)` the sampler also
pins its KV cache to (batch over data axes, kv heads over `tensor`).

Modules (every public name is re-exported here, so `sharding.make_mesh` etc. work):

- `rules`: logical-axis rules, the presets, `logical_to_spec`.
- `mesh`: `make_mesh`, `MeshConfig`, `RolloutTrainMeshes`, `describe`.
- `partition`: parameter / optimizer-state / batch shardings (`policy_shardings` for LoRA), `shard_params`,
  `sharded_init`, `init_sharded_state`, `jit_sharded_step`, `use_rules` / `constrain`, `handoff`.
- `distributed`: `initialize_distributed`, `define_distributed_flags`.
- `checkpoint_io`: `save_sharded`, `restore_sharded`, `abstract_tree` (orbax).
"""

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollouts_jax.sharding.checkpoint_io import abstract_tree, restore_sharded, save_sharded
from rollouts_jax.sharding.distributed import define_distributed_flags, initialize_distributed
from rollouts_jax.sharding.mesh import MeshConfig, RolloutTrainMeshes, describe, make_mesh
from rollouts_jax.sharding.partition import (ShardingContext, abstract_params, constrain, constrain_kv_cache,
                                             current_context, data_sharding, handoff, init_sharded_opt_state,
                                             init_sharded_state,
                                             jit_sharded_step, param_shardings, param_specs, policy_shardings,
                                             process_batch_slice,
                                             shard_batch, shard_params, sharded_init, tree_shardings_like,
                                             use_rules)
from rollouts_jax.sharding.rules import AXIS_NAMES, BATCH_AXES, PRESETS, MeshAxes, Rules, get_rules, logical_to_spec

__all__ = [
    "AXIS_NAMES", "BATCH_AXES", "PRESETS", "Mesh", "MeshAxes", "MeshConfig", "NamedSharding", "PartitionSpec",
    "RolloutTrainMeshes", "Rules", "ShardingContext", "abstract_params", "abstract_tree", "constrain",
    "constrain_kv_cache", "current_context", "data_sharding", "define_distributed_flags", "describe",
    "get_rules", "handoff", "init_sharded_opt_state", "init_sharded_state", "initialize_distributed", "jit_sharded_step",
    "logical_to_spec", "make_mesh", "param_shardings", "param_specs", "policy_shardings", "process_batch_slice", "restore_sharded",
    "save_sharded", "shard_batch", "shard_params", "sharded_init", "tree_shardings_like", "use_rules",
]
