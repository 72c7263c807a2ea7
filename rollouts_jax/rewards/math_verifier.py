"""MATH-style answer checking on top of Hugging Face's ``math-verify``.

The verdict is exactly ``math_verify.verify(parse(gold), parse(completion))`` with the
library's default extraction (LaTeX, then plain expressions; ``\\boxed{}`` and "final answer
is" anchors; the rightmost match wins) and default comparison (numeric to 6 decimals, symbolic
simplification, sets, intervals, matrices, units and ``\\text{}`` stripped). We add only:

* the reference is wrapped as ``$...$`` (MATH-500 answers are bare LaTeX) unless it already
  holds ``$`` or ``\\boxed``; it is parsed once and cached;
* the completion is touched up first (:func:`prepare_completion`): ``°`` -> ``^{\\circ}`` and
  ``−`` -> ``-``, which math-verify misses, and a sentence-ending period right after a digit
  is dropped (math-verify reads "is 14/3." as 14/3.0 and then rejects it against 14/3);
* exceptions and timeouts are caught per comparison exactly as math-verify does by default
  (an error in one (gold, prediction) pair makes that pair false) but counted, under
  ``math/no_answer``, ``math/timeout`` and ``math/error``, instead of only logged.
"""
from __future__ import annotations

import functools
import math
import re

try:  # the GPU benchmark image lacks math-verify; the package must still import there
  import math_verify
  from math_verify.errors import TimeoutException
except ImportError:  # pragma: no cover - exercised by tests/experiments/test_bench_gpu.py
  math_verify = None

  class TimeoutException(Exception):
    """Stand-in: never raised when math-verify is missing (its graders then fail on use)."""

from rollouts_jax.graders import common

_UNICODE_FIXES = (("\u00b0", "^{\\circ}"), ("\u2212", "-"))
_DELIMITED_RE = re.compile(r"(?<!\\)\$|\\boxed|\\\(|\\\[")
_NUMBER_FULL_STOP_RE = re.compile(r"(?<=\d)\.(?=\s|$)")


def _signal_timeout(timeout_s: float | None) -> int | None:
    """math-verify's timeouts use ``signal.alarm`` (whole seconds, main thread only)."""
    if timeout_s is None or timeout_s <= 0 or not common.in_main_thread():
        return None
    return max(1, int(math.ceil(timeout_s)))


def wrap_reference(reference) -> str:
    """The string math-verify parses for a reference answer (``$...$`` unless already delimited).

    Already delimited means: an unescaped ``$``, ``\\boxed``, ``\\(`` or ``\\[``.

    Raises:
        ValueError: None or an empty reference.

    >>> wrap_reference(r"\\frac{14}{3}"), wrap_reference(27.0)
    ('$\\\\frac{14}{3}$', '$27.0$')
    """
    if reference is None or isinstance(reference, bool):
        raise ValueError(f"math reference answer must be a non-empty string or number, got {reference!r}")
    ref = str(reference).strip()
    if not ref:
        raise ValueError("math reference answer is empty")
    if _DELIMITED_RE.search(ref):
        return ref
    return f"${ref}$"


@functools.lru_cache(maxsize=4096)
def _parse_reference(wrapped: str, timeout: int | None) -> tuple:
    return tuple(math_verify.parse(wrapped, parsing_timeout=timeout, raise_on_error=True))


def parse_reference(reference, *, timeout_s: float | None = 5.0) -> tuple:
    """Parses (and caches) a reference answer with math-verify; returns its extractions.

    Raises:
        ValueError: an empty reference, or one math-verify finds no answer in.
    """
    wrapped = wrap_reference(reference)
    gold = _parse_reference(wrapped, _signal_timeout(timeout_s))
    if not gold:
        raise ValueError(f"math-verify extracts no answer from the reference {reference!r}")
    return gold


def prepare_completion(completion: str) -> str:
    """The completion as math-verify sees it: ``°``, ``−`` rewritten, "14/3." -> "14/3".

    >>> prepare_completion("The angle is 90°. The answer is 14/3.")
    'The angle is 90^{\\\\circ}. The answer is 14/3'
    """
    text = str(completion)
    for bad, good in _UNICODE_FIXES:
        text = text.replace(bad, good)
    return _NUMBER_FULL_STOP_RE.sub("", text)


def parse_completion(completion: str, *, timeout_s: float | None = 5.0) -> list:
    """math-verify's extractions from a completion ([] when none); errors count as failures."""
    text = prepare_completion(completion)
    try:
        return math_verify.parse(text, parsing_timeout=_signal_timeout(timeout_s), raise_on_error=True)
    except TimeoutException:
        common.record_failure("math/timeout")
    except Exception:  # noqa: BLE001 - math-verify's own default turns these into [].
        common.record_failure("math/error")
    return []


def math_reward(completion: str, reference, *, timeout_s: float | None = 5.0) -> float:
    """1.0 when math-verify judges the completion's final answer equal to the reference, else 0.0.

    Accepts LaTeX and plain answers (``\\frac{14}{3}``, ``14/3``, ``\\dfrac{14}{3}``,
    ``4.666667``), ``\\boxed{}`` or "The final answer is ..." anchors, ``\\text{}`` units,
    degrees, thousands separators and ``x = 5`` for ``5``. A completion without an extractable
    answer, a timeout or a grader exception scores 0 and is counted
    (see :func:`rollouts_jax.rewards.failure_counts`).

    Args:
        completion: the model's text.
        reference: the gold answer, bare LaTeX (``"\\frac{14}{3}"``) or a number.
        timeout_s: per-step limit for math-verify's parsing and each comparison (``signal.alarm``,
            rounded up to whole seconds; active only in a process's main thread). The process
            pool in :func:`rollouts_jax.rewards.score_batch` adds a hard limit around the call.

    Returns:
        0.0 or 1.0.

    Raises:
        ValueError: the reference is empty or holds no answer.

    Reference: math-verify (Hugging Face, github.com/huggingface/Math-Verify), the grader of
    Open-R1; MATH (Hendrycks et al., 2021) and its MATH-500 split (Lightman et al., 2023).

    >>> math_reward(r"so the answer is $\\boxed{\\dfrac{14}{3}}$", r"\\frac{14}{3}")
    1.0
    >>> math_reward("The final answer is 14/3.", r"\\frac{14}{3}"), math_reward(r"\\boxed{3/14}", r"\\frac{14}{3}")
    (1.0, 0.0)
    """
    wrapped = wrap_reference(reference)
    timeout = _signal_timeout(timeout_s)
    try:
        gold = _parse_reference(wrapped, timeout)
    except TimeoutException:
        common.record_failure("math/timeout")
        return 0.0
    except Exception:  # noqa: BLE001 - a grader error scores 0 and is counted.
        common.record_failure("math/error")
        return 0.0
    if not gold:
        raise ValueError(f"math-verify extracts no answer from the reference {reference!r}")
    pred = parse_completion(completion, timeout_s=timeout_s)
    if not pred:
        common.record_failure("math/no_answer")
        return 0.0
    for g in gold:
        for p in pred:
            try:
                if math_verify.verify(g, p, timeout_seconds=timeout, raise_on_error=True):
                    return 1.0
            except TimeoutException:
                common.record_failure("math/timeout")
            except Exception:  # noqa: BLE001 - the pair counts as unequal, as in math-verify.
                common.record_failure("math/error")
    return 0.0


def math_equal(answer_a: str, answer_b: str, *, timeout_s: float | None = 5.0) -> bool:
    """Whether two bare answers are equivalent for math-verify (``a`` is treated as the gold).

    Use it with :func:`rollouts_jax.rewards.canonicalize_answers` to merge equivalent answers
    (``1/2`` and ``0.5``) before majority voting.

    >>> math_equal("1/2", "0.5"), math_equal(r"\\frac{1}{2}", "0.4")
    (True, False)
    """
    if not str(answer_a).strip() or not str(answer_b).strip():
        return False
    try:
        return math_reward(wrap_reference(answer_b), answer_a, timeout_s=timeout_s) == 1.0
    except ValueError:
        return False
