"""Test-time selection: majority vote, best-of-N, best-of-majority, soft self-consistency."""
import numpy as np
import pytest

from rollouts_jax import rewards


def test_majority_vote_select():
    s = rewards.majority_vote_select(["3", "4", None, "4", "3"])
    assert (s.index, s.answer) == (0, "3")     # 2-2 tie: first seen wins
    np.testing.assert_allclose(s.scores, [0.4, 0.4, np.nan, 0.4, 0.4])
    s = rewards.majority_vote_select(["3", "4", "4"])
    assert (s.index, s.answer, s.indices.tolist()) == (1, "4", [1])
    s = rewards.majority_vote_select([None, ""])
    assert (s.index, s.answer, len(s.indices)) == (-1, None, 0)


def test_best_of_n():
    s = rewards.best_of_n([0.1, 0.9, np.nan, 0.9])
    assert s.index == 1 and np.isnan(s.scores[2])
    s = rewards.best_of_n([0.1, 0.9, 0.5], answers=["1", None, "3"])
    assert (s.index, s.answer) == (2, "3")     # the sample without an answer is skipped
    assert rewards.best_of_n([np.nan]).index == -1
    with pytest.raises(ValueError):
        rewards.best_of_n([[0.1]])


def test_best_of_majority_ignores_rare_high_scores():
    answers = ["a", "a", "a", "b", "b", "c"]
    scores = [0.2, 0.3, 0.4, 0.6, 0.8, 0.99]    # c: one lucky reward-model score
    # BoN trusts the reward model and picks the rare answer.
    assert rewards.best_of_n(scores, answers).answer == "c"
    # BoM keeps answers with frequency >= alpha: {a: 1/2, b: 1/3}; b scores higher on average.
    s = rewards.best_of_majority(answers, scores, alpha=0.3)
    assert (s.answer, s.index) == ("b", 4)      # the best-scoring sample of "b"
    np.testing.assert_allclose(s.scores, [0.3, 0.3, 0.3, 0.7, 0.7, 0.99])
    # k = 2 returns both candidates, best first; k larger than |S| returns all of S.
    s = rewards.best_of_majority(answers, scores, alpha=0.3, k=5)
    assert s.answers == ["b", "a"] and s.indices.tolist() == [4, 2]
    # A low threshold admits c.
    assert rewards.best_of_majority(answers, scores, alpha=0.1).answer == "c"
    # max aggregation ranks by each answer's best score.
    assert rewards.best_of_majority(answers, [0.2, 0.3, 0.95, 0.6, 0.8, 0.99], alpha=0.3,
                                    agg="max").answer == "a"


def test_best_of_majority_ties_and_fallback():
    # Equal mean scores: the more frequent answer wins.
    s = rewards.best_of_majority(["a", "b", "b"], [0.5, 0.5, 0.5], alpha=0.0)
    assert s.answer == "b"
    # Nothing reaches alpha: fall back to the most frequent answer.
    s = rewards.best_of_majority(["a", "b", "b", "c"], [0.9, 0.1, 0.2, 0.9], alpha=0.9)
    assert (s.answer, s.index) == ("b", 2)
    s = rewards.best_of_majority([None, None], [0.1, 0.2])
    assert s.index == -1
    with pytest.raises(ValueError):
        rewards.best_of_majority(["a"], [0.1, 0.2])
    with pytest.raises(ValueError):
        rewards.best_of_majority(["a"], [0.1], k=0)


def test_sequence_scores_by_hand():
    p = np.asarray([[0.5, 0.8, 0.9], [0.9, 0.1, 1.0]])
    lp = np.log(p)
    mask = np.asarray([[True, True, False], [True, True, True]])
    np.testing.assert_allclose(rewards.sequence_scores(lp, mask, agg="mean"),
                               [0.65, (0.9 + 0.1 + 1.0) / 3], rtol=1e-6)
    np.testing.assert_allclose(rewards.sequence_scores(lp, mask, agg="min"), [0.5, 0.1], rtol=1e-6)
    np.testing.assert_allclose(rewards.sequence_scores(lp, mask, agg="product"),
                               [0.4, 0.09], rtol=1e-6)
    empty = rewards.sequence_scores(lp, np.zeros_like(mask))
    assert np.isnan(empty).all()
    with pytest.raises(ValueError, match="agg"):
        rewards.sequence_scores(lp, agg="median")
    with pytest.raises(ValueError, match="mask shape"):
        rewards.sequence_scores(lp, mask[:, :2])


def test_soft_self_consistency():
    # One confident "a" against two hesitant "b"s.
    lp = np.log(np.asarray([[0.9, 0.9], [0.5, 0.5], [0.5, 0.6]]))
    answers = ["a", "b", "b"]
    s = rewards.soft_self_consistency(answers, lp)
    assert (s.answer, s.index) == ("a", 0)
    np.testing.assert_allclose(s.scores, [0.9, 0.5, 0.55], rtol=1e-6)
    # Likelihood-weighted votes: 0.9 < 0.5 + 0.55, so "b" (its best sample, index 2).
    s = rewards.soft_self_consistency(answers, lp, combine="sum")
    assert (s.answer, s.index) == ("b", 2)
    # The mask restricts the score to the answer span: only the last token counts here.
    mask = np.asarray([[False, True]] * 3)
    lp2 = np.log(np.asarray([[0.99, 0.2], [0.1, 0.7], [0.1, 0.3]]))
    assert rewards.soft_self_consistency(answers, lp2, mask).answer == "b"
    assert rewards.soft_self_consistency(answers, lp2).answer == "a"
    # Samples without an answer never win; answers=None picks the single best sample.
    assert rewards.soft_self_consistency([None, "b", "b"], lp).answer == "b"
    assert rewards.soft_self_consistency(None, lp).index == 0
    # Soft-SC with identical per-sample scores reduces to majority vote under "sum".
    flat = np.log(np.full((5, 3), 0.7))
    votes = ["x", "y", "y", "z", "y"]
    assert rewards.soft_self_consistency(votes, flat, combine="sum").answer == \
        rewards.majority_vote_select(votes).answer == "y"
    with pytest.raises(ValueError, match="combine"):
        rewards.soft_self_consistency(answers, lp, combine="vote")
