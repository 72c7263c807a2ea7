"""Items 7 and 8 of issue 18: graders never stall, kill or silently zero a run.

7: a grader stuck in C code (a C loop, a sleep with signals blocked) times out and its worker
   is replaced while the batch continues; a grader calling `os._exit` costs one sample, not the
   run; asking for inline scoring of a grader not known to be safe still isolates it; Ctrl-C
   while a grader is stuck interrupts the scoring at once.
8: raising, hanging and NaN graders are counted as failures with their messages, apart from
   completions without an answer, and `check_grader_health` stops a run whose grader fails on
   most samples.
"""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from rollouts_jax import rewards
from rollouts_jax.graders import pool as pool_lib
import reliability_graders as graders

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


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


def test_stuck_and_exiting_graders_cost_one_sample_each(pool):
  completions = ["a", "spin", "bb", "deaf_sleep", "exit", "cccc"]
  t0 = time.monotonic()
  values, stats = pool.score(graders.misbehave, completions, [None] * 6, timeout_s=1.0)
  elapsed = time.monotonic() - t0
  assert values.tolist() == [1.0, 0.0, 2.0, 0.0, 0.0, 4.0]
  assert stats["status"].tolist() == [0, pool_lib.STATUS_TIMEOUT, 0, pool_lib.STATUS_TIMEOUT,
                                      pool_lib.STATUS_CRASH, 0]
  assert (stats["timeouts"], stats["crashes"], stats["failures"], stats["restarts"]) == (2, 1, 3, 3)
  assert elapsed < 12.0  # two 1 s deadlines on two workers, plus replacements, not forever
  # The pool is whole again and scores the next batch.
  values, stats = pool.score(graders.misbehave, ["xyz"] * 4, [None] * 4, timeout_s=5.0)
  assert values.tolist() == [3.0] * 4 and stats["failures"] == 0


def test_unsafe_grader_is_isolated_even_when_inline_is_asked():
  assert pool_lib.is_inline_safe(rewards.arithmetic_reward)
  assert not pool_lib.is_inline_safe(graders.misbehave)
  try:
    t0 = time.monotonic()
    values, stats = rewards.score_batch(graders.misbehave, ["spin", "exit", "ab"], [None] * 3,
                                        timeout_s=1.0, num_workers=0)
    assert time.monotonic() - t0 < 15.0
    assert stats["mode"] == "pool" and values.tolist() == [0.0, 0.0, 2.0]
    assert stats["status"].tolist() == [pool_lib.STATUS_TIMEOUT, pool_lib.STATUS_CRASH, 0]
  finally:
    rewards.shutdown_default_pools()
  # A known-safe grader runs inline, still under a deadline per call.
  values, stats = rewards.score_batch("arithmetic", ["<answer>12</answer>", "12"], ["12", "12"], num_workers=0)
  assert stats["mode"] == "inline" and values.tolist() == [1.0, 0.0] and stats["no_answer"] == 1


_CTRL_C_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    # What an interactive Python has, whatever this test inherits (a suite started in the
    # background of a non-interactive shell ignores SIGINT, and so would its children).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, sys.argv[1])
    from rollouts_jax import rewards
    import reliability_graders as graders
    pool = rewards.GraderPool(num_workers=1)
    pool.wait_ready(60)
    print("pids", *pool.pids(), flush=True)
    t0 = time.monotonic()
    try:
      pool.score(graders.misbehave, ["spin"], [None], timeout_s=300)
    except KeyboardInterrupt:
      print(f"interrupted after {time.monotonic() - t0:.1f}", flush=True)
      pool.close()
      sys.exit(0)
    sys.exit(1)
""")


def test_ctrl_c_interrupts_scoring_while_a_grader_is_stuck_in_c():
  proc = subprocess.Popen([sys.executable, "-c", _CTRL_C_SCRIPT, str(HERE)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
  worker = None
  try:
    line = proc.stdout.readline()
    assert line.startswith("pids"), proc.stderr.read()[-2000:]
    worker = int(line.split()[1])
    time.sleep(1.5)  # the grader is now spinning in C
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "interrupted" in out and time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not _alive(worker)
  finally:   # nothing left spinning if an assertion or the timeout fired
    proc.kill()
    if worker is not None and _alive(worker):
      os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("grader, kind, text", [
    (graders.always_raise, "errors", "RuntimeError: grader bug"),
    (graders.always_nan, "invalid", "nan"),
    (graders.always_hang, "timeouts", "no result after 0.5 s"),
])
def test_failing_grader_stops_the_run_with_its_message(pool, grader, kind, text):
  values, stats = pool.score(grader, ["a", "b", "c", "d"], [None] * 4, timeout_s=0.5)
  assert values.tolist() == [0.0] * 4
  assert stats[kind] == 4 and stats["failures"] == 4 and stats["no_answer"] == 0
  assert len(stats["messages"]) == 1 and text in stats["messages"][0] and "(x4)" in stats["messages"][0]
  with pytest.raises(pool_lib.GraderFailureError, match=f"failed on 4 of 4 samples.*{text}"):
    pool_lib.check_grader_health(stats, max_failure_frac=0.5)


def test_no_answer_is_not_a_grader_failure(pool):
  completions = ["no answer"] * 6 + ["caught", "raise", "abc", "nan"]
  values, stats = pool.score(graders.misbehave, completions, [None] * 10, timeout_s=5)
  assert values.tolist() == [0.0] * 8 + [3.0, 0.0]
  assert stats["no_answer"] == 6
  assert (stats["caught"], stats["errors"], stats["invalid"], stats["failures"]) == (1, 1, 1, 3)
  messages = " | ".join(stats["messages"])
  assert "demo/error: ValueError: invalid literal" in messages  # the error the grader swallowed
  assert "KeyError" in messages and "invalid" in messages
  pool_lib.check_grader_health(stats, max_failure_frac=0.5)  # 3 of 10: a warning, not a stop
  # Real graders: answers missing from most completions is normal, not a failing grader.
  values, stats = rewards.score_batch("gsm8k", ["I do not know"] * 8 + ["#### 3"] * 2, ["3"] * 10)
  assert stats["no_answer"] == 8 and stats["failures"] == 0
  pool_lib.check_grader_health(stats, max_failure_frac=0.1)
  merged = pool_lib.merge_stats([stats, stats])
  assert (merged["num"], merged["no_answer"], merged["failures"]) == (20, 16, 0)
  assert "16 without an answer" in pool_lib.summarize_stats(merged)
