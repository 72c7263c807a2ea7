"""Answer extraction and light normalisation, shared by verifiers, label-free rewards and selection.

Label-free rewards (TTRL, DARE, Co-Reward) and test-time selection (majority vote, BoM, Soft-SC)
bucket the N samples of a prompt by their extracted answer string. Those functions compare
strings exactly, so extract with :func:`extract_answer` (which normalises by default) first.
"""
from __future__ import annotations

import fractions
import re
from typing import Iterable, Optional

ANSWER_KINDS = ("boxed", "answer_tag", "hash", "gsm8k", "last_number", "auto")

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_TOKEN_RE = re.compile(r"[^\s$]+")
# A number: optional sign (a minus right after a word, digit or bracket is subtraction, not a
# sign), thousands groups only when they are complete, optional decimals.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}])[-\u2212])?"
    r"(?:(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d])|(?<![\w.])\d+)(?:\.\d+)?"
    r"|(?:(?<![\w)\]}])[-\u2212])?(?<![\w.])\.\d+")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")


def find_boxed(text: str) -> Optional[str]:
    """Returns the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces are matched, so nested groups survive (``\\boxed{\\frac{1}{2}}`` gives
    ``\\frac{1}{2}``). ``\\boxed 5`` (no braces) gives the next token. A box that is never
    closed is skipped. Linear time, however many unclosed boxes a degenerate completion holds.

    Args:
        text: a completion.

    Returns:
        The box content, stripped, or None when there is no complete box.

    >>> find_boxed(r"so $\\boxed{\\frac{1}{2}}$, not \\boxed{3")
    '\\\\frac{1}{2}'
    """
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    closing = None
    for i in reversed(starts):
        j = i
        while j < len(text) and text[j] == " ":
            j += 1
        if j >= len(text):
            continue
        if text[j] != "{":
            m = _BOX_TOKEN_RE.match(text, j)
            if m:
                return m.group(0)
            continue
        if closing is None:
            closing = _closing_braces(text)
        k = closing.get(j)
        if k is not None:
            return text[j + 1:k].strip()
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Maps the index of each ``{`` to that of its matching ``}`` (unmatched ones are absent)."""
    stack, match = [], {}
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            match[stack.pop()] = i
    return match


def find_answer_tag(text: str) -> Optional[str]:
    """Returns the stripped content of the last complete ``<answer>...</answer>``, or None.

    The block is the last closing tag and the nearest opening tag before it (tags are matched
    case-insensitively), found in linear time.

    >>> find_answer_tag("<think>2+2</think><answer> 4 </answer>")
    '4'
    """
    lower = text.lower()
    end = lower.rfind("</answer>")
    if end == -1:
        return None
    start = lower.rfind("<answer>", 0, end)
    if start == -1:
        return None
    return text[start + len("<answer>"):end].strip()


def find_hash_answer(text: str) -> Optional[str]:
    """Returns what follows the last ``####`` (GSM8K's answer marker) up to the line end.

    >>> find_hash_answer("9 * 2 = 18\\n#### 18")
    '18'
    """
    k = text.rfind("####")
    if k == -1:
        return None
    tail = text[k + 4:].split("\n", 1)[0].strip()
    return tail or None


def find_numbers(text: str) -> list[str]:
    """Returns every number in ``text`` in order, as written (commas and signs kept).

    A minus sign counts only where it cannot be subtraction, so ``"5-3"`` gives
    ``['5', '3']`` and ``"is -3"`` gives ``['-3']``.

    >>> find_numbers("Paid $1,200.50 and -3 then 5-2")
    ['1,200.50', '-3', '5', '2']
    """
    return [m.group(0) for m in _NUMBER_RE.finditer(text)]


def find_last_number(text: str) -> Optional[str]:
    """Returns the last number in ``text`` (see :func:`find_numbers`), or None."""
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m.group(0)
    return last


def parse_number(text) -> Optional[fractions.Fraction]:
    """Parses a plain number (``"1,000"``, ``"-2.50"``, ``"$18"``, ``"3/4"``, ``"12%"``) exactly.

    Dollar signs, a trailing period, surrounding spaces and a percent sign are dropped
    (``"12%"`` is 12). Ints and floats pass through (floats by their decimal repr).

    Returns:
        A :class:`fractions.Fraction`, or None when ``text`` is not one number.

    >>> parse_number("$1,000.50")
    Fraction(2001, 2)
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return fractions.Fraction(text)
    if isinstance(text, float):
        return fractions.Fraction(repr(text)) if text == text and abs(text) != float("inf") else None
    if not isinstance(text, str):
        return None
    s = text.strip().replace("\u2212", "-").replace("\\$", "").replace("$", "")
    s = s.replace("\\!", "").replace("\\,", "").replace(" ", "")
    s = s.rstrip(".").rstrip("%").replace("\\%", "")
    if not s:
        return None
    if "/" in s:
        num, _, den = s.partition("/")
        a, b = parse_number(num), parse_number(den)
        if a is None or b is None or b == 0 or "/" in den:
            return None
        return a / b
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    return fractions.Fraction(s.replace(",", ""))


def format_number(value: fractions.Fraction) -> str:
    """Canonical string of an exact number: ``18``, ``0.5``, ``-7/3`` (no trailing zeros).

    >>> format_number(fractions.Fraction(36, 2)), format_number(fractions.Fraction(1, 2))
    ('18', '0.5')
    """
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # a terminating decimal
        digits = 0
        scaled = value
        while scaled.denominator != 1:
            scaled *= 10
            digits += 1
        sign = "-" if scaled < 0 else ""
        s = str(abs(scaled.numerator)).rjust(digits + 1, "0")
        return f"{sign}{s[:-digits]}.{s[-digits:]}"
    return f"{value.numerator}/{value.denominator}"


_STRIP_TOKENS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "\\$")


def normalize_answer(answer: Optional[str]) -> Optional[str]:
    """Light, purely textual normalisation so that trivially different answers share a bucket.

    Removes spaces, ``$``, ``\\left``/``\\right``, thin spaces, ``\\displaystyle``, degree marks
    (``^\\circ``, ``°``) and a trailing period; maps ``\\dfrac``/``\\tfrac`` to ``\\frac``; unwraps
    an answer that is entirely ``\\text{...}``; writes plain numbers canonically (``1,000.0`` ->
    ``1000``, ``.50`` -> ``0.5``). It does not decide mathematical equivalence (``1/2`` and
    ``0.5`` stay apart; use :func:`rollouts_jax.rewards.canonicalize_answers` for that).

    Args:
        answer: an extracted answer or None.

    Returns:
        The normalised string, or None for None / an empty answer.

    >>> normalize_answer(r"\\$1,000.00"), normalize_answer(r"\\dfrac{1}{2} "), normalize_answer("90^\\circ")
    ('1000', '\\\\frac{1}{2}', '90')
    """
    if answer is None:
        return None
    s = str(answer).strip()
    for tok in ("^{\\circ}", "^\\circ", "\u00b0"):
        s = s.replace(tok, "")
    for tok in _STRIP_TOKENS:
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    m = re.fullmatch(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", s)
    if m:
        s = m.group(1).strip()
    if _PLAIN_NUMBER_RE.fullmatch(s):
        s = format_number(fractions.Fraction(s.replace(",", "")))
    return s or None


def extract_answer(text: Optional[str], kind: str = "auto", *, normalize: bool = True) -> Optional[str]:
    """Extracts the final answer of a completion as a string, for voting and bucketing.

    Kinds:
      * ``"boxed"``: content of the last ``\\boxed{}`` (MATH-style, as TTRL and Co-Reward use).
      * ``"answer_tag"``: content of the last ``<answer>...</answer>`` (R1 / countdown templates).
      * ``"hash"`` (alias ``"gsm8k"``): the number after the last ``####``.
      * ``"last_number"``: the last number anywhere in the text.
      * ``"auto"``: the first that exists of boxed, answer tag, ``####``, last number.

    Args:
        text: the completion (None gives None).
        kind: one of :data:`ANSWER_KINDS`.
        normalize: apply :func:`normalize_answer` (default True).

    Returns:
        The answer string, or None when the completion holds no answer of that kind.

    Raises:
        ValueError: unknown ``kind``.

    >>> extract_answer("... so $\\\\boxed{\\\\dfrac{1}{2}}$.", "boxed")
    '\\\\frac{1}{2}'
    >>> extract_answer("She pays 9 * 2 = $18.\\n#### 18", "gsm8k")
    '18'
    """
    if kind not in ANSWER_KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; expected one of {ANSWER_KINDS}")
    if text is None:
        return None
    if kind == "boxed":
        ans = find_boxed(text)
    elif kind == "answer_tag":
        ans = find_answer_tag(text)
    elif kind in ("hash", "gsm8k"):
        tail = find_hash_answer(text)
        ans = None if tail is None else find_last_number(tail)
    elif kind == "last_number":
        ans = find_last_number(text)
    else:
        ans = find_boxed(text)
        if ans is None:
            ans = find_answer_tag(text)
        if ans is None:
            tail = find_hash_answer(text)
            ans = None if tail is None else find_last_number(tail)
        if ans is None:
            ans = find_last_number(text)
    if ans is not None and normalize:
        ans = normalize_answer(ans)
    return ans or None


def extract_answers(texts: Iterable[Optional[str]], kind: str = "auto", *,
                    normalize: bool = True) -> list[Optional[str]]:
    """:func:`extract_answer` over a list (one prompt's N samples, say)."""
    return [extract_answer(t, kind, normalize=normalize) for t in texts]
