"""The grader process pool: hung, spinning, crashing and buggy graders cost a 0, not the run."""
import functools
import os
import time

import numpy as np
import pytest

from rollouts_jax import rewards
from rollouts_jax.graders import pool as pool_lib, registry as grader_registry
import rewards_test_graders as graders

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool():
    with rewards.GraderPool(num_workers=2) as p:
        p.wait_ready(timeout_s=60)
        yield p


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sleeping_grader_times_out_and_training_continues(pool):
    completions = ["a", "bb", "hang", "cccc", "ddddd", "ee"]
    pids_before = pool.pids()
    t0 = time.monotonic()
    values, stats = pool.score(graders.length_or_hang, completions, [None] * 6, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    expected = [1, 2, 0, 4, 5, 2]
    np.testing.assert_array_equal(values, np.asarray(expected, np.float32))
    assert values.dtype == np.float32
    assert stats["status"].tolist() == [0, 0, pool_lib.STATUS_TIMEOUT, 0, 0, 0]
    assert (stats["timeouts"], stats["ok"], stats["restarts"], stats["failures"]) == (1, 5, 1, 1)
    # The hung call is abandoned after its own deadline, not after the whole batch.
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5.0
    killed = set(pids_before) - set(pool.pids())
    assert len(killed) == 1 and not _alive(killed.pop())
    # The next batch runs on the repaired pool.
    values, stats = pool.score("gsm8k", ["#### 3", "#### 4"] * 3, ["3"] * 6, timeout_s=10)
    assert values.tolist() == [1.0, 0.0] * 3 and stats["ok"] == 6


def test_grader_stuck_in_c_code_is_killed(pool):
    # sum(range(10**13)) never returns to the interpreter loop, so no signal handler could stop it.
    t0 = time.monotonic()
    values, stats = pool.score(graders.length_or_hang, ["spin", "abc"], [None, None], timeout_s=TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S + 5.0
    assert values.tolist() == [0.0, 3.0]
    assert stats["status"].tolist() == [pool_lib.STATUS_TIMEOUT, pool_lib.STATUS_OK]


def test_crash_error_and_invalid_results_score_zero(pool):
    completions = ["crash", "raise", "nan", "text", "xyz"]
    values, stats = pool.score(graders.length_or_hang, completions, [None] * 5, timeout_s=10)
    assert values.tolist() == [0.0, 0.0, 0.0, 0.0, 3.0]
    assert stats["status"].tolist() == [pool_lib.STATUS_CRASH, pool_lib.STATUS_ERROR,
                                        pool_lib.STATUS_INVALID, pool_lib.STATUS_INVALID,
                                        pool_lib.STATUS_OK]
    assert (stats["crashes"], stats["errors"], stats["invalid"]) == (1, 1, 2)
    assert stats["restarts"] == 1  # only the crash costs a worker
    assert any("grader bug" in m for m in stats["messages"])


def test_pool_matches_direct_calls_and_collects_grader_failures(pool):
    cases = [
        ("math", r"so $\boxed{\frac{14}{3}}$", r"\frac{14}{3}"),
        ("math", "no answer here at all", "3"),
        ("math", r"\boxed{3/14}", r"\frac{14}{3}"),
        ("gsm8k", "He pays 2 * 9 = 18.\n#### 18", "#### 18"),
        ("gsm8k", "I do not know", "#### 18"),
        ("countdown", "<answer>(3 + 5) * 2</answer>", ([2, 3, 5], 16)),
        ("countdown", "<answer>3 ** 5</answer>", ([3, 5], 243)),
        ("format", "<think>a</think><answer>b</answer>", None),
    ]
    rewards.reset_failure_counts()
    direct = [rewards.get_reward_fn(name)(c, r) for name, c, r in cases]
    direct_failures = rewards.failure_counts()
    pooled = []
    collected = {}
    for name, c, r in cases:
        values, stats = pool.score(name, [c], [r], timeout_s=10)
        pooled.append(float(values[0]))
        for k, v in stats["grader_failures"].items():
            collected[k] = collected.get(k, 0) + v
    assert pooled == direct == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert collected == direct_failures == {
        "math/no_answer": 1, "gsm8k/no_answer": 1, "countdown/parse_error": 1}


def test_score_batch_inline_mode_uses_the_alarm():
    # Inline scoring is only for graders declared safe; they still get a deadline per call.
    pool_lib.mark_inline_safe(graders.length_or_hang)
    try:
        values, stats = rewards.score_batch(graders.length_or_hang, ["hang", "ab", "raise"],
                                            [None] * 3, timeout_s=0.3, num_workers=0)
    finally:
        pool_lib._INLINE_SAFE.discard(graders.length_or_hang)
    assert stats["mode"] == "inline"
    assert values.tolist() == [0.0, 2.0, 0.0]
    assert stats["status"].tolist() == [pool_lib.STATUS_TIMEOUT, pool_lib.STATUS_OK,
                                        pool_lib.STATUS_ERROR]
    assert any("no result after 0.3 s" in m for m in stats["messages"])


def test_partial_of_a_module_function_is_accepted(pool):
    fn = functools.partial(rewards.countdown_reward, use_all=False)
    values, _ = pool.score(fn, ["<answer>3 + 5</answer>"] * 2, [([2, 3, 5], 8), ([2, 3, 5], 7)],
                           timeout_s=10)
    assert values.tolist() == [1.0, 0.0]


def test_bad_inputs_raise_clear_errors(pool):
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        pool.score("gsm8k", ["a", "b"], ["1"])
    with pytest.raises(ValueError, match="cannot be pickled"):
        pool.score(lambda c, r: 1.0, ["a"], [None])
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rewards.score_batch("nope", ["a"], [None], num_workers=0)
    with pytest.raises(ValueError, match="list of strings"):
        pool.score("gsm8k", "abc", ["1", "2", "3"])
    with pytest.raises(ValueError, match="num_workers"):
        rewards.GraderPool(num_workers=0)


def test_registry_round_trip():
    assert {"math", "gsm8k", "countdown", "format"} <= set(rewards.reward_fn_names())
    rewards.register_reward_fn("test_length", graders.length_or_hang)
    try:
        assert rewards.get_reward_fn("test_length")("abc", None) == 3.0
        with pytest.raises(ValueError, match="already registered"):
            rewards.register_reward_fn("test_length", graders.length_or_hang)
    finally:
        grader_registry._REGISTRY.pop("test_length")


def test_workers_that_cannot_start_raise_instead_of_looping():
    p = rewards.GraderPool(num_workers=1, preload=("rollouts_jax_no_such_module",),
                           startup_timeout_s=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="failing to start"):
            p.score("gsm8k", ["#### 1"], ["1"], timeout_s=5)
        assert time.monotonic() - t0 < 30
    finally:
        p.close()
    with pytest.raises(ValueError, match="closed"):
        p.score("gsm8k", ["#### 1"], ["1"])
