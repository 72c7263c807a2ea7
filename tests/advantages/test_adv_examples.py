"""Hand-computed examples for the advantage transforms and recipes."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages as adv


def _apply(t, rewards, /, mask=None, **extra):
  values, m = adv.apply(t, jnp.asarray(rewards, jnp.float32),
                        mask=None if mask is None else jnp.asarray(mask), **extra)
  return np.asarray(values), np.asarray(m)


# ------------------------------------------------------------------ GRPO / Dr. GRPO / RLOO

def test_grpo_hand_computed():
  # Group 1: mean 1/4, unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
  # Group 2: mean 1, deviations (1, 0, -1, 0), unbiased var 2/3.
  r = [[1., 0., 0., 0.], [2., 1., 0., 1.]]
  values, mask = _apply(adv.grpo(), r)
  s2 = math.sqrt(2 / 3)
  expected = [[0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4)],
              [1 / (s2 + 1e-4), 0., -1 / (s2 + 1e-4), 0.]]
  np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)
  assert mask.all()


def test_grpo_population_std_and_ragged_mask():
  # The masked sample (reward 5) takes no part: mean over (1, 0, 0) = 1/3, pop. std = sqrt(2)/3.
  r = [[1., 0., 5., 0.]]
  values, mask = _apply(adv.grpo(eps=0., ddof=0), r, mask=[[True, True, False, True]])
  s = math.sqrt(2) / 3
  np.testing.assert_allclose(values, [[(2 / 3) / s, (-1 / 3) / s, 0., (-1 / 3) / s]], rtol=1e-6)
  np.testing.assert_array_equal(mask, [[True, True, False, True]])


def test_dr_grpo_hand_computed():
  values, _ = _apply(adv.dr_grpo(), [[1., 0., 0., 0.], [3., 3., 0., 2.]])
  np.testing.assert_allclose(values, [[0.75, -0.25, -0.25, -0.25], [1., 1., -2., 0.]], atol=1e-7)


def test_rloo_hand_computed():
  # r_i - mean of the others.
  values, _ = _apply(adv.rloo(), [[1., 0., 0., 0.]])
  np.testing.assert_allclose(values, [[1., -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
  values, mask = _apply(adv.rloo(), [[3., 1., 9., 2.]], mask=[[True, True, False, True]])
  np.testing.assert_allclose(values, [[3 - 1.5, 1 - 2.5, 0., 2 - 2.]], rtol=1e-6, atol=1e-7)
  values, _ = _apply(adv.rloo(), [[4.], [2.]])  # N = 1: nothing to leave out.
  np.testing.assert_array_equal(values, [[0.], [0.]])


def test_batch_std_and_clip():
  r = [[1., -1.], [3., -3.]]
  values, _ = _apply(adv.scale_by_batch_std(eps=0., ddof=0), r)
  np.testing.assert_allclose(values, np.asarray(r) / math.sqrt(5), rtol=1e-6)
  values, _ = _apply(adv.clip(2.), r)
  np.testing.assert_array_equal(values, [[1., -1.], [2., -2.]])


# ------------------------------------------------------------------ MC-GRPO

def test_mc_grpo_hand_computed():
  values, mask = _apply(adv.group_median_baseline(), [[0., 1., 3.]])
  np.testing.assert_array_equal(values, [[-1., 0., 2.]])
  np.testing.assert_array_equal(mask, [[True, False, True]])
  # MAD of (1, 0, 2) is 1.
  values, mask = _apply(adv.mc_grpo(), [[0., 1., 3.]])
  np.testing.assert_allclose(values, [[-1 / (1 + 1e-6), 0., 2 / (1 + 1e-6)]], rtol=1e-6)
  np.testing.assert_array_equal(mask, [[True, False, True]])


def test_mc_grpo_ties_one_pivot_at_stable_rank():
  # Stable order of (1, 1, 1, 0, 1): index 3, then 0, 1, 2, 4; rank 2 is index 1.
  values, mask = _apply(adv.group_median_baseline(), [[1., 1., 1., 0., 1.]])
  np.testing.assert_array_equal(mask, [[True, False, True, True, True]])
  np.testing.assert_array_equal(values, [[0., 0., 0., -1., 0.]])


def test_mc_grpo_binary_rewards_reference_blows_up_guard_does_not():
  r = [[1., 0., 0.]]
  ref_values, _ = _apply(adv.mc_grpo(mad_fallback=False, eps=1e-3), r)
  np.testing.assert_allclose(ref_values, [[1000., 0., 0.]], rtol=1e-5)  # the reference's MAD+1e-3
  values, mask = _apply(adv.mc_grpo(), r)
  # MAD = 0 -> fall back to the unbiased std of (1, 0, 0) = sqrt(1/3).
  np.testing.assert_allclose(values, [[1 / (math.sqrt(1 / 3) + 1e-6), 0., 0.]], rtol=1e-5)
  np.testing.assert_array_equal(mask.sum(-1), [2])


@pytest.mark.parametrize("n", [3, 5, 9, 17, 65])
def test_mc_grpo_binary_rewards_bounded_by_about_sqrt_n(n):
  rng = np.random.default_rng(n)
  r = (rng.random((256, n)) < rng.random((256, 1))).astype(np.float32)
  values, _ = _apply(adv.mc_grpo(), r)
  assert np.isfinite(values).all()
  assert np.abs(values).max() <= n / math.sqrt(n - 1) + 1e-4


def test_mc_grpo_compensation_and_eval_mode():
  r = [[0., 1., 1., 1., 2.]]
  values, mask = _apply(adv.mc_grpo(scale="none", compensate=True), r)
  # Two non-zero advantages out of 5 samples -> multiplied by 5/2.
  np.testing.assert_allclose(values, [[-2.5, 0., 0., 0., 2.5]])
  values, mask = _apply(adv.mc_grpo(scale="none", exclude_pivot=False), r)
  assert mask.all()


def test_mc_grpo_even_group_uses_lower_median():
  values, mask = _apply(adv.group_median_baseline(), [[4., 1., 2., 3.]])
  np.testing.assert_array_equal(values, [[2., -1., 0., 1.]])
  np.testing.assert_array_equal(mask, [[True, True, False, True]])


def test_chain_after_pivot_uses_full_group_statistics():
  # The pivot is off the loss but still counts in the std (statistics before filtering).
  r = jnp.array([[0., 1., 3.]])
  t = adv.chain(adv.group_median_baseline(), adv.scale_by_group_std(eps=0., ddof=0))
  values, mask = adv.apply(t, r)
  std_full = np.std([-1., 0., 2.])
  np.testing.assert_allclose(values, [[-1 / std_full, 0., 2 / std_full]], rtol=1e-6)


# ------------------------------------------------------------------ uniqueness

def test_uniqueness_grpo_hand_computed():
  # GRPO: mean 3/4, unbiased std 0.5 -> (0.5, 0.5, 0.5, -1.5). Correct sizes (2, 2, 1) ->
  # w = (1/2, 1/2, 1), mean 2/3 -> (3/4, 3/4, 3/2).
  r = [[1., 1., 1., 0.]]
  ids = jnp.array([[0, 0, 1, 2]])
  values, _ = _apply(adv.uniqueness_grpo(alpha=1., eps=0.), r, cluster_ids=ids)
  np.testing.assert_allclose(values, [[0.375, 0.375, 0.75, -1.5]], rtol=1e-6)
  # Without renormalization.
  values, _ = _apply(adv.uniqueness_grpo(alpha=1., eps=0., renormalize=False), r, cluster_ids=ids)
  np.testing.assert_allclose(values, [[0.25, 0.25, 0.5, -1.5]], rtol=1e-6)


def test_uniqueness_alpha_zero_is_grpo_and_ids_are_labels_only():
  rng = np.random.default_rng(0)
  r = jnp.asarray((rng.random((4, 6)) < 0.5).astype(np.float32))
  ids = jnp.asarray(rng.integers(0, 3, (4, 6)))
  base_vals, _ = adv.apply(adv.grpo(), r)
  v0, _ = adv.apply(adv.uniqueness_grpo(alpha=0.), r, cluster_ids=ids)
  np.testing.assert_allclose(v0, base_vals, rtol=1e-6)
  v1, _ = adv.apply(adv.uniqueness_grpo(alpha=1.), r, cluster_ids=ids)
  v2, _ = adv.apply(adv.uniqueness_grpo(alpha=1.), r, cluster_ids=ids * 1000 - 7)
  np.testing.assert_allclose(v1, v2, rtol=1e-6)
  # Renormalized: mean weight of correct samples is 1 -> their advantage sum is unchanged.
  correct = np.asarray(r) > 0
  np.testing.assert_allclose((np.asarray(v1) * correct).sum(-1),
                             (np.asarray(base_vals) * correct).sum(-1), rtol=1e-5, atol=1e-6)
  # Incorrect samples are untouched.
  np.testing.assert_allclose(np.asarray(v1)[~correct], np.asarray(base_vals)[~correct], rtol=1e-6)


def test_uniqueness_count_all():
  values, _ = _apply(adv.uniqueness_reweight(alpha=1., count="all", renormalize=False),
                     [[1., 1., -1.]], cluster_ids=jnp.array([[0, 1, 1]]),
                     rewards=jnp.array([[1., 1., 0.]]))
  np.testing.assert_allclose(values, [[1., 0.5, -1.]])


# ------------------------------------------------------------------ XRPO / PVPO

def test_novelty_sharpen_hand_computed():
  a = jnp.array([[1., 1., 1., -3.]])
  s = jnp.array([[-2., -1., -1., -1.]])  # mean -1.25
  r = jnp.array([[1., 1., 1., 0.]])
  values, _ = _apply(adv.novelty_sharpen(lam=1., kappa=0.5), a, seq_logprobs=s, rewards=r)
  eta = np.exp(np.array([-0.75, 0.25, 0.25, 0.25]))
  bonus = np.minimum(np.maximum(1 - eta, 0), 0.5 * np.abs([1., 1., 1., -3.]))
  expected = np.array([1., 1., 1., -3.]) + bonus * np.array([1, 1, 1, 0])
  np.testing.assert_allclose(values, [expected], rtol=1e-6)
  assert values[0, 0] > 1 and values[0, 1] == 1 and values[0, 3] == -3
  # Ungated: the incorrect sample is likely (eta > 1), so no bonus either.
  v2, _ = _apply(adv.novelty_sharpen(lam=1., kappa=0.5, correct_only=False), a, seq_logprobs=s)
  np.testing.assert_allclose(v2, values, rtol=1e-6)


def test_reference_anchor():
  r = [[1., 1., 1.], [0., 1., 1.]]
  ref = jnp.array([[0., 1., 0., 0.], [1., 1., 1., 1.]])
  values, _ = _apply(adv.reference_anchor(), r, ref_rewards=ref)
  np.testing.assert_allclose(values, [[0.75, 0.75, 0.75], [-1., 0., 0.]])
  # Per-prompt means and a prompt with no reference (falls back to its own mean).
  values, _ = _apply(adv.reference_anchor(), r, ref_rewards=jnp.array([[0.25, 9.], [1., 9.]]),
                     ref_mask=jnp.array([[True, False], [False, False]]))
  np.testing.assert_allclose(values, [[0.75, 0.75, 0.75], [-2 / 3, 1 / 3, 1 / 3]], rtol=1e-6)
  values, _ = _apply(adv.reference_anchor(), r, ref_rewards=jnp.array([0.25, 1.]))
  np.testing.assert_allclose(values, [[0.75, 0.75, 0.75], [-1., 0., 0.]])


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("call, match", [
    (lambda: adv.apply(adv.grpo(), jnp.zeros(4)), "shape \\[B, N\\]"),
    (lambda: adv.apply(adv.grpo(), jnp.zeros((2, 3)), mask=jnp.ones((2, 2), bool)), "mask"),
    (lambda: adv.apply(adv.uniqueness_grpo(), jnp.zeros((2, 3))), "cluster_ids"),
    (lambda: adv.apply(adv.uniqueness_grpo(), jnp.zeros((2, 3)), cluster_ids=jnp.zeros((2, 2), int)),
     "cluster_ids"),
    (lambda: adv.apply(adv.novelty_sharpen(), jnp.zeros((2, 3))), "seq_logprobs"),
    (lambda: adv.novelty_sharpen().update(jnp.zeros((1, 2)), (), seq_logprobs=jnp.zeros((1, 2))),
     "rewards"),
    (lambda: adv.apply(adv.reference_anchor(), jnp.zeros((2, 3))), "ref_rewards"),
    (lambda: adv.apply(adv.reference_anchor(), jnp.zeros((2, 3)), ref_rewards=jnp.zeros((3, 3))),
     "rows"),
    (lambda: adv.group_median_baseline(scale="iqr"), "scale"),
    (lambda: adv.uniqueness_reweight(alpha=-1.), "alpha"),
    (lambda: adv.clip(0.), "max_abs"),
    (lambda: adv.chain(adv.grpo(), lambda x: x), "AdvantageTransform"),
    (lambda: adv.apply(lambda x: x, jnp.zeros((1, 2))), "AdvantageTransform"),
    (lambda: adv.grpo().update(jnp.zeros((1, 2)), ()), "state"),
])
def test_bad_input_raises_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()
