"""Property tests (hypothesis) for the advantage transforms."""
import os
import sys

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from adv_cases import CASES, make_extras  # noqa: E402

from rollouts_jax import advantages as adv  # noqa: E402

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)
REWARD = st.one_of(st.sampled_from([0., 1., 2., 0.5]),
                   st.integers(-30, 30).map(lambda x: x / 10))


@st.composite
def batches(draw, odd_n=False):
  # Few distinct shapes (each new shape compiles); ragged groups come from the mask.
  b, n = draw(st.sampled_from([(1, 1), (2, 3), (3, 5), (3, 7)] if odd_n else
                              [(1, 1), (3, 1), (2, 4), (3, 8)]))
  rewards = draw(hnp.arrays(np.float32, (b, n), elements=REWARD))
  mask = draw(hnp.arrays(np.bool_, (b, n)))
  seed = draw(st.integers(0, 2**16))
  return rewards, mask, seed


def _run(name, rewards, mask, extras):
  t = CASES[name][0]()
  values, out_mask = adv.apply(t, jnp.asarray(rewards), mask=jnp.asarray(mask), **extras)
  return np.asarray(values), np.asarray(out_mask)


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=batches())
def test_masked_entries_zero_and_finite(name, data):
  rewards, mask, seed = data
  extras = make_extras(np.random.default_rng(seed), *rewards.shape)
  values, out_mask = _run(name, rewards, mask, extras)
  assert np.isfinite(values).all()
  assert not (out_mask & ~mask).any(), "a transform may only remove samples from the mask"
  assert (values[~out_mask] == 0).all()


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[1]))
@SETTINGS
@given(data=batches(), const=st.lists(REWARD, min_size=3, max_size=3))
def test_all_equal_groups_give_exactly_zero(name, data, const):
  _, mask, seed = data
  b, n = mask.shape
  rewards = np.repeat(np.asarray(const[:b], np.float32)[:, None], n, axis=1)
  extras = make_extras(np.random.default_rng(seed), b, n)
  values, _ = _run(name, rewards, mask, extras)
  np.testing.assert_array_equal(values, np.zeros_like(values))


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[1]))
def test_single_sample_groups_give_zero(name):
  rewards = np.array([[3.], [0.], [-1.]], np.float32)
  extras = make_extras(np.random.default_rng(0), 3, 1)
  values, _ = _run(name, rewards, np.ones((3, 1), bool), extras)
  np.testing.assert_array_equal(values, np.zeros((3, 1)))


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=batches())
def test_permuting_a_group_permutes_the_output(name, data):
  rewards, mask, seed = data
  rng = np.random.default_rng(seed)
  b, n = rewards.shape
  extras = make_extras(rng, b, n)
  perm = np.stack([rng.permutation(n) for _ in range(b)])
  take = lambda x: np.take_along_axis(np.asarray(x), perm, axis=1)
  p_extras = dict(extras, cluster_ids=jnp.asarray(take(extras["cluster_ids"])),
                  seq_logprobs=jnp.asarray(take(extras["seq_logprobs"])))
  values, out_mask = _run(name, rewards, mask, extras)
  p_values, p_mask = _run(name, take(rewards), take(mask), p_extras)
  np.testing.assert_allclose(p_values, take(values), rtol=1e-5, atol=1e-5)
  if not CASES[name][2]:
    np.testing.assert_array_equal(p_mask, take(out_mask))
  else:
    # Under ties the pivot may be another sample with the same (median) reward.
    np.testing.assert_array_equal(p_mask.sum(1), out_mask.sum(1))
    dropped = lambda m_in, m_out, r: np.sort(np.where(m_in & ~m_out, r, np.inf), axis=1)
    np.testing.assert_array_equal(dropped(take(mask), p_mask, take(rewards)),
                                  dropped(mask, out_mask, rewards))


@SETTINGS
@given(data=batches(odd_n=True), full=st.booleans())
def test_mc_grpo_exactly_one_pivot_per_group(data, full):
  rewards, mask, _ = data
  if full:
    mask = np.ones_like(mask)
  for t in (adv.mc_grpo(), adv.group_median_baseline(scale="std", compensate=True)):
    values, out_mask = adv.apply(t, jnp.asarray(rewards), mask=jnp.asarray(mask))
    values, out_mask = np.asarray(values), np.asarray(out_mask)
    dropped = mask & ~out_mask
    has_any = mask.any(1)
    np.testing.assert_array_equal(dropped.sum(1), has_any.astype(int))
    for b in np.flatnonzero(has_any):
      r = rewards[b][mask[b]]
      pivot_r = rewards[b][dropped[b]][0]
      k = (len(r) - 1) // 2
      assert pivot_r == np.sort(r)[k]  # the pivot sits at the (lower) median
      # At most k samples strictly below / above the median; they keep the gradient.
      assert (r < pivot_r).sum() <= k and (r > pivot_r).sum() <= len(r) - 1 - k
      if len(r) % 2 == 1:
        assert (r > pivot_r).sum() <= k


def _np_group(rewards, mask, fn):
  out = np.zeros_like(rewards, dtype=np.float64)
  for b in range(rewards.shape[0]):
    idx = np.flatnonzero(mask[b])
    if len(idx):
      out[b, idx] = fn(rewards[b, idx].astype(np.float64))
  return out


def _np_grpo(r):
  std = np.std(r, ddof=1) if len(r) > 1 else 0.
  return (r - r.mean()) / (std + 1e-4)


def _np_rloo(r):
  n = len(r)
  return np.array([r[i] - np.delete(r, i).mean() for i in range(n)]) if n > 1 else 0 * r


def _np_median(r):
  med = np.sort(r)[(len(r) - 1) // 2]
  return r - med


@pytest.mark.parametrize("name, ref", [("grpo", _np_grpo), ("rloo", _np_rloo),
                                       ("dr_grpo", lambda r: r - r.mean()),
                                       ("median_none", _np_median)])
@SETTINGS
@given(data=batches())
def test_matches_numpy_reference(name, ref, data):
  rewards, mask, _ = data
  values, _ = _run(name, rewards, mask, {})
  expected = _np_group(rewards, mask, ref)
  out_mask = np.asarray(_run(name, rewards, mask, {})[1])
  np.testing.assert_allclose(values, np.where(out_mask, expected, 0), rtol=1e-4, atol=1e-4)


CHAINS = [
    (adv.group_median_baseline, lambda: adv.scale_by_group_std(ddof=0), lambda: adv.clip(1.5)),
    (adv.group_mean_baseline, adv.scale_by_group_std, adv.uniqueness_reweight,
     adv.novelty_sharpen),
    (adv.leave_one_out_baseline, adv.scale_by_batch_std),
]


@pytest.mark.parametrize("factories", CHAINS, ids=["median", "grpo_unique_novelty", "rloo_batch"])
@SETTINGS
@given(data=batches())
def test_chain_equals_applying_by_hand(factories, data):
  rewards, mask, seed = data
  extras = make_extras(np.random.default_rng(seed), *rewards.shape)
  r, m0 = jnp.asarray(rewards), jnp.asarray(mask)
  t = adv.chain(*(f() for f in factories))
  values, out_mask, state = t.update(r, t.init(), mask=m0, **extras)
  assert isinstance(state, adv.ChainState) and len(state.inner) == len(factories)
  v, m = r, m0
  for f in factories:
    tf = f()
    v, m, _ = tf.update(v, tf.init(), mask=m, group_mask=m0, rewards=r, **extras)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(v))
  np.testing.assert_array_equal(np.asarray(out_mask), np.asarray(m))
  # A single-element chain is the transform itself.
  tf = factories[0]()
  v1, m1, _ = tf.update(r, tf.init(), mask=m0, **extras, rewards=r)
  v2, m2 = adv.apply(adv.chain(factories[0]()), r, mask=m0, **extras)
  np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2))
  np.testing.assert_array_equal(np.asarray(m1), np.asarray(m2))
