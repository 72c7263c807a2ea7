"""Arithmetic (and any task whose answer is one number in ``<answer>`` tags): exact match."""
from __future__ import annotations

from rollouts_jax.graders import common, pool
from rollouts_jax.rewards import extract


@pool.mark_inline_safe  # pure Python over bounded text: may run in the training process
def arithmetic_reward(completion: str, reference, *, timeout_s: float | None = 2.0) -> float:
    """1.0 when the last ``<answer>...</answer>`` holds exactly the reference number, else 0.0.

    The tag content must be one number (``936``, ``-12``, ``1,000``, ``2.50``, ``3/4``);
    values are compared exactly as fractions, so ``936.0`` equals ``936`` but ``935.9999`` does
    not. There is no fallback to numbers outside the tags: the task's template asks for them.
    No tag, or a tag that is not a number, scores 0 and counts as ``arithmetic/no_answer``.

    Args:
        completion: the model's text.
        reference: the answer (str, int or float).
        timeout_s: per-call limit (``SIGALRM``, main thread only).

    Returns:
        0.0 or 1.0.

    Raises:
        ValueError: the reference is not a number.

    >>> arithmetic_reward("7+9=16, carry 1 ... <answer>936</answer>", "936")
    1.0
    >>> arithmetic_reward("<answer>936</answer> or maybe <answer>935</answer>", 936)
    0.0
    """
    gold = extract.parse_number(reference)
    if gold is None:
        raise ValueError(f"arithmetic reference is not a number: {reference!r}")
    try:
        with common.time_limit(timeout_s):
            tag = extract.find_answer_tag(str(completion))
            value = None if tag is None else extract.parse_number(tag)
    except common.GraderTimeout:
        common.record_failure("arithmetic/timeout")
        return 0.0
    if value is None:
        common.record_failure("arithmetic/no_answer")
        return 0.0
    return float(value == gold)
