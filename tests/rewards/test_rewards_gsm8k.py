"""gsm8k_reward: every GSM8K test solution scores 1 against itself, perturbed ones 0."""
import fractions
import json
import os
import pathlib

import pytest

from rollouts_jax import rewards

REPO = pathlib.Path(__file__).resolve().parents[2]
# $ROLLOUTS_JAX_BENCHMARKS, else the files shipped in the package (rollouts_jax.data.benchmarks.PACKAGED_DIR).
BENCHMARKS = pathlib.Path(os.environ.get("ROLLOUTS_JAX_BENCHMARKS") or REPO / "rollouts_jax" / "data" / "benchmark_files")
GSM8K = BENCHMARKS / "gsm8k_test.jsonl"
needs_gsm8k = pytest.mark.skipif(
    not GSM8K.exists(), reason=f"GSM8K test set not found at {GSM8K} (set ROLLOUTS_JAX_BENCHMARKS)")


def _solutions():
    with open(GSM8K) as f:
        return [json.loads(line)["answer"] for line in f]


def _final(solution):
    head, _, tail = solution.rpartition("####")
    return head, int(tail.strip().replace(",", ""))


@needs_gsm8k
def test_every_reference_solution_scores_one():
    solutions = _solutions()
    assert len(solutions) == 1319
    for sol in solutions:
        head, gold = _final(sol)
        assert rewards.gsm8k_reward(sol, sol) == 1.0, sol
        assert rewards.gsm8k_reward(sol, str(gold)) == 1.0
        assert rewards.gsm8k_reward(sol, gold) == 1.0
        # The same answer written the way models write it.
        assert rewards.gsm8k_reward(head + f"The answer is ${gold:,}.00.", sol) == 1.0
        assert rewards.gsm8k_reward(head + f"So the total is $\\boxed{{{gold}}}$.", sol) == 1.0


@needs_gsm8k
def test_every_perturbed_solution_scores_zero():
    for sol in _solutions():
        head, gold = _final(sol)
        for wrong in {gold + 1, gold - 1, gold * 10 + 1, -gold - 1}:
            assert rewards.gsm8k_reward(f"{head}#### {wrong}", sol) == 0.0, (sol, wrong)
        assert rewards.gsm8k_reward(f"{head}#### {gold}.5", sol) == 0.0
        assert rewards.gsm8k_reward(head + f"The answer is {gold + 1}.", sol) == 0.0


@pytest.mark.parametrize("completion,expected", [
    ("#### 1,018", 1.0),
    ("#### 1018.0", 1.0),
    ("She pays $1,018 in total.", 1.0),          # last number
    ("The answer is 1018 dollars, as 3 * 6 = 18", 1.0),  # number right after "answer is"
    ("<answer>1018</answer>", 1.0),
    ("#### 1,019", 0.0),
    ("The total is 101.8", 0.0),
    ("The total is 1018.5", 0.0),
    ("The change is -1018", 0.0),                  # a sign, not a dash
    ("nothing", 0.0),
])
def test_extraction_rules(completion, expected):
    assert rewards.gsm8k_reward(completion, "#### 1,018") == expected


def test_subtraction_is_not_a_sign():
    assert rewards.gsm8k_answer("It is 5-3") == fractions.Fraction(3)
    assert rewards.gsm8k_answer("It is -3") == fractions.Fraction(-3)


def test_no_number_counts_a_failure_and_bad_reference_raises():
    rewards.reset_failure_counts()
    assert rewards.gsm8k_reward("I cannot tell", "#### 4") == 0.0
    assert rewards.failure_counts() == {"gsm8k/no_answer": 1}
    with pytest.raises(ValueError, match="no number"):
        rewards.gsm8k_reward("#### 4", "#### four")


@pytest.mark.parametrize("completion,expected", [
    ("6+0=6, 3+9=12 carry 1 ... <answer>936</answer>", 1.0),
    ("<answer> 936.0 </answer>", 1.0),
    ("<answer>1,936</answer>", 0.0),
    ("<answer>935</answer> no wait <answer>936</answer>", 1.0),   # the last tag counts
    ("<answer>936</answer> no wait <answer>935</answer>", 0.0),
    ("<answer>936 apples</answer>", 0.0),                          # not one number
    ("the answer is 936", 0.0),                                    # no tags, no fallback
])
def test_arithmetic_reward(completion, expected):
    assert rewards.arithmetic_reward(completion, "936") == expected
    assert rewards.get_reward_fn("arithmetic")(completion, 936) == expected


def test_arithmetic_failures_and_bad_reference():
    rewards.reset_failure_counts()
    rewards.arithmetic_reward("936", "936")
    rewards.arithmetic_reward("<answer>x</answer>", "936")
    assert rewards.failure_counts() == {"arithmetic/no_answer": 2}
    with pytest.raises(ValueError, match="not a number"):
        rewards.arithmetic_reward("<answer>1</answer>", "one")
