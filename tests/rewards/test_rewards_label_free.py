"""Label-free rewards: TTRL majority vote, DARE, Co-Reward (hand-computed examples + invariants)."""
import fractions

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax import rewards

answers_st = st.lists(st.one_of(st.none(), st.sampled_from(["1", "2", "3", "4"])), min_size=1,
                      max_size=12)


def test_majority_vote_ties_and_empty():
    assert rewards.majority_vote(["2", "1", "1", "2"]) == ("2", 2)   # tie: first seen
    assert rewards.majority_vote([None, "", "3"]) == ("3", 1)
    assert rewards.majority_vote([None, ""]) == (None, 0)
    labels, counts, inverse = rewards.answer_counts(["b", None, "a", "b"])
    assert labels == ["b", "a"] and counts.tolist() == [2, 1] and inverse.tolist() == [0, -1, 1, 0]


def test_ttrl_reward():
    r = rewards.ttrl_reward(["4", "5", "4", None, "4"])
    assert r.dtype == np.float32 and r.tolist() == [1, 0, 1, 0, 1]
    assert rewards.ttrl_reward([None, None]).tolist() == [0, 0]   # no label: all zero
    assert rewards.ttrl_reward(["7"] * 4).tolist() == [1] * 4      # unanimous: all one
    # With an equivalence, "0.5" agrees with the label "1/2" although the vote counts strings.
    def same(a, b):
        return fractions.Fraction(a) == fractions.Fraction(b)

    assert rewards.ttrl_reward(["1/2", "1/2", "0.5", "3"], same=same).tolist() == [1, 1, 1, 0]


@settings(max_examples=100, deadline=None)
@given(answers_st)
def test_ttrl_is_indicator_of_the_mode(answers):
    r = rewards.ttrl_reward(answers)
    label, count = rewards.majority_vote(answers)
    assert r.sum() == count
    assert all((ri == 1.0) == (a is not None and a == label) for ri, a in zip(r, answers))


def test_dare_without_uncertainty_is_the_answer_distribution():
    answers = ["a", "a", "a", "b", None, "c"]
    r = rewards.dare_reward(answers, alpha=0.0, prune=False)
    np.testing.assert_allclose(r, [3 / 5, 3 / 5, 3 / 5, 1 / 5, 0, 1 / 5], rtol=1e-6)
    # With the bonus: b(y) = 1 - n(y)/M  (u = 0).
    r = rewards.dare_reward(answers, alpha=0.5, prune=False)
    np.testing.assert_allclose(r, [0.6 + 0.5 * 0.4] * 3 + [0.2 + 0.5 * 0.8, 0, 0.2 + 0.5 * 0.8],
                               rtol=1e-6)


def test_dare_hand_computed_with_uncertainty_and_pruning():
    answers = ["a", "a", "a", "b", "b", "c"]
    u = [0.2, 0.4, 0.3, 0.6, 0.6, 0.9]          # u(a) = 0.3, u(b) = 0.6, u(c) = 0.9
    # Normalised by the max: u = 1/3, 2/3, 1; n/u = 9, 3, 1  ->  p = 9/13, 3/13, 1/13.
    p = np.asarray([9, 3, 1]) / 13
    b = np.asarray([(1 - 3 / 6) * (1 - 1 / 3), (1 - 2 / 6) * (1 - 2 / 3), 0.0])
    no_prune = rewards.dare_reward(answers, u, alpha=0.5, prune=False)
    np.testing.assert_allclose(no_prune, np.repeat(p + 0.5 * b, [3, 2, 1]), rtol=1e-5)
    # tau = 0.1 prunes c (p = 1/13); kept: p~ = 9/12, 3/12; M~ = 5; u~ = 0.3/0.6, 0.6/0.6.
    pruned = rewards.dare_reward(answers, u, alpha=0.5, tau=0.1)
    expected = [0.75 + 0.5 * (1 - 3 / 5) * 0.5] * 3 + [0.25 + 0.0] * 2 + [0.0]
    np.testing.assert_allclose(pruned, expected, rtol=1e-5)
    assert rewards.dare_reward(answers, u, alpha=0.5, tau=0.1, pruned_reward=-1.0)[-1] == -1.0
    # A fixed scale (e.g. log V) instead of the group maximum.
    scaled = rewards.dare_reward(answers, u, alpha=0.0, prune=False, uncertainty_scale=1.0)
    w = np.asarray([3 / 0.3, 2 / 0.6, 1 / 0.9])
    np.testing.assert_allclose(scaled, np.repeat(w / w.sum(), [3, 2, 1]), rtol=1e-5)


def test_dare_edge_cases():
    np.testing.assert_allclose(rewards.dare_reward(["x"] * 5, [0.3] * 5), 1.0)  # unanimous
    assert rewards.dare_reward([None, None]).tolist() == [0.0, 0.0]
    # tau above every p keeps only the mode (all modes when they tie).
    r = rewards.dare_reward(["a", "a", "b", "c"], tau=0.9, alpha=0.0)
    assert r.tolist() == [1.0, 1.0, 0.0, 0.0]
    r = rewards.dare_reward(["a", "b", "c", "d"], tau=0.9, alpha=0.0)
    assert r.tolist() == [0.25] * 4
    with pytest.raises(ValueError, match="shape"):
        rewards.dare_reward(["a", "b"], [0.1])
    with pytest.raises(ValueError, match=">= 0"):
        rewards.dare_reward(["a", "b"], [0.1, -1.0])
    with pytest.raises(ValueError, match="alpha"):
        rewards.dare_reward(["a"], alpha=-1)


@settings(max_examples=100, deadline=None)
@given(answers_st, st.randoms(use_true_random=False))
def test_dare_is_permutation_equivariant_and_ranks_by_frequency(answers, rnd):
    u = [rnd.random() for _ in answers]
    perm = list(range(len(answers)))
    rnd.shuffle(perm)
    r = rewards.dare_reward(answers, u, tau=0.05)
    r_perm = rewards.dare_reward([answers[i] for i in perm], [u[i] for i in perm], tau=0.05)
    np.testing.assert_allclose(r_perm, r[perm], rtol=1e-5, atol=1e-7)
    # Without uncertainty, bonus or pruning, a more frequent answer never earns less.
    plain = rewards.dare_reward(answers, alpha=0.0, prune=False)
    _, counts, inv = rewards.answer_counts(answers)
    for i in range(len(answers)):
        for j in range(len(answers)):
            if inv[i] >= 0 and inv[j] >= 0 and counts[inv[i]] > counts[inv[j]]:
                assert plain[i] > plain[j]
    if (inv >= 0).any():
        # p sums to one over the distinct answers.
        firsts = [int(np.flatnonzero(inv == k)[0]) for k in range(len(counts))]
        np.testing.assert_allclose(plain[firsts].sum(), 1.0, rtol=1e-5)


def test_co_reward_cross_labels():
    original = ["4", "5", "4", None]
    rephrased = ["5", "5", "4"]
    r_orig, r_reph = rewards.co_reward(original, rephrased)
    assert r_orig.tolist() == [0, 1, 0, 0]      # label from the rephrasing: "5"
    assert r_reph.tolist() == [0, 0, 1]         # label from the original: "4"
    r_orig, r_reph = rewards.co_reward(["4", "4"], [None, ""])
    assert r_orig.tolist() == [0, 0] and r_reph.tolist() == [0, 0]
    # Agreeing views reward the shared majority.
    r_orig, r_reph = rewards.co_reward(["1", "1", "2"], ["1", "3", "1"])
    assert r_orig.tolist() == [1, 1, 0] and r_reph.tolist() == [1, 0, 1]


def test_apply_per_prompt_and_canonicalize():
    batch = [["1", "1", "2"], ["3", None, "3"]]
    out = rewards.apply_per_prompt(rewards.ttrl_reward, batch)
    assert out.shape == (2, 3) and out.dtype == np.float32
    assert out.tolist() == [[1, 1, 0], [1, 0, 1]]
    u = np.asarray([[0.1, 0.1, 0.5], [0.2, 0.0, 0.2]])
    dare = rewards.apply_per_prompt(rewards.dare_reward, batch, u, alpha=0.0, prune=False)
    np.testing.assert_allclose(dare[1], [1.0, 0.0, 1.0])
    assert rewards.canonicalize_answers(["a", "A", "b", None], lambda x, y: x.lower() == y.lower()) \
        == ["a", "a", "b", None]
