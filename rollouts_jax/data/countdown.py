"""Countdown: reach a target from a few numbers with + - * /.

An example is ``{"numbers": [int, ...], "target": int, "solution": str, "difficulty": int}``.
Every instance is solvable: the target is the value of a random expression over the
numbers, and that expression is the ``solution`` (written without spaces, minimal
parentheses, e.g. ``"(12+7)*3"``). The solution uses every number exactly once and all of
its intermediate values are non-negative integers (divisions are exact).

The model's answer is the expression inside ``<answer>...</answer>`` (see
:mod:`rollouts_jax.data.formatting`); :func:`check_solution` is the exact checker, the
countdown reward's own rule (:mod:`rollouts_jax.rewards.countdown`).

Difficulty levels (:data:`COUNTDOWN_LEVELS`):

====  =======  ===========  =======  ==========
lvl   numbers  each in      ops      target in
====  =======  ===========  =======  ==========
1     3        1..10        + - *    1..100
2     3        1..99        + - * /  1..100
3     4        1..99        + - * /  1..100
====  =======  ===========  =======  ==========

Generation is pure Python seeded by strings (``random.Random`` with string seeds hashes them
with SHA-512), so the same seed gives the same examples on every platform and version.

>>> ex = generate_countdown(seed=0, split="train", num_examples=2, difficulty=1)[0]
>>> check_solution(ex["solution"], ex["numbers"], ex["target"])
True
"""

from __future__ import annotations

import dataclasses
import fractions
import random
from typing import Collection, Sequence

# The one countdown evaluator is the reward's; the data module generates instances and reuses it.
from rollouts_jax.rewards import countdown as _grader

__all__ = ["CountdownLevel", "COUNTDOWN_LEVELS", "generate_countdown", "evaluate_expression",
           "check_solution", "countdown_key"]


@dataclasses.dataclass(frozen=True)
class CountdownLevel:
  """One difficulty level: how many numbers, their range, the operators, the target range."""
  num_numbers: int
  max_number: int
  ops: str
  max_target: int


COUNTDOWN_LEVELS = {
    1: CountdownLevel(num_numbers=3, max_number=10, ops="+-*", max_target=100),
    2: CountdownLevel(num_numbers=3, max_number=99, ops="+-*/", max_target=100),
    3: CountdownLevel(num_numbers=4, max_number=99, ops="+-*/", max_target=100),
}

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclasses.dataclass(frozen=True)
class _Node:
  value: int
  text: str
  op: str | None  # None for a number


def _combine(left: _Node, right: _Node, op: str) -> _Node | None:
  """left op right, or None when the step leaves the non-negative integers."""
  if op == "+":
    value = left.value + right.value
  elif op == "-":
    value = left.value - right.value
  elif op == "*":
    value = left.value * right.value
  else:
    if right.value == 0 or left.value % right.value:
      return None
    value = left.value // right.value
  if value < 0:
    return None
  prec = _PRECEDENCE[op]

  def wrap(node, is_right):
    if node.op is None:
      return node.text
    p = _PRECEDENCE[node.op]
    if p < prec or (is_right and p == prec and op in "-/"):
      return f"({node.text})"
    return node.text

  return _Node(value, f"{wrap(left, False)}{op}{wrap(right, True)}", op)


def _random_expression(rng: random.Random, numbers: Sequence[int], ops: str) -> _Node | None:
  """A random binary expression tree using each number once (None if a step failed)."""
  nodes = [_Node(n, str(n), None) for n in numbers]
  while len(nodes) > 1:
    i, j = rng.sample(range(len(nodes)), 2)
    node = _combine(nodes[i], nodes[j], rng.choice(ops))
    if node is None:
      return None
    nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
  return nodes[0]


def countdown_key(example: dict) -> tuple:
  """Identity of an instance for de-duplication: (sorted numbers, target)."""
  return tuple(sorted(example["numbers"])), int(example["target"])


def generate_countdown(seed: int, split: str, num_examples: int, difficulty: int = 2,
                       exclude: Collection[tuple] = (), max_attempts_per_example: int = 10_000,
                       ) -> list[dict]:
  """Generates distinct, solvable countdown instances.

  Args:
    seed: the dataset seed.
    split: split name, mixed into the seed so splits differ (``"train"``, ``"test"``).
    num_examples: how many instances.
    difficulty: a key of :data:`COUNTDOWN_LEVELS`.
    exclude: keys (:func:`countdown_key`) to avoid, e.g. the test split's when making train.
    max_attempts_per_example: give up (``ValueError``) after this many failed draws in a row.

  Returns:
    A list of ``{"numbers", "target", "solution", "difficulty"}`` dicts, no two with the same
    key and none whose key is in ``exclude``.

  >>> [ex["numbers"] for ex in generate_countdown(0, "test", 2, difficulty=3)] == [
  ...     ex["numbers"] for ex in generate_countdown(0, "test", 2, difficulty=3)]
  True
  """
  if difficulty not in COUNTDOWN_LEVELS:
    raise ValueError(f"countdown difficulty must be one of {sorted(COUNTDOWN_LEVELS)}, "
                     f"got {difficulty}")
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  level = COUNTDOWN_LEVELS[difficulty]
  rng = random.Random(f"countdown/{difficulty}/{seed}/{split}")
  seen = set(exclude)
  out: list[dict] = []
  failures = 0
  while len(out) < num_examples:
    numbers = [rng.randint(1, level.max_number) for _ in range(level.num_numbers)]
    node = _random_expression(rng, numbers, level.ops)
    example = None
    if node is not None and 1 <= node.value <= level.max_target:
      example = {"numbers": numbers, "target": node.value, "solution": node.text,
                 "difficulty": difficulty}
      if countdown_key(example) in seen:
        example = None
    if example is None:
      failures += 1
      if failures > max_attempts_per_example:
        raise ValueError(f"could not draw {num_examples} distinct countdown instances at "
                         f"difficulty {difficulty} (got {len(out)}); ask for fewer")
      continue
    failures = 0
    seen.add(countdown_key(example))
    out.append(example)
  return out


def evaluate_expression(expr: str) -> fractions.Fraction:
  """Exactly evaluates an arithmetic expression of integers, + - * / and parentheses.

  The parser is the reward's (:func:`rollouts_jax.rewards.countdown.parse_expression`): one
  grammar for the data and the grader.

  Args:
    expr: e.g. ``"(12+7)*3"``. Unary minus is allowed; nothing else (no names, calls, powers).

  Returns:
    The value as a ``Fraction``.

  Raises:
    ValueError: the text is not such an expression, or divides by zero.

  >>> evaluate_expression("(12+7)*3/2")
  Fraction(57, 2)
  """
  tree = _grader.parse_expression(expr)  # CountdownSyntaxError is a ValueError
  try:
    return _grader.evaluate_expression(tree)
  except ZeroDivisionError as e:
    raise ValueError(f"division by zero in {expr!r}") from e


def check_solution(expr: str, numbers: Sequence[int], target: int) -> bool:
  """True when ``expr`` uses each of ``numbers`` exactly once and equals ``target``.

  The countdown reward's rule on a bare answer
  (:func:`rollouts_jax.rewards.countdown.check_expression` with ``use_all=True``), so a
  generated solution is exactly what the reward accepts: binary and unary + - * /,
  parentheses, exact division, an optional ``= target`` tail.

  Args:
    expr: the proposed expression.
    numbers: the available numbers.
    target: the value to reach.

  Returns:
    Whether the expression is a valid solution (malformed text gives ``False``).

  >>> check_solution("(12+7)*3", [3, 12, 7], 57), check_solution("12*3", [3, 12, 7], 36)
  (True, False)
  """
  return _grader.check_expression(expr, numbers, target, use_all=True)
