"""pass@k and maj@k: brute-force enumeration, exact rationals, tie and None rules, errors."""

import doctest
import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from rollouts_jax.training import eval_metrics
from rollouts_jax.training.eval_metrics import maj_at_k, majority_answer, mean_pass_at_k, pass_at_k


def _brute_pass_at_k(n, c, k):
  """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_doctests():
  result = doctest.testmod(eval_metrics, raise_on_error=False, verbose=False)
  assert result.attempted >= 8 and result.failed == 0


def test_pass_at_k_matches_subset_enumeration():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_vectorized_equals_scalar_calls():
  rng = np.random.default_rng(0)
  n = rng.integers(4, 40, size=(5, 7))
  c = rng.integers(0, n + 1)
  got = pass_at_k(n, c, 4)
  assert got.shape == (5, 7) and got.dtype == np.float64
  want = np.array([[pass_at_k(int(a), int(b), 4) for a, b in zip(ra, rb)] for ra, rb in zip(n, c)])
  np.testing.assert_array_equal(got, want)
  # Broadcasting a scalar n against an array of c.
  np.testing.assert_array_equal(pass_at_k(16, np.arange(17), 2),
                                [pass_at_k(16, i, 2) for i in range(17)])


def test_pass_at_k_large_n_matches_exact_rational():
  # The binomials here overflow float64; the product form stays accurate.
  for n, c, k in [(1200, 3, 100), (2000, 1, 1), (500, 250, 64), (10000, 17, 1000)]:
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_k_properties():
  assert pass_at_k(10, 0, 5) == 0.0
  assert pass_at_k(10, 1, 10) == 1.0
  assert pass_at_k(10, 6, 5) == 1.0        # n - c < k: every k-subset holds a correct sample
  np.testing.assert_allclose(pass_at_k(12, np.arange(13), 1), np.arange(13) / 12)
  curve = [pass_at_k(32, 5, k) for k in range(1, 33)]
  assert all(a <= b for a, b in zip(curve, curve[1:]))


@pytest.mark.parametrize("n, c, k, match", [
    (4, 1, 5, "k <= num_samples"),
    (4, 1, 0, "k must be >= 1"),
    (4, 5, 2, "num_correct"),
    (4, -1, 2, "num_correct"),
    (4.5, 1, 2, "integers"),
])
def test_pass_at_k_errors(n, c, k, match):
  with pytest.raises(ValueError, match=match):
    pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_int_k():
  with pytest.raises(ValueError, match="k must be an int"):
    pass_at_k(4, 1, 2.0)


def test_mean_pass_at_k():
  rng = np.random.default_rng(1)
  correct = rng.random((6, 8)) < 0.3
  for k in (1, 3, 8):
    want = np.mean([_brute_pass_at_k(8, int(r.sum()), k) for r in correct])
    assert mean_pass_at_k(correct, k) == pytest.approx(want, abs=1e-12)
  assert mean_pass_at_k(correct.astype(np.int32), 2) == mean_pass_at_k(correct, 2)
  with pytest.raises(ValueError, match="2-D"):
    mean_pass_at_k(correct[0], 1)
  with pytest.raises(ValueError, match="k <= num_samples"):
    mean_pass_at_k(correct, 9)
  with pytest.raises(ValueError, match="0/1"):
    mean_pass_at_k(np.full((2, 2), 2), 1)


def _brute_majority(answers):
  """Independent rule: highest count, then earliest first occurrence."""
  valid = [(a, i) for i, a in enumerate(answers) if a is not None]
  if not valid:
    return None
  firsts = {}
  for a, i in valid:
    firsts.setdefault(a, i)
  return min(firsts.values(), key=lambda i: (-answers.count(answers[i]), i))


def test_majority_answer_rules():
  assert majority_answer(["a", "b", "b", "a"]) == 0            # tie -> first occurrence
  assert majority_answer([None, "b", "a", "a"]) == 2
  assert majority_answer([None, None, "x"]) == 2               # None never wins
  assert majority_answer([]) is None
  rng = random.Random(0)
  for _ in range(500):
    answers = [rng.choice(["1", "2", "3", None]) for _ in range(rng.randint(0, 7))]
    assert majority_answer(answers) == _brute_majority(answers), answers


def test_maj_at_k_hand_example_and_prefix():
  answers = [["5", "3", "3", "5", "5"],
             [None, "2", None, "9", "9"],
             [None, None, None, None, None]]
  correct = [[True, False, False, True, True],
             [False, True, False, False, False],
             [False] * 5]
  # k=1: "5" right; prompt 2 has only None -> no vote -> wrong.
  assert maj_at_k(answers, correct, 1) == pytest.approx(1 / 3)
  # k=3: "3" beats "5"; "2" is the only answer -> right.
  assert maj_at_k(answers, correct, 3) == pytest.approx(1 / 3)
  # k=4: "5" and "3" tie at 2 -> "5" came first; "2" vs "9" tie -> "2" first.
  assert maj_at_k(answers, correct, 4) == pytest.approx(2 / 3)
  # k=5: "5" wins; "9" wins over "2".
  assert maj_at_k(answers, correct, 5) == pytest.approx(1 / 3)


def test_maj_at_k_matches_brute_force():
  rng = random.Random(3)
  for _ in range(50):
    n = rng.randint(1, 6)
    answers = [[rng.choice(["1", "2", "3", None]) for _ in range(n)] for _ in range(4)]
    correct = [[a == "2" for a in row] for row in answers]
    for k in range(1, n + 1):
      want = np.mean([(w := _brute_majority(row[:k])) is not None and row[w] == "2"
                      for row in answers])
      assert maj_at_k(answers, correct, k) == pytest.approx(want)


def test_maj_at_k_errors():
  with pytest.raises(ValueError, match="k <= samples per prompt"):
    maj_at_k([["1", "2"]], [[True, False]], 3)
  with pytest.raises(ValueError, match="prompts"):
    maj_at_k([["1"]], [], 1)
  with pytest.raises(ValueError, match="correctness flags"):
    maj_at_k([["1", "2"]], [[True]], 1)
  with pytest.raises(ValueError, match="k must be an int"):
    maj_at_k([["1"]], [[True]], 0)


def test_one_majority_vote_everywhere():
  """maj@k's vote, the task's vote, TTRL's pseudo-label and self-consistency pick the same answer."""
  from rollouts_jax import rewards, tasks
  rng = random.Random(1)
  math = tasks.get("math500")
  for _ in range(300):
    pool = rng.choice([["1", "2", "3"], ["0.5", r"\frac{1}{2}", "1/2", "3", ""]])
    answers = [rng.choice(pool + [None]) for _ in range(rng.randint(0, 8))]
    label, count = rewards.majority_vote(answers)
    idx = majority_answer(answers)
    assert (None if idx is None else answers[idx]) == label, answers
    assert tasks.majority_answer(tasks.get("arithmetic"), answers) == (label, count), answers
    assert rewards.majority_vote_select(answers).answer == label, answers
    # Evaluation merges what the task judges the same, then votes: the task's own vote.
    merged = rewards.canonicalize_answers(answers, math.same)
    idx = majority_answer(merged)
    assert (None if idx is None else merged[idx]) == tasks.majority_answer(math, answers)[0], answers


def test_test_time_selection_rules_pick_different_samples():
  """BoN takes the top-scored sample, BoM the best-scored frequent answer, soft-SC the answer
  whose best sample scores highest; a prompt with no answer counts as wrong."""
  from rollouts_jax.training import evaluation
  answers = [["1", "2", "2", "2"], [None, None, None, None]]
  correct = np.array([[True, False, False, False], [False] * 4])
  scores = np.array([[-0.3, -0.2, -0.9, -0.9], [-0.1, -0.2, -0.3, -0.4]])
  got = evaluation.selection_accuracy(["bon", "bom", "soft_sc"], answers, correct, scores, 4)
  # prompt 0: bon -> sample 1 ("2", wrong); bom: "1" scores -0.3 > mean(-0.2, -0.9, -0.9) -> right;
  # soft-SC (max): "2" has -0.2 > -0.3 -> wrong. Prompt 1: nothing to choose.
  assert got == {"eval/bon@4": 0.0, "eval/bom@4": 0.5, "eval/soft_sc@4": 0.0}
  with pytest.raises(ValueError, match="eval.selection.*'best'"):
    evaluation.Evaluator(None, type("P", (), {"task": None})(), None, k=4, batch_size=8, num_workers=1, timeout_s=1.0,
                         selection=("best",))


def test_selection_rules_run_in_the_loop_from_the_config(tmp_path, monkeypatch):
  import pathlib
  from rollouts_jax.training import config as config_lib, loop
  from rollouts_jax.io.metrics import read_jsonl
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(loop, "plot_curves", lambda *a, **k: [])
  repo = pathlib.Path(__file__).resolve().parents[2]
  config = config_lib.load_config_file(repo / "configs" / "default.py", "smoke")
  config.eval.selection = "bon,bom,soft_sc"
  summary = loop.train(config_lib.from_config_dict(config), tmp_path / "run", progress=False)
  k = config.eval.k
  for when in ("before", "after"):
    for rule in ("bon", "bom", "soft_sc"):
      assert 0.0 <= summary[when][f"eval/{rule}@{k}"] <= summary[when][f"eval/pass@{k}"]
  assert f"eval/bom@{k}" in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]


def test_deeplook_is_a_config_key_of_every_evaluation(tmp_path, monkeypatch):
  """eval.deeplook: DeepLook decodes the same prompts beside plain sampling, in the loop's evaluations."""
  import pathlib
  from rollouts_jax.training import config as config_lib, loop
  with pytest.raises(ValueError, match="eval.deeplook_kwargs: DeepLook has no setting 'depth'"):
    config_lib.from_config_dict({"eval": {"deeplook": True, "deeplook_kwargs": "depth=3"}})
  with pytest.raises(ValueError, match="eval.deeplook_kwargs.*horizon must be >= 1"):
    config_lib.from_config_dict({"eval": {"deeplook": True, "deeplook_kwargs": "horizon=0"}})
  with pytest.raises(ValueError, match="eval.deeplook_kwargs vote_weight"):
    config_lib.from_config_dict({"eval": {"deeplook": True, "deeplook_kwargs": "vote_weight=loud"}})
  with pytest.raises(ValueError, match="eval.deeplook is False"):
    config_lib.from_config_dict({"eval": {"deeplook_kwargs": "k=2"}})
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(loop, "plot_curves", lambda *a, **k: [])
  repo = pathlib.Path(__file__).resolve().parents[2]
  config = config_lib.load_config_file(repo / "configs" / "default.py", "smoke")
  config.eval.deeplook = True
  config.eval.deeplook_kwargs = "k=2,horizon=2,margin=-10.0,rank_by=logprob,vote_weight=likelihood"
  exp = config_lib.from_config_dict(config)
  ev = loop.evaluator(exp, *loop.load_policy(exp, loop.load_task(exp)[0])[::2])
  assert ev.deeplook.k == 2 and ev.deeplook.rank_by == "logprob" and ev.deeplook_vote == "likelihood"
  summary = loop.train(exp, tmp_path / "run", progress=False)
  k = config.eval.k
  for when in ("before", "after"):
    row = summary[when]
    assert 0.0 <= row[f"eval/deeplook@{k}"] <= 1.0
    # margin -10 triggers a lookahead wherever one fits: DeepLook decodes more than plain sampling.
    assert row["eval/deeplook_tokens_per_prompt"] > row["eval/tokens_per_prompt"] > 0
