"""Checkpoints: one synchronous checkpointer over orbax's CheckpointManager, with checksums.

A checkpoint step directory holds two items written together: `state`, a pytree of arrays
(params, optimizer state, counters, PRNG key data), and `meta`, a JSON dict (data-stream
position, counters, config echo). Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save leaves no step that `latest_step` sees;
saves here are synchronous, so a step that `save` returned for is complete on disk.

Integrity: once orbax has finalized a step, the SHA-256 of every file in it is written to
`<step>/checksums.json` (atomically). On restore every file is checked against it before
orbax reads anything, and the restored floating-point arrays must be finite. A step that
fails (flipped or truncated bytes, a missing manifest or metadata file, no checksum file,
NaN/inf values) is damaged: `restore()` without a step falls back to the newest intact step
with a one-line warning, and raises `CheckpointDamagedError` naming the folder when no step
is intact. A directory in which no step has a checksum file (written before checksums
existed) restores unverified, with a warning. A step is `save`d again when the existing one
is damaged (it is moved aside to `<directory>/damaged/`).

Typed PRNG keys (`jax.random.key`) are stored as their uint32 key data and rebuilt on
restore when the matching leaf of `abstract_state` is a typed key (array or
ShapeDtypeStruct); raw uint32 keys (`jax.random.PRNGKey`) are ordinary arrays.

`save_params` / `load_params` write and read one pytree (no steps) with the same orbax
handler, checksums and checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any

_log = logging.getLogger(__name__)

#: The file, inside a step (or `save_params`) directory, that lists its files' SHA-256.
CHECKSUM_FILE = "checksums.json"
_DAMAGED_DIR = "damaged"


class CheckpointDamagedError(RuntimeError):
  """A checkpoint's files do not match their checksums, or no step of a directory is intact."""


class NonFiniteStateError(ValueError):
  """A restored state holds NaN or inf in a floating-point array."""


class CheckpointDiskFullError(OSError):
  """A checkpoint did not fit on its filesystem; the half-written step has been removed."""


_ENOSPC_MARKS = ("No space left on device", "os_error_code='28'", "[Errno 28]")


def _is_disk_full(error: BaseException) -> bool:
  """True when `error` (or an error it was raised from) is a full filesystem (ENOSPC)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == 28:
      return True
    if any(mark in str(error) for mark in _ENOSPC_MARKS):
      return True
    error = error.__cause__ or error.__context__
  return False


class _QuietOrbax(logging.Filter):
  """Drops orbax's INFO records (several a save) unless absl's verbosity is DEBUG or finer, and
  its threads' reports of a full disk (`Checkpointer.save` raises one named error instead)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname.replace(os.sep, "/"):
      return True
    if record.levelno >= logging.WARNING:
      return not any(mark in record.getMessage() for mark in _ENOSPC_MARKS)
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    return absl_logging.get_verbosity() >= absl_logging.DEBUG


_QUIET_ORBAX = _QuietOrbax()


def quiet_orbax_logs() -> None:
  """Installs the `_QuietOrbax` filter on the `absl` logger orbax writes to (once)."""
  absl_logger = logging.getLogger("absl")
  if _QUIET_ORBAX not in absl_logger.filters:
    absl_logger.addFilter(_QUIET_ORBAX)


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
  """`params/layer/w`: the key path of a leaf, as jax.tree_util.keystr spells it simply."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


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



# ----------------------------------------------------------------------------------------------
# Integrity: file checksums and finiteness
# ----------------------------------------------------------------------------------------------

def _is_local(path: str) -> bool:
  return "://" not in path


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while True:
      block = f.read(1 << 22)
      if not block:
        return h.hexdigest()
      h.update(block)


def _files_under(directory: str) -> list[str]:
  out = []
  for root, dirs, files in os.walk(directory):
    dirs.sort()
    for name in sorted(files):
      rel = os.path.relpath(os.path.join(root, name), directory)
      if rel != CHECKSUM_FILE and not rel.startswith(CHECKSUM_FILE + "."):
        out.append(rel)
  return out


def write_checksums(directory: str | os.PathLike) -> dict:
  """Writes `<directory>/checksums.json`: size and SHA-256 of every file below `directory`.

  Args:
    directory: a finished checkpoint directory (a step, or a `save_params` folder).

  Returns:
    The dict written: `{"algorithm": "sha256", "files": {relative path: [size, hexdigest]}}`.

  >>> import tempfile, pathlib
  >>> with tempfile.TemporaryDirectory() as d:
  ...   _ = pathlib.Path(d, "a").write_bytes(b"abc")
  ...   _ = write_checksums(d)
  ...   ok = verify_checksums(d)
  ...   _ = pathlib.Path(d, "a").write_bytes(b"abd")
  ...   ok, verify_checksums(d)
  (None, 'checksum mismatch in a')
  """
  directory = os.fspath(directory)
  files = {rel: [os.path.getsize(os.path.join(directory, rel)), _sha256_file(os.path.join(directory, rel))]
           for rel in _files_under(directory)}
  record = {"algorithm": "sha256", "files": files}
  tmp = os.path.join(directory, f"{CHECKSUM_FILE}.{os.getpid()}.tmp")
  with open(tmp, "w") as f:
    json.dump(record, f, indent=0, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(directory, CHECKSUM_FILE))
  return record


def has_checksums(directory: str | os.PathLike) -> bool:
  return os.path.isfile(os.path.join(os.fspath(directory), CHECKSUM_FILE))


def verify_checksums(directory: str | os.PathLike) -> str | None:
  """None when every file listed in `<directory>/checksums.json` is present and unchanged.

  Returns:
    None, or a short reason: no checksum file, a missing file, a size change (truncated),
    a checksum mismatch (flipped bytes).
  """
  directory = os.fspath(directory)
  try:
    with open(os.path.join(directory, CHECKSUM_FILE)) as f:
      files = json.load(f)["files"]
  except FileNotFoundError:
    return f"no {CHECKSUM_FILE} (the save was interrupted before its checksums were written)"
  except (ValueError, KeyError, TypeError) as e:
    return f"unreadable {CHECKSUM_FILE} ({e})"
  for rel, (size, digest) in sorted(files.items()):
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
      return f"missing file {rel}"
    actual = os.path.getsize(path)
    if actual != size:
      return f"{rel} has {actual} bytes, {size} were written (truncated or damaged)"
    if _sha256_file(path) != digest:
      return f"checksum mismatch in {rel}"
  return None


@jax.jit
def _all_finite(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)


def nonfinite_leaves(tree: PyTree) -> list[str]:
  """Key paths (as `jax.tree_util.keystr` writes them) of floating-point leaves with NaN or inf.

  >>> nonfinite_leaves({"a": jnp.ones(2), "b": {"c": jnp.array([1.0, jnp.nan])}, "n": jnp.arange(2)})
  ['b/c']
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  floats = [(p, x) for p, x in leaves
            if hasattr(x, "dtype") and hasattr(x, "shape") and not _is_typed_key(x)
            and jnp.issubdtype(x.dtype, jnp.inexact)]
  if not floats:
    return []
  ok = np.asarray(jax.device_get(_all_finite([x for _, x in floats])))
  return [_path_str(p) for (p, _), good in zip(floats, ok) if not good]


def check_finite(tree: PyTree, what: str = "state") -> None:
  """Raises NonFiniteStateError naming the leaves of `tree` that hold NaN or inf.

  >>> check_finite({"w": jnp.array([0.0, jnp.inf])}, "params")
  Traceback (most recent call last):
  ...
  rollouts_jax.io.checkpoint.NonFiniteStateError: params hold NaN or inf in 1 array(s): w
  """
  bad = nonfinite_leaves(tree)
  if bad:
    more = f" ... (+{len(bad) - 8} more)" if len(bad) > 8 else ""
    raise NonFiniteStateError(f"{what} hold NaN or inf in {len(bad)} array(s): {', '.join(bad[:8])}{more}")


def _restore_keys(abstract: PyTree, restored: PyTree) -> PyTree:
  return jax.tree.map(
      lambda a, x: jax.random.wrap_key_data(x, impl=_key_impl(a)) if _is_typed_key(a) else x, abstract, restored)


class Checkpointer:
  """Saves and restores (state pytree, meta dict) pairs every `save_every` steps.

  Args:
    directory: where step directories `<step>/{state,meta}` go (created if missing).
    save_every: `should_save(step)` is true on multiples of this (0: only forced saves).
    keep: how many of the latest checkpoints to keep.
    verify: check checksums and finiteness on restore (False: trust the files).

  All processes of a multi-host job must call `save` and `restore` together (process 0 writes
  the checksums; every process verifies them on restore, so all pick the same step).

  >>> import tempfile, jax.numpy as jnp
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with Checkpointer(d, save_every=2, keep=2) as ckpt:
  ...     for step in range(1, 7):
  ...       _ = ckpt.save(step, {"w": jnp.full((2,), step)}, {"pos": step})
  ...     state, meta, step = ckpt.restore({"w": jax.ShapeDtypeStruct((2,), jnp.int32)})
  ...     ckpt.all_steps(), state["w"].tolist(), meta, step
  ([4, 6], [6, 6], {'pos': 6}, 6)
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int, keep: int = 3, verify: bool = True,
               active_processes: set[int] | None = None):
    if save_every < 0:
      raise ValueError(f"save_every must be >= 0, got {save_every}.")
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}.")
    self.directory = _abs_path(directory)
    self.save_every = save_every
    self.keep = keep
    self.verify = verify
    quiet_orbax_logs()
    # A subset of the processes (a disaggregated run's trainers) checkpoints alone: orbax syncs only
    # them, and host arrays are written as numpy (orbax refuses process-local jax arrays there).
    self._subset = active_processes is not None and jax.process_count() > 1
    subset = {}
    if self._subset:
      os.makedirs(self.directory, exist_ok=True)   # orbax cannot create it for a subset
      subset = dict(multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=min(active_processes), active_processes=set(active_processes)))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False,  # save() returns only once the step is final on disk
        create=not self._subset,
        cleanup_tmp_directories=True,      # drop half-written steps left by a killed run
        **_preservation_options(keep), **subset)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    """The complete checkpoints' steps, ascending (damaged ones included: see `check_step`)."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None when there is none."""
    return self._manager.latest_step()

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(int(step)))

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
      True if a checkpoint was written (complete on disk, with its checksums); False if
      skipped, also when an intact checkpoint `step` already exists (a damaged one is moved
      to `<directory>/damaged/` and written again).
    """
    step = int(step)
    meta = _check_json(meta)
    if step in self.all_steps():
      reason = self.check_step(step) if self.verify else None
      if reason is None:
        _log.info("Checkpoint step %d already exists in %s; not saving again.", step, self.directory)
        return False
      self._quarantine([step], {step: reason})
    elif not force and not self.should_save(step):
      return False
    try:
      saved = self._manager.save(
          step, force=True,
          args=ocp.args.Composite(state=ocp.args.StandardSave(self._host(_keys_to_data(state))),
                                  meta=ocp.args.JsonSave(meta)))
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if not _is_disk_full(e):
        raise
      raise self._disk_full(step, state) from e
    if saved and _is_local(self.directory) and jax.process_index() == 0:
      write_checksums(self.step_dir(step))
    return bool(saved)

  def _host(self, tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree) if self._subset else tree

  def _disk_full(self, step: int, state: PyTree) -> CheckpointDiskFullError:
    """Removes step `step`'s half-written files; the error naming the directory and the space."""
    for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
      if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    needed = sum(int(np.prod(np.shape(x))) * np.dtype(getattr(x, "dtype", np.float32)).itemsize
                 for x in jax.tree.leaves(_keys_to_data(state)))
    free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
    latest = self.latest_step()
    return CheckpointDiskFullError(
        28, f"The filesystem of {self.directory} is full: checkpoint step {step} needs about {needed:,} bytes "
        f"({free:,} free now). The half-written step was removed; "
        + (f"the last good checkpoint is step {latest}, and a rerun after freeing space resumes from it."
           if latest is not None else "there is no earlier checkpoint."))

  # ---- integrity -------------------------------------------------------------------------------

  def _legacy(self) -> bool:
    """True when no step has a checksum file (a directory written before checksums existed)."""
    return not any(has_checksums(self.step_dir(s)) for s in self.all_steps())

  def check_step(self, step: int) -> str | None:
    """None if checkpoint `step`'s files match their checksums; else why not."""
    if not _is_local(self.directory):
      return None
    if not has_checksums(self.step_dir(step)) and self._legacy():
      return None
    return verify_checksums(self.step_dir(step))

  def _quarantine(self, steps, reasons: dict) -> None:
    """Moves damaged steps to `<directory>/damaged/<step>.<time>` so that they are not reused."""
    if jax.process_index() == 0 and _is_local(self.directory):
      target = os.path.join(self.directory, _DAMAGED_DIR)
      os.makedirs(target, exist_ok=True)
      for step in steps:
        dest = os.path.join(target, f"{step}.{time.strftime('%Y%m%d-%H%M%S')}")
        if os.path.exists(self.step_dir(step)):
          shutil.move(self.step_dir(step), dest)
          _log.warning("Moved damaged checkpoint step %d (%s) to %s.", step, reasons.get(step, "damaged"), dest)
    if not self._subset:
      _sync(f"rollouts_jax_quarantine_{'_'.join(map(str, steps))}")
    self._manager.reload()

  # ---- restore ---------------------------------------------------------------------------------

  def restore(self, abstract_state: PyTree, step: int | None = None) -> tuple[PyTree, dict, int]:
    """Reads checkpoint `step` (default: the newest intact one) into the structure of `abstract_state`.

    Args:
      abstract_state: a pytree of arrays or jax.ShapeDtypeStruct giving the structure, shapes,
        dtypes (stored values are cast to them) and shardings (None: the default device).
      step: which checkpoint; None for the newest intact one (see `restore_latest_intact`).

    Returns:
      (state, meta, step).

    Raises:
      FileNotFoundError: the directory holds no checkpoint, or not `step`.
      ValueError: the saved tree does not match `abstract_state` (the message names the keys).
      CheckpointDamagedError: `step` is damaged, or (step None) no step is intact.
      NonFiniteStateError: `step` holds NaN or inf.
    """
    if step is None:
      return self.restore_latest_intact(abstract_state)
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
    if step not in steps:
      raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}; have {steps}.")
    state, meta = self._restore_step(abstract_state, step)
    return state, meta, step

  def restore_latest_intact(self, abstract_state: PyTree, *, quarantine: bool = False,
                            ) -> tuple[PyTree, dict, int]:
    """Restores the newest step whose files match their checksums and whose arrays are finite.

    Newer damaged steps are skipped with one warning line naming them and why. Only the
    process that owns the directory (the training run) should pass `quarantine=True`.

    Args:
      abstract_state: as for `restore`.
      quarantine: move the skipped damaged steps to `<directory>/damaged/`.

    Returns:
      (state, meta, step).

    Raises:
      FileNotFoundError: no checkpoint at all.
      CheckpointDamagedError: every step is damaged (the message names the folder and each step).
      ValueError: the saved tree does not match `abstract_state`.
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
    problems: dict[int, str] = {}
    legacy = self._legacy() if self.verify else False
    if legacy and _is_local(self.directory):
      _log.warning("Checkpoints in %s have no %s (written before checksums existed): restoring unverified.",
                   self.directory, CHECKSUM_FILE)
    for step in reversed(steps):
      try:
        state, meta = self._restore_step(abstract_state, step, legacy=legacy)
      except (CheckpointDamagedError, NonFiniteStateError) as e:
        problems[step] = str(getattr(e, "reason", e))
        continue
      if problems:
        _log.warning("Checkpoint step(s) %s in %s damaged (%s); resuming from step %d.",
                     ", ".join(map(str, problems)), self.directory,
                     "; ".join(f"{s}: {r}" for s, r in problems.items()), step)
        if quarantine:
          self._quarantine(list(problems), problems)
      return state, meta, step
    raise CheckpointDamagedError(
        f"No intact checkpoint in {self.directory}: " + "; ".join(f"step {s}: {r}" for s, r in problems.items())
        + ". Move the folder aside to start afresh, or restore a step explicitly with verify=False.")

  def _restore_step(self, abstract_state: PyTree, step: int, legacy: bool | None = None) -> tuple[PyTree, dict]:
    where = f"checkpoint step {step} in {self.directory}"
    if self.verify and _is_local(self.directory):
      legacy = self._legacy() if legacy is None else legacy
      reason = None if legacy else verify_checksums(self.step_dir(step))
      if reason is not None:
        err = CheckpointDamagedError(f"{where} is damaged: {reason}.")
        err.reason = reason
        raise err
    target = jax.tree.map(_abstract_leaf, abstract_state)
    # Orbax reports a shape mismatch only from inside its async reads; catch it first.
    saved_tree = self._saved_tree(step)
    diff = "" if saved_tree is None else _structure_diff(saved_tree, target)
    if "shape mismatch" in diff:
      raise ValueError(f"abstract_state does not match {where}: {diff}.")
    try:
      out = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      error = self._mismatch_error(step, target, e)
      if legacy and not diff:  # unverified files that orbax cannot read: treat as damage
        damaged = CheckpointDamagedError(f"{where} is unreadable: {e}")
        damaged.reason = f"unreadable ({type(e).__name__})"
        raise damaged from e
      raise error from e
    state = _restore_keys(abstract_state, out["state"])
    if self.verify:
      bad = nonfinite_leaves(state)
      if bad:
        err = NonFiniteStateError(f"{where} holds NaN or inf in {len(bad)} array(s): {', '.join(bad[:8])}.")
        err.reason = f"NaN or inf in {', '.join(bad[:3])}"
        raise err
    return state, dict(out["meta"] or {})

  def read(self, step: int | None = None) -> tuple[PyTree, dict, int]:
    """(state as saved, meta, step) without an abstract state: numpy arrays, PRNG keys as key data.

    Verifies checksums and finiteness like `restore` (step None: the newest intact step,
    with the same one-line warning when newer steps are skipped).
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
    if step is not None and step not in steps:
      raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}; have {steps}.")
    candidates = [step] if step is not None else list(reversed(steps))
    reasons = {}
    for s in candidates:
      reason = self.check_step(s) if self.verify else None
      if reason is None:
        try:
          state = jax.tree.map(np.asarray, load_params(os.path.join(self.step_dir(s), "state"), verify=False))
          with open(os.path.join(self.step_dir(s), "meta", "metadata")) as f:
            meta = json.load(f)
        except Exception as e:  # pylint: disable=broad-except
          reason = f"unreadable ({type(e).__name__}: {str(e)[:200]})"
        else:
          bad = nonfinite_leaves(state) if self.verify else []
          if not bad:
            if reasons:
              _log.warning("Checkpoint step(s) %s in %s damaged (%s); reading step %d.",
                           ", ".join(map(str, reasons)), self.directory,
                           "; ".join(f"{k}: {r}" for k, r in reasons.items()), s)
            return state, meta, s
          reason = f"NaN or inf in {', '.join(bad[:3])}"
      reasons[s] = reason
    if step is not None:
      raise (NonFiniteStateError if reasons[step].startswith("NaN") else CheckpointDamagedError)(
          f"checkpoint step {step} in {self.directory} is damaged: {reasons[step]}.")
    raise CheckpointDamagedError(f"No intact checkpoint in {self.directory}: "
                                 + "; ".join(f"step {s}: {r}" for s, r in reasons.items()))

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


def _sync(name: str) -> None:
  """A barrier across the processes of a multi-host job (a no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def save_params(path: str | os.PathLike, params: PyTree, *, force: bool = False) -> None:
  """Writes a pytree of arrays (e.g. params) to the directory `path`, synchronously, with checksums.

  Every process of a multi-host job calls it (each writes the shards it owns); process 0
  writes `checksums.json` once the directory is final.

  Args:
    path: a directory that must not exist yet unless `force` (which replaces it).
    params: a pytree of arrays (sharded or not).
    force: replace an existing directory.

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
  if _is_local(path) and jax.process_index() == 0:
    write_checksums(path)
  _sync("rollouts_jax_save_params")


def load_params(path: str | os.PathLike, abstract: PyTree | None = None, *, verify: bool = True) -> PyTree:
  """Reads a pytree written by `save_params`, checking its checksums and finiteness.

  Args:
    path: the directory given to `save_params`.
    abstract: a pytree of arrays / ShapeDtypeStructs giving structure, dtypes and shardings
      (a ShapeDtypeStruct's sharding is used; none: the default device); None restores the
      saved structure with the saved shardings.
    verify: check checksums (when the folder has them) and that floating arrays are finite.

  Raises:
    FileNotFoundError: `path` does not exist. ValueError: `abstract` does not match.
    CheckpointDamagedError: a file does not match its checksum. NonFiniteStateError: NaN/inf.
  """
  path = _abs_path(path)
  if not os.path.exists(path) and _is_local(path):
    raise FileNotFoundError(f"No saved params at {path}.")
  if verify and _is_local(path) and has_checksums(path):
    reason = verify_checksums(path)
    if reason is not None:
      raise CheckpointDamagedError(f"The params saved at {path} are damaged: {reason}.")
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
  if abstract is not None:
    out = _restore_keys(abstract, out)
  if verify:
    check_finite(out, f"The params saved at {path}")
  return out
