"""Tasks: one extractor for reward, vote and clusters; label-preserving rewrites; countdown strategies."""

import numpy as np
import pytest

from rollouts_jax import data, rewards, tasks


def _arithmetic_texts():
  exs = data.generate_arithmetic(0, "train", 40, digits=3)
  out = []
  for i, ex in enumerate(exs):
    sol = ex["solution"]
    out += [(sol, ex["answer"]), (sol.replace(ex["answer"], str(int(ex["answer"]) + 1)), ex["answer"]),
            ("no tag " + ex["answer"], ex["answer"]), (f"<answer>{int(ex['answer']):,}</answer>", ex["answer"]),
            (f"<answer>{ex['answer']}.0</answer>", ex["answer"]), ("<answer>abc</answer>", ex["answer"])]
  return out


def _countdown_texts():
  exs = data.generate_countdown(0, "train", 40, difficulty=2)
  out = []
  for ex in exs:
    ref = {"numbers": ex["numbers"], "target": ex["target"]}
    sol = ex["solution"]
    out += [(f"<answer>{sol}</answer>", ref), (f"<answer>{sol}+1</answer>", ref), (sol, ref),
            (f"<answer>{sol} = {ex['target']}</answer>", ref), ("<answer>(1+</answer>", ref), ("nothing", ref)]
  return out


@pytest.mark.parametrize("name,verifier,cases", [
    ("arithmetic", rewards.arithmetic_reward, _arithmetic_texts()),
    ("countdown", rewards.countdown_reward, _countdown_texts()),
    ("gsm8k", rewards.gsm8k_reward, [("#### 18", "18"), ("so \\boxed{18}", "18"), ("The answer is 17.", "18"),
                                      ("no number", "18"), ("$1,018.00", "1018")]),
])
def test_task_reward_is_grade_of_extract_and_agrees_with_the_verifier(name, verifier, cases):
  task = tasks.get(name)
  values = []
  for text, ref in cases:
    r = task.reward(text, ref)
    assert r == task.grade(task.extract(text), ref)
    assert r == verifier(text, ref), (text, ref)
    values.append(r)
  assert 0 < np.mean(values) < 1  # both outcomes occur


def test_math_task_grades_its_own_extraction():
  task = tasks.get("math500")
  assert task.extract(r"so $\boxed{\dfrac{14}{3}}$.") == r"\frac{14}{3}"
  assert task.reward(r"so $\boxed{\dfrac{14}{3}}$.", r"\frac{14}{3}") == 1.0
  assert task.reward(r"so $\boxed{3}$", r"\frac{14}{3}") == 0.0
  assert task.same("0.5", r"\frac{1}{2}")
  assert task.reward("the answer is 14/3 (no box)", r"\frac{14}{3}") == 0.0  # what the vote cannot see is not graded


def test_arithmetic_rewrite_preserves_the_answer():
  task = tasks.get("arithmetic")
  for ex in data.generate_arithmetic(1, "train", 50, digits=3, ops="+*"):
    view = task.rewrite(ex, seed=0)
    a, op, b = view["question"][len("What is "):-1].split(" ")
    assert (int(a) + int(b) if op == "+" else int(a) * int(b)) == int(ex["answer"])
    assert view["question"] != ex["question"] or ex["a"] == ex["b"]
    assert task.reward(ex["solution"], task.reference(view)) == 1.0


def test_countdown_rewrite_preserves_the_solutions():
  task = tasks.get("countdown")
  changed = 0
  for ex in data.generate_countdown(1, "train", 50, difficulty=2):
    view = task.rewrite(ex, seed=3)
    assert sorted(view["numbers"]) == sorted(ex["numbers"]) and view["target"] == ex["target"]
    changed += view["numbers"] != ex["numbers"]
    assert task.reward(f"<answer>{ex['solution']}</answer>", task.reference(view)) == 1.0
    assert task.rewrite(ex, seed=3) == view  # deterministic
  assert changed >= 40


def test_countdown_strategies_are_canonical_structures():
  task = tasks.get("countdown")
  s = lambda e: task.strategy(f"<answer>{e}</answer>")
  assert s("(3+5)*2") == s("2*(5+3)") == s("( 5 + 3 ) * 2")
  assert s("3*2+5*2") != s("(3+5)*2")
  assert s("3+5+2") == s("2+(3+5)") == s("5+2+3")
  assert s("8-3") != s("3-8")
  assert s("1+") is None and task.strategy("no answer") is None


def test_majority_answer_merges_what_the_task_judges_the_same():
  task = tasks.get("math500")
  label, count = tasks.majority_answer(task, ["0.5", r"\frac{1}{2}", "3", "3", None])
  assert count == 2 and label in ("0.5", "3")
  label, count = tasks.majority_answer(task, ["0.5", r"\frac{1}{2}", "1/2", "3", "3"])
  assert (label, count) == ("0.5", 3)
  assert tasks.majority_answer(task, [None, ""]) == (None, 0)


def test_unknown_task_names_the_key():
  with pytest.raises(ValueError, match="data.task: unknown task 'gsm9k'"):
    tasks.get("gsm9k")
