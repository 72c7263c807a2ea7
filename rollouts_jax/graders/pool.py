"""Batch scoring isolated from the training process, so that no grader can stall or kill training.

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

:func:`score_batch` runs a grader in this process only when it is known to be safe (pure
Python over bounded text, no C extension that could hold the interpreter:
:func:`is_inline_safe`; the built-in ``arithmetic``, ``gsm8k``, ``countdown`` and ``format``
graders), and then still under a ``SIGALRM`` deadline per call; every other grader goes to
the pool. Its stats keep grader failures (errors, timeouts, crashes, invalid values, and the
errors graders catch themselves) apart from completions without an answer, which are a normal
0; :func:`check_grader_health` turns a grader that fails on most samples into an error.
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import dataclasses
import functools
import importlib
import logging
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

from rollouts_jax.graders import common, registry

STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT, STATUS_CRASH, STATUS_INVALID = 0, 1, 2, 3, 4
STATUS_NAMES = ("ok", "error", "timeout", "crash", "invalid")
# Time a worker may spend loading a task (unpickling the function can import its module)
# before the per-call clock starts.
_LOAD_GRACE_S = 30.0
_MAX_MESSAGES = 5
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]

RewardFn = Callable[[str, Any], float]
log = logging.getLogger(__name__)


class GraderFailureError(RuntimeError):
    """The grader failed (raised, timed out, crashed, returned non-finite values) on too many samples."""


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _watch_parent(parent_pid: int) -> None:
    """Exits the worker when the parent dies (best effort: needs the GIL to run)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent dies, even while it is stuck in C code."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_entry() -> None:
    """Entry point of a worker interpreter: ``argv[1]`` is its socket's file descriptor."""
    conn = mp_connection.Connection(int(sys.argv[1]))
    parent_pid, sys_path, preload, *rest = conn.recv()
    if rest and rest[0]:
        _die_with_parent()
    sys.path[:] = sys_path
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before PR_SET_PDEATHSIG took effect
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
        common.take_failure_messages()
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
        conn.send(("done", task_id, status, value, _delta(before, common.failure_counts()),
                   common.take_failure_messages()[:3]))


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


class _Tally:
    """Per-sample outcomes of one batch, turned into the stats dict by :meth:`stats`."""

    def __init__(self, n: int, mode: str):
        self.n, self.mode = n, mode
        self.status = np.zeros(n, np.int8)
        self.caught = np.zeros(n, bool)      # the grader caught its own error / time limit
        self.no_answer = np.zeros(n, bool)   # no extractable (or parseable) answer: a normal 0
        self.counts: collections.Counter = collections.Counter()
        self.messages: dict[str, list] = {}  # distinct text -> [count, first index]
        self.restarts = 0
        self.t0 = time.monotonic()

    def message(self, i: int, text: str) -> None:
        entry = self.messages.get(text)
        if entry is None:
            if len(self.messages) < 4 * _MAX_MESSAGES:
                self.messages[text] = [1, i]
        else:
            entry[0] += 1

    def record(self, i: int, code: int, delta: Optional[dict] = None, texts: Sequence[str] = ()) -> None:
        self.status[i] = code
        for key, count in (delta or {}).items():
            self.counts[key] += count
            kind = common.kind_of(key)
            if kind in common.GRADER_FAILURE_KINDS:
                self.caught[i] = True
            elif kind in common.NO_ANSWER_KINDS:
                self.no_answer[i] = True
        for text in texts:
            self.message(i, text)
        if self.caught[i] and not texts:
            self.message(i, ", ".join(k for k in sorted(delta or {})
                                      if common.kind_of(k) in common.GRADER_FAILURE_KINDS))

    def stats(self) -> dict:
        status = self.status
        failed = (status != STATUS_OK) | self.caught
        out = {"num": self.n, "mode": self.mode}
        for code, key in ((STATUS_OK, "ok"), (STATUS_ERROR, "errors"), (STATUS_TIMEOUT, "timeouts"),
                          (STATUS_CRASH, "crashes"), (STATUS_INVALID, "invalid")):
            out[key] = int(np.sum(status == code))
        out["caught"] = int(np.sum(self.caught & (status == STATUS_OK)))
        out["failures"] = int(np.sum(failed))
        out["failure_frac"] = out["failures"] / self.n if self.n else 0.0
        out["no_answer"] = int(np.sum(self.no_answer & ~failed))
        out["grader_failures"] = dict(self.counts)
        out["restarts"] = self.restarts
        out["wall_s"] = time.monotonic() - self.t0
        out["status"] = status
        out["failed"] = failed
        ordered = sorted(self.messages.items(), key=lambda kv: kv[1][1])[:_MAX_MESSAGES]
        out["messages"] = [f"[{first}] {text}" + (f" (x{count})" if count > 1 else "")
                           for text, (count, first) in ordered]
        return out


class GraderPool:
    """A set of grader processes with per-call deadlines; see the module docstring.

    One :meth:`score` call at a time per pool (it is not thread-safe). POSIX only (workers
    get their socket through ``pass_fds`` and are stopped with SIGKILL).

    Args:
        num_workers: worker processes (default :func:`default_num_workers`).
        preload: modules each worker imports before it reports ready.
        startup_timeout_s: a worker not ready by then is replaced; repeated start-up failures
            raise RuntimeError.

    with GraderPool(num_workers=2) as pool:
        rewards, stats = pool.score("gsm8k", ["#### 3", "#### 4"], ["3", "3"], timeout_s=5)
    rewards, stats["timeouts"]
    # (array([1., 0.], dtype=float32), 0)
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
                [sys.executable, "-c", "from rollouts_jax.graders.pool import _worker_entry; "
                 "_worker_entry()", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        conn = mp_connection.Connection(ours.detach())
        conn.send((os.getpid(), list(sys.path), self._preload,
                   threading.current_thread() is threading.main_thread()))
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
        rewards = np.zeros(n, np.float32)
        tally = _Tally(n, "pool")
        queue = collections.deque(range(n))
        remaining = n
        restarts0, startup_failures = self.total_restarts, 0
        workers = self._workers

        def finish(i: int, code: int, value=None, delta=None, texts=()) -> None:
            nonlocal remaining
            if code == STATUS_OK:
                rewards[i] = value
            elif isinstance(value, str):
                texts = [f"{STATUS_NAMES[code]}: {value}", *texts]
            else:
                texts = [f"{STATUS_NAMES[code]}: reward {value!r}", *texts]
            tally.record(i, code, delta, texts)
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
                                finish(msg[1], msg[2], msg[3], msg[4], msg[5] if len(msg) > 5 else ())
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
        tally.restarts = self.total_restarts - restarts0
        return rewards, tally.stats()

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
    """Worker processes of the shared pool: half the CPU cores (the trainer needs the rest), 2 to 8.

    Two at least, so that one grader stuck until its deadline does not serialize the batch.
    """
    return max(2, min(8, (os.cpu_count() or 2) // 2))


_DEFAULT_POOLS: dict[int, GraderPool] = {}


def get_default_pool(num_workers: Optional[int] = None) -> GraderPool:
    """The shared pool :func:`score_batch` uses, created on first use and closed at exit.

    Its workers also import the tasks package before they report ready: a task's grader
    imports it on its first call, which would otherwise count against the first sample's
    time limit (on a loaded machine, every sample's: each timeout restarts the worker).
    """
    key = default_num_workers() if num_workers is None else int(num_workers)
    pool = _DEFAULT_POOLS.get(key)
    if pool is None or pool._closed:  # noqa: SLF001
        pool = _DEFAULT_POOLS[key] = GraderPool(key, preload=("rollouts_jax.rewards", "rollouts_jax.tasks"))
    return pool


@atexit.register
def shutdown_default_pools() -> None:
    """Closes the shared pools (also registered with ``atexit``)."""
    while _DEFAULT_POOLS:
        _, pool = _DEFAULT_POOLS.popitem()
        pool.close()


# ---- inline scoring of known-safe graders ------------------------------------------------------

_INLINE_SAFE: set = set()
_WARNED_UNSAFE: set = set()


def _unwrap(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def mark_inline_safe(fn: RewardFn) -> RewardFn:
    """Declares ``fn`` safe to run in the training process (returns it, so usable as a decorator).

    Only for graders that run pure Python over bounded text: nothing that can block in C code
    (regex on unbounded input, big-integer or symbolic math, subprocesses, I/O). Inline calls
    still get a ``SIGALRM`` deadline, which interrupts Python code but not a C call.
    """
    _INLINE_SAFE.add(_unwrap(fn))
    return fn


def is_inline_safe(fn: RewardFn) -> bool:
    """True for graders that :func:`score_batch` may run in this process (partials see through).

    >>> from rollouts_jax import rewards
    >>> is_inline_safe(rewards.arithmetic_reward), is_inline_safe(rewards.math_reward)
    (True, False)
    """
    return _unwrap(fn) in _INLINE_SAFE


def _score_inline(fn: RewardFn, completions, references, timeout_s: float) -> tuple[np.ndarray, dict]:
    n = _check_inputs(completions, references)
    rewards = np.zeros(n, np.float32)
    tally = _Tally(n, "inline")
    common.take_failure_messages()
    for i in range(n):
        before = common.failure_counts()
        texts = []
        value = 0.0
        try:
            with common.time_limit(timeout_s):
                raw = fn(completions[i], references[i])
        except common.GraderTimeout:
            code = STATUS_TIMEOUT
            texts.append(f"timeout: no result after {timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - a grader error scores 0.
            code = STATUS_ERROR
            texts.append(f"error: {type(e).__name__}: {e}"[:500])
        else:
            try:
                value = float(raw)
                code = STATUS_OK if math.isfinite(value) else STATUS_INVALID
            except (TypeError, ValueError):
                code = STATUS_INVALID
            if code == STATUS_INVALID:
                texts.append(f"invalid: non-finite or non-numeric reward {raw!r}"[:500])
        if code == STATUS_OK:
            rewards[i] = value
        tally.record(i, code, _delta(before, common.failure_counts()),
                     texts + common.take_failure_messages()[:3])
    return rewards, tally.stats()


def score_batch(reward_fn: Union[str, RewardFn], completions: Sequence[str],
                references: Sequence[Any], *, timeout_s: float = 10.0,
                num_workers: Optional[int] = None,
                pool: Optional[GraderPool] = None) -> tuple[np.ndarray, dict]:
    """Scores a flat batch of completions (B prompts x N samples, flattened) against references.

    Each ``reward_fn(completions[i], references[i])`` runs with a hard per-call deadline of
    ``timeout_s``: a call that raises, returns a non-finite or non-numeric value, runs past
    the deadline (its worker is killed and replaced) or kills its worker scores 0, and the
    call still returns.

    Where graders run: graders known to be safe (:func:`is_inline_safe`) run in this process
    under a ``SIGALRM`` deadline when ``num_workers`` is None or 0 (and this is the main
    thread); every other grader runs in the shared worker pool (``num_workers`` processes, or
    :func:`default_num_workers` when None or 0: an unsafe grader is never run inline).
    ``num_workers > 0`` always uses the pool.

    Args:
        reward_fn: a registered name (``"math"``, ``"gsm8k"``, ``"countdown"``, ``"format"``...)
            or a picklable callable ``(completion, reference) -> float``.
        completions: the texts, length M.
        references: one reference per completion, length M (repeat a prompt's reference N times).
        timeout_s: per-call wall-clock limit in seconds.
        num_workers: see above.
        pool: a :class:`GraderPool` to use instead of the shared one.

    Returns:
        ``(rewards, stats)``: float32[M] rewards, and a dict with counts ``ok``, ``errors``
        (the grader raised), ``timeouts``, ``crashes`` (the worker died), ``invalid``
        (non-finite or non-numeric value), ``caught`` (returned, but the grader recorded its
        own error or time limit); ``failures`` (samples with any of these) and
        ``failure_frac``; ``no_answer`` (completions without an extractable answer: a normal
        0, not a failure); ``grader_failures`` (the graders' own counts by kind, e.g.
        ``{"math/no_answer": 3}``); ``messages`` (the first few distinct failure texts, with
        the first sample index and a count); ``restarts``; ``wall_s``; ``mode`` (``"pool"`` or
        ``"inline"``); ``status`` (int8[M], codes in :data:`STATUS_NAMES`) and ``failed``
        (bool[M]).

    Raises:
        ValueError: mismatched lengths, an unknown name, an unpicklable ``reward_fn``.

    >>> import rollouts_jax.rewards  # registers the built-in graders' names
    >>> rewards, stats = score_batch("gsm8k", ["#### 3", "I think 4", "no idea"], ["3", "3", "3"])
    >>> rewards.tolist(), stats["failures"], stats["no_answer"], stats["mode"]
    ([1.0, 0.0, 0.0], 0, 1, 'inline')
    """
    fn = resolve_reward_fn(reward_fn)
    if pool is not None:
        return pool.score(fn, completions, references, timeout_s=timeout_s)
    if num_workers is None or int(num_workers) == 0:
        if is_inline_safe(fn) and common.in_main_thread():
            return _score_inline(fn, completions, references, timeout_s)
        if num_workers is not None and _unwrap(fn) not in _WARNED_UNSAFE:
            _WARNED_UNSAFE.add(_unwrap(fn))
            why = ("the in-process deadline (SIGALRM) needs the main thread" if is_inline_safe(fn) else
                   "it is not known to be safe in the training process (see rewards.mark_inline_safe)")
            log.warning("num_workers=0 asks for inline scoring of %r, but %s; scoring it in %d worker processes.",
                        fn, why, default_num_workers())
        num_workers = None
    return get_default_pool(num_workers).score(fn, completions, references, timeout_s=timeout_s)


# ---- stats -------------------------------------------------------------------------------------

_COUNT_KEYS = ("num", "ok", "errors", "timeouts", "crashes", "invalid", "caught", "failures", "no_answer",
               "restarts")


def merge_stats(parts: Sequence[dict]) -> dict:
    """One stats dict for several :func:`score_batch` calls (e.g. the batches of one step)."""
    out: dict[str, Any] = {k: sum(int(p.get(k, 0)) for p in parts) for k in _COUNT_KEYS}
    out["failure_frac"] = out["failures"] / out["num"] if out["num"] else 0.0
    counts: collections.Counter = collections.Counter()
    for p in parts:
        counts.update(p.get("grader_failures", {}))
    out["grader_failures"] = dict(counts)
    out["wall_s"] = sum(float(p.get("wall_s", 0.0)) for p in parts)
    seen, messages = set(), []
    for p in parts:
        for m in p.get("messages", []):
            text = m.split("] ", 1)[-1]
            if text not in seen:
                seen.add(text)
                messages.append(m)
    out["messages"] = messages[:_MAX_MESSAGES]
    return out


def summarize_stats(stats: dict) -> str:
    """One log line: ``grader: 3/64 failed (2 timeouts, 1 error); 5 without an answer; first: ...``.

    >>> summarize_stats({"num": 4, "failures": 1, "errors": 1, "no_answer": 2,
    ...                  "messages": ["[2] error: ValueError: bad"]})
    'grader: 1/4 failed (1 errors); 2 without an answer; first: [2] error: ValueError: bad'
    """
    kinds = ", ".join(f"{stats[k]} {k}" for k in ("errors", "timeouts", "crashes", "invalid", "caught")
                      if stats.get(k))
    line = f"grader: {stats.get('failures', 0)}/{stats.get('num', 0)} failed" + (f" ({kinds})" if kinds else "")
    line += f"; {stats.get('no_answer', 0)} without an answer"
    if stats.get("messages"):
        line += "; first: " + " | ".join(stats["messages"][:3])
    return line


def check_grader_health(stats: dict, max_failure_frac: float = 0.5, *, min_samples: int = 1) -> dict:
    """Raises :class:`GraderFailureError` when more than ``max_failure_frac`` of the samples failed.

    Failures are grader failures only (errors, timeouts, crashes, invalid values, errors the
    grader caught itself); completions without an answer are not failures.

    Args:
        stats: from :func:`score_batch` (or :func:`merge_stats` of several).
        max_failure_frac: the largest tolerated failed fraction (1.0: never raise).
        min_samples: batches smaller than this are not judged.

    Returns:
        ``stats``, for chaining.

    >>> check_grader_health({"num": 4, "failures": 3, "errors": 3, "messages": ["[0] error: KeyError: 'x'"]})
    Traceback (most recent call last):
    ...
    rollouts_jax.graders.pool.GraderFailureError: The grader failed on 3 of 4 samples (75% > max_failure_frac 50%): 3 errors. First messages: [0] error: KeyError: 'x'
    """
    n, failed = int(stats.get("num", 0)), int(stats.get("failures", 0))
    if n >= max(1, min_samples) and failed / n > max_failure_frac:
        kinds = ", ".join(f"{stats[k]} {k}" for k in ("errors", "timeouts", "crashes", "invalid", "caught")
                          if stats.get(k))
        raise GraderFailureError(
            f"The grader failed on {failed} of {n} samples ({failed / n:.0%} > max_failure_frac "
            f"{max_failure_frac:.0%}): {kinds}. First messages: " + " | ".join(stats.get("messages", [])[:5]))
    return stats
