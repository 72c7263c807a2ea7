"""Misbehaving graders for the reliability tests (module level: the worker processes import them)."""
import math
import os
import signal
import time

from rollouts_jax.graders import common


def misbehave(completion, reference):
  """len(completion), unless the completion names a fault to act out."""
  if completion == "spin":
    return float(sum(range(10**13)))  # one C call that never returns to the interpreter
  if completion == "deaf_sleep":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT, signal.SIGTERM})
    time.sleep(10**6)  # and no signal can reach it
  if completion == "exit":
    os._exit(0)  # a "clean" exit from inside the grader
  if completion == "raise":
    raise KeyError("missing field 'answer'")
  if completion == "nan":
    return math.nan
  if completion == "caught":
    try:
      int("twelve")
    except ValueError:
      common.record_failure("demo/error")  # a grader that swallows its own error
    return 0.0
  if completion == "no answer":
    common.record_failure("demo/no_answer")
    return 0.0
  return float(len(completion))


def always_raise(completion, reference):
  raise RuntimeError("grader bug: reference is None")


def always_nan(completion, reference):
  return float("nan")


def always_hang(completion, reference):
  time.sleep(10**6)
