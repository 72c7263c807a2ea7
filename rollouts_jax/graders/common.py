"""Shared plumbing for graders: a per-call time limit and process-local failure counters.

Graders never raise on model output: a malformed completion or a grader error scores 0 and
is counted here, under a ``"<grader>/<kind>"`` key, so that a training loop can log how often
its rewards are failing. :func:`rollouts_jax.rewards.score_batch` collects the counts from its
worker processes and returns them in its stats dict.
"""
from __future__ import annotations

import collections
import contextlib
import signal
import sys
import threading
import time

_FAILURES: collections.Counter = collections.Counter()
_MESSAGES: list = []
_MAX_MESSAGES = 20

#: Failure kinds that describe the model's output, not the grader: a completion without an
#: extractable answer (or with an unparseable one) is a normal 0, never a grader failure.
NO_ANSWER_KINDS = ("no_answer", "parse_error")
#: Failure kinds where the grader itself failed (it caught its own exception or time limit).
GRADER_FAILURE_KINDS = ("error", "timeout")


def kind_of(key: str) -> str:
    """``"math/no_answer"`` -> ``"no_answer"``."""
    return key.rsplit("/", 1)[-1]


class GraderTimeout(Exception):
    """Raised inside a grader when its per-call time limit runs out."""


def record_failure(key: str, message: str | None = None) -> None:
    """Counts one failure of kind ``key`` (e.g. ``"math/no_answer"``) in this process.

    For grader failures (kinds ``error`` and ``timeout``) a message is kept too: ``message``,
    else the exception being handled when this is called from an ``except`` block; see
    :func:`take_failure_messages`.
    """
    _FAILURES[key] += 1
    if kind_of(key) in GRADER_FAILURE_KINDS and len(_MESSAGES) < _MAX_MESSAGES:
        if message is None:
            exc = sys.exc_info()[1]
            message = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        _MESSAGES.append(f"{key}: {message}"[:500] if message else key)


def take_failure_messages() -> list[str]:
    """Returns and clears the messages of grader failures recorded in this process.

    >>> reset_failure_counts()
    >>> try:
    ...     1 / 0
    ... except ZeroDivisionError:
    ...     record_failure("demo/error")
    >>> take_failure_messages(), take_failure_messages()
    (['demo/error: ZeroDivisionError: division by zero'], [])
    """
    out = list(_MESSAGES)
    _MESSAGES.clear()
    return out


def failure_counts() -> dict[str, int]:
    """Returns a copy of this process's failure counters.

    Returns:
        A dict from ``"<grader>/<kind>"`` to the number of failures recorded since the last
        :func:`reset_failure_counts` (kinds: ``no_answer``, ``parse_error``, ``error``, ``timeout``).

    >>> reset_failure_counts(); record_failure("demo/error"); failure_counts()
    {'demo/error': 1}
    """
    return dict(_FAILURES)


def reset_failure_counts() -> None:
    """Clears this process's failure counters (and kept messages)."""
    _FAILURES.clear()
    _MESSAGES.clear()


def in_main_thread() -> bool:
    """True when signals (and so signal-based time limits) are usable here."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raises :class:`GraderTimeout` in the body after ``seconds`` of wall time.

    Uses ``SIGALRM`` with a float interval timer, so it works only in the main thread of a
    process; elsewhere (or with ``seconds`` None or <= 0) it is a no-op and the process pool's
    hard kill is the only bound. Nested limits keep the earlier deadline and the outer timer is
    re-armed on exit. Code stuck inside one long C call (a huge integer power, say) is not
    interrupted; the pool's kill covers that.

    Args:
        seconds: the limit in seconds.

    >>> with time_limit(1.0):
    ...   x = sum(range(10))
    """
    if seconds is None or seconds <= 0 or not in_main_thread():
        yield
        return

    def _handler(signum, frame):
        raise GraderTimeout(f"grader exceeded {seconds:g} s")

    outer_remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    old_handler = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    if outer_remaining > 0 and outer_remaining <= seconds:
        # The outer deadline comes first: leave its timer and handler alone.
        yield
        return
    signal.signal(signal.SIGALRM, _handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if outer_remaining > 0:
            left = outer_remaining - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
