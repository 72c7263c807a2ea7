"""Cross-process locks and build-once folders, with nothing heavier than the standard library.

:class:`FileLock` is an exclusive ``fcntl.flock`` lock on a file: the kernel drops it when the
holding process exits, however it dies (``kill -9`` included), so a stale lock of a dead
process is simply taken over; the file records the holder's pid and host for messages.
:func:`atomic_build` builds a folder once across processes (TFDS datasets, SFT warm starts):
under a lock, into a temporary sibling, renamed into place when complete.
:mod:`rollouts_jax.training.workdir` builds the workdir lock on these.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import tempfile
import time
from typing import Any, Callable

__all__ = ["FileLock", "LockedError", "atomic_build"]


class LockedError(RuntimeError):
  """Another live process holds the lock."""


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
  ...     except LockedError as e:
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
    """Takes the lock, waiting up to ``timeout_s``; raises LockedError naming the holder."""
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
            raise LockedError(
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
