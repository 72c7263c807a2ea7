"""GSM8K: the final number of the completion against the reference's ``#### N``."""
from __future__ import annotations

import fractions
from typing import Optional

from rollouts_jax.graders import common, pool
from rollouts_jax.rewards import extract

_ANSWER_HINTS = ("answer is", "answer:", "answer =")


def gsm8k_reference_number(reference) -> fractions.Fraction:
    """The gold number of a GSM8K reference: a full solution ending ``#### N`` or the number itself.

    Raises:
        ValueError: no number can be read from the reference.

    >>> gsm8k_reference_number("9 * 2 = <<9*2=18>>18\\n#### 1,018")
    Fraction(1018, 1)
    """
    if isinstance(reference, str) and "####" in reference:
        tail = extract.find_hash_answer(reference)
        value = extract.parse_number(tail) if tail is not None else None
    else:
        value = extract.parse_number(reference)
    if value is None:
        raise ValueError(f"GSM8K reference holds no number after '####': {reference!r}")
    return value


def gsm8k_answer(completion: str) -> Optional[fractions.Fraction]:
    """The number a completion commits to, or None.

    The first rule that finds a number wins: the text after the last ``####``; the last
    ``\\boxed{}``; the last ``<answer>`` block; the first number after the last "answer is" /
    "answer:"; the last number anywhere. Within a span the last number counts, with thousands
    separators, ``$`` and a trailing period ignored, compared exactly as a fraction
    (``18.00`` equals ``18``).

    >>> gsm8k_answer("She makes 9 * 2 = $18.\\nThe answer is $1,018.00."), gsm8k_answer("no idea")
    (Fraction(1018, 1), None)
    """
    spans = [extract.find_hash_answer(completion), extract.find_boxed(completion),
             extract.find_answer_tag(completion)]
    low = completion.lower()
    hint = max(low.rfind(h) for h in _ANSWER_HINTS)
    if hint != -1:
        line = completion[hint:].split("\n", 1)[0]
        numbers = extract.find_numbers(line)
        spans.append(numbers[0] if numbers else None)
    spans.append(completion)
    for span in spans:
        if span is None:
            continue
        num = extract.find_last_number(span)
        if num is not None:
            return extract.parse_number(num)
    return None


@pool.mark_inline_safe  # pure Python over bounded text: may run in the training process
def gsm8k_reward(completion: str, reference, *, timeout_s: float | None = 2.0) -> float:
    """1.0 when the completion's final number equals the GSM8K reference's, else 0.0.

    Args:
        completion: the model's text.
        reference: a GSM8K ``answer`` field (ending ``#### N``) or the number (str, int, float).
        timeout_s: per-call limit (``SIGALRM``, main thread only); a timeout scores 0 and is counted.

    Returns:
        0.0 or 1.0. No number in the completion scores 0 and counts as ``gsm8k/no_answer``.

    Raises:
        ValueError: the reference holds no number.

    Reference: GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems").

    >>> gsm8k_reward("2 + 1 = 3 bolts.\\n#### 3", "It takes 2/2=<<2/2=1>>1 ...\\n#### 3")
    1.0
    >>> gsm8k_reward("The answer is 4.", 3)
    0.0
    """
    gold = gsm8k_reference_number(reference)
    try:
        with common.time_limit(timeout_s):
            pred = gsm8k_answer(str(completion))
    except common.GraderTimeout:
        common.record_failure("gsm8k/timeout")
        return 0.0
    if pred is None:
        common.record_failure("gsm8k/no_answer")
        return 0.0
    return float(pred == gold)
