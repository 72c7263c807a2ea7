"""Device meshes: `make_mesh`, the rollout/training mesh pair, and a log line.

>>> mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
>>> dict(mesh.shape)
{'data': 1, 'fsdp': 1, 'tensor': 1}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rollouts_jax.sharding.partition import handoff, param_shardings, policy_shardings, use_rules
from rollouts_jax.sharding.rules import AXIS_NAMES, PRESETS, Rules, get_rules

def _resolve_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills one -1 entry and checks that the shape uses exactly `num_devices` devices."""
  shape = tuple(int(s) for s in mesh_shape)
  if sum(s == -1 for s in shape) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh_shape {shape}: entries must be positive, with at most one -1 (fill).")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(
          f"mesh_shape {shape}: the product of the fixed axes ({known}) does not divide the device "
          f"count {num_devices}.")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  elif known != num_devices:
    relation = "does not divide" if num_devices % known else "is smaller than"
    raise ValueError(
        f"mesh_shape {shape} needs {known} devices, which {relation} the device count {num_devices}; "
        f"the product of mesh_shape must equal the number of devices (use -1 on one axis to fill, or "
        f"pass devices= to use a subset).")
  return shape


def make_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str] = AXIS_NAMES,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A device mesh of the given shape.

  Args:
    mesh_shape: one size per axis, e.g. (2, 2, 2) = data 2, fsdp 2, tensor 2. One entry
      may be -1 to take all remaining devices. The product must equal the device count.
    axis_names: mesh axis names; default ("data", "fsdp", "tensor").
    devices: the devices to use (default: `jax.devices()`, all processes).
  Returns:
    A `jax.sharding.Mesh` with Auto axis types; on TPU the device order follows the
    physical topology (`mesh_utils.create_device_mesh`).
  Raises:
    ValueError: the shape does not match the device count (both are named), a bad
      entry, or a length different from `axis_names`.

  make_mesh((1, -1, 1)).shape
  # OrderedDict({'data': 1, 'fsdp': 8, 'tensor': 1})
  """
  devices = list(jax.devices() if devices is None else devices)
  axis_names = tuple(axis_names)
  if len(mesh_shape) != len(axis_names):
    raise ValueError(f"mesh_shape {tuple(mesh_shape)} has {len(mesh_shape)} entries but there are "
                     f"{len(axis_names)} axis names {axis_names}.")
  shape = _resolve_shape(mesh_shape, len(devices))
  try:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    device_array = mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # pylint: disable=broad-except
    # CPU devices and device subsets have no topology to follow.
    device_array = np.asarray(devices, dtype=object).reshape(shape)
  auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
  return Mesh(device_array, axis_names, axis_types=auto)


# ----------------------------------------------------------------------------- rollout / train meshes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh (data, fsdp, tensor) and its logical-axis preset; the experiment config's `mesh` section.

  One definition for the config section and `RolloutTrainMeshes.create`, so the keys and their
  defaults cannot drift apart. `check()` reads the section alone (names and forms); the devices
  are counted when the meshes are built.

  Attributes:
    shape: training mesh (data, fsdp, tensor); one entry may be -1 (fill with the remaining devices).
    preset: rules preset of the training mesh ("pure_dp", "fsdp", "fsdp_tp").
    rollout_shape: a separate rollout mesh on other devices (Tunix-style roles), or () to roll out on
      the training mesh; weights are handed off to it before each generation.
    rollout_preset: rules preset for rollouts ("": `preset`).
  """
  shape: tuple[int, ...] = (1, 1, 1)
  preset: str = "fsdp"
  rollout_shape: tuple[int, ...] = ()
  rollout_preset: str = ""

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
    object.__setattr__(self, "rollout_shape", tuple(int(s) for s in self.rollout_shape))

  def check(self) -> None:
    """The `mesh` keys: known presets, and shapes of one size per axis (positive, at most one -1)."""
    for key, preset in (("mesh.preset", self.preset), ("mesh.rollout_preset", self.rollout_preset)):
      if preset and preset not in PRESETS:
        raise ValueError(f"Config key {key}: unknown sharding preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    for key, shape in (("mesh.shape", self.shape), ("mesh.rollout_shape", self.rollout_shape)):
      if key == "mesh.rollout_shape" and not shape:
        continue
      if len(shape) != len(AXIS_NAMES) or any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
        raise ValueError(f"Config key {key}={shape}: one size per axis ({', '.join(AXIS_NAMES)}), each positive "
                         "or -1 (fill with the remaining devices) at most once.")


def _split_devices(train_shape, rollout_shape, devices):
  """Devices of the training and rollout meshes: disjoint blocks, or all devices for both."""
  n = len(devices)
  t_fill, r_fill = -1 in train_shape, -1 in rollout_shape
  if t_fill and r_fill:
    raise ValueError(f"Only one of mesh.shape {train_shape} and mesh.rollout_shape {rollout_shape} "
                     "may contain -1.")
  pt = None if t_fill else math.prod(train_shape)
  pr = None if r_fill else math.prod(rollout_shape)
  if pt == n and pr == n:
    return devices, devices  # colocated: same devices, possibly different layouts
  if pt is None:
    pt = n - pr
    if pt <= 0:
      raise ValueError(f"mesh.rollout_shape {rollout_shape} uses all {n} devices; none left for mesh.shape "
                       f"{train_shape}.")
  if pr is None:
    pr = n - pt
    if pr <= 0:
      raise ValueError(f"mesh.shape {train_shape} uses all {n} devices; none left for mesh.rollout_shape "
                       f"{rollout_shape}.")
  if pt + pr > n:
    raise ValueError(
        f"mesh.shape {train_shape} ({pt} devices) and mesh.rollout_shape {rollout_shape} ({pr} devices) "
        f"need {pt + pr} devices but {n} are available; use disjoint meshes that fit, or both of size {n}.")
  return devices[:pt], devices[pt:pt + pr]


@dataclasses.dataclass(frozen=True)
class RolloutTrainMeshes:
  """Training and rollout roles, each with its mesh and rules (colocated or disjoint).

  With separate meshes the trainer updates params on `train_mesh` and `handoff`s them
  to `rollout_mesh` before each generation (a `jax.device_put` reshard).

  roles = RolloutTrainMeshes.create(MeshConfig((1, 4, 1), "fsdp", (2, 1, 2), "fsdp_tp"))
  rollout_params = roles.to_rollout(cfg, train_params)
  """
  train_mesh: Mesh
  rollout_mesh: Mesh
  train_rules: Rules
  rollout_rules: Rules

  @classmethod
  def create(cls, config: MeshConfig, devices: Sequence[jax.Device] | None = None,
             axis_names: Sequence[str] = AXIS_NAMES) -> "RolloutTrainMeshes":
    """Builds both meshes from a MeshConfig (disjoint device blocks, training first)."""
    devices = list(jax.devices() if devices is None else devices)
    train_rules = get_rules(config.preset)
    rollout_rules = get_rules(config.rollout_preset or config.preset)
    if not config.rollout_shape:
      mesh = make_mesh(config.shape, axis_names, devices)
      return cls(mesh, mesh, train_rules, rollout_rules)
    t_dev, r_dev = _split_devices(config.shape, config.rollout_shape, devices)
    return cls(make_mesh(config.shape, axis_names, t_dev),
               make_mesh(config.rollout_shape, axis_names, r_dev), train_rules, rollout_rules)

  @property
  def separate(self) -> bool:
    """True when rollouts run on other devices or another layout than training."""
    return self.train_mesh != self.rollout_mesh or self.train_rules != self.rollout_rules

  def train_shardings(self, cfg) -> Any:
    return param_shardings(cfg, self.train_mesh, self.train_rules)

  def rollout_shardings(self, cfg) -> Any:
    return param_shardings(cfg, self.rollout_mesh, self.rollout_rules)

  def rollout_context(self):
    """`use_rules` for the rollout mesh (wrap sampler calls in it)."""
    return use_rules(self.rollout_mesh, self.rollout_rules)

  def to_rollout(self, cfg, params: Any, dtype=None) -> Any:
    """Hands training params (a LoRA policy too: base and adapters) to the rollout mesh (identity when
    colocated with the same rules)."""
    return handoff(params, policy_shardings(self.rollout_shardings(cfg), params), dtype=dtype)


def describe(mesh: Mesh) -> str:
  """One line for logs: mesh axes and sizes, devices and processes."""
  return (f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
          f"{jax.process_count()} process(es)")
