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

>>> mesh = make_mesh((2, 2, 2))                                   # doctest: +SKIP
>>> rules = get_rules("fsdp_tp")                                  # doctest: +SKIP
>>> params = sharded_init(cfg, jax.random.key(0), mesh, rules)    # doctest: +SKIP
>>> tokens = shard_batch(np_tokens, mesh)                         # doctest: +SKIP
>>> logits = models.forward(cfg, params, tokens)                  # XLA partitions it

Since `models.forward` and the sampler are `jax.jit` functions, sharded inputs are
all XLA needs to partition them. Inside `use_rules(mesh, rules)` the sampler also
pins its KV cache to (batch over data axes, kv heads over `tensor`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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

  >>> logical_to_spec(("layers", "embed", "mlp"), get_rules("fsdp_tp"))
  PartitionSpec(None, 'fsdp', 'tensor')
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


# ----------------------------------------------------------------------------- meshes


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

  >>> make_mesh((1, -1, 1)).shape  # doctest: +SKIP
  OrderedDict({'data': 1, 'fsdp': 8, 'tensor': 1})
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


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in _as_tuple(axes))


def _restrict_to_mesh(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
  """Drops mesh axes that this mesh does not have (e.g. a mesh with only a `data` axis)."""
  entries = []
  for entry in spec:
    entries.append(_entry(tuple(a for a in _as_tuple(entry) if a in mesh.shape)))
  return PartitionSpec(*entries)


def _path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _check_divisible(name: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh,
                     logical_axes: Sequence[str | None] | None = None) -> None:
  for dim, entry in enumerate(spec):
    if entry is None:
      continue
    size = _axis_size(mesh, entry)
    if shape[dim] % size:
      logical = f" ({logical_axes[dim]!r})" if logical_axes is not None else ""
      axes = _as_tuple(entry)
      what = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
      raise ValueError(
          f"{name!r}: dimension {dim}{logical} has size {shape[dim]}, which is not divisible by "
          f"{what} of size {size} (mesh {dict(mesh.shape)}). Choose a mesh shape whose "
          f"{what} divides {shape[dim]}, or change the sharding rules.")


# ----------------------------------------------------------------------------- parameters


def param_specs(cfg, rules: Rules) -> Any:
  """The PartitionSpec of every parameter (same structure as params), mesh-independent.

  >>> from rollouts_jax.models import ModelConfig
  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2)
  >>> param_specs(cfg, get_rules("fsdp"))["layers"]["q"]
  PartitionSpec(None, 'fsdp', None)
  """
  from rollouts_jax.models import transformer  # pylint: disable=g-import-not-at-top
  return jax.tree.map(lambda axes: logical_to_spec(axes, rules), transformer.param_axes(cfg),
                      is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(cfg, mesh: Mesh, rules: Rules) -> Any:
  """A NamedSharding for every parameter, checked for divisibility.

  Args:
    cfg: a `models.ModelConfig`.
    mesh: the device mesh.
    rules: a rules table.
  Returns:
    A pytree of `NamedSharding` with the structure of params.
  Raises:
    ValueError: a parameter dimension not divisible by its mesh axes; the message
      names the parameter, the dimension, its logical name, the mesh axis and both sizes.

  >>> shardings = param_shardings(cfg, make_mesh((2, 2, 2)), get_rules("fsdp_tp"))  # doctest: +SKIP
  >>> shardings["layers"]["gate"].spec  # doctest: +SKIP
  PartitionSpec(None, 'fsdp', 'tensor')
  """
  from rollouts_jax.models import transformer  # pylint: disable=g-import-not-at-top
  is_tuple = lambda x: isinstance(x, tuple)
  axes_tree = transformer.param_axes(cfg)
  shapes_tree = transformer.param_shapes(cfg)
  flat_axes, treedef = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=is_tuple)
  flat_shapes = treedef.flatten_up_to(shapes_tree)
  out = []
  for (path, axes), shape in zip(flat_axes, flat_shapes):
    spec = _restrict_to_mesh(logical_to_spec(axes, rules), mesh)
    _check_divisible(_path_str(path), shape, spec, mesh, axes)
    out.append(NamedSharding(mesh, spec))
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_tree_divisible(tree, shardings) -> None:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  for (path, leaf), s in zip(flat, treedef.flatten_up_to(shardings)):
    if isinstance(s, NamedSharding):
      _check_divisible(_path_str(path), np.shape(leaf), s.spec, s.mesh)


def shard_params(params: Any, shardings: Any) -> Any:
  """Places a params pytree (host or device arrays) on `shardings`.

  Args:
    params: a params pytree.
    shardings: the matching pytree of shardings (e.g. `param_shardings(...)`).
  Returns:
    The params as sharded `jax.Array`s (single-process; for many processes build
    them with `sharded_init` or `restore_sharded`).
  Raises:
    ValueError: a dimension not divisible by its mesh axes.

  The result never shares buffers with `params`, so donating it (see
  `jit_sharded_step`) leaves `params` intact.

  >>> params = shard_params(models.init_params(cfg, key), param_shardings(cfg, mesh, rules))  # doctest: +SKIP
  """
  _check_tree_divisible(params, shardings)
  out = jax.device_put(params, shardings, may_alias=False)
  # Never alias: a train step that donates the sharded state would delete `params` too. device_put
  # can still reuse the source buffer as one shard (seen for replicated targets), so copy those.
  return jax.tree.map(lambda src, dst: jnp.copy(dst) if _shares_buffer(src, dst) else dst, params, out)


def _buffer_pointers(x) -> set[int]:
  try:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  except Exception:  # pylint: disable=broad-except
    return set()


def _shares_buffer(src, dst) -> bool:
  if not isinstance(src, jax.Array) or src is dst:
    return isinstance(src, jax.Array)
  return bool(_buffer_pointers(src) & _buffer_pointers(dst))


def abstract_params(cfg, mesh: Mesh, rules: Rules, dtype=jnp.float32) -> Any:
  """`jax.ShapeDtypeStruct`s of the params, carrying their shardings (no memory used).

  The target for `restore_sharded`, and the spec of what `sharded_init` builds.

  >>> abstract_params(cfg, mesh, rules)["embed"].sharding  # doctest: +SKIP
  """
  from rollouts_jax.models import transformer  # pylint: disable=g-import-not-at-top
  shardings = param_shardings(cfg, mesh, rules)
  shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg, dtype=dtype), jax.random.key(0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def sharded_init(cfg, key: jax.Array, mesh: Mesh, rules: Rules, dtype=jnp.float32) -> Any:
  """Random params created directly in their sharded layout.

  `eval_shape` gives the structure, the rules give the shardings, and
  `jit(init_params, out_shardings=...)` makes every device build only its shard, so a
  model larger than one device's memory can be initialized. The values equal
  `models.init_params(cfg, key, dtype)` (the PRNG is partitionable).

  Args:
    cfg: a `models.ModelConfig`.
    key: a PRNG key.
    mesh: the device mesh.
    rules: a rules table.
    dtype: parameter dtype.
  Returns:
    The params pytree, sharded as `param_shardings(cfg, mesh, rules)`.

  >>> params = sharded_init(cfg, jax.random.key(0), make_mesh((1, 8, 1)), get_rules("fsdp"))  # doctest: +SKIP
  """
  from rollouts_jax.models import transformer  # pylint: disable=g-import-not-at-top
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params(cfg, mesh, rules, dtype))
  init = jax.jit(functools.partial(transformer.init_params, cfg, dtype=dtype), out_shardings=shardings)
  return init(key)


# ----------------------------------------------------------------------------- optimizer / train state


def _key_name(k) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return str(k)


def _mesh_of(shardings: Any) -> Mesh:
  for s in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)):
    if isinstance(s, NamedSharding):
      return s.mesh
  raise ValueError("No NamedSharding found in the given shardings; cannot tell which mesh to use.")


def tree_shardings_like(tree: Any, params_shardings: Any, params: Any = None) -> Any:
  """Shardings for a pytree that contains copies of the params (optax state, a train state).

  A leaf whose path ends with a parameter's path (e.g. `[0].mu['layers']['q']`
  ends with `['layers']['q']`) and whose shape equals that parameter's shape gets the
  parameter's sharding; every other leaf (step counters, scalars, factored
  statistics) is replicated. Works on arrays or on `jax.eval_shape` output.

  Args:
    tree: the pytree, e.g. `jax.eval_shape(optimizer.init, params)`.
    params_shardings: the params' shardings (e.g. `param_shardings(...)`).
    params: the params or their ShapeDtypeStructs, so that shapes must match too
      (recommended). Without it a leaf of the parameter's rank at its path matches.
  Returns:
    A pytree of shardings with the structure of `tree`.

  >>> state_shapes = jax.eval_shape(optax.adamw(1e-3).init, params)             # doctest: +SKIP
  >>> state_shardings = tree_shardings_like(state_shapes, shardings, params)     # doctest: +SKIP
  """
  mesh = _mesh_of(params_shardings)
  replicated = NamedSharding(mesh, PartitionSpec())
  flat_sh, sh_def = jax.tree_util.tree_flatten_with_path(
      params_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  shapes = [None] * len(flat_sh) if params is None else [np.shape(p) for p in sh_def.flatten_up_to(params)]
  table = {tuple(_key_name(k) for k in path): (s, shape) for (path, s), shape in zip(flat_sh, shapes)}
  max_len = max((len(p) for p in table), default=0)

  def choose(path, leaf):
    names = tuple(_key_name(k) for k in path)
    shape = np.shape(leaf)
    for n in range(min(max_len, len(names)), 0, -1):
      hit = table.get(names[-n:])
      if hit is None:
        continue
      sharding, pshape = hit
      # Without params, a same-rank leaf at a parameter's path is taken to mirror it.
      ok_shape = pshape == shape if pshape is not None else len(shape) == len(sharding.spec)
      if ok_shape and shape:
        try:
          _check_divisible(_path_str(path), shape, sharding.spec, sharding.mesh)
        except ValueError:
          return replicated
        return sharding
    return replicated

  return jax.tree_util.tree_map_with_path(choose, tree)


def init_sharded_opt_state(optimizer, params: Any, params_shardings: Any) -> Any:
  """`optimizer.init(params)` built directly in a sharded layout.

  Moments that mirror the params get the params' shardings; counters are replicated.

  Args:
    optimizer: an `optax.GradientTransformation`.
    params: sharded params.
    params_shardings: their shardings.
  Returns:
    The optimizer state, sharded as `tree_shardings_like(...)` says.

  >>> opt_state = init_sharded_opt_state(optax.adamw(1e-3), params, shardings)  # doctest: +SKIP
  """
  abstract = jax.eval_shape(optimizer.init, params)
  shardings = tree_shardings_like(abstract, params_shardings, params)
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def jit_sharded_step(step_fn: Callable, state_shardings: Any, batch_sharding: Any, *,
                     donate_state: bool = True, extra_in_shardings: tuple = (),
                     out_shardings: Any = None) -> Callable:
  """Jits `step_fn(state, batch, *extra) -> (state, aux)` with fixed shardings.

  The state comes in and goes out with `state_shardings` (so it never drifts between
  steps and never recompiles), and is donated: its buffers are reused for the new
  state, so a step needs memory for one state, not two. Do not use the old state
  after the call.

  Args:
    step_fn: the pure step.
    state_shardings: a pytree of shardings matching the state (see `tree_shardings_like`).
    batch_sharding: a sharding (or pytree of shardings) for the batch; one sharding
      applies to every leaf (e.g. `data_sharding(mesh)`).
    donate_state: donate argument 0.
    extra_in_shardings: shardings of further positional arguments (e.g. a replicated key).
    out_shardings: override; default (state_shardings, replicated) for (state, aux).
  Returns:
    The jitted step.

  >>> step = jit_sharded_step(train_step, state_shardings, data_sharding(mesh))  # doctest: +SKIP
  >>> state, metrics = step(state, batch)                                          # doctest: +SKIP
  """
  if out_shardings is None:
    out_shardings = (state_shardings, NamedSharding(_mesh_of(state_shardings), PartitionSpec()))
  return jax.jit(step_fn, in_shardings=(state_shardings, batch_sharding, *extra_in_shardings),
                 out_shardings=out_shardings, donate_argnums=(0,) if donate_state else ())


# ----------------------------------------------------------------------------- data


def data_sharding(mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
  """Leading (batch) dimension split over the data axes, the rest replicated.

  >>> data_sharding(make_mesh((2, 2, 2))).spec  # doctest: +SKIP
  PartitionSpec(('data', 'fsdp'),)
  """
  axes = tuple(a for a in batch_axes if a in mesh.shape)
  return NamedSharding(mesh, PartitionSpec(_entry(axes)))


def process_batch_slice(global_batch_size: int) -> slice:
  """The rows of a global batch that this process loads (contiguous, equal per process).

  >>> process_batch_slice(16)  # one process
  slice(0, 16, None)
  """
  n, i = jax.process_count(), jax.process_index()
  if global_batch_size % n:
    raise ValueError(f"Global batch size {global_batch_size} is not divisible by the process count {n}.")
  per = global_batch_size // n
  return slice(i * per, (i + 1) * per)


def shard_batch(batch: Any, mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> Any:
  """Places a batch pytree on the mesh, leading dimension over the data axes.

  Single process: the arrays are the whole batch. Many processes: each process passes
  its own rows (see `process_batch_slice`) and the result is one global array
  (`jax.make_array_from_process_local_data`) whose batch is the concatenation over
  processes.

  Args:
    batch: a pytree of arrays [B_local, ...].
    mesh: the mesh.
    batch_axes: mesh axes the batch is split over.
  Returns:
    The pytree of global sharded `jax.Array`s.
  Raises:
    ValueError: a global batch size not divisible by the data axes' size.

  >>> tokens = shard_batch(np.zeros((8, 16), np.int32), make_mesh((2, 4, 1)))  # doctest: +SKIP
  """
  sharding = data_sharding(mesh, batch_axes)
  size = _axis_size(mesh, sharding.spec[0]) if len(sharding.spec) else 1
  nproc = jax.process_count()

  def put(path, x):
    if np.ndim(x) == 0:
      raise ValueError(f"Batch leaf {_path_str(path)!r} is a scalar; a batch leaf needs a leading batch dimension.")
    global_b = np.shape(x)[0] * nproc
    if global_b % size:
      raise ValueError(
          f"Batch leaf {_path_str(path)!r}: global batch size {global_b} is not divisible by mesh axes "
          f"{tuple(batch_axes)} of size {size} (mesh {dict(mesh.shape)}).")
    if nproc == 1:
      return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree_util.tree_map_with_path(put, batch)


# ----------------------------------------------------------------------------- activation hook


@dataclasses.dataclass(frozen=True)
class ShardingContext:
  """An active (mesh, rules) pair; hashable, so it can be a static jit argument."""
  mesh: Mesh
  rules: Rules


_ACTIVE: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar(
    "rollouts_jax_sharding_context", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[ShardingContext]:
  """Activates sharding constraints on activations and the KV cache inside the block.

  Outside such a block `constrain` is the identity, so single-device code pays nothing.

  >>> with use_rules(mesh, get_rules("fsdp_tp")):                   # doctest: +SKIP
  ...   out = sampling.sample(cfg, params, ids, mask, key, config)
  """
  token = _ACTIVE.set(ShardingContext(mesh, tuple(rules)))
  try:
    yield _ACTIVE.get()
  finally:
    _ACTIVE.reset(token)


def current_context() -> ShardingContext | None:
  """The active ShardingContext, or None outside `use_rules`."""
  return _ACTIVE.get()


def _fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Drops trailing mesh axes of an entry until they divide its dimension (hints must not fail)."""
  entries = []
  for dim, entry in enumerate(spec):
    axes = _as_tuple(entry)
    while axes and shape[dim] % _axis_size(mesh, axes):
      axes = axes[:-1]
    entries.append(_entry(axes))
  return PartitionSpec(*entries)


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              ctx: ShardingContext | None = None) -> jax.Array:
  """A sharding constraint by logical names; the identity when no rules are active.

  Mesh axes that do not divide a dimension are dropped for that dimension (this is a
  layout hint, never an error).

  Args:
    x: an array (usually inside jit).
    logical_axes: one logical name (or None) per dimension.
    ctx: the (mesh, rules) to use; default the active `use_rules` context.
  Returns:
    x, constrained.

  >>> constrain(jnp.ones((4, 2)), ("batch", None)).shape  # no active rules: identity
  (4, 2)
  """
  ctx = ctx if ctx is not None else current_context()
  if ctx is None:
    return x
  spec = _restrict_to_mesh(logical_to_spec(logical_axes, ctx.rules), ctx.mesh)
  spec = _fit_spec(spec, x.shape, ctx.mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def constrain_kv_cache(cache, ctx: ShardingContext | None = None):
  """Pins a `models.KVCache`: rows over the batch axes, kv heads over `tensor` when divisible.

  Identity when no rules are active (see `use_rules`).
  """
  ctx = ctx if ctx is not None else current_context()
  if ctx is None:
    return cache
  kv = (None, "batch", "seq", "kv_heads", "head_dim")
  return cache.replace(k=constrain(cache.k, kv, ctx), v=constrain(cache.v, kv, ctx),
                       mask=constrain(cache.mask, ("batch", "seq"), ctx),
                       next_pos=constrain(cache.next_pos, ("batch",), ctx))


# ----------------------------------------------------------------------------- rollout / train meshes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Static mesh settings (what the experiment config's `sharding` block selects).

  Attributes:
    mesh_shape: training mesh (data, fsdp, tensor); one entry may be -1.
    preset: rules preset of the training mesh ("pure_dp", "fsdp", "fsdp_tp").
    rollout_mesh_shape: a separate rollout mesh, or None to roll out on the training mesh.
    rollout_preset: rules preset for rollouts (default: `preset`).
  """
  mesh_shape: tuple[int, ...] = (1, -1, 1)
  preset: str = "fsdp"
  rollout_mesh_shape: tuple[int, ...] | None = None
  rollout_preset: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
    if self.rollout_mesh_shape is not None:
      object.__setattr__(self, "rollout_mesh_shape", tuple(int(s) for s in self.rollout_mesh_shape))
    get_rules(self.preset)
    if self.rollout_preset is not None:
      get_rules(self.rollout_preset)


def _split_devices(train_shape, rollout_shape, devices):
  """Devices of the training and rollout meshes: disjoint blocks, or all devices for both."""
  n = len(devices)
  t_fill, r_fill = -1 in train_shape, -1 in rollout_shape
  if t_fill and r_fill:
    raise ValueError(f"Only one of mesh_shape {train_shape} and rollout_mesh_shape {rollout_shape} "
                     "may contain -1.")
  pt = None if t_fill else math.prod(train_shape)
  pr = None if r_fill else math.prod(rollout_shape)
  if pt == n and pr == n:
    return devices, devices  # colocated: same devices, possibly different layouts
  if pt is None:
    pt = n - pr
    if pt <= 0:
      raise ValueError(f"rollout_mesh_shape {rollout_shape} uses all {n} devices; none left for mesh_shape "
                       f"{train_shape}.")
  if pr is None:
    pr = n - pt
    if pr <= 0:
      raise ValueError(f"mesh_shape {train_shape} uses all {n} devices; none left for rollout_mesh_shape "
                       f"{rollout_shape}.")
  if pt + pr > n:
    raise ValueError(
        f"mesh_shape {train_shape} ({pt} devices) and rollout_mesh_shape {rollout_shape} ({pr} devices) "
        f"need {pt + pr} devices but {n} are available; use disjoint meshes that fit, or both of size {n}.")
  return devices[:pt], devices[pt:pt + pr]


@dataclasses.dataclass(frozen=True)
class RolloutTrainMeshes:
  """Training and rollout roles, each with its mesh and rules (colocated or disjoint).

  With separate meshes the trainer updates params on `train_mesh` and `handoff`s them
  to `rollout_mesh` before each generation (a `jax.device_put` reshard).

  >>> roles = RolloutTrainMeshes.create(MeshConfig((1, 4, 1), "fsdp", (2, 1, 2), "fsdp_tp"))  # doctest: +SKIP
  >>> rollout_params = roles.to_rollout(cfg, train_params)                                   # doctest: +SKIP
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
    if config.rollout_mesh_shape is None:
      mesh = make_mesh(config.mesh_shape, axis_names, devices)
      return cls(mesh, mesh, train_rules, rollout_rules)
    t_dev, r_dev = _split_devices(config.mesh_shape, config.rollout_mesh_shape, devices)
    return cls(make_mesh(config.mesh_shape, axis_names, t_dev),
               make_mesh(config.rollout_mesh_shape, axis_names, r_dev), train_rules, rollout_rules)

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
    """Hands training params to the rollout mesh (identity when colocated with the same rules)."""
    return handoff(params, self.rollout_shardings(cfg), dtype=dtype)


def handoff(params: Any, target_shardings: Any, dtype=None, donate: bool = False) -> Any:
  """Reshards params onto other shardings (e.g. training mesh -> rollout mesh).

  A `jax.device_put` between shardings: XLA moves only what each target device lacks.
  Where source and target shardings are equal no copy is made and the result shares
  buffers with `params`, so hand off again after every (donating) train step.

  Args:
    params: a pytree of jax.Arrays.
    target_shardings: the matching pytree of target shardings.
    dtype: optionally cast floating leaves (e.g. jnp.bfloat16 for rollouts), done on
      the source devices before the transfer (halves the bytes moved).
    donate: let the source buffers be freed by the transfer.
  Returns:
    The params on `target_shardings`.

  >>> rollout_params = handoff(train_params, param_shardings(cfg, rollout_mesh, rules))  # doctest: +SKIP
  """
  _check_tree_divisible(params, target_shardings)
  if dtype is not None:
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    params = jax.tree.map(cast, params)
  return jax.device_put(params, target_shardings, donate=donate)


# ----------------------------------------------------------------------------- checkpoints


def _abs_path(path) -> Any:
  from etils import epath  # pylint: disable=g-import-not-at-top
  s = os.fspath(path)
  return epath.Path(s if "://" in s else os.path.abspath(s))


def abstract_tree(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs carrying shardings: the restore target for `restore_sharded`.

  Args:
    tree: arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(...)`).
    shardings: a matching pytree of shardings; default each leaf's own `.sharding`.
  Returns:
    A pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`.

  >>> target = abstract_tree(jax.eval_shape(make_state), state_shardings)  # doctest: +SKIP
  """
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def save_sharded(path, tree: Any, *, force: bool = False) -> None:
  """Saves a pytree of (sharded) arrays with orbax; every process calls it.

  Each process writes the shards it owns; the call returns when the checkpoint is
  complete on disk.

  Args:
    path: checkpoint directory (local path or a `gs://` URL); must not exist unless `force`.
    tree: the pytree (params, optimizer state, a whole train state).
    force: overwrite an existing checkpoint.

  >>> save_sharded("ckpt/step_100", state)  # doctest: +SKIP
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(_abs_path(path), tree, force=force)
    ckptr.wait_until_finished()


def restore_sharded(path, target: Any) -> Any:
  """Restores a checkpoint onto the shardings given by `target` (any mesh).

  A checkpoint written on one mesh restores on another: each device reads just the
  slices its target shards need.

  Args:
    path: the checkpoint directory given to `save_sharded`.
    target: the pytree structure with, at each leaf, a `jax.ShapeDtypeStruct` carrying
      a sharding (see `abstract_tree`, `abstract_params`) or a jax.Array whose shape,
      dtype and sharding are used.
  Returns:
    The restored pytree, sharded as `target`.

  >>> params = restore_sharded("ckpt/step_100", abstract_params(cfg, mesh, rules))  # doctest: +SKIP
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  def as_abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      if x.sharding is None:
        raise ValueError("restore_sharded needs a sharding on every ShapeDtypeStruct of the target.")
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

  target = jax.tree.map(as_abstract, target)
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(_abs_path(path), target)


# ----------------------------------------------------------------------------- multi-host


_ENV_COORD = ("ROLLOUTS_JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
_ENV_NUM = ("ROLLOUTS_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES")
_ENV_ID = ("ROLLOUTS_JAX_PROCESS_ID", "JAX_PROCESS_ID")
_ENV_AUTO = "ROLLOUTS_JAX_DISTRIBUTED"


def _from_env(names, environ):
  for n in names:
    if environ.get(n) not in (None, ""):
      return environ[n]
  return None


def _distributed_is_initialized() -> bool:
  fn = getattr(jax.distributed, "is_initialized", None)
  if fn is not None:
    return bool(fn())
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client is not None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
                           auto: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
  """Starts multi-process JAX (`jax.distributed.initialize`) when asked; else does nothing.

  Settings come from the arguments (e.g. absl flags), else from the environment:
  `ROLLOUTS_JAX_COORDINATOR_ADDRESS` / `JAX_COORDINATOR_ADDRESS`,
  `ROLLOUTS_JAX_NUM_PROCESSES` / `JAX_NUM_PROCESSES`, `ROLLOUTS_JAX_PROCESS_ID` /
  `JAX_PROCESS_ID`. With none of them set it is a no-op (one process) unless `auto`
  (or `ROLLOUTS_JAX_DISTRIBUTED=auto`), which lets JAX detect the cluster itself: a
  Cloud TPU pod, SLURM, Open MPI or Kubernetes. Call it before any other JAX call.

  Args:
    coordinator_address: "host:port" of process 0.
    num_processes: number of processes.
    process_id: this process's index in [0, num_processes).
    local_device_ids: devices this process drives (e.g. one GPU per process).
    auto: let JAX auto-detect the cluster when nothing is given.
    environ: the environment to read (default `os.environ`).
  Returns:
    True when this call initialized the distributed runtime.
  Raises:
    ValueError: an incomplete or inconsistent setting.

  >>> initialize_distributed(environ={})  # one process: nothing to do
  False
  """
  environ = os.environ if environ is None else environ
  if _distributed_is_initialized():
    return False
  coordinator_address = coordinator_address or _from_env(_ENV_COORD, environ)
  num_processes = num_processes if num_processes is not None else _from_env(_ENV_NUM, environ)
  process_id = process_id if process_id is not None else _from_env(_ENV_ID, environ)
  if auto is None:
    auto = environ.get(_ENV_AUTO, "").lower() in ("auto", "1", "true")
  if coordinator_address is None and num_processes is None and process_id is None:
    if not auto:
      return False
    jax.distributed.initialize(local_device_ids=local_device_ids)
    return True
  try:
    num_processes = None if num_processes is None else int(num_processes)
    process_id = None if process_id is None else int(process_id)
  except ValueError as e:
    raise ValueError(f"num_processes and process_id must be integers: {e}") from None
  if num_processes == 1 and not coordinator_address:
    return False
  missing = [n for n, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                            ("process_id", process_id)) if v is None]
  if missing and not auto:
    raise ValueError(f"Multi-process launch is missing {', '.join(missing)} (flags or env "
                     f"{', '.join(_ENV_COORD + _ENV_NUM + _ENV_ID)}); give all three, or use auto detection.")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is outside [0, num_processes={num_processes}).")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids)
  return True


def define_distributed_flags(flag_values=None) -> None:
  """Defines absl flags --coordinator_address, --num_processes, --process_id, --distributed_auto.

  Pass them on: `initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
  FLAGS.process_id, auto=FLAGS.distributed_auto)`.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process runs).", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "This process's index (multi-process runs).", flag_values=fv)
  flags.DEFINE_bool("distributed_auto", None,
                    "Let JAX detect the cluster (TPU pod, SLURM, Open MPI, Kubernetes).", flag_values=fv)


def describe(mesh: Mesh) -> str:
  """One line for logs: mesh axes and sizes, devices and processes."""
  return (f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
          f"{jax.process_count()} process(es)")
