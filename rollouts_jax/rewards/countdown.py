"""Countdown: reach a target with + - * / over given numbers, each used once. No ``eval``.

The expression is parsed by a small recursive-descent parser that knows only non-negative
integer literals, ``+ - * /``, unary minus and parentheses, and is evaluated with exact
rational arithmetic (:class:`fractions.Fraction`). There is no exponent operator, so ``**``
and ``^`` are syntax errors: nothing a completion writes can build a huge number. Literals are
checked against the given numbers before anything is evaluated.
"""
from __future__ import annotations

import collections
import fractions
import numbers as _numbers
import re
from typing import Optional, Sequence

from rollouts_jax.graders import common, pool
from rollouts_jax.rewards import extract

MAX_EXPRESSION_CHARS = 512
MAX_NESTING = 64
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(\S))?")
_OPERATOR_ALIASES = (("\\times", "*"), ("\\cdot", "*"), ("\u00d7", "*"), ("\u00b7", "*"),
                     ("\\div", "/"), ("\u00f7", "/"), ("\u2212", "-"), ("\u2013", "-"),
                     ("\\left", ""), ("\\right", ""), ("\\(", ""), ("\\)", ""),
                     ("\\[", ""), ("\\]", ""), ("$", ""))
_TRAILING_EXPR_RE = re.compile(r"[0-9+\-*/()=\s]*$")


class CountdownSyntaxError(ValueError):
    """The answer is not an expression of integers, + - * /, and parentheses."""


def parse_countdown_reference(reference) -> tuple[tuple[int, ...], int]:
    """Normalises a countdown reference: ``(numbers, target)`` or ``{"numbers"|"nums": .., "target": ..}``.

    Raises:
        ValueError: anything else, or non-integer numbers / target.

    >>> parse_countdown_reference({"nums": [3, 5], "target": 8})
    ((3, 5), 8)
    """
    if isinstance(reference, dict):
        nums = reference.get("numbers", reference.get("nums"))
        target = reference.get("target")
    elif isinstance(reference, (tuple, list)) and len(reference) == 2:
        nums, target = reference
    else:
        raise ValueError("countdown reference must be (numbers, target) or a dict with "
                         f"'numbers' (or 'nums') and 'target', got {reference!r}")
    if nums is None or target is None:
        raise ValueError(f"countdown reference lacks numbers or target: {reference!r}")
    try:
        nums = list(nums)
    except TypeError as e:
        raise ValueError(f"countdown numbers must be a sequence of ints, got {nums!r}") from e
    if not nums or not all(_is_int(n) for n in nums) or not _is_int(target):
        raise ValueError(f"countdown numbers and target must be integers, got {nums!r}, {target!r}")
    return tuple(int(n) for n in nums), int(target)


def _is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, _numbers.Integral):
        return True
    return isinstance(x, float) and x.is_integer()


def _tokenize(text: str) -> list:
    tokens = []
    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        num, op = m.groups()
        if num is not None:
            tokens.append(int(num))
        elif op is not None:
            if op not in "+-*/()":
                raise CountdownSyntaxError(f"unexpected character {op!r}")
            tokens.append(op)
        pos = m.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*;
    unary := '-' unary | atom; atom := INT | '(' expr ')'."""

    def __init__(self, tokens):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        tok = self.peek()
        self.pos += 1
        return tok

    def enter(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise CountdownSyntaxError("expression nests too deeply")

    def expr(self):
        self.enter()
        node = self.term()
        while self.peek() in ("+", "-"):
            node = (self.take(), node, self.term())
        self.depth -= 1
        return node

    def term(self):
        node = self.unary()
        while self.peek() in ("*", "/"):
            node = (self.take(), node, self.unary())
        return node

    def unary(self):
        if self.peek() == "-":
            self.take()
            self.enter()
            node = ("neg", self.unary())
            self.depth -= 1
            return node
        return self.atom()

    def atom(self):
        tok = self.take()
        if isinstance(tok, int):
            return tok
        if tok == "(":
            node = self.expr()
            if self.take() != ")":
                raise CountdownSyntaxError("unbalanced parentheses")
            return node
        raise CountdownSyntaxError(f"expected a number or '(', got {tok!r}")


def parse_expression(text: str):
    """Parses a countdown expression into a tree of ints and ``(op, left, right)`` / ``("neg", x)``.

    Raises:
        CountdownSyntaxError: empty, too long (> ``MAX_EXPRESSION_CHARS``), nested deeper than
            ``MAX_NESTING``, or anything outside integers, ``+ - * /`` and parentheses
            (``**``, ``^``, decimals and names included).

    >>> parse_expression("(3 + 5) * 2")
    ('*', ('+', 3, 5), 2)
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CountdownSyntaxError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokenize(text)
    if not tokens:
        raise CountdownSyntaxError("empty expression")
    parser = _Parser(tokens)
    tree = parser.expr()
    if parser.pos != len(tokens):
        raise CountdownSyntaxError(f"unexpected {tokens[parser.pos]!r} after the expression")
    return tree


def expression_literals(tree) -> list[int]:
    """The integer literals of a parsed expression, left to right."""
    if isinstance(tree, int):
        return [tree]
    return [n for child in tree[1:] for n in expression_literals(child)]


def evaluate_expression(tree) -> fractions.Fraction:
    """Exact value of a parsed expression. Raises ZeroDivisionError on division by zero."""
    if isinstance(tree, int):
        return fractions.Fraction(tree)
    if tree[0] == "neg":
        return -evaluate_expression(tree[1])
    op, a, b = tree[0], evaluate_expression(tree[1]), evaluate_expression(tree[2])
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def extract_countdown_answer(completion: str) -> Optional[str]:
    """The expression a completion proposes, or None.

    With ``<answer>...</answer>`` tags: the content of the last one (TinyZero's template).
    Without: the last line holding a digit, reduced to its trailing run of expression
    characters (so ``"So the answer is (3 + 5) * 2."`` gives ``"(3 + 5) * 2"``). LaTeX
    delimiters and ``\\times``/``\\div``/``×``/``÷``/``−`` are mapped to plain operators; a
    ``\\boxed{}`` inside the chosen text is unwrapped.

    >>> extract_countdown_answer("<think>..</think> <answer> (3 + 5) * 2 </answer>")
    '(3 + 5) * 2'
    """
    tag = extract.find_answer_tag(completion)
    if tag is not None:
        text = tag
    else:
        lines = [ln for ln in completion.splitlines() if any(c.isdigit() for c in ln)]
        if not lines:
            return None
        text = lines[-1]
    boxed = extract.find_boxed(text)
    if boxed is not None:
        text = boxed
    for bad, good in _OPERATOR_ALIASES:
        text = text.replace(bad, good)
    text = text.strip().rstrip(".").strip()
    if tag is None:
        text = _TRAILING_EXPR_RE.search(text).group(0).strip()
    return text or None


@pool.mark_inline_safe  # pure Python over bounded text: may run in the training process
def countdown_reward(completion: str, reference, *, use_all: bool = True,
                     timeout_s: float | None = 2.0) -> float:
    """1.0 when the proposed expression uses the given numbers correctly and equals the target.

    Rules: the answer (see :func:`extract_countdown_answer`) is an expression, optionally
    followed by ``= <integer>`` parts that must all equal the target (``"(3+5)*2 = 16"``). Each
    literal must be one of the given numbers, each given number is used at most once, and with
    ``use_all`` (the default, as in TinyZero) every given number exactly once. The exact
    rational value must equal the target. Division by zero, an unknown or reused number, or a
    wrong value scores 0; a missing or unparsable answer scores 0 and counts as
    ``countdown/no_answer`` or ``countdown/parse_error``.

    Args:
        completion: the model's text.
        reference: ``(numbers, target)`` or ``{"numbers" | "nums": [...], "target": t}``.
        use_all: require every number to be used (else: at most once each).
        timeout_s: per-call limit (``SIGALRM``, main thread only); the parser is linear and the
            values are bounded, so it is a backstop.

    Returns:
        0.0 or 1.0.

    Raises:
        ValueError: a malformed reference.

    Reference: the Countdown task of TinyZero (Pan et al., 2025) / Stream-of-Search
    (Gandhi et al., 2024).

    >>> countdown_reward("<answer>(3 + 5) * 2</answer>", ([2, 3, 5], 16))
    1.0
    >>> countdown_reward("<answer>(3 + 5) * 2 * 2</answer>", ([2, 3, 5], 32))  # 2 used twice
    0.0
    """
    nums, target = parse_countdown_reference(reference)
    try:
        with common.time_limit(timeout_s):
            return _grade(str(completion), nums, target, use_all)
    except common.GraderTimeout:
        common.record_failure("countdown/timeout")
        return 0.0


def check_expression(answer: str, numbers: Sequence[int], target: int, *, use_all: bool = True) -> bool:
    """Whether a bare countdown answer (no tags) is correct: the rule :func:`countdown_reward` grades by.

    Args:
        answer: an expression, optionally followed by ``= <integer>`` parts that must all
            equal the target (``"(3+5)*2 = 16"``).
        numbers: the given numbers; each literal must be one of them, used at most as often
            as given (with ``use_all``: exactly as often).
        target: the value to reach (exact rational arithmetic; division by zero is wrong).
        use_all: require every number to be used.

    Returns:
        True or False (malformed text is False).

    >>> check_expression("(3 + 5) * 2", [2, 3, 5], 16), check_expression("3 * 5", [2, 3, 5], 15)
    (True, False)
    """
    try:
        return _check(answer, tuple(int(n) for n in numbers), int(target), use_all)
    except CountdownSyntaxError:
        return False


def _check(answer: str, nums: Sequence[int], target: int, use_all: bool) -> bool:
    """:func:`check_expression`, raising :class:`CountdownSyntaxError` on text it cannot parse."""
    expr, *claims = answer.split("=")
    tree = parse_expression(expr)
    claimed = [parse_expression(c) for c in claims]
    if any(not isinstance(c, int) or c != target for c in claimed):
        return False
    used = collections.Counter(expression_literals(tree))
    given = collections.Counter(nums)
    if any(used[n] > given[n] for n in used):
        return False  # an unknown number, or one used more often than given
    if use_all and used != given:
        return False
    try:
        value = evaluate_expression(tree)
    except ZeroDivisionError:
        return False
    return value == target


def _grade(completion: str, nums: Sequence[int], target: int, use_all: bool) -> float:
    answer = extract_countdown_answer(completion)
    if answer is None:
        common.record_failure("countdown/no_answer")
        return 0.0
    try:
        return float(_check(answer, nums, target, use_all))
    except CountdownSyntaxError:
        common.record_failure("countdown/parse_error")
        return 0.0
