"""Batch scoring in worker processes, so that a hung or crashing grader cannot stall training.

:class:`GraderPool` keeps ``num_workers`` long-lived worker processes. They are fresh Python
interpreters (``python -c``, talking over a socket pair), not forks and not
``multiprocessing`` children: they inherit no JAX threads, never re-import the launching
script, and import only ``rollouts_jax.rewards`` plus the modules of the reward functions
they are sent (so those must be importable: not defined in ``__main__``). Each call of the
reward function is one task with its own deadline, counted from the moment the worker starts
it. A worker that passes the deadline is killed (SIGKILL) and replaced; its task scores 0.
A worker that dies (segfault, out of memory) is replaced the same way. Exceptions in the
reward function score 0 without costing a worker. Every call returns, after at most about
``ceil(len / num_workers) * timeout_s`` plus start-up time, whatever the graders do.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib
import math
import multiprocessing.connection as mp_connection
import os
import pathlib
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from rollouts_jax.rewards import common

STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT, STATUS_CRASH, STATUS_INVALID = 0, 1, 2, 3, 4
STATUS_NAMES = ("ok", "error", "timeout", "crash", "invalid")
# Time a worker may spend loading a task (unpickling the function can import its module)
# before the per-call clock starts.
_LOAD_GRACE_S = 30.0
_MAX_MESSAGES = 5
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]

RewardFn = Callable[[str, Any], float]


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _watch_parent(parent_pid: int) -> None:
    """Exits the worker when the parent dies (best effort: needs the GIL to run)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_entry() -> None:
    """Entry point of a worker interpreter: ``argv[1]`` is its socket's file descriptor."""
    conn = mp_connection.Connection(int(sys.argv[1]))
    parent_pid, sys_path, preload = conn.recv()
    sys.path[:] = sys_path
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _worker_main(conn, preload)


def _worker_main(conn, preload: Sequence[str]) -> None:
    """Worker loop: load a task, say "start", run it, send the value and new failure counts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent.
    for name in preload:
        importlib.import_module(name)
    conn.send(("ready", os.getpid()))
    fns: dict[bytes, Callable] = {}
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        task_id = None
        try:
            task_id, fn_blob, completion, reference = pickle.loads(data)
            fn = fns.get(fn_blob)
            if fn is None:
                fn = fns[fn_blob] = pickle.loads(fn_blob)
        except BaseException as e:  # noqa: BLE001 - report and keep serving.
            conn.send(("done", task_id, STATUS_ERROR, f"cannot load the task: {e!r}"[:500], {}))
            continue
        conn.send(("start", task_id, time.monotonic()))
        before = common.failure_counts()
        try:
            raw = fn(completion, reference)
        except BaseException as e:  # noqa: BLE001 - a grader error scores 0, the worker lives.
            status, value = STATUS_ERROR, f"{type(e).__name__}: {e}"[:500]
        else:
            try:
                value = float(raw)
                status = STATUS_OK if math.isfinite(value) else STATUS_INVALID
            except (TypeError, ValueError):
                status, value = STATUS_INVALID, f"non-numeric reward {type(raw).__name__}"
        conn.send(("done", task_id, status, value, _delta(before, common.failure_counts())))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any
    spawned: float
    ready: bool = False
    task: Optional[int] = None
    dispatched: float = 0.0
    started: Optional[float] = None


def resolve_reward_fn(reward_fn: Union[str, RewardFn]) -> RewardFn:
    """A reward callable, looked up in the registry when given by name."""
    if isinstance(reward_fn, str):
        from rollouts_jax.rewards import registry  # noqa: PLC0415 - avoids an import cycle.
        return registry.get_reward_fn(reward_fn)
    if not callable(reward_fn):
        raise ValueError(f"reward_fn must be a callable or a registered name, got {reward_fn!r}")
    return reward_fn


def _check_inputs(completions, references) -> int:
    if isinstance(completions, str):
        raise ValueError("completions must be a list of strings, not one string")
    n = len(completions)
    if len(references) != n:
        raise ValueError(f"got {n} completions but {len(references)} references")
    return n


def _new_stats(n: int) -> dict:
    return {"num": n, "ok": 0, "errors": 0, "timeouts": 0, "crashes": 0, "invalid": 0,
            "failures": 0, "grader_failures": {}, "restarts": 0, "wall_s": 0.0,
            "status": np.zeros(n, np.int8), "messages": []}


def _finish_stats(stats: dict, failures: collections.Counter, t0: float) -> dict:
    status = stats["status"]
    for code, key in ((STATUS_OK, "ok"), (STATUS_ERROR, "errors"), (STATUS_TIMEOUT, "timeouts"),
                      (STATUS_CRASH, "crashes"), (STATUS_INVALID, "invalid")):
        stats[key] = int(np.sum(status == code))
    stats["grader_failures"] = dict(failures)
    stats["failures"] = int(np.sum(status != STATUS_OK)) + int(sum(failures.values()))
    stats["wall_s"] = time.monotonic() - t0
    return stats


class GraderPool:
    """A set of grader processes with per-call deadlines; see the module docstring.

    One :meth:`score` call at a time per pool (it is not thread-safe). POSIX only (workers
    get their socket through ``pass_fds`` and are stopped with SIGKILL).

    Args:
        num_workers: worker processes (default :func:`default_num_workers`).
        preload: modules each worker imports before it reports ready.
        startup_timeout_s: a worker not ready by then is replaced; repeated start-up failures
            raise RuntimeError.

    >>> with GraderPool(num_workers=2) as pool:  # doctest: +SKIP
    ...     rewards, stats = pool.score("gsm8k", ["#### 3", "#### 4"], ["3", "3"], timeout_s=5)
    >>> rewards, stats["timeouts"]  # doctest: +SKIP
    (array([1., 0.], dtype=float32), 0)
    """

    def __init__(self, num_workers: Optional[int] = None, *,
                 preload: Sequence[str] = ("rollouts_jax.rewards",),
                 startup_timeout_s: float = 120.0):
        num_workers = default_num_workers() if num_workers is None else int(num_workers)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._preload = tuple(preload)
        self._startup_timeout_s = float(startup_timeout_s)
        self.num_workers = num_workers
        self.total_restarts = 0
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]
        self._closed = False

    # ---- worker management -------------------------------------------------------------
    def _spawn(self) -> _Worker:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The worker must find this package before it receives our sys.path.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from rollouts_jax.rewards.pool import _worker_entry; "
                 "_worker_entry()", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        conn = mp_connection.Connection(ours.detach())
        conn.send((os.getpid(), list(sys.path), self._preload))
        return _Worker(process=proc, conn=conn, spawned=time.monotonic())

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            w.process.kill()
            w.process.wait(timeout=5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        w.conn.close()

    def _replace(self, idx: int) -> None:
        self._kill(self._workers[idx])
        self._workers[idx] = self._spawn()
        self.total_restarts += 1

    def pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def wait_ready(self, timeout_s: Optional[float] = None) -> None:
        """Blocks until every worker has started (useful before timing the first batch)."""
        deadline = time.monotonic() + (self._startup_timeout_s if timeout_s is None else timeout_s)
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("grader workers did not start in time")
            mp_connection.wait([w.conn for w in self._workers if not w.ready], timeout=left)
            for idx, w in enumerate(self._workers):
                if w.ready:
                    continue
                try:
                    while w.conn.poll():
                        if w.conn.recv()[0] == "ready":
                            w.ready = True
                except (EOFError, OSError) as e:
                    raise RuntimeError(f"a grader worker died at start-up "
                                       f"(exit code {w.process.poll()})") from e

    def close(self) -> None:
        """Kills the workers. The pool cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            self._kill(w)

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- scoring -------------------------------------------------------------------------
    def score(self, reward_fn: Union[str, RewardFn], completions: Sequence[str],
              references: Sequence[Any], *, timeout_s: float = 10.0) -> tuple[np.ndarray, dict]:
        """Scores ``reward_fn(completions[i], references[i])`` for every i; see :func:`score_batch`."""
        if self._closed:
            raise ValueError("this GraderPool is closed")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        fn = resolve_reward_fn(reward_fn)
        n = _check_inputs(completions, references)
        try:
            blob = pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"reward_fn {fn!r} cannot be pickled for the worker processes; use a "
                             "module-level function or functools.partial of one") from e
        t0 = time.monotonic()
        rewards = np.zeros(n, np.float32)
        stats = _new_stats(n)
        status = stats["status"]
        failures: collections.Counter = collections.Counter()
        queue = collections.deque(range(n))
        remaining = n
        restarts0, startup_failures = self.total_restarts, 0
        workers = self._workers

        def finish(i: int, code: int, value=None, delta=None) -> None:
            nonlocal remaining
            status[i] = code
            if code == STATUS_OK:
                rewards[i] = value
            elif isinstance(value, str) and len(stats["messages"]) < _MAX_MESSAGES:
                stats["messages"].append(f"[{i}] {STATUS_NAMES[code]}: {value}")
            if delta:
                failures.update(delta)
            remaining -= 1

        try:
            while remaining:
                now = time.monotonic()
                for idx, w in enumerate(workers):
                    if not (w.ready and w.task is None and queue):
                        continue
                    i = queue.popleft()
                    try:
                        payload = pickle.dumps((i, blob, completions[i], references[i]))
                    except Exception as e:  # noqa: BLE001 - an unpicklable reference.
                        finish(i, STATUS_ERROR, f"cannot pickle the task: {e!r}"[:500])
                        continue
                    try:
                        w.conn.send_bytes(payload)
                    except OSError:
                        queue.appendleft(i)
                        self._replace(idx)
                        continue
                    w.task, w.dispatched, w.started = i, now, None
                if not remaining:
                    break
                mp_connection.wait([w.conn for w in workers], timeout=self._next_wait(timeout_s))
                for idx, w in enumerate(workers):
                    dead = False
                    try:
                        while w.conn.poll():
                            msg = w.conn.recv()
                            if msg[0] == "ready":
                                w.ready = True
                            elif msg[0] == "start" and msg[1] == w.task:
                                w.started = msg[2]
                            elif msg[0] == "done" and msg[1] == w.task:
                                finish(msg[1], msg[2], msg[3], msg[4])
                                w.task = None
                    except (EOFError, OSError):
                        dead = True
                    if dead or w.process.poll() is not None:
                        if w.task is not None:
                            finish(w.task, STATUS_CRASH, f"worker died (exit code {w.process.poll()})")
                        elif not w.ready:
                            startup_failures += 1
                        self._replace(idx)
                now = time.monotonic()
                for idx, w in enumerate(workers):
                    if w.task is not None and now >= self._deadline(w, timeout_s):
                        finish(w.task, STATUS_TIMEOUT, f"no result after {timeout_s:g} s")
                        self._replace(idx)
                    elif not w.ready and now - w.spawned > self._startup_timeout_s:
                        startup_failures += 1
                        self._replace(idx)
                if startup_failures > self.num_workers:
                    raise RuntimeError("grader workers keep failing to start; check that "
                                       f"{self._preload} imports in a fresh process")
        except BaseException:
            # A worker still busy would answer into the next call: replace it.
            for idx, w in enumerate(workers):
                if w.task is not None:
                    self._replace(idx)
            raise
        stats["restarts"] = self.total_restarts - restarts0
        return rewards, _finish_stats(stats, failures, t0)

    @staticmethod
    def _deadline(w: _Worker, timeout_s: float) -> float:
        if w.started is not None:
            return w.started + timeout_s
        return w.dispatched + timeout_s + _LOAD_GRACE_S

    def _next_wait(self, timeout_s: float) -> float:
        now = time.monotonic()
        deadlines = [self._deadline(w, timeout_s) for w in self._workers if w.task is not None]
        deadlines += [w.spawned + self._startup_timeout_s for w in self._workers if not w.ready]
        if not deadlines:
            return 1.0
        return min(max(min(deadlines) - now, 0.0), 60.0)


def default_num_workers() -> int:
    """``min(8, os.cpu_count())``: graders are light; more workers mostly cost memory."""
    return max(1, min(8, os.cpu_count() or 1))


_DEFAULT_POOLS: dict[int, GraderPool] = {}


def get_default_pool(num_workers: Optional[int] = None) -> GraderPool:
    """The shared pool :func:`score_batch` uses, created on first use and closed at exit."""
    key = default_num_workers() if num_workers is None else int(num_workers)
    pool = _DEFAULT_POOLS.get(key)
    if pool is None or pool._closed:  # noqa: SLF001
        pool = _DEFAULT_POOLS[key] = GraderPool(key)
    return pool


@atexit.register
def shutdown_default_pools() -> None:
    """Closes the shared pools (also registered with ``atexit``)."""
    while _DEFAULT_POOLS:
        _, pool = _DEFAULT_POOLS.popitem()
        pool.close()


def _score_inline(fn: RewardFn, completions, references, timeout_s: float) -> tuple[np.ndarray, dict]:
    n = _check_inputs(completions, references)
    t0 = time.monotonic()
    rewards = np.zeros(n, np.float32)
    stats = _new_stats(n)
    failures: collections.Counter = collections.Counter()
    for i in range(n):
        before = common.failure_counts()
        try:
            with common.time_limit(timeout_s):
                raw = fn(completions[i], references[i])
            value = float(raw)
            code = STATUS_OK if math.isfinite(value) else STATUS_INVALID
        except common.GraderTimeout:
            code, value = STATUS_TIMEOUT, None
        except Exception as e:  # noqa: BLE001 - a grader error scores 0.
            code, value = STATUS_ERROR, None
            if len(stats["messages"]) < _MAX_MESSAGES:
                stats["messages"].append(f"[{i}] error: {type(e).__name__}: {e}"[:500])
        stats["status"][i] = code
        if code == STATUS_OK:
            rewards[i] = value
        failures.update(_delta(before, common.failure_counts()))
    return rewards, _finish_stats(stats, failures, t0)


def score_batch(reward_fn: Union[str, RewardFn], completions: Sequence[str],
                references: Sequence[Any], *, timeout_s: float = 10.0,
                num_workers: Optional[int] = None,
                pool: Optional[GraderPool] = None) -> tuple[np.ndarray, dict]:
    """Scores a flat batch of completions (B prompts x N samples, flattened) against references.

    Each ``reward_fn(completions[i], references[i])`` runs in a worker process with a hard
    per-call deadline of ``timeout_s``: a call that raises, returns a non-finite or non-numeric
    value, runs past the deadline (its worker is killed and replaced) or kills its worker
    scores 0, and the call still returns.

    Args:
        reward_fn: a registered name (``"math"``, ``"gsm8k"``, ``"countdown"``, ``"format"``...)
            or a picklable callable ``(completion, reference) -> float``.
        completions: the texts, length M.
        references: one reference per completion, length M (repeat a prompt's reference N times).
        timeout_s: per-call wall-clock limit in seconds.
        num_workers: worker processes of the shared pool (default :func:`default_num_workers`);
            0 runs inline in this process, with only a ``SIGALRM`` limit (main thread only, and
            it cannot stop a call stuck in C code).
        pool: a :class:`GraderPool` to use instead of the shared one.

    Returns:
        ``(rewards, stats)``: float32[M] rewards, and a dict with counts ``ok``, ``errors``,
        ``timeouts``, ``crashes``, ``invalid``; ``grader_failures`` (the graders' own counts
        of malformed answers and caught errors, e.g. ``{"math/no_answer": 3}``); ``failures``
        (all of these together); ``restarts`` (workers replaced); ``wall_s``; ``status``
        (int8[M], codes in :data:`STATUS_NAMES`); ``messages`` (the first few error texts).

    Raises:
        ValueError: mismatched lengths, an unknown name, an unpicklable ``reward_fn``.

    >>> rewards, stats = score_batch("gsm8k", ["#### 3", "I think 4"], ["3", "3"], num_workers=0)
    >>> rewards.tolist(), stats["failures"]
    ([1.0, 0.0], 0)
    """
    fn = resolve_reward_fn(reward_fn)
    if pool is not None:
        return pool.score(fn, completions, references, timeout_s=timeout_s)
    if num_workers is not None and int(num_workers) == 0:
        return _score_inline(fn, completions, references, timeout_s)
    return get_default_pool(num_workers).score(fn, completions, references, timeout_s=timeout_s)
