"""A workdir belongs to one run: a process lock, a config fingerprint, and cross-process builds.

* :class:`FileLock`: an exclusive ``fcntl.flock`` lock on a file. The kernel drops it when the
  holding process exits, however it dies (``kill -9`` included), so a stale lock of a dead
  process is simply taken over; the file records the holder's pid and host for messages.
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
import errno
import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Iterable, Mapping

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
    "data.data_dir", "data.manual_dir", "sft.cache_dir",  # where files live, not what they hold
)


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir (or build) lock."""


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

def _holder(path: str) -> str:
  try:
    info = json.loads(pathlib.Path(path).read_text() or "{}")
  except (OSError, ValueError):
    return "another process"
  return f"process {info.get('pid', '?')} on {info.get('host', '?')} (since {info.get('since', '?')})"


class FileLock:
  """An exclusive cross-process lock on ``path`` (``fcntl.flock``), released on exit or death.

  Args:
    path: the lock file (created with its folder; never deleted, which keeps flock race-free).
    timeout_s: how long :meth:`acquire` waits; None waits forever, 0 does not wait.
    what: what the lock protects, for error messages.

  Locks are per open file: a second :class:`FileLock` on the same path conflicts even within
  one process. Works on local filesystems (and NFS where the kernel maps flock to NFS locks).

  >>> import tempfile, os
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with FileLock(os.path.join(d, "x.lock")):
  ...     try:
  ...       FileLock(os.path.join(d, "x.lock"), timeout_s=0).acquire()
  ...     except WorkdirLockedError as e:
  ...       print(str(e).split(" (")[0].endswith(f"in use by process {os.getpid()} on {socket.gethostname()}"))
  True
  """

  def __init__(self, path: str | os.PathLike, *, timeout_s: float | None = None, what: str | None = None,
               poll_s: float = 0.1):
    self.path = os.path.abspath(os.fspath(path))
    self.timeout_s = timeout_s
    self.what = what or self.path
    self.poll_s = poll_s
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> "FileLock":
    """Takes the lock, waiting up to ``timeout_s``; raises WorkdirLockedError naming the holder."""
    if self._fd is not None:
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
    try:
      while True:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except OSError as e:
          if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
          if deadline is not None and time.monotonic() >= deadline:
            raise WorkdirLockedError(
                f"{self.what} is in use by {_holder(self.path)} (lock file {self.path}). Wait for it "
                "to finish or stop it; a lock left by a process that died is taken over "
                "automatically.") from None
          time.sleep(self.poll_s)
    except BaseException:
      os.close(fd)
      raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "since": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                  timespec="seconds")}).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
      fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
      os.close(fd)

  def __enter__(self) -> "FileLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

  def __del__(self):
    try:
      self.release()
    except Exception:  # pylint: disable=broad-except
      pass


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


def atomic_build(final: str | os.PathLike, build: Callable[[pathlib.Path], Any], *,
                 done_file: str | None = None, timeout_s: float | None = None) -> bool:
  """Builds the folder ``final`` at most once across processes.

  Under a lock next to it, ``build(tmp)`` fills a fresh temporary sibling folder, which is
  then renamed to ``final``. A process that finds ``final`` complete (and ``done_file`` in it,
  when given) returns at once; one that waited on the lock re-checks, so concurrent callers
  all return with ``final`` complete and only one of them built it. A builder that dies
  leaves only its temporary folder, removed by the next build.

  Args:
    final: the folder to produce.
    build: fills the folder it is given (a path in the same parent as ``final``).
    done_file: a file name whose presence inside ``final`` marks it complete.
    timeout_s: how long to wait for another builder (None: forever).

  Returns:
    True if this call built the folder, False if it was already there.

  >>> import tempfile, pathlib
  >>> with tempfile.TemporaryDirectory() as d:
  ...   out = pathlib.Path(d, "cache")
  ...   first = atomic_build(out, lambda tmp: (tmp / "x").write_text("1"))
  ...   again = atomic_build(out, lambda tmp: (tmp / "x").write_text("2"))
  ...   first, again, (out / "x").read_text()
  (True, False, '1')
  """
  final = pathlib.Path(final)

  def complete() -> bool:
    return final.is_dir() and (done_file is None or (final / done_file).exists())

  if complete():
    return False
  final.parent.mkdir(parents=True, exist_ok=True)
  with FileLock(final.parent / f".{final.name}.lock", timeout_s=timeout_s, what=f"The build of {final}"):
    if complete():
      return False
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
      shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died (we hold the lock)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
      build(tmp)
      if final.exists():  # incomplete leftovers (no done_file): replace them
        shutil.rmtree(final)
      os.rename(tmp, final)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
  return True


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
  """``["key: old -> new", ...]`` over the result-affecting keys that differ (sorted)."""
  _, a = config_fingerprint(saved, exclude=exclude)
  _, b = config_fingerprint(new, exclude=exclude)
  return [f"{k}: {_show(a.get(k, _ABSENT))} -> {_show(b.get(k, _ABSENT))}"
          for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


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
