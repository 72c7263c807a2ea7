"""math_reward: math-verify's verdicts, MATH-500 self-consistency, rewritings and near misses."""
import json
import os
import pathlib
import threading

import math_verify
import pytest
from math_verify.errors import TimeoutException

from rollouts_jax import rewards
from rollouts_jax.rewards import math_verifier
from rewards_test_rewrites import near_misses, rewrites

REPO = pathlib.Path(__file__).resolve().parents[2]
# $ROLLOUTS_JAX_BENCHMARKS, else the files shipped in the package (rollouts_jax.data.benchmarks.PACKAGED_DIR).
BENCHMARKS = pathlib.Path(os.environ.get("ROLLOUTS_JAX_BENCHMARKS") or REPO / "rollouts_jax" / "data" / "benchmark_files")
MATH500 = BENCHMARKS / "math500.jsonl"
needs_math500 = pytest.mark.skipif(
    not MATH500.exists(), reason=f"MATH-500 not found at {MATH500} (set ROLLOUTS_JAX_BENCHMARKS)")
# Every 4th answer in the default suite; all 500 under -m slow.
SUBSET_STRIDE = 4


def _math500_answers():
    with open(MATH500) as f:
        return [json.loads(line)["answer"] for line in f]


def _math_verify_verdict(completion, reference):
    """math-verify's own verdict with its default configuration."""
    gold = math_verify.parse(math_verifier.wrap_reference(reference))
    return float(math_verify.verify(gold, math_verify.parse(completion)))


HAND_CASES = [
    # (completion, reference, expected)
    (r"So $x = \boxed{\frac{14}{3}}$.", r"\frac{14}{3}", 1.0),
    (r"$\boxed{14/3}$", r"\frac{14}{3}", 1.0),
    (r"$\boxed{\dfrac{14}{3}}$", r"\frac{14}{3}", 1.0),
    ("The final answer is 14/3", r"\frac{14}{3}", 1.0),
    (r"$\boxed{4.666667}$", r"\frac{14}{3}", 1.0),
    (r"$\boxed{4.67}$", r"\frac{14}{3}", 0.0),
    (r"$\boxed{\frac{3}{14}}$", r"\frac{14}{3}", 0.0),
    (r"$\boxed{\left( 3,\frac{\pi}{2}\right)}$", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"$\boxed{(3, \pi/2)}$", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"$\boxed{(3, \pi)}$", r"\left( 3, \frac{\pi}{2} \right)", 0.0),
    (r"$\boxed{145}$", r"145^\circ", 1.0),
    (r"$\boxed{145^{\circ}}$", "145", 1.0),
    (r"$\boxed{145 \text{ degrees}}$", r"145^\circ", 1.0),
    (r"$\boxed{146^\circ}$", r"145^\circ", 0.0),
    (r"$\boxed{5.4}$", r"5.4 \text{ cents}", 1.0),
    (r"$\boxed{864 \text{ inches}^2}$", r"864 \mbox{ inches}^2", 1.0),
    (r"$\boxed{10080}$", r"10,\!080", 1.0),
    (r"$\boxed{18.9}$", r"\$18.90", 1.0),
    (r"$\boxed{\text{Evelyn}}$", r"\text{Evelyn}", 1.0),
    (r"$\boxed{\text{Navin}}$", r"\text{Evelyn}", 0.0),
    (r"$\boxed{(3,4)}$", "(3,4]", 0.0),
    (r"$\boxed{-2,1}$", "1,-2", 1.0),
    (r"$\boxed{1,2}$", "1,-2", 0.0),
    (r"$\boxed{q-p}$", "p - q", 0.0),
    (r"\boxed{5}", "x=5", 1.0),
    (r"I first got \boxed{13} but it is \boxed{14}", "14", 1.0),  # "it is" anchors the last box
    (r"\boxed{13} wait no \boxed{14}", "14", 0.0),  # math-verify reads two boxes as a set
    ("no answer here", "3", 0.0),
    ("", "3", 0.0),
    # Numeric references as the other benchmarks store them (amc23: 27.0, aime24: "033").
    (r"\boxed{27}", 27.0, 1.0),
    (r"\boxed{33}", "033", 1.0),
]


@pytest.mark.parametrize("completion,reference,expected", HAND_CASES)
def test_hand_cases(completion, reference, expected):
    assert rewards.math_reward(completion, reference) == expected


@pytest.mark.parametrize("completion,reference,_", HAND_CASES)
def test_agrees_with_math_verify(completion, reference, _):
    assert rewards.math_reward(completion, reference) == _math_verify_verdict(completion, reference)


def test_documented_touch_ups_only_fix_math_verify_misses():
    # math-verify alone misses these; each is one documented rewrite in prepare_completion.
    cases = [("The answer is 14/3.", r"\frac{14}{3}"), (r"\boxed{145°}", r"145^\circ"),
             ("The answer is \u22123", "-3")]
    for completion, reference in cases:
        assert _math_verify_verdict(completion, reference) == 0.0
        assert rewards.math_reward(completion, reference) == 1.0
        prepared = math_verifier.prepare_completion(completion)
        assert _math_verify_verdict(prepared, reference) == 1.0


def _check_rewrites(answers):
    checked = 0
    for ans in answers:
        for name, completion in rewrites(ans):
            got = rewards.math_reward(completion, ans)
            assert got == 1.0, (name, ans, completion)
            if math_verifier.prepare_completion(completion) == completion:
                assert got == _math_verify_verdict(completion, ans), (name, ans, completion)
            checked += 1
        for name, completion in near_misses(ans):
            got = rewards.math_reward(completion, ans)
            assert got == 0.0, (name, ans, completion)
            assert got == _math_verify_verdict(completion, ans), (name, ans, completion)
            checked += 1
    return checked


@needs_math500
def test_every_math500_reference_accepts_itself():
    answers = _math500_answers()
    assert len(answers) == 500
    for ans in answers:
        assert rewards.math_reward(f"The final answer is $\\boxed{{{ans}}}$.", ans) == 1.0, ans


@needs_math500
def test_every_math500_worked_solution_scores_one():
    # The full reference solutions (prose, LaTeX, [asy] code, a final \boxed{}) as completions.
    with open(MATH500) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert rewards.math_reward(row["solution"], row["answer"]) == 1.0, row["unique_id"]


@needs_math500
def test_math500_rewritings_and_near_misses_subset():
    answers = _math500_answers()[::SUBSET_STRIDE]
    assert _check_rewrites(answers) > 4 * len(answers)


@pytest.mark.slow
@needs_math500
def test_math500_rewritings_and_near_misses_all():
    assert _check_rewrites(_math500_answers()) > 2500


def test_failures_are_counted_not_raised(monkeypatch):
    rewards.reset_failure_counts()
    assert rewards.math_reward("I have no idea", "3") == 0.0
    assert rewards.failure_counts() == {"math/no_answer": 1}

    def hang(*args, **kwargs):
        raise TimeoutException("simulated")

    def boom(*args, **kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(math_verify, "verify", hang)
    assert rewards.math_reward(r"\boxed{3}", "3") == 0.0
    monkeypatch.setattr(math_verify, "verify", boom)
    assert rewards.math_reward(r"\boxed{3}", "3") == 0.0
    counts = rewards.failure_counts()
    assert counts["math/timeout"] >= 1 and counts["math/error"] >= 1


def test_bad_reference_raises():
    for bad in ("", "   ", None):
        with pytest.raises(ValueError, match="reference"):
            rewards.math_reward(r"\boxed{3}", bad)


def test_same_verdicts_off_the_main_thread():
    # Off the main thread math-verify's signal timeouts are off; the verdicts must not change.
    results = []
    cases = HAND_CASES[:10]
    thread = threading.Thread(
        target=lambda: results.extend(rewards.math_reward(c, r) for c, r, _ in cases))
    thread.start()
    thread.join(60)
    assert results == [e for _, _, e in cases]


def test_math_equal_merges_equivalent_answers_for_voting():
    answers = ["0.5", r"\frac{1}{2}", "1/2", "2", None, r"\dfrac{4}{2}"]
    merged = rewards.canonicalize_answers(answers, rewards.math_equal)
    assert merged == ["0.5", "0.5", "0.5", "2", None, "2"]
    assert rewards.majority_vote(merged) == ("0.5", 3)
