"""Multi-digit addition and multiplication with short worked solutions (SFT warm-start data).

An example is ``{"question": "What is 347 + 589?", "answer": "936", "solution": str,
"a": 347, "b": 589, "op": "+", "difficulty": 3}``; ``difficulty`` is the largest operand
length in digits. The solution has no spaces, one step a line, and always ends with the
final answer line ``<answer>N</answer>``.

Addition works column by column from the units, each line ``x+y+c=s`` with the two digits
of the column (a missing digit is 0) and the carry ``c`` coming in; the answer is the last
line's ``s`` followed by the units digits of the earlier lines, read upwards::

  7+9+0=16
  4+8+1=13
  3+5+1=9
  <answer>936</answer>

Multiplication writes one partial product per non-zero digit of ``b`` (units first, the
digit carrying its place value), then adds them up one at a time::

  347*9=3123
  347*80=27760
  347*500=173500
  3123+27760=30883
  30883+173500=204383
  <answer>204383</answer>

A single-digit (or zero) ``b`` gives one product line. The format is kept small and regular
so a 1-3M parameter model with a character-level tokenizer learns it in minutes on a CPU.

>>> print(worked_solution(47, "+", 8))
7+8+0=15
4+0+1=5
<answer>55</answer>
"""

from __future__ import annotations

import random

__all__ = ["worked_solution", "generate_arithmetic", "arithmetic_key", "ARITHMETIC_OPS"]

ARITHMETIC_OPS = ("+", "*")


def _addition_steps(a: int, b: int) -> list[str]:
  da, db = str(a)[::-1], str(b)[::-1]
  lines, carry = [], 0
  for k in range(max(len(da), len(db))):
    x = int(da[k]) if k < len(da) else 0
    y = int(db[k]) if k < len(db) else 0
    s = x + y + carry
    lines.append(f"{x}+{y}+{carry}={s}")
    carry = s // 10
  return lines


def _multiplication_steps(a: int, b: int) -> list[str]:
  if b < 10:
    return [f"{a}*{b}={a * b}"]
  lines, partials = [], []
  for k, digit in enumerate(str(b)[::-1]):
    if digit == "0":
      continue
    factor = int(digit) * 10**k
    lines.append(f"{a}*{factor}={a * factor}")
    partials.append(a * factor)
  total = partials[0]
  for p in partials[1:]:
    lines.append(f"{total}+{p}={total + p}")
    total += p
  return lines


def worked_solution(a: int, op: str, b: int) -> str:
  """The worked solution of ``a op b`` (see the module docstring for the format).

  Args:
    a: non-negative integer.
    op: ``"+"`` or ``"*"``.
    b: non-negative integer.

  Returns:
    The steps, one a line, ending in ``<answer>{a op b}</answer>``.

  >>> worked_solution(12, "*", 34).splitlines()[-1]
  '<answer>408</answer>'
  """
  if a < 0 or b < 0:
    raise ValueError(f"operands must be non-negative, got {a} and {b}")
  if op == "+":
    lines, result = _addition_steps(a, b), a + b
  elif op == "*":
    lines, result = _multiplication_steps(a, b), a * b
  else:
    raise ValueError(f"op must be one of {ARITHMETIC_OPS}, got {op!r}")
  return "\n".join(lines + [f"<answer>{result}</answer>"])


def arithmetic_key(example: dict) -> tuple:
  """Identity of a problem for de-duplication: (a, op, b)."""
  return int(example["a"]), example["op"], int(example["b"])


def _operand_range(num_digits: int) -> tuple[int, int]:
  return (0 if num_digits == 1 else 10**(num_digits - 1)), 10**num_digits - 1


def generate_arithmetic(seed: int, split: str, num_examples: int, digits: int = 3,
                        min_digits: int = 1, ops: str = "+", exclude=()) -> list[dict]:
  """Generates distinct arithmetic problems with worked solutions.

  Each operand first draws its length uniformly in ``[min_digits, digits]``, then its value
  uniformly among numbers of that length, so short and long operands are equally common.

  Args:
    seed: the dataset seed.
    split: split name, mixed into the seed.
    num_examples: how many problems.
    digits: the largest operand length (the difficulty).
    min_digits: the smallest operand length.
    ops: the operators to draw from, a string over ``"+*"``.
    exclude: keys (:func:`arithmetic_key`) to avoid, e.g. the test split's.

  Returns:
    A list of example dicts (see the module docstring), distinct and not in ``exclude``.

  >>> ex = generate_arithmetic(0, "train", 1, digits=2)[0]
  >>> int(ex["answer"]) == ex["a"] + ex["b"]
  True
  """
  if not 1 <= min_digits <= digits:
    raise ValueError(f"need 1 <= min_digits <= digits, got min_digits={min_digits}, "
                     f"digits={digits}")
  if not ops or any(op not in ARITHMETIC_OPS for op in ops) or len(set(ops)) != len(ops):
    raise ValueError(f"ops must be distinct characters of {''.join(ARITHMETIC_OPS)!r}, "
                     f"got {ops!r}")
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  lo, hi = _operand_range(min_digits)[0], _operand_range(digits)[1]
  seen = set(exclude)
  available = (hi - lo + 1)**2 * len(ops) - sum(
      1 for k in seen if k[1] in ops and lo <= k[0] <= hi and lo <= k[2] <= hi)
  if num_examples > available:
    raise ValueError(f"only {available} distinct problems with {min_digits}-{digits} digit "
                     f"operands and ops {ops!r} are left; asked for {num_examples}")
  rng = random.Random(f"arithmetic/{ops}/{min_digits}-{digits}/{seed}/{split}")

  def operand():
    return rng.randint(*_operand_range(rng.randint(min_digits, digits)))

  out: list[dict] = []
  while len(out) < num_examples:
    a, op, b = operand(), rng.choice(ops), operand()
    if (a, op, b) in seen:
      continue
    seen.add((a, op, b))
    result = a + b if op == "+" else a * b
    out.append({"question": f"What is {a} {op} {b}?", "answer": str(result),
                "solution": worked_solution(a, op, b), "a": a, "b": b, "op": op,
                "difficulty": max(len(str(a)), len(str(b)))})
  return out
