"""`guess`: a number-guessing game that needs no tool; the environment answers higher / lower.

The secret is an integer in [1, max_value]. Each policy turn is one guess (the last integer
of the turn, or of its `<guess>` tag); the environment replies "higher", "lower" or, for a
turn without a number, an error observation; the correct guess ends the episode with reward
1. With `consistent_reward` > 0 a guess inside the interval the earlier replies still allow
earns that much (a per-turn reward for per-turn credit).

>>> env = GuessEnv(max_value=16)
>>> s = env.reset({"secret": 11})
>>> env.step(s, "8")[:3]
('higher', 0.0, False)
>>> s = env.step(s, "8").state
>>> env.step(s, "<guess>11</guess>")[1:3]
(1.0, True)
"""

from __future__ import annotations

import random
import re

from rollouts_jax.envs import base, tools

_INT = re.compile(r"-?\d+")
_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


class GuessEnv(base.Env):
  """Guess the secret number (see the module docstring)."""
  name = "guess"
  stop_strings = ()
  plain_wrap = ("<reply>", "</reply>\n")

  def __init__(self, max_value: int = 16, consistent_reward: float = 0.0):
    self.max_value = int(max_value)
    self.consistent_reward = float(consistent_reward)

  def prompt(self, example):
    return f"Guess my number from 1 to {int(example.get('max_value', self.max_value))}.\n"

  def reset(self, example):
    return {"secret": int(example["secret"]), "low": 1, "high": int(example.get("max_value", self.max_value)),
            "guesses": 0, "solved": False}

  def step(self, state, completion_text):
    state = dict(state)
    text = str(completion_text)
    tagged = _GUESS.findall(text)
    found = tagged or _INT.findall(text)
    if not found:
      return base.StepResult(tools.error("bad_arguments", "no number in the guess"), 0.0, False, state)
    guess = int(found[-1])
    state["guesses"] += 1
    bonus = self.consistent_reward if state["low"] <= guess <= state["high"] else 0.0
    if guess == state["secret"]:
      state["solved"] = True
      return base.StepResult("correct", 1.0, True, state)
    if guess < state["secret"]:
      state["low"] = max(state["low"], guess + 1)
      return base.StepResult("higher", bonus, False, state)
    state["high"] = min(state["high"], guess - 1)
    return base.StepResult("lower", bonus, False, state)

  def solved(self, state):
    return bool(state["solved"])


def examples(n: int, max_value: int, seed: int) -> list[dict]:
  """`n` games with secrets drawn uniformly from [1, max_value] (deterministic in `seed`).

  >>> [e["secret"] for e in examples(3, 16, 0)]
  [13, 14, 2]
  """
  rng = random.Random(seed)
  return [{"secret": rng.randint(1, max_value), "max_value": max_value, "answer": ""} for _ in range(n)]


@base.register("guess")
def guess(max_value: int = 16, consistent_reward: float = 0.0) -> GuessEnv:
  """The guessing game.

  Args:
    max_value: secrets are in [1, max_value].
    consistent_reward: per-turn reward of a guess the earlier replies still allow.
  """
  if int(max_value) < 2:
    raise base.setting_error("guess", "max_value", f"must be >= 2, got {max_value}")
  if float(consistent_reward) < 0:
    raise base.setting_error("guess", "consistent_reward", f"must be >= 0, got {consistent_reward}")
  return GuessEnv(max_value=max_value, consistent_reward=consistent_reward)
