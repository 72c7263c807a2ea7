"""Checkpoints: a thin, synchronous wrapper over orbax's CheckpointManager.

A checkpoint step directory holds two items written together: `state`, a pytree of arrays
(params, optimizer state, counters, PRNG key data), and `meta`, a JSON dict (data-stream
position, counters, config echo). Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save leaves no step that `latest_step` sees;
saves here are synchronous, so a step that `save` returned for is complete on disk.

Typed PRNG keys (`jax.random.key`) are stored as their uint32 key data and rebuilt on
restore when the matching leaf of `abstract_state` is a typed key (array or
ShapeDtypeStruct); raw uint32 keys (`jax.random.PRNGKey`) are ordinary arrays.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any

_log = logging.getLogger(__name__)


def _abs_path(path) -> str:
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


def _is_typed_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(x):
  """The PRNG implementation of a typed key array or ShapeDtypeStruct."""
  if isinstance(x, jax.Array):
    return jax.random.key_impl(x)
  found = []
  jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), jax.ShapeDtypeStruct(x.shape, x.dtype))
  return found[0]


def _keys_to_data(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


def _abstract_leaf(x):
  """A ShapeDtypeStruct (uint32 key data for typed keys) for one leaf of `abstract_state`."""
  if isinstance(x, (int, float, bool, np.number, np.bool_)) and not hasattr(x, "shape"):
    return x  # python scalars restore as themselves
  sharding = getattr(x, "sharding", None)
  if _is_typed_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    if isinstance(sharding, jax.sharding.NamedSharding):
      # Key data has trailing (unsharded) dimensions after the key's own.
      spec = tuple(sharding.spec) + (None,) * (len(data.shape) - len(sharding.spec))
      sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
      raise ValueError("typed PRNG keys in abstract_state must have a NamedSharding or none; "
                       f"got {sharding}. Pass jax.random.key_data(key) instead.")
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"abstract_state leaves must be arrays or jax.ShapeDtypeStruct, got {type(x).__name__}.")
  if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or sharding is None:
    # Without a sharding orbax would try the saved one, which fails on another topology.
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _path_str(path) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def _flat_shapes(tree: PyTree) -> dict[str, tuple | None]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_str(p): tuple(getattr(x, "shape", ())) if hasattr(x, "shape") else None for p, x in leaves}


def _structure_diff(saved_tree: PyTree, abstract: PyTree, name: str = "abstract_state",
                    limit: int = 12) -> str:
  """Human-readable differences of paths and shapes; '' when none are found."""
  saved, wanted = _flat_shapes(saved_tree), _flat_shapes(abstract)
  missing = sorted(set(saved) - set(wanted))
  unexpected = sorted(set(wanted) - set(saved))
  shapes = sorted(k for k in set(saved) & set(wanted)
                  if saved[k] is not None and wanted[k] is not None and saved[k] != wanted[k])
  lines = []

  def show(keys):
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more

  if missing:
    lines.append(f"in the checkpoint but not in {name}: {show(missing)}")
  if unexpected:
    lines.append(f"in {name} but not in the checkpoint: {show(unexpected)}")
  if shapes:
    lines.append("shape mismatch: " + show([f"{k} (saved {saved[k]}, wanted {wanted[k]})" for k in shapes]))
  return "; ".join(lines)


def _metadata_tree(item_metadata) -> PyTree | None:
  """The nested dict/list of array metadata of a StandardSave item, across orbax versions."""
  if hasattr(item_metadata, "item_metadata"):  # a StepMetadata
    item_metadata = item_metadata.item_metadata
  tree = getattr(item_metadata, "tree", item_metadata)
  return tree if isinstance(tree, (dict, list, tuple)) else None


def _check_json(meta: dict) -> dict:
  if meta is None:
    return {}
  if not isinstance(meta, dict):
    raise ValueError(f"meta must be a dict, got {type(meta).__name__}.")
  try:
    return json.loads(json.dumps(meta))
  except (TypeError, ValueError) as e:
    raise ValueError(f"meta must be JSON-serializable: {e}") from None


def _preservation_options(keep: int) -> dict:
  names = {f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)}
  managers = getattr(ocp, "checkpoint_managers", None)
  if "preservation_policy" in names and hasattr(managers, "LatestN"):
    return {"preservation_policy": managers.LatestN(n=keep)}
  return {"max_to_keep": keep}


class Checkpointer:
  """Saves and restores (state pytree, meta dict) pairs every `save_every` steps.

  Args:
    directory: where step directories `<step>/{state,meta}` go (created if missing).
    save_every: `should_save(step)` is true on multiples of this (0: only forced saves).
    keep: how many of the latest checkpoints to keep.

  All processes of a multi-host job must call `save` and `restore` together.

  >>> import tempfile, jax.numpy as jnp
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with Checkpointer(d, save_every=2, keep=2) as ckpt:
  ...     for step in range(1, 7):
  ...       _ = ckpt.save(step, {"w": jnp.full((2,), step)}, {"pos": step})
  ...     state, meta, step = ckpt.restore({"w": jax.ShapeDtypeStruct((2,), jnp.int32)})
  ...     ckpt.all_steps(), state["w"].tolist(), meta, step
  ([4, 6], [6, 6], {'pos': 6}, 6)
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int, keep: int = 3):
    if save_every < 0:
      raise ValueError(f"save_every must be >= 0, got {save_every}.")
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}.")
    self.directory = _abs_path(directory)
    self.save_every = save_every
    self.keep = keep
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False,  # save() returns only once the step is final on disk
        create=True,
        cleanup_tmp_directories=True,      # drop half-written steps left by a killed run
        **_preservation_options(keep))
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    """The complete checkpoints' steps, ascending."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    """True on multiples of `save_every` that are not saved yet."""
    return self.save_every > 0 and step % self.save_every == 0 and step not in self.all_steps()

  def save(self, step: int, state: PyTree, meta: dict | None = None, *, force: bool = False) -> bool:
    """Writes `state` and `meta` as checkpoint `step` if `should_save(step)` or `force`.

    Args:
      step: the training step the state is after.
      state: a pytree of arrays (jax or numpy); typed PRNG keys are stored as key data.
      meta: a JSON-serializable dict, restored exactly.
      force: save even if `step` is not a multiple of `save_every`.

    Returns:
      True if a checkpoint was written (and is complete on disk); False if skipped, also
      when checkpoint `step` already exists.
    """
    step = int(step)
    meta = _check_json(meta)
    if step in self.all_steps():
      _log.info("Checkpoint step %d already exists in %s; not saving again.", step, self.directory)
      return False
    if not force and not self.should_save(step):
      return False
    saved = self._manager.save(
        step, force=True,
        args=ocp.args.Composite(state=ocp.args.StandardSave(_keys_to_data(state)),
                                meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()
    return bool(saved)

  def restore(self, abstract_state: PyTree, step: int | None = None) -> tuple[PyTree, dict, int]:
    """Reads checkpoint `step` (default: the latest) into the structure of `abstract_state`.

    Args:
      abstract_state: a pytree of arrays or jax.ShapeDtypeStruct giving the structure, shapes,
        dtypes (stored values are cast to them) and shardings (None: the default device).
      step: which checkpoint; None for the latest.

    Returns:
      (state, meta, step).

    Raises:
      FileNotFoundError: the directory holds no checkpoint, or not `step`.
      ValueError: the saved tree does not match `abstract_state` (the message names the keys).
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}; have {steps}.")
    target = jax.tree.map(_abstract_leaf, abstract_state)
    # Orbax reports a shape mismatch only from inside its async reads; catch it first.
    saved_tree = self._saved_tree(step)
    diff = "" if saved_tree is None else _structure_diff(saved_tree, target)
    if "shape mismatch" in diff:
      raise ValueError(f"abstract_state does not match checkpoint step {step} in {self.directory}: {diff}.")
    try:
      out = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._mismatch_error(step, target, e) from e
    state = jax.tree.map(
        lambda a, x: jax.random.wrap_key_data(x, impl=_key_impl(a)) if _is_typed_key(a) else x,
        abstract_state, out["state"])
    return state, dict(out["meta"] or {}), step

  def _saved_tree(self, step: int) -> PyTree | None:
    """The saved state's metadata tree, or None if this orbax version's layout is unknown."""
    try:
      return _metadata_tree(self._manager.item_metadata(step)["state"])
    except Exception:  # pylint: disable=broad-except
      return None

  def _mismatch_error(self, step: int, target: PyTree, error: Exception) -> ValueError:
    tree = self._saved_tree(step)
    diff = "" if tree is None else _structure_diff(tree, target)
    where = f"checkpoint step {step} in {self.directory}"
    if diff:
      return ValueError(f"abstract_state does not match {where}: {diff}.")
    return ValueError(f"Restoring {where} failed: {error}")

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def save_params(path: str | os.PathLike, params: PyTree, *, force: bool = False) -> None:
  """Writes a pytree of arrays (e.g. params) to the directory `path`, synchronously.

  Args:
    path: a directory that must not exist yet unless `force` (which replaces it).
    params: a pytree of arrays.

  >>> import tempfile, os, jax.numpy as jnp
  >>> with tempfile.TemporaryDirectory() as d:
  ...   save_params(os.path.join(d, "p"), {"w": jnp.arange(3.0)})
  ...   load_params(os.path.join(d, "p"), {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})["w"].tolist()
  [0.0, 1.0, 2.0]
  """
  path = _abs_path(path)
  if os.path.exists(path) and not force:
    raise ValueError(f"{path} exists; pass force=True to replace it.")
  checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  try:
    checkpointer.save(path, args=ocp.args.StandardSave(_keys_to_data(params)), force=force)
  finally:
    checkpointer.close()


def load_params(path: str | os.PathLike, abstract: PyTree | None = None) -> PyTree:
  """Reads a pytree written by `save_params`.

  Args:
    path: the directory given to `save_params`.
    abstract: a pytree of arrays / ShapeDtypeStructs giving structure, dtypes and shardings;
      None restores the saved structure on the default device.

  Raises:
    FileNotFoundError: `path` does not exist. ValueError: `abstract` does not match.
  """
  path = _abs_path(path)
  if not os.path.exists(path) and "://" not in path:
    raise FileNotFoundError(f"No saved params at {path}.")
  target = None if abstract is None else jax.tree.map(_abstract_leaf, abstract)
  checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  try:
    diff = ""
    if target is not None:
      try:
        tree = _metadata_tree(checkpointer.metadata(path))
        diff = "" if tree is None else _structure_diff(tree, target, name="abstract")
      except Exception:  # pylint: disable=broad-except
        pass  # unknown metadata layout: orbax's own error below
    if "shape mismatch" in diff:
      raise ValueError(f"abstract does not match the params saved at {path}: {diff}.")
    try:
      out = checkpointer.restore(path, args=ocp.args.StandardRestore(target))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"abstract does not match the params saved at {path}: {diff}." if diff
                       else f"Loading params from {path} failed: {e}") from e
  finally:
    checkpointer.close()
  if abstract is None:
    return out
  return jax.tree.map(
      lambda a, x: jax.random.wrap_key_data(x, impl=_key_impl(a)) if _is_typed_key(a) else x, abstract, out)
