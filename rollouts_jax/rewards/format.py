"""Format rewards: does the completion follow the answer template, whatever the answer."""
from __future__ import annotations

import re

from rollouts_jax.graders import common, pool
from rollouts_jax.rewards import extract

FORMAT_STYLES = ("think_answer", "answer_tag", "boxed")
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_THINK_ANSWER_RE = re.compile(
    r"\s*(?:<think>)?(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_ANSWER_TAIL_RE = re.compile(r".*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)


@pool.mark_inline_safe  # pure Python over bounded text: may run in the training process
def format_reward(completion: str, reference=None, *, style: str = "think_answer",
                  timeout_s: float | None = 2.0) -> float:
    """1.0 when the completion follows the template ``style``, else 0.0. ``reference`` is ignored.

    Styles:
      * ``"think_answer"`` (DeepSeek-R1 / TinyZero): ``<think>...</think>`` then
        ``<answer>...</answer>`` and nothing else but whitespace; the opening ``<think>`` may sit
        in the prompt and is optional; each tag appears once and both parts are non-empty.
      * ``"answer_tag"``: exactly one non-empty ``<answer>...</answer>`` block, and only
        whitespace after it.
      * ``"boxed"``: at least one complete, non-empty ``\\boxed{...}``.

    Args:
        completion: the model's text.
        reference: unused; accepted so every reward has the signature ``(completion, reference)``.
        style: one of :data:`FORMAT_STYLES`.
        timeout_s: per-call limit (``SIGALRM``, main thread only).

    Returns:
        0.0 or 1.0.

    Raises:
        ValueError: unknown ``style``.

    Reference: the format reward of DeepSeek-R1 (DeepSeek-AI, 2025), as in TinyZero / Open-R1.

    >>> format_reward("<think> 3+5=8 </think>\\n<answer> 8 </answer>")
    1.0
    >>> format_reward("<answer>8</answer> and more"), format_reward("x \\\\boxed{8}", style="boxed")
    (0.0, 1.0)
    """
    if style not in FORMAT_STYLES:
        raise ValueError(f"unknown format style {style!r}; expected one of {FORMAT_STYLES}")
    text = str(completion)
    try:
        with common.time_limit(timeout_s):
            return float(_check(text, style))
    except common.GraderTimeout:
        common.record_failure("format/timeout")
        return 0.0


def _check(text: str, style: str) -> bool:
    if style == "boxed":
        box = extract.find_boxed(text)
        return bool(box)
    counts = {tag: text.count(tag) for tag in _TAGS}
    if counts["<answer>"] != 1 or counts["</answer>"] != 1:
        return False
    if style == "answer_tag":
        m = _ANSWER_TAIL_RE.fullmatch(text)
        return bool(m and m.group("answer").strip())
    if counts["</think>"] != 1 or counts["<think>"] > 1:
        return False
    if counts["<think>"] == 1 and not text.lstrip().startswith("<think>"):
        return False
    m = _THINK_ANSWER_RE.fullmatch(text)
    return bool(m and m.group("think").strip() and m.group("answer").strip())
