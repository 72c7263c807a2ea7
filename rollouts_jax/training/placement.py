"""Where params, optimizer state and batches live: one device, or meshes with logical-axis rules."""

from __future__ import annotations

import contextlib
import logging

import jax
import numpy as np

from rollouts_jax import models

log = logging.getLogger(__name__)


class Placement:
  """Where params, optimizer state and batches live: one device, or meshes with logical rules.

  With `mesh.rollout_shape`, training and rollouts run on disjoint device blocks and the
  policy is handed off (resharded) to the rollout mesh before each generation.
  """

  def __init__(self, mesh: "sharding.MeshConfig", cfg: models.ModelConfig):
    from rollouts_jax import sharding  # pylint: disable=g-import-not-at-top
    self.sharding, self.cfg = sharding, cfg
    shape = tuple(mesh.shape)
    self.active = int(np.prod(shape)) != 1 or bool(mesh.rollout_shape)
    rollout_devices = int(np.prod(mesh.rollout_shape)) if mesh.rollout_shape else 0
    # The rollout devices' share of all devices (None: rollouts and updates share the devices).
    self.producer_share = rollout_devices / (rollout_devices + int(np.prod(shape))) if rollout_devices else None
    if self.active:
      self.roles = sharding.RolloutTrainMeshes.create(mesh)
      self.mesh = self.roles.train_mesh
      self.param_shardings = self.roles.train_shardings(cfg)
      log.info("Training mesh: %s", sharding.describe(self.mesh))
      if self.roles.separate:
        log.info("Rollout mesh: %s", sharding.describe(self.roles.rollout_mesh))

  def policy_shardings(self, policy):
    """The training mesh's shardings of a policy tree (with LoRA: its base weights and adapters; see
    `sharding.policy_shardings`); None on one device."""
    return self.sharding.policy_shardings(self.param_shardings, policy) if self.active else None

  def params(self, params):
    """Params (a LoRA policy too) placed on the training mesh."""
    return self.sharding.shard_params(params, self.policy_shardings(params)) if self.active else params

  def rollout_params(self, params):
    """The policy as the sampler sees it (a copy on the rollout mesh when roles are separate)."""
    return self.roles.to_rollout(self.cfg, params) if self.active and self.roles.separate else params

  def batch(self, rollouts):
    """The batch on the training mesh. Every process builds the same global batch (the pipeline
    is deterministic in the step's key), so each passes its own rows to `shard_batch`."""
    if not self.active:
      return rollouts
    if jax.process_count() > 1:
      rows = self.sharding.process_batch_slice(rollouts.prompt_ids.shape[0])
      rollouts = jax.tree_util.tree_map(lambda x: x[rows], rollouts)
    return self.sharding.shard_batch(rollouts, self.mesh)

  def rollout_context(self):
    return self.roles.rollout_context() if self.active else contextlib.nullcontext()


def abstract(tree):
  """Shape, dtype and sharding of every array of `tree` (the target of a checkpoint restore)."""
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def to_global(tree, shardings):
  """Values every process holds whole (host arrays, process-local arrays) as global arrays with
  `shardings` (one sharding for every leaf, or a tree of them): each device takes its part of the
  local copy. Orbax saves, and a multi-process program computes on, only global arrays. A leaf that
  is already a global array on its sharding (a LoRA policy's frozen base) is kept as it is."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

  def leaf(x, s):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and x.sharding.is_equivalent_to(s, x.ndim):
      return x
    return jax.make_array_from_callback(np.shape(x), s, lambda idx, h=np.asarray(x): h[idx])

  return jax.tree_util.tree_map(leaf, tree, shardings)


def replicated(tree, mesh):
  """Process-local arrays as replicated global ones (orbax saves only global arrays across processes).

  Every process holds the same pipeline state (the pipeline is deterministic in the step's key), so
  each local value is the replicated global value. The identity in a single process.
  """
  if jax.process_count() == 1:
    return tree
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree_util.tree_map(
      lambda x: to_global(x, whole) if isinstance(x, jax.Array) and x.is_fully_addressable else x, tree)


def local(tree):
  """The inverse of `replicated` for a restored pipeline state: replicated global arrays as local ones."""
  if jax.process_count() == 1:
    return tree
  return jax.tree_util.tree_map(
      lambda x: jax.numpy.asarray(np.asarray(x)) if isinstance(x, jax.Array) and not x.is_fully_addressable else x,
      tree)
