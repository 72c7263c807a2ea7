"""Logical-axis rules: the presets, and logical names -> `PartitionSpec`.

One rules table maps the logical axis names that `models.param_axes` puts on every
parameter (and that activations use) to mesh axes:

| logical name | `pure_dp` | `fsdp` | `fsdp_tp` |
|--------------|-----------|--------|-----------|
| `batch`      | (data, fsdp) | (data, fsdp) | (data, fsdp) |
| `embed`      | -         | fsdp   | fsdp      |
| `vocab`, `mlp`, `heads`, `kv_heads` | - | - | tensor |
| `layers`, `norm`, `seq`, `head_dim` | - | - | - |

>>> tuple(logical_to_spec(("batch", "seq"), get_rules("fsdp")))
(('data', 'fsdp'), None)
"""

from __future__ import annotations

import math
from typing import Sequence

from jax.sharding import Mesh, PartitionSpec

AXIS_NAMES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Names that are never sharded, shared by every preset.
_UNSHARDED = (("layers", None), ("norm", None), ("seq", None), ("head_dim", None))

PRESETS: dict[str, Rules] = {
    "pure_dp": (("batch", BATCH_AXES),) + _UNSHARDED + (
        ("vocab", None), ("embed", None), ("mlp", None), ("heads", None), ("kv_heads", None)),
    "fsdp": (("batch", BATCH_AXES),) + _UNSHARDED + (
        ("vocab", None), ("embed", "fsdp"), ("mlp", None), ("heads", None), ("kv_heads", None)),
    "fsdp_tp": (("batch", BATCH_AXES),) + _UNSHARDED + (
        ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
        ("kv_heads", "tensor")),
}


def get_rules(preset: str) -> Rules:
  """The rules table of a preset: a tuple of (logical name, mesh axes) pairs.

  Mesh axes are None (replicated), one axis name, or a tuple of names. Tables are
  plain tuples, so custom rules are `my_rules + get_rules("fsdp")`: the first rule
  for a name whose mesh axes are still free in the spec wins.

  Args:
    preset: "pure_dp", "fsdp" or "fsdp_tp".
  Returns:
    The rules tuple.

  >>> dict(get_rules("fsdp_tp"))["mlp"]
  'tensor'
  """
  if preset not in PRESETS:
    raise ValueError(f"Unknown sharding preset {preset!r}; choose one of {', '.join(PRESETS)}.")
  return PRESETS[preset]


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _entry(axes: tuple[str, ...]) -> MeshAxes:
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """Maps a tuple of logical axis names to a PartitionSpec under `rules`.

  A None name stays replicated. A mesh axis is used at most once per spec: when the
  first rule for a name uses an axis already taken by an earlier dimension, the next
  rule for that name is tried, and the dimension is replicated when none is left.

  Args:
    logical_axes: one logical name (or None) per array dimension.
    rules: a rules table, e.g. `get_rules("fsdp")`.
  Returns:
    A `jax.sharding.PartitionSpec` with one entry per dimension.
  Raises:
    ValueError: a logical name that has no rule (catches typos).

  >>> tuple(logical_to_spec(("layers", "embed", "mlp"), get_rules("fsdp_tp")))
  (None, 'fsdp', 'tensor')
  """
  table: dict[str, list[tuple[str, ...]]] = {}
  for name, axes in rules:
    table.setdefault(name, []).append(_as_tuple(axes))
  used: set[str] = set()
  entries = []
  for name in logical_axes:
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise ValueError(f"Logical axis {name!r} has no sharding rule; known names: {', '.join(table)}.")
    chosen: tuple[str, ...] = ()
    for axes in table[name]:
      if not used.intersection(axes):
        chosen = axes
        break
    used.update(chosen)
    entries.append(_entry(chosen))
  return PartitionSpec(*entries)


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in _as_tuple(axes))


def _restrict_to_mesh(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
  """Drops mesh axes that this mesh does not have (e.g. a mesh with only a `data` axis)."""
  entries = []
  for entry in spec:
    entries.append(_entry(tuple(a for a in _as_tuple(entry) if a in mesh.shape)))
  return PartitionSpec(*entries)
