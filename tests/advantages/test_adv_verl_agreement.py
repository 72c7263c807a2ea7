"""REINFORCE++, REINFORCE++-baseline, OPO, GPG and GRPO pass@k: verl's values, edge cases, properties.

verl itself is not a test dependency (its package imports ray, pandas and tensordict at the
top), so its outputs are written here as numbers: each VERL row is what verl 0.9.1's
`verl.trainer.ppo.core_algos.compute_<estimator>_outcome_advantage` returned (torch float32,
`algorithm.gamma=1`, `norm_adv_by_std_in_grpo=True`) on the same batch laid out its way: one
row per valid sample, `index` = the prompt, the reward on the last response token. verl's
advantage is the same on every token of a response; a masked sample here is a sample verl
never sees. The small cases are also worked by hand in the comments.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages as adv

# name -> (rewards [B, N], lengths [B, N], sample mask [B, N])
CASES = {
    "mixed": ([[1., 0., 0.5], [2.5, 2.5, -1.]], [[3, 1, 2], [2, 2, 4]], [[1, 1, 1], [1, 1, 1]]),
    # rewards that are not 0/1 and not representable in binary; one masked sample (7.0)
    "masked": ([[0.1, 1 / 3, 7.], [1., 0., 0.]], [[2, 3, 1], [1, 4, 2]], [[1, 1, 0], [1, 1, 1]]),
    "all_equal": ([[0.3] * 3, [0.3] * 3], [[1, 2, 3], [3, 2, 1]], [[1, 1, 1], [1, 1, 1]]),
    "single": ([[3.], [0.], [-1.]], [[2], [1], [3]], [[1], [1], [1]]),
    "ties": ([[1., 1., 0.], [0.1, 0.9, 0.9]], [[1, 2, 3], [2, 2, 2]], [[1, 1, 1], [1, 1, 1]]),
}

# verl 0.9.1's advantages of the valid samples, in row-major order.
VERL = {
    "reinforce_pp": {
        "mixed": [0.2045754045, -0.5114385485, -0.1534315795, 1.2785964012, 1.2785964012, -1.2274525165],
        "masked": [-0.2835654318, 0.5104177594, 2.7789411545, -0.6238439679, -0.6238439679],
        "all_equal": [0.] * 6,
        "single": [1.2659240961, -0.2531848252, -0.7595545053],
        "ties": [0.9264253378, 0.9264253378, -1.2114793063, -0.9976888299, 0.7126348615, 0.7126348615],
    },
    "reinforce_pp_baseline": {
        "mixed": [0.5261314511, -0.1644160300, 0.1808577031, 0.9864963889, 0.9864963889, -1.4304199219],
        "masked": [-0.0493132062, 0.7038345933, 2.4791114330, -0.7486647367, -0.7486647367],
        "all_equal": [0.] * 6,
        "single": [1.2659240961, -0.2531848252, -0.7595545053],
        "ties": [0.8852929473, 0.8852929473, -1.2394101620, -0.9561163187, 0.7436460853, 0.7436460853],
    },
    "opo": {
        "mixed": [1 / 3, -2 / 3, -1 / 6, 1.75, 1.75, -1.75],
        "masked": [-0.14, 0.0933333337, 0.8571428657, -0.1428571492, -0.1428571492],
        # verl: 2.98e-08 for the second group (its float32 weighted mean of 0.3s is not 0.3);
        # here exactly 0 (the mean is taken relative to the group maximum).
        "all_equal": [0., 0., 0., 2.9802322387695312e-08, 2.9802322387695312e-08, 2.9802322387695312e-08],
        "single": [3., 0., -1.],
        "ties": [0.5, 0.5, -0.5, -0.5333333015, 0.2666666508, 0.2666666508],
    },
    "gpg": {
        "mixed": [0.6000000238, -0.6000000238, 0., 1.3999999762, 1.3999999762, -2.8000001907],
        "masked": [-0.1944444478, 0.1944444627, 1.1111110449, -0.5555555820, -0.5555555820],
        "all_equal": [0.] * 6,
        "single": [4.5, 0., -1.5],
        "ties": [0.4000000060, 0.4000000060, -0.8000000715, -0.6399999857, 0.3199999928, 0.3199999928],
    },
    "grpo_passk": {
        "mixed": [0.9999979734, 0., 0., 0., 0., 0.],
        "masked": [0., 1.4142050743, 1.7320477962, 0., 0.],
        "all_equal": [0.] * 6,
        # "single": verl raises ("Pass@k requires at least 2 samples per group"); here 0.
        "ties": [0.] * 6,
    },
}


def _run(name, case, **kwargs):
  r, lengths, mask = CASES[case]
  mask = np.asarray(mask, bool)
  values, out_mask = adv.apply(adv.build(name, **kwargs), jnp.asarray(r, jnp.float32), mask=jnp.asarray(mask),
                               lengths=jnp.asarray(lengths))
  values = np.asarray(values)
  assert np.isfinite(values).all() and (values[~mask] == 0).all()
  np.testing.assert_array_equal(np.asarray(out_mask), mask)
  return values[mask]


@pytest.mark.parametrize("name,case", [(n, c) for n in VERL for c in VERL[n]])
def test_matches_verl(name, case):
  got = _run(name, case)
  if case == "all_equal":   # exactly 0 here, whatever verl's round-off
    np.testing.assert_array_equal(got, np.zeros_like(got))
  np.testing.assert_allclose(got, VERL[name][case], rtol=2e-6, atol=2e-7)


def test_hand_computed_cases():
  # REINFORCE++ on "single": rewards (3, 0, -1) over 2 + 1 + 3 = 6 tokens. Token mean (6 + 0 - 3) / 6
  # = 0.5; token variance (2 * 2.5^2 + 0.5^2 + 3 * 1.5^2) / 5 = 19.5 / 5 = 3.9.
  np.testing.assert_allclose(_run("reinforce_pp", "single"), np.array([2.5, -0.5, -1.5]) / math.sqrt(3.9 + 1e-8),
                             rtol=1e-6)
  # OPO on "mixed", group 1: b = (3 * 1 + 1 * 0 + 2 * 0.5) / 6 = 2/3; group 2: b = (5 + 5 - 4) / 8 = 0.75.
  np.testing.assert_allclose(_run("opo", "mixed"), [1 / 3, -2 / 3, -1 / 6, 1.75, 1.75, -1.75], rtol=1e-6)
  # GPG on "mixed": 6 samples, 5 non-zero rewards: alpha = 6/5; group means 0.5 and 4/3.
  np.testing.assert_allclose(_run("gpg", "mixed"), 1.2 * np.array([0.5, -0.5, 0., 7 / 6, 7 / 6, -7 / 3]), rtol=1e-6)
  # pass@k on "masked", group 1 = (0.1, 1/3): margin 0.2333 over the unbiased std 0.2333/sqrt(2).
  np.testing.assert_allclose(_run("grpo_passk", "masked"), [0., math.sqrt(2) / (1 + 1e-6 * 6 / 0.7 / math.sqrt(2)),
                                                            math.sqrt(3) / (1 + 1e-6 * math.sqrt(3)), 0., 0.],
                             rtol=1e-5)


# ------------------------------------------------------------------ edge cases and options

def test_single_sample_groups_follow_verl_or_give_zero():
  # verl takes a lone sample's group mean (OPO: baseline) as 0, so A = r; "zero" keeps GRPO's 0.
  np.testing.assert_allclose(_run("opo", "single"), [3., 0., -1.])
  np.testing.assert_array_equal(_run("opo", "single", single_sample="zero"), [0., 0., 0.])
  np.testing.assert_array_equal(_run("gpg", "single", single_sample="zero"), [0., 0., 0.])
  np.testing.assert_array_equal(_run("reinforce_pp_baseline", "single", single_sample="zero"), [0., 0., 0.])
  np.testing.assert_array_equal(_run("grpo_passk", "single"), [0., 0., 0.])


@pytest.mark.parametrize("name", ["reinforce_pp_baseline", "opo", "gpg", "grpo_passk"])
def test_all_equal_groups_give_exactly_zero(name):
  # Each group equal, the groups different (REINFORCE++ without a baseline is the exception).
  r = jnp.asarray([[0.1, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3], [7., 7., 7.]], jnp.float32)
  values, _ = adv.apply(adv.build(name), r, lengths=jnp.asarray([[1, 5, 2], [3, 3, 9], [2, 1, 4]]))
  np.testing.assert_array_equal(np.asarray(values), np.zeros((3, 3)))


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"])
def test_a_masked_sample_does_not_count(name):
  # Changing the reward or length of a masked sample changes nothing: it is outside every statistic.
  rng = np.random.default_rng(0)
  r = rng.normal(size=(3, 4)).astype(np.float32)
  lengths = rng.integers(1, 9, (3, 4))
  mask = np.ones((3, 4), bool)
  mask[1, 2] = False
  run = lambda r, l: np.asarray(adv.apply(adv.build(name), jnp.asarray(r), mask=jnp.asarray(mask),
                                          lengths=jnp.asarray(l))[0])
  base = run(r, lengths)
  r2, l2 = r.copy(), lengths.copy()
  r2[1, 2], l2[1, 2] = 1e6, 1000
  np.testing.assert_array_equal(run(r2, l2), base)
  assert base[1, 2] == 0


def test_reinforce_pp_whitens_over_the_batch_tokens():
  rng = np.random.default_rng(1)
  r = rng.choice([0., 1., 0.25], (4, 5)).astype(np.float32)
  lengths = rng.integers(1, 12, (4, 5))
  a = np.asarray(adv.apply(adv.reinforce_pp(), jnp.asarray(r), lengths=jnp.asarray(lengths))[0])
  w = lengths.astype(np.float64)
  mean = np.sum(w * a) / w.sum()
  var = np.sum(w * (a - mean) ** 2) / (w.sum() - 1)
  assert abs(mean) < 1e-6 and abs(var - 1) < 1e-5
  # Global, not per prompt: the prompts' means stay apart, and an affine change of the rewards is undone.
  assert np.ptp([np.sum(w[b] * a[b]) / w[b].sum() for b in range(4)]) > 0.1
  a2 = np.asarray(adv.apply(adv.reinforce_pp(), jnp.asarray(3 * r - 2), lengths=jnp.asarray(lengths))[0])
  np.testing.assert_allclose(a2, a, rtol=1e-5, atol=1e-5)
  # weight="samples": every sample once.
  s = np.asarray(adv.apply(adv.reinforce_pp(weight="samples"), jnp.asarray(r))[0])
  np.testing.assert_allclose(s, (r - r.mean()) / np.sqrt(r.var(ddof=1) + 1e-8), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_baseline_ignores_per_prompt_offsets():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(3, 4)).astype(np.float32)
  lengths = jnp.asarray(rng.integers(1, 9, (3, 4)))
  shifted = r + np.array([[5.], [-2.], [0.5]], np.float32)
  a = adv.apply(adv.reinforce_pp_baseline(), jnp.asarray(r), lengths=lengths)[0]
  b = adv.apply(adv.reinforce_pp_baseline(), jnp.asarray(shifted), lengths=lengths)[0]
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_opo_baseline_is_length_weighted():
  rng = np.random.default_rng(3)
  r = rng.normal(size=(3, 5)).astype(np.float32)
  lengths = rng.integers(1, 20, (3, 5))
  a = np.asarray(adv.apply(adv.opo(), jnp.asarray(r), lengths=jnp.asarray(lengths))[0])
  np.testing.assert_allclose(np.sum(lengths * a, axis=1), 0, atol=1e-4)   # zero length-weighted mean
  same = np.asarray(adv.apply(adv.opo(), jnp.asarray(r), lengths=jnp.asarray(3 * lengths))[0])
  np.testing.assert_allclose(same, a, rtol=1e-5, atol=1e-6)
  equal = np.asarray(adv.apply(adv.opo(), jnp.asarray(r), lengths=jnp.full((3, 5), 7))[0])
  np.testing.assert_allclose(equal, np.asarray(adv.apply(adv.dr_grpo(), jnp.asarray(r))[0]), rtol=1e-5, atol=1e-6)


def test_gpg_alpha_counts():
  r = jnp.asarray([[1., 0., 0., 0.], [1., 1., 1., 1.], [0., 0., 0., 0.]])
  dr = np.asarray(adv.apply(adv.dr_grpo(), r)[0])
  # verl: 12 samples, 5 non-zero rewards; the paper: 4 samples in groups that are not uniform.
  np.testing.assert_allclose(np.asarray(adv.apply(adv.gpg(), r)[0]), dr * 12 / 5, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(adv.apply(adv.gpg(count="mixed_group", f_norm=2.), r)[0]),
                             dr * 12 / 4 / 2, rtol=1e-6)
  zeros = jnp.zeros((2, 3))
  np.testing.assert_array_equal(np.asarray(adv.apply(adv.gpg(), zeros)[0]), np.zeros((2, 3)))


def test_passk_credits_only_the_best_sample():
  rng = np.random.default_rng(4)
  r = rng.choice([0., 0.2, 0.5, 1., 3.], (6, 5)).astype(np.float32)
  a = np.asarray(adv.apply(adv.grpo_passk(norm_by_std=False), jnp.asarray(r))[0])
  for b in range(6):
    top = np.sort(r[b])[::-1]
    assert np.count_nonzero(a[b]) <= 1
    assert a[b].sum() == pytest.approx(top[0] - top[1])
    if a[b].any():
      assert r[b, np.flatnonzero(a[b])[0]] == top[0]


def test_jit_and_errors():
  r, m = jnp.asarray([[1., 0., 2.], [0., 0., 1.]]), jnp.asarray([[True, True, False], [True, True, True]])
  lengths = jnp.asarray([[2, 3, 1], [4, 4, 1]])
  for name in ("reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"):
    t = adv.build(name)
    jitted = jax.jit(lambda r, m, l: adv.apply(t, r, mask=m, lengths=l))(r, m, lengths)
    eager = adv.apply(t, r, mask=m, lengths=lengths)
    np.testing.assert_allclose(np.asarray(jitted[0]), np.asarray(eager[0]), rtol=1e-6, atol=1e-7)
  for name in ("reinforce_pp", "opo"):
    with pytest.raises(ValueError, match="lengths"):
      adv.apply(adv.build(name), r)
  with pytest.raises(ValueError, match="rl.advantage_kwargs"):
    adv.build("gpg", alpha=2.)
  with pytest.raises(ValueError, match="count"):
    adv.build("gpg", count="valid")
  with pytest.raises(ValueError, match="single_sample"):
    adv.build("opo", single_sample="drop")
  with pytest.raises(ValueError, match="weight"):
    adv.build("reinforce_pp", weight="sequences")
