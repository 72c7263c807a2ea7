"""Countdown and arithmetic generators: validity, determinism, distinct splits, the format."""
import fractions
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax.data import arithmetic, countdown, formatting


@pytest.mark.parametrize("difficulty", sorted(countdown.COUNTDOWN_LEVELS))
def test_countdown_instances_are_solvable_and_in_range(difficulty):
  level = countdown.COUNTDOWN_LEVELS[difficulty]
  examples = countdown.generate_countdown(7, "train", 300, difficulty=difficulty)
  assert len(examples) == 300
  for ex in examples:
    assert len(ex["numbers"]) == level.num_numbers
    assert all(1 <= n <= level.max_number for n in ex["numbers"])
    assert 1 <= ex["target"] <= level.max_target
    assert countdown.check_solution(ex["solution"], ex["numbers"], ex["target"])
    assert set(re.sub(r"[0-9()]", "", ex["solution"])) <= set(level.ops)
    assert " " not in ex["solution"]
  assert len({countdown.countdown_key(e) for e in examples}) == len(examples)


def test_countdown_solution_steps_stay_non_negative_integers():
  # Re-evaluate every parenthesized sub-expression: all are integers >= 0.
  for ex in countdown.generate_countdown(1, "test", 200, difficulty=3):
    for sub in re.findall(r"\(([^()]*)\)", ex["solution"]):
      v = countdown.evaluate_expression(sub)
      assert v.denominator == 1 and v >= 0


def test_countdown_is_deterministic_and_seeded():
  a = countdown.generate_countdown(3, "train", 50, difficulty=2)
  b = countdown.generate_countdown(3, "train", 50, difficulty=2)
  c = countdown.generate_countdown(4, "train", 50, difficulty=2)
  d = countdown.generate_countdown(3, "test", 50, difficulty=2)
  assert a == b
  assert a != c and a != d
  # a prefix of a longer request is the shorter request
  assert countdown.generate_countdown(3, "train", 20, difficulty=2) == a[:20]


def test_countdown_exclude_and_errors():
  test = countdown.generate_countdown(0, "test", 50, difficulty=1)
  keys = {countdown.countdown_key(e) for e in test}
  train = countdown.generate_countdown(0, "train", 500, difficulty=1, exclude=keys)
  assert not keys & {countdown.countdown_key(e) for e in train}
  with pytest.raises(ValueError, match="difficulty"):
    countdown.generate_countdown(0, "train", 1, difficulty=9)
  with pytest.raises(ValueError, match="distinct"):
    countdown.generate_countdown(0, "train", 10**6, difficulty=1, max_attempts_per_example=50)


def test_evaluate_and_check_by_hand():
  assert countdown.evaluate_expression("(12+7)*3") == 57
  assert countdown.evaluate_expression("100/8") == fractions.Fraction(25, 2)
  assert countdown.check_solution("(12+7)*3", [7, 3, 12], 57)
  assert countdown.check_solution(" 12*3+7 ", [7, 3, 12], 43)
  assert not countdown.check_solution("12*3", [7, 3, 12], 36)            # 7 unused
  assert not countdown.check_solution("12*3+7+7", [7, 3, 12], 50)        # 7 twice
  assert not countdown.check_solution("(12+7)*3", [7, 3, 12], 58)        # wrong value
  assert countdown.check_solution("-3+12+7", [7, 3, 12], 16)             # unary minus, as the reward
  assert countdown.check_solution("(12+7)*3 = 57", [7, 3, 12], 57)       # a "= target" tail, as the reward
  assert not countdown.check_solution("12/(7-7)+3", [7, 7, 12, 3], 3)    # division by zero
  assert not countdown.check_solution("__import__('os')", [1], 1)
  assert not countdown.check_solution("2**3", [2, 3], 8)
  for bad in ["1 +", "a+1", "1.5+1", "f(1)"]:
    with pytest.raises(ValueError):
      countdown.evaluate_expression(bad)


def test_addition_solution_by_hand():
  assert arithmetic.worked_solution(347, "+", 589) == (
      "7+9+0=16\n4+8+1=13\n3+5+1=9\n<answer>936</answer>")
  assert arithmetic.worked_solution(5, "+", 995) == (
      "5+5+0=10\n0+9+1=10\n0+9+1=10\n<answer>1000</answer>")
  assert arithmetic.worked_solution(0, "+", 0) == "0+0+0=0\n<answer>0</answer>"


def test_multiplication_solution_by_hand():
  assert arithmetic.worked_solution(347, "*", 589) == (
      "347*9=3123\n347*80=27760\n347*500=173500\n3123+27760=30883\n30883+173500=204383\n"
      "<answer>204383</answer>")
  assert arithmetic.worked_solution(12, "*", 7) == "12*7=84\n<answer>84</answer>"
  assert arithmetic.worked_solution(12, "*", 305) == (
      "12*5=60\n12*300=3600\n60+3600=3660\n<answer>3660</answer>")


def _replay_addition(a, b, solution):
  """Checks every column line and rebuilds the answer from the lines alone."""
  lines = solution.splitlines()
  steps = [tuple(map(int, re.fullmatch(r"(\d)\+(\d)\+([01])=(\d+)", l).groups()))
           for l in lines[:-1]]
  carry = 0
  for k, (x, y, c, s) in enumerate(steps):
    assert x == (a // 10**k) % 10 and y == (b // 10**k) % 10 and c == carry and s == x + y + c
    carry = s // 10
  return str(steps[-1][3]) + "".join(str(s % 10) for *_, s in reversed(steps[:-1]))


def _replay_multiplication(a, b, solution):
  total = None
  for line in solution.splitlines()[:-1]:
    lhs, rhs = line.split("=")
    x, op, y = re.fullmatch(r"(\d+)([*+])(\d+)", lhs).groups()
    assert int(rhs) == (int(x) * int(y) if op == "*" else int(x) + int(y))
    total = int(rhs)
  return str(total)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from("+*"))
def test_worked_solutions_are_correct_and_parseable(a, b, op):
  solution = arithmetic.worked_solution(a, op, b)
  expected = str(a + b if op == "+" else a * b)
  assert formatting.parse_answer(solution) == expected
  assert solution.splitlines()[-1] == f"<answer>{expected}</answer>"
  assert " " not in solution
  replay = _replay_addition if op == "+" else _replay_multiplication
  assert replay(a, b, solution) == expected


def test_arithmetic_examples():
  examples = arithmetic.generate_arithmetic(0, "train", 400, digits=3, min_digits=2, ops="+*")
  assert len({arithmetic.arithmetic_key(e) for e in examples}) == 400
  assert {e["op"] for e in examples} == {"+", "*"}
  for e in examples:
    assert 10 <= e["a"] <= 999 and 10 <= e["b"] <= 999
    assert e["difficulty"] == max(len(str(e["a"])), len(str(e["b"])))
    assert e["question"] == f"What is {e['a']} {e['op']} {e['b']}?"
    assert e["answer"] == str(eval(f"{e['a']}{e['op']}{e['b']}"))
    assert formatting.parse_answer(e["solution"]) == e["answer"]
  assert examples == arithmetic.generate_arithmetic(0, "train", 400, digits=3, min_digits=2,
                                                    ops="+*")
  assert examples != arithmetic.generate_arithmetic(1, "train", 400, digits=3, min_digits=2,
                                                    ops="+*")


def test_arithmetic_space_limits_and_errors():
  # 1-digit addition has exactly 100 problems: all of them can be drawn, not one more.
  everything = arithmetic.generate_arithmetic(0, "train", 100, digits=1)
  assert {(e["a"], e["b"]) for e in everything} == {(a, b) for a in range(10) for b in range(10)}
  with pytest.raises(ValueError, match="only 100 distinct"):
    arithmetic.generate_arithmetic(0, "train", 101, digits=1)
  test = arithmetic.generate_arithmetic(0, "test", 30, digits=1)
  with pytest.raises(ValueError, match="only 70 distinct"):
    arithmetic.generate_arithmetic(0, "train", 71, digits=1,
                                   exclude={arithmetic.arithmetic_key(e) for e in test})
  with pytest.raises(ValueError, match="ops"):
    arithmetic.generate_arithmetic(0, "train", 1, ops="-")
  with pytest.raises(ValueError, match="min_digits"):
    arithmetic.generate_arithmetic(0, "train", 1, digits=2, min_digits=3)
  with pytest.raises(ValueError, match="op must be"):
    arithmetic.worked_solution(1, "-", 2)


_EXPR_CHARS = "0123456789+-*/() ="


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 199), st.text(alphabet=_EXPR_CHARS, max_size=24), st.sampled_from(["", "+1", "-x", "*2"]))
def test_countdown_checker_is_the_rewards(idx, noise, tail):
  """One countdown evaluator: the data checker and the reward agree on generated, mutated and random text."""
  from rollouts_jax import rewards
  ex = _COUNTDOWN_POOL[idx]
  nums, target = ex["numbers"], ex["target"]
  for expr in (ex["solution"], ex["solution"] + tail, noise, ex["solution"][: len(noise)] + noise,
               ex["solution"] + "=" + str(target)):
    ok = countdown.check_solution(expr, nums, target)
    graded = rewards.countdown_reward(formatting.wrap_answer(expr), (nums, target))
    assert ok == (graded == 1.0), (expr, nums, target)
    try:
      value = countdown.evaluate_expression(expr)
    except ValueError:
      continue
    assert value == rewards.evaluate_expression(rewards.parse_expression(expr))


_COUNTDOWN_POOL = [ex for d in sorted(countdown.COUNTDOWN_LEVELS)
                   for ex in countdown.generate_countdown(5, "test", 200 // len(countdown.COUNTDOWN_LEVELS) + 1, d)]
