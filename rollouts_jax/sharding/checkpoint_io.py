"""Save/restore of sharded pytrees onto any mesh (the one checkpointer of `io.checkpoint`)."""

from __future__ import annotations

from typing import Any

import jax


def abstract_tree(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs carrying shardings: the restore target for `restore_sharded`.

  Args:
    tree: arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(...)`).
    shardings: a matching pytree of shardings; default each leaf's own `.sharding`.
  Returns:
    A pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`.

  target = abstract_tree(jax.eval_shape(make_state), state_shardings)
  """
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def save_sharded(path, tree: Any, *, force: bool = False) -> None:
  """Saves a pytree of (sharded) arrays; every process calls it (see `io.checkpoint.save_params`).

  Each process writes the shards it owns; the call returns when the checkpoint is complete on
  disk, with checksums of its files.

  Args:
    path: checkpoint directory (local path or a `gs://` URL); must not exist unless `force`.
    tree: the pytree (params, optimizer state, a whole train state).
    force: overwrite an existing checkpoint.

  save_sharded("ckpt/step_100", state)
  """
  from rollouts_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  checkpoint.save_params(path, tree, force=force)


def restore_sharded(path, target: Any) -> Any:
  """Restores a checkpoint onto the shardings given by `target` (any mesh).

  A checkpoint written on one mesh restores on another: each device reads just the
  slices its target shards need. Checksums and finiteness are verified
  (`io.checkpoint.load_params`).

  Args:
    path: the checkpoint directory given to `save_sharded`.
    target: the pytree structure with, at each leaf, a `jax.ShapeDtypeStruct` carrying
      a sharding (see `abstract_tree`, `abstract_params`) or a jax.Array whose shape,
      dtype and sharding are used.
  Returns:
    The restored pytree, sharded as `target`.

  params = restore_sharded("ckpt/step_100", abstract_params(cfg, mesh, rules))
  """
  from rollouts_jax.io import checkpoint  # pylint: disable=g-import-not-at-top

  def as_abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      if x.sharding is None:
        raise ValueError("restore_sharded needs a sharding on every ShapeDtypeStruct of the target.")
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

  return checkpoint.load_params(path, jax.tree.map(as_abstract, target))
