"""Sharded parameters, optimizer state and batches; the activation-constraint hook.

Shardings come from the rules table (`rules.py`) applied to each array's logical
axis names; `jax.jit` with in/out shardings does the rest.

>>> from rollouts_jax.models import ModelConfig
>>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2)
>>> tuple(param_specs(cfg, get_rules("fsdp_tp"))["layers"]["gate"])
(None, 'fsdp', 'tensor')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollouts_jax.sharding.rules import (BATCH_AXES, Rules, _as_tuple, _axis_size, _entry, _restrict_to_mesh,
                                         get_rules, logical_to_spec)


def _path_str(path) -> str:
  """A key path as `layers/q` (for error messages)."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


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
  >>> tuple(param_specs(cfg, get_rules("fsdp"))["layers"]["q"])
  (None, 'fsdp', None)
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

  shardings = param_shardings(cfg, make_mesh((2, 2, 2)), get_rules("fsdp_tp"))
  shardings["layers"]["gate"].spec
  # PartitionSpec(None, 'fsdp', 'tensor')
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


def policy_shardings(params_shardings: Any, policy: Any) -> Any:
  """The shardings of a policy tree: `params_shardings` itself, or with LoRA adapters (`models.lora`)
  a `LoraWeight` of shardings at every adapted projection.

  The base weight W [L, in, out] keeps its parameter's sharding; the down adapter A [L, in, r]
  is split like W's input dimension and the up adapter B [L, r, out] like W's output dimension,
  with the rank replicated. Then `x @ A` needs the same collectives as `x @ W`, and the merged
  `W + s A B` (the sampler's) lands on W's sharding without a reshard.

  Args:
    params_shardings: the base params' shardings (e.g. `param_shardings(cfg, mesh, rules)`).
    policy: the policy tree (params, or params with `LoraWeight` nodes), or its shapes.
  Returns:
    A pytree of shardings with the structure of `policy`.
  """
  from rollouts_jax.models import lora  # pylint: disable=g-import-not-at-top
  if not lora.is_lora(policy):
    return params_shardings
  layers = dict(params_shardings["layers"])
  for name, w in policy["layers"].items():
    if lora.is_lora_weight(w):
      s = layers[name]
      lead, fan_in, fan_out = (tuple(s.spec) + (None,) * 3)[:3]
      layers[name] = w.replace(w=s, a=NamedSharding(s.mesh, PartitionSpec(lead, fan_in, None)),
                               b=NamedSharding(s.mesh, PartitionSpec(lead, None, fan_out)))
  return dict(params_shardings, layers=layers)


def _sharding_views(params_shardings: Any, params: Any) -> list[tuple[Any, Any]]:
  """(shardings, params) pairs whose paths a state's leaves may end with: the policy tree, and with
  LoRA also its base (plain paths: a critic built from the trunk) and its adapters (the optimizer's
  moments cover `lora.partition`'s trainable tree, `{name: {"a", "b"}}`)."""
  from rollouts_jax.models import lora  # pylint: disable=g-import-not-at-top
  views = [(params_shardings, params)]
  if lora.is_lora(params_shardings):
    views.append((lora.base_of(params_shardings), None if params is None else lora.base_of(params)))
    views.append((lora.adapters_of(params_shardings), None if params is None else lora.adapters_of(params)))
  return views


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

  params = shard_params(models.init_params(cfg, key), param_shardings(cfg, mesh, rules))
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

  abstract_params(cfg, mesh, rules)["embed"].sharding
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

  params = sharded_init(cfg, jax.random.key(0), make_mesh((1, 8, 1)), get_rules("fsdp"))
  """
  from rollouts_jax.models import transformer  # pylint: disable=g-import-not-at-top
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params(cfg, mesh, rules, dtype))
  init = jax.jit(functools.partial(transformer.init_params, cfg, dtype=dtype), out_shardings=shardings)
  return init(key)


# ----------------------------------------------------------------------------- optimizer / train state


def _key_names(path) -> tuple[str, ...]:
  """One name per key of a key path (`DictKey('q')`, `GetAttrKey('q')` both give 'q')."""
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


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
  statistics) is replicated. Works on arrays or on `jax.eval_shape` output. With a LoRA
  policy's shardings (`policy_shardings`) the adapters' moments (`{name: {"a", "b"}}`) get their
  adapter's sharding and a plain copy of the trunk (a critic) its base weights'.

  Args:
    tree: the pytree, e.g. `jax.eval_shape(optimizer.init, params)`.
    params_shardings: the params' shardings (e.g. `param_shardings(...)`).
    params: the params or their ShapeDtypeStructs, so that shapes must match too
      (recommended). Without it a leaf of the parameter's rank at its path matches.
  Returns:
    A pytree of shardings with the structure of `tree`.

  state_shapes = jax.eval_shape(optax.adamw(1e-3).init, params)
  state_shardings = tree_shardings_like(state_shapes, shardings, params)
  """
  mesh = _mesh_of(params_shardings)
  replicated = NamedSharding(mesh, PartitionSpec())
  table = {}
  for view_shardings, view_params in _sharding_views(params_shardings, params):
    flat_sh, sh_def = jax.tree_util.tree_flatten_with_path(
        view_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    shapes = ([None] * len(flat_sh) if view_params is None
              else [np.shape(p) for p in sh_def.flatten_up_to(view_params)])
    table.update({_key_names(path): (s, shape) for (path, s), shape in zip(flat_sh, shapes)})
  max_len = max((len(p) for p in table), default=0)

  def choose(path, leaf):
    names = _key_names(path)
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

  opt_state = init_sharded_opt_state(optax.adamw(1e-3), params, shardings)
  """
  return init_sharded_state(optimizer.init, params, params_shardings)[0]


def init_sharded_state(init_fn: Callable, params: Any, params_shardings: Any = None) -> tuple[Any, Any]:
  """`init_fn(params)` (a train state holding the params and optimizer moments) built in place.

  The documented path: `jax.eval_shape` gives the state's structure without memory,
  `tree_shardings_like` gives each leaf a sharding (moments mirror their parameter, counters
  are replicated), and `jax.jit(init_fn, out_shardings=...)` makes every device write only its
  shard. The state never aliases `params` (jit outputs are fresh buffers), so a step that
  donates the state leaves `params` (e.g. a KL reference) intact.

  Args:
    init_fn: params -> state, traceable (e.g. `functools.partial(init_train_state, tx=tx)`).
    params: the (sharded) params.
    params_shardings: their shardings; None on one device (the state is jitted with no
      sharding constraints, where the params live).

  Returns:
    `(state, state_shardings)`; `state_shardings` is None when `params_shardings` is.

  >>> import optax
  >>> state, _ = init_sharded_state(optax.adam(1e-3).init, {"w": jnp.ones((2, 3))})
  >>> state[0].mu["w"].shape
  (2, 3)
  """
  if params_shardings is None:
    return jax.jit(init_fn)(params), None
  abstract = jax.eval_shape(init_fn, params)
  shardings = tree_shardings_like(abstract, params_shardings, params)
  return jax.jit(init_fn, out_shardings=shardings)(params), shardings


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

  step = jit_sharded_step(train_step, state_shardings, data_sharding(mesh))
  state, metrics = step(state, batch)
  """
  if out_shardings is None:
    out_shardings = (state_shardings, NamedSharding(_mesh_of(state_shardings), PartitionSpec()))
  return jax.jit(step_fn, in_shardings=(state_shardings, batch_sharding, *extra_in_shardings),
                 out_shardings=out_shardings, donate_argnums=(0,) if donate_state else ())


# ----------------------------------------------------------------------------- data


def data_sharding(mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
  """Leading (batch) dimension split over the data axes, the rest replicated.

  data_sharding(make_mesh((2, 2, 2))).spec
  # PartitionSpec(('data', 'fsdp'),)
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

  tokens = shard_batch(np.zeros((8, 16), np.int32), make_mesh((2, 4, 1)))
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

  with use_rules(mesh, get_rules("fsdp_tp")):
    out = sampling.sample(cfg, params, ids, mask, key, config)
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

  rollout_params = handoff(train_params, param_shardings(cfg, rollout_mesh, rules))
  """
  _check_tree_divisible(params, target_shardings)
  if dtype is not None:
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    params = jax.tree.map(cast, params)
  return jax.device_put(params, target_shardings, donate=donate)
