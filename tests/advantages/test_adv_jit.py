"""Every transform and recipe is jittable, does not retrace on a second call, and agrees with eager
execution on large groups."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adv_cases import CASES, make_extras  # noqa: E402

from rollouts_jax import advantages as adv  # noqa: E402


def _inputs(seed, b, n):
  rng = np.random.default_rng(seed)
  rewards = jnp.asarray(rng.integers(0, 3, (b, n)), jnp.float32)
  mask = jnp.asarray(rng.random((b, n)) < 0.9)
  return rewards, mask, make_extras(rng, b, n)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_matches_eager_and_does_not_retrace(name):
  t = CASES[name][0]()
  traces = []

  @jax.jit
  def f(rewards, mask, extras):
    traces.append(1)  # runs only while tracing
    return adv.apply(t, rewards, mask=mask, **extras)

  def g(rewards, mask, extras):  # the (init, update) form under jit
    state = t.init()
    values, out_mask, state = t.update(rewards, state, mask=mask, **extras)
    return values, out_mask, state

  first = f(*_inputs(0, 4, 6))
  r2, m2, e2 = _inputs(1, 4, 6)
  second = f(r2, m2, e2)
  jax.block_until_ready((first, second))
  assert len(traces) == 1
  eager_values, eager_mask = adv.apply(t, r2, mask=m2, **e2)
  np.testing.assert_allclose(second[0], eager_values, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(second[1], eager_mask)
  values, out_mask, state = jax.jit(g)(r2, m2, e2)
  np.testing.assert_allclose(values, eager_values, rtol=1e-6, atol=1e-6)
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(t.init())


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "mc_grpo", "uniqueness_grpo",
                                  "grpo_novelty_clip"])
def test_large_groups_jit_matches_eager(name):
  # B=64 prompts x N=512 samples: the compiled transform agrees with op-by-op execution at scale.
  # (Speed is not asserted here: wall-clock bounds depend on the machine.)
  t = CASES[name][0]()
  r, m, e = _inputs(0, 64, 512)
  values, out_mask = jax.jit(lambda r, m, e: adv.apply(t, r, mask=m, **e))(r, m, e)
  eager_values, eager_mask = adv.apply(t, r, mask=m, **e)
  np.testing.assert_allclose(values, eager_values, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out_mask, eager_mask)
  assert np.isfinite(np.asarray(values)).all()
