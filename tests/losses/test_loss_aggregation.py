"""The four aggregation modes match their formulas on ragged masks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import hypothesis.extra.numpy as hnp

from rollouts_jax import losses


def _np_agg(v, m, agg, max_len=None):
  v = v.astype(np.float64)
  rows = [v[i][m[i]] for i in range(v.shape[0])]
  nonempty = [r for r in rows if len(r)]
  if agg == "token-mean":
    tokens = np.concatenate(rows)
    return tokens.mean() if len(tokens) else 0.
  if agg == "seq-mean-token-sum":
    return np.mean([r.sum() for r in nonempty]) if nonempty else 0.
  if agg == "seq-mean-token-mean":
    return np.mean([r.mean() for r in nonempty]) if nonempty else 0.
  if agg == "seq-mean-token-sum-norm":
    return sum(r.sum() for r in rows) / (v.shape[0] * (max_len or v.shape[1]))
  raise AssertionError(agg)


def test_hand_example():
  v = jnp.array([[1., 2., 3., 9.], [4., 9., 9., 9.], [9., 9., 9., 9.]])
  m = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  assert float(losses.aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
  assert float(losses.aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
  assert float(losses.aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
  assert float(losses.aggregate(v, m, "seq-mean-token-sum-norm")) == pytest.approx(10 / (3 * 4))
  assert float(losses.aggregate(v, m, "seq-mean-token-sum-norm", max_len=10)) == pytest.approx(
      10 / 30)


@pytest.mark.parametrize("agg", losses.AGG_MODES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.sampled_from([(1, 1), (3, 5), (4, 7)]).flatmap(
    lambda s: st.tuples(hnp.arrays(np.float32, s, elements=st.floats(-5, 5, width=32)),
                        hnp.arrays(np.bool_, s))))
def test_modes_match_formulas_on_ragged_masks(agg, data):
  v, m = data
  got = float(losses.aggregate(jnp.asarray(v), jnp.asarray(m), agg))
  assert got == pytest.approx(_np_agg(v, m, agg), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_masked_tokens_do_not_matter_and_grads_are_finite(agg):
  rng = np.random.default_rng(0)
  v = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  m = jnp.asarray(rng.random((4, 6)) < 0.6).at[2].set(False)
  junk = jnp.where(m, v, jnp.nan)
  assert float(losses.aggregate(junk, m, agg)) == pytest.approx(float(losses.aggregate(v, m, agg)))
  g = jax.grad(lambda x: losses.aggregate(x, m, agg))(v)
  assert np.isfinite(g).all() and (np.asarray(g)[~np.asarray(m)] == 0).all()
  assert float(losses.aggregate(v, jnp.zeros_like(m), agg)) == 0.


def test_bad_mode_and_shapes_raise():
  with pytest.raises(ValueError, match="agg must be one of"):
    losses.aggregate(jnp.zeros((2, 2)), jnp.ones((2, 2), bool), "sum")
  with pytest.raises(ValueError, match="shape"):
    losses.aggregate(jnp.zeros((2, 2)), jnp.ones((2, 3), bool))
  with pytest.raises(ValueError, match="max_len"):
    losses.aggregate(jnp.zeros((2, 2)), jnp.ones((2, 2), bool), "seq-mean-token-sum-norm", 0)
