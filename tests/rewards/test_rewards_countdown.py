"""countdown_reward: safe parsing, exact arithmetic, each number once, no hangs."""
import fractions
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax import rewards
from rollouts_jax.rewards import countdown

REF = ([2, 3, 5, 7], 24)
GOOD = "7 * (5 - 2) + 3"


@pytest.mark.parametrize("answer,why", [
    ("7 * (5 - 2) + 3 + 2 - 2", "value 24 but 2 used three times"),
    ("(7 - 5) * 3 * (2 + 2)", "value 24 but 2 used twice"),
    ("(7 + 5) * 2 + 0 * 3", "value 24 but 0 is not given"),
    ("8 * 3 + 7 - 5 - 2", "value 24 but 8 is not given"),
    ("(5 + 7) * 2", "value 24 but 3 is unused"),
    ("7 * 5 - 3 - 2", "uses each number once but equals 30"),
    ("3 / (7 - 5 - 2)", "division by zero"),
    ("(7 - 5) ** 3 * 3", "no exponent operator"),
    ("(7 - 5) ^ 3 * 3", "no exponent operator"),
    ("7 * (5 - 2) + 3.0", "no decimals"),
])
def test_rule_breaking_answers_score_zero(answer, why):
    assert rewards.countdown_reward(f"<answer>{answer}</answer>", REF) == 0.0, why
    assert rewards.countdown_reward(f"<answer>{GOOD}</answer>", REF) == 1.0


def test_correct_answers_in_every_accepted_form():
    ref, good = REF, GOOD
    forms = [
        f"<answer>{good}</answer>",
        f"<think>...</think>\n<answer> {good} = 24 </answer>",
        f"<answer>$\\boxed{{7 \\times (5 - 2) + 3}}$</answer>",
        f"Let me think.\nSo the answer is {good}.",
        f"Working...\n{good} = 24",
        "<answer>7 × (5 − 2) + 3</answer>",
        "<answer>(3 + 7 * (5 - 2))</answer>",
        "<answer>-(2 - 5) * 7 + 3</answer>",     # unary minus
    ]
    for completion in forms:
        assert rewards.countdown_reward(completion, ref) == 1.0, completion
    # A claimed result that is not the target is wrong even if the expression is right.
    assert rewards.countdown_reward(f"<answer>{good} = 25</answer>", ref) == 0.0
    # Exact rationals: 3 / 2 * 8 = 12, no float rounding.
    assert rewards.countdown_reward("<answer>3 / 2 * 8</answer>", ([3, 2, 8], 12)) == 1.0
    assert rewards.countdown_reward("<answer>(1 / 3) * 3 * 5</answer>", ([1, 3, 3, 5], 5)) == 1.0
    # Duplicated given numbers may each be used once.
    assert rewards.countdown_reward("<answer>5 * 5 - 1</answer>", ([5, 5, 1], 24)) == 1.0
    assert rewards.countdown_reward("<answer>5 * 5 * 5 - 1</answer>", ([5, 5, 1], 124)) == 0.0


def test_at_most_once_variant():
    assert rewards.countdown_reward("<answer>(5 + 7) * 2</answer>", REF, use_all=False) == 1.0
    assert rewards.countdown_reward("<answer>(5 + 7) * 2</answer>", REF) == 0.0
    assert rewards.countdown_reward("<answer>(7 - 5) * 3 * (2 + 2)</answer>", REF, use_all=False) == 0.0
    fn = rewards.get_reward_fn("countdown_at_most_once")
    assert fn("<answer>(5 + 7) * 2</answer>", REF) == 1.0


def test_division_by_zero_scores_zero():
    assert rewards.countdown_reward("<answer>4 / (3 - 3) + 0</answer>", ([4, 3, 3, 0], 1)) == 0.0
    assert rewards.countdown_reward("<answer>0 / 4 * 3 + 3</answer>", ([4, 3, 3, 0], 3)) == 1.0


@pytest.mark.parametrize("expression", [
    "2 ** 999999999", "9 ** 9 ** 9 ** 9", "2 ^ 99999999", "pow(2, 9999999)",
    "__import__('os').system('true')", "(lambda: 1)()", "1e999999", "2.5 * 2", "x + 1",
    "(" * 5000 + "1" + ")" * 5000, "-" * 5000 + "1", "1 +" * 2000 + "1", "((((2))))" + ")",
])
def test_hostile_answers_are_rejected_fast(expression):
    rewards.reset_failure_counts()
    hostile = f"<answer>{expression}</answer>"
    assert rewards.countdown_reward(hostile, ([2, 9, 1], 512)) == 0.0
    assert rewards.failure_counts() == {"countdown/parse_error": 1}
    # Rejected at the cost of parsing, never evaluated: within 50x the cost of scoring an
    # ordinary correct answer (evaluating 2 ** 999999999 would take 10^4 times longer and more).
    normal = "<answer>9 * 2 + 1</answer>"
    assert rewards.countdown_reward(normal, ([2, 9, 1], 19)) == 1.0
    best = {"hostile": float("inf"), "normal": float("inf")}
    for _ in range(5):  # alternating, fastest of five
        for name, text, target in (("hostile", hostile, 512), ("normal", normal, 19)):
            t0 = time.perf_counter()
            rewards.countdown_reward(text, ([2, 9, 1], target))
            best[name] = min(best[name], time.perf_counter() - t0)
    assert best["hostile"] < 50 * best["normal"], best


def test_missing_answer_counts_a_failure():
    rewards.reset_failure_counts()
    assert rewards.countdown_reward("I give up.", ([1, 2], 3)) == 0.0
    assert rewards.countdown_reward("<answer></answer>", ([1, 2], 3)) == 0.0
    assert rewards.failure_counts() == {"countdown/no_answer": 2}


def test_reference_forms_and_errors():
    good = "<answer>1 + 2</answer>"
    assert rewards.countdown_reward(good, ([1, 2], 3)) == 1.0
    assert rewards.countdown_reward(good, {"numbers": [1, 2], "target": 3}) == 1.0
    assert rewards.countdown_reward(good, {"nums": (2, 1), "target": 3.0}) == 1.0
    for bad in [3, ([1, 2],), {"numbers": [1, 2]}, ([1.5, 2], 3), ([], 3), ("12", 3)]:
        with pytest.raises(ValueError, match="countdown"):
            rewards.countdown_reward(good, bad)


# ---- property: any expression tree over the numbers scores 1 at its own value ----------
def _trees(numbers):
    """Strategy: an expression string using each of ``numbers`` once, in some order."""
    if len(numbers) == 1:
        return st.just(str(numbers[0]))
    return st.integers(1, len(numbers) - 1).flatmap(
        lambda k: st.tuples(_trees(numbers[:k]), st.sampled_from("+-*/"), _trees(numbers[k:])).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"))


@st.composite
def _puzzles(draw):
    numbers = draw(st.lists(st.integers(1, 100), min_size=2, max_size=5))
    order = draw(st.permutations(numbers))
    return numbers, draw(_trees(list(order)))


def _reference_value(expr):
    """Independent evaluation: Python's own parser on Fraction literals."""
    import ast
    tree = ast.parse(expr, mode="eval")

    def ev(node):
        if isinstance(node, ast.Constant):
            return fractions.Fraction(node.value)
        a, b = ev(node.left), ev(node.right)
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)] \
            if not isinstance(node.op, ast.Div) else a / b
    return ev(tree.body)


@settings(max_examples=150, deadline=None)
@given(_puzzles())
def test_any_valid_expression_scores_one_at_its_value(puzzle):
    numbers, expr = puzzle
    try:
        value = _reference_value(expr)
    except ZeroDivisionError:
        return
    assert countdown.evaluate_expression(countdown.parse_expression(expr)) == value
    if value.denominator != 1:
        assert rewards.countdown_reward(f"<answer>{expr}</answer>", (numbers, 0)) == (value == 0)
        return
    target = int(value)
    assert rewards.countdown_reward(f"<answer>{expr}</answer>", (numbers, target)) == 1.0
    assert rewards.countdown_reward(f"<answer>{expr}</answer>", (numbers, target + 1)) == 0.0
    # Dropping one given number from the reference makes the answer use an unknown number.
    assert rewards.countdown_reward(f"<answer>{expr}</answer>", (numbers[1:], target)) == 0.0
