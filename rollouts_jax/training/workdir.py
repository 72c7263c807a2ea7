"""A workdir belongs to one run: a process lock, a config fingerprint, and cross-process builds.

* :class:`FileLock` (from :mod:`rollouts_jax.io.filelock`): an exclusive ``fcntl.flock`` lock on a
  file, dropped by the kernel when the holder exits however it dies (``kill -9`` included), so
  a stale lock of a dead process is simply taken over.
* :func:`lock_workdir`: refuses a second training process on the same workdir, naming the
  process that holds it.
* :func:`atomic_build`: builds a folder once across processes (TFDS datasets, SFT warm
  starts): under a lock, into a temporary sibling, renamed into place when complete.
* :func:`config_fingerprint` / :func:`check_workdir_config`: a rerun of a workdir with a
  config that changes results is refused before any work, naming the differing keys;
  settings that only steer the loop (cadences, logging, worker counts, timeouts, mesh,
  ``stop_after_step``) are left out of the fingerprint.

>>> import tempfile, os
>>> with tempfile.TemporaryDirectory() as d:
...   with lock_workdir(d):
...     try:
...       lock_workdir(d)
...     except WorkdirLockedError as e:
...       print("refused")
...   _ = check_workdir_config(d, {"rl": {"learning_rate": 1.5e-4}, "eval": {"every": 10}})
...   _ = check_workdir_config(d, {"rl": {"learning_rate": 1.5e-4}, "eval": {"every": 50}})
...   try:
...     check_workdir_config(d, {"rl": {"learning_rate": 1e-3}, "eval": {"every": 50}})
...   except ConfigMismatchError as e:
...     print(e.changes)
refused
['rl.learning_rate: 0.00015 -> 0.001']
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Any, Iterable, Mapping

from rollouts_jax.io.filelock import FileLock, LockedError, atomic_build  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
LOCK_FILE = ".workdir.lock"

#: Dotted config keys (fnmatch patterns) that steer the loop but do not change what it
#: computes: left out of the fingerprint, so changing them on a rerun is allowed.
LOOP_ONLY_KEYS: tuple[str, ...] = (
    "stop_after_step",
    "checkpoint.*",            # cadence and retention
    "eval.every",              # evaluation cadence (evaluation draws its own keys)
    "eval.batch_size",         # chunking of evaluation prompts
    "*log_every*", "*logging*", "*progress*",
    "*num_workers*", "*timeout*",   # grader pool size and deadlines
    "reward.max_failure_frac",      # when a failing grader stops the run
    "allow_config_change",
    "mesh.*",                  # placement: the same computation on other devices
    "model.remat",             # recomputation instead of storage: the same values
    "rl.micro_batch_size",     # gradient accumulation: the same update, other memory
    "rl.logprob_chunk",        # the output head over chunks of positions: the same values, other memory
    "data.data_dir", "data.manual_dir", "sft.cache_dir",  # where files live, not what they hold
)


#: Another live process holds the workdir (or a build) lock.
WorkdirLockedError = LockedError


class ConfigMismatchError(ValueError):
  """The workdir was started with a config that differs in settings that change results.

  Attributes:
    changes: ``["rl.learning_rate: 0.00015 -> 0.001", ...]``.
  """

  def __init__(self, message: str, changes: list[str]):
    super().__init__(message)
    self.changes = changes


# ----------------------------------------------------------------------------------------------
# Locks
# ----------------------------------------------------------------------------------------------

def lock_workdir(workdir: str | os.PathLike, *, timeout_s: float = 0.0) -> FileLock:
  """Takes ``<workdir>/.workdir.lock`` for this process (held until released or exit).

  Call it first, before reading checkpoints or writing anything. In a multi-host job only
  process 0 needs to call it.

  Args:
    workdir: the run's folder (created if missing).
    timeout_s: how long to wait for another run to finish (0: refuse at once).

  Returns:
    The held :class:`FileLock` (use it as a context manager, or keep it for the process life).

  Raises:
    WorkdirLockedError: another live process trains in this workdir; the message names it.
  """
  workdir = os.fspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  return FileLock(os.path.join(workdir, LOCK_FILE), timeout_s=timeout_s,
                  what=f"The workdir {os.path.abspath(workdir)}").acquire()


# ----------------------------------------------------------------------------------------------
# Config fingerprint
# ----------------------------------------------------------------------------------------------

def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = list(v) if isinstance(v, tuple) else v
  return out


def _plain(d: Any) -> Any:
  if hasattr(d, "to_dict"):
    d = d.to_dict()
  if isinstance(d, Mapping):
    return {str(k): _plain(v) for k, v in d.items()}
  if isinstance(d, (list, tuple)):
    return [_plain(v) for v in d]
  return d


def _loop_only(key: str, patterns: Iterable[str]) -> bool:
  return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def config_fingerprint(exp_dict: Mapping[str, Any], *, exclude: Iterable[str] = ()) -> tuple[str, dict[str, Any]]:
  """(digest, {dotted key: value}) of the settings of ``exp_dict`` that change results.

  Args:
    exp_dict: the experiment config as nested dicts (``dataclasses.asdict(exp)``, or a
      ConfigDict); tuples and lists compare equal.
    exclude: more fnmatch patterns of dotted keys to leave out, besides :data:`LOOP_ONLY_KEYS`.

  Returns:
    A 16-hex-digit SHA-256 prefix of the canonical JSON, and the flat dict it hashes.

  >>> a = config_fingerprint({"rl": {"learning_rate": 1e-3}, "checkpoint": {"every": 10}})
  >>> b = config_fingerprint({"rl": {"learning_rate": 1e-3}, "checkpoint": {"every": 99}})
  >>> a == b, a[1]
  (True, {'rl.learning_rate': 0.001})
  """
  patterns = tuple(LOOP_ONLY_KEYS) + tuple(exclude)
  flat = {k: v for k, v in _flatten(_plain(exp_dict)).items() if not _loop_only(k, patterns)}
  canonical = json.dumps(flat, sort_keys=True, default=str)
  return hashlib.sha256(canonical.encode()).hexdigest()[:16], flat


def _show(v: Any) -> str:
  return "<absent>" if v is _ABSENT else json.dumps(v, default=str)


_ABSENT = object()


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any], *, exclude: Iterable[str] = ()) -> list[str]:
  """``["key: old -> new", ...]`` over the result-affecting keys that differ (sorted).

  A key that exists on one side only (a setting added or removed by a newer version of the
  library) is a change only when its value there is not the "off" value: the default of a
  new key (``rl.logprob_chunk: 0``), or an empty / zero / false value of a removed one, is what
  the older run did, so the run still resumes.

  >>> config_changes({"rl": {"lr": 1}}, {"rl": {"lr": 1, "new_knob": 0}})
  []
  >>> config_changes({"rl": {"lr": 1}}, {"rl": {"lr": 1, "new_knob": 4}})
  ['rl.new_knob: <absent> -> 4']
  """
  _, a = config_fingerprint(saved, exclude=exclude)
  _, b = config_fingerprint(new, exclude=exclude)
  defaults = _default_flat()

  def same(k):
    x, y = a.get(k, _ABSENT), b.get(k, _ABSENT)
    if x is _ABSENT or y is _ABSENT:
      present = y if x is _ABSENT else x
      return present == defaults.get(k, _ABSENT) or present in ("", 0, False, None, [])
    return x == y

  return [f"{k}: {_show(a.get(k, _ABSENT))} -> {_show(b.get(k, _ABSENT))}"
          for k in sorted(set(a) | set(b)) if not same(k)]


def _default_flat() -> dict[str, Any]:
  """The flat default experiment config (what a key absent from an older config.json meant)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  return _flatten(_plain(dataclasses.asdict(config_lib.ExperimentConfig())))


def _write_json_atomic(path: pathlib.Path, data: Any) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=2, default=str))
  os.replace(tmp, path)


def check_workdir_config(workdir: str | os.PathLike, exp_dict: Mapping[str, Any], *, allow_change: bool = False,
                         exclude: Iterable[str] = (), write: bool = True) -> dict[str, Any]:
  """Ties ``workdir`` to its config: call it before any work (after :func:`lock_workdir`).

  A new workdir gets ``config.json``. A rerun whose result-affecting settings equal the saved
  ones continues (loop-only settings may differ; ``config.json`` is updated to the new
  values). A rerun that changes results raises :class:`ConfigMismatchError` naming each
  differing key, and leaves ``config.json`` untouched; with ``allow_change`` it continues: the
  old file is kept as ``config.<UTC time>.json`` and the change is appended to
  ``config_changes.jsonl``.

  Args:
    workdir: the run's folder.
    exp_dict: the config as nested plain dicts (``dataclasses.asdict(exp)``).
    allow_change: continue despite result-affecting differences (the explicit override).
    exclude: more loop-only key patterns (see :func:`config_fingerprint`).
    write: False for processes that only check (multi-host: all but process 0).

  Returns:
    ``{"status": "new" | "same" | "changed", "changes": [...], "fingerprint": digest}``.

  Raises:
    ConfigMismatchError: the settings differ and ``allow_change`` is False.
  """
  workdir = pathlib.Path(workdir)
  path = workdir / CONFIG_FILE
  exp_dict = _plain(exp_dict)
  digest, _ = config_fingerprint(exp_dict, exclude=exclude)
  if not path.exists():
    if write:
      workdir.mkdir(parents=True, exist_ok=True)
      _write_json_atomic(path, exp_dict)
    return {"status": "new", "changes": [], "fingerprint": digest}
  try:
    saved = json.loads(path.read_text())
  except ValueError as e:
    if not allow_change:
      raise ConfigMismatchError(
          f"{path} is unreadable ({e}); cannot tell whether this rerun matches the run in {workdir}. "
          "Pass the override (allow_change / --allow_config_change) to continue with the new config.",
          [f"{CONFIG_FILE}: unreadable"]) from None
    saved = {}
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  saved = config_lib.upgrade(saved)   # a workdir of an earlier version, in today's keys
  changes = config_changes(saved, exp_dict, exclude=exclude)
  if changes and not allow_change:
    raise ConfigMismatchError(
        f"The workdir {workdir} was started with another config; these settings change results: "
        f"{'; '.join(changes)}. Use another workdir, or pass the override (--allow_config_change) to "
        f"continue this run with the new settings ({CONFIG_FILE} is then kept as config.<time>.json).",
        changes)
  if write:
    if changes:
      stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
      shutil.copyfile(path, workdir / f"config.{stamp}.json")
      with open(workdir / "config_changes.jsonl", "a") as f:
        f.write(json.dumps({"time": stamp, "changes": changes}) + "\n")
      log.warning("Continuing %s with a changed config (override given): %s", workdir, "; ".join(changes))
    if saved != json.loads(json.dumps(exp_dict, default=str)):
      _write_json_atomic(path, exp_dict)
  return {"status": "changed" if changes else "same", "changes": changes, "fingerprint": digest}


@contextlib.contextmanager
def claim_workdir(workdir: str | os.PathLike, exp_dict: Mapping[str, Any], *, allow_change: bool = False,
                  primary: bool = True):
  """Lock + config check in one: ``with claim_workdir(workdir, asdict(exp)): train(...)``.

  Args:
    workdir: the run's folder.
    exp_dict: the config as nested dicts.
    allow_change: the override of :func:`check_workdir_config`.
    primary: False on the processes of a multi-host job other than 0 (they only check).

  Yields:
    The result of :func:`check_workdir_config`.
  """
  lock = lock_workdir(workdir) if primary else None
  try:
    yield check_workdir_config(workdir, exp_dict, allow_change=allow_change, write=primary)
  finally:
    if lock is not None:
      lock.release()
