"""Cluster-id functions for uniqueness weighting."""
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages as adv
from rollouts_jax.advantages import clustering


def test_canonical_ids_invariant_to_relabeling():
  a = clustering.canonical_ids(["x", "y", "x", "z", "y"])
  b = clustering.canonical_ids([7, 3, 7, 1, 3])
  np.testing.assert_array_equal(a, [0, 1, 0, 3, 1])
  np.testing.assert_array_equal(a, b)


def test_cluster_by_answer():
  ids = adv.cluster_by_answer([["42", " 42 ", "7", None, ""], ["a", "A", "b", "a", "c"]])
  np.testing.assert_array_equal(ids, [[0, 0, 2, 3, 4], [0, 0, 2, 0, 4]])
  assert ids.dtype == np.int32
  ids = adv.cluster_by_answer([["1/2", "0.5"]], normalize=lambda s: round(eval(s), 6))
  np.testing.assert_array_equal(ids, [[0, 0]])


def test_cluster_by_judge_and_fallback_to_singletons():
  judge = lambda texts, problem=None: ["alg" if "x" in t else "geo" for t in texts]
  ids = adv.cluster_by_judge([["x=1", "draw", "x=2"], ["a", "b", "c"]], judge)
  np.testing.assert_array_equal(ids, [[0, 1, 0], [0, 0, 0]])

  def flaky(texts, problem=None):
    if problem == "bad":
      raise RuntimeError("judge down")
    return [0] * (len(texts) - (problem == "short"))

  ids = adv.cluster_by_judge([["a", "b"], ["c", "d"], ["e", "f"]], flaky,
                             problems=["ok", "bad", "short"])
  np.testing.assert_array_equal(ids, [[0, 0], [0, 1], [0, 1]])


def test_pairwise_and_llm_judges():
  calls = []

  def same(a, b):
    calls.append((a, b))
    return a[0] == b[0]

  ids = adv.cluster_by_judge([["ab", "cd", "ax", "ce"]], adv.pairwise_judge(same))
  np.testing.assert_array_equal(ids, [[0, 1, 0, 1]])
  assert len(calls) <= 4 * 3 // 2

  prompts = []

  def complete(prompt):
    prompts.append(prompt)
    return "Solution 1: 2\nSolution 2: 1\nsolution 3 - strategy 2\n"

  ids = adv.cluster_by_judge([["p", "q", "r"]], adv.llm_judge(complete), problems=["1+1"])
  np.testing.assert_array_equal(ids, [[0, 1, 0]])
  assert "1+1" in prompts[0] and "Solution 3:\nr" in prompts[0]
  garbled = adv.cluster_by_judge([["p", "q"]], adv.llm_judge(lambda p: "no idea"))
  np.testing.assert_array_equal(garbled, [[0, 1]])
  with pytest.raises(ValueError, match="1..3"):
    clustering.parse_judge_reply("Solution 1: 1", 3)


def test_singletons_reduce_uniqueness_to_grpo():
  r = jnp.array([[1., 1., 0., 1.]])
  ids = adv.cluster_by_judge([["a", "b", "c", "d"]], lambda t, problem=None: 1 / 0)
  v, _ = adv.apply(adv.uniqueness_grpo(alpha=1.), r, cluster_ids=jnp.asarray(ids))
  g, _ = adv.apply(adv.grpo(), r)
  np.testing.assert_allclose(v, g, rtol=1e-6)


def test_bad_groups_raise():
  with pytest.raises(ValueError, match="same number"):
    adv.cluster_by_answer([["a"], ["a", "b"]])
  with pytest.raises(ValueError, match="at least one"):
    adv.cluster_by_judge([], lambda t: t)
  with pytest.raises(ValueError, match="problems"):
    adv.cluster_by_judge([["a"]], lambda t: t, problems=["x", "y"])
