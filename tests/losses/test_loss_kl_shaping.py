"""KL estimators, entropy bonus and DAPO overlong shaping."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import losses


def test_kl_estimators_match_formulas():
  rng = np.random.default_rng(0)
  lp = rng.normal(size=(3, 5)).astype(np.float32) - 2
  ref = rng.normal(size=(3, 5)).astype(np.float32) - 2
  d = ref.astype(np.float64) - lp
  for kind, expected in [("k1", -d), ("k2", 0.5 * d**2), ("k3", np.exp(d) - d - 1)]:
    got = losses.kl_penalty(jnp.asarray(lp), jnp.asarray(ref), kind=kind)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  k3 = np.asarray(losses.kl_penalty(jnp.asarray(lp), jnp.asarray(ref), kind="k3"))
  assert (k3 >= 0).all()
  np.testing.assert_array_equal(losses.kl_penalty(jnp.asarray(lp), jnp.asarray(lp)), 0.)


def test_k3_is_unbiased_for_the_true_kl():
  # Categorical p, q over 4 tokens: E_{x~p}[k1] = E[k3] = KL(p || q); k2 is not.
  p = np.array([0.5, 0.2, 0.2, 0.1])
  q = np.array([0.25, 0.25, 0.25, 0.25])
  true_kl = np.sum(p * np.log(p / q))
  lp, ref = jnp.log(jnp.asarray(p))[None], jnp.log(jnp.asarray(q))[None]
  for kind in ("k1", "k3"):
    est = np.sum(p * np.asarray(losses.kl_penalty(lp, ref, kind=kind))[0])
    assert est == pytest.approx(true_kl, rel=1e-5)


def test_kl_mask_agg_and_gradient():
  lp = jnp.array([[-1., -2., 50.]])
  ref = jnp.array([[-1.5, -1., -80.]])
  mask = jnp.array([[True, True, False]])
  per_token = losses.kl_penalty(lp, ref, kind="k3", mask=mask)
  assert float(per_token[0, 2]) == 0.
  total = losses.kl_penalty(lp, ref, kind="k3", mask=mask, agg="token-mean")
  assert float(total) == pytest.approx(float(per_token[0, :2].mean()))
  g = jax.grad(lambda x: losses.kl_penalty(x, ref, kind="k3", mask=mask, agg="token-mean"))(lp)
  # d/dlp (exp(ref - lp) - (ref - lp) - 1) = 1 - exp(ref - lp); masked token: no gradient.
  np.testing.assert_allclose(g[0, :2], (1 - np.exp(np.array([-0.5, 1.]))) / 2, rtol=1e-5)
  assert float(g[0, 2]) == 0.
  gref = jax.grad(lambda r: losses.kl_penalty(lp, r, kind="k3", mask=mask, agg="token-mean"))(ref)
  np.testing.assert_array_equal(gref, 0.)  # the reference is a constant
  with pytest.raises(ValueError, match="kind"):
    losses.kl_penalty(lp, ref, kind="k4")
  with pytest.raises(ValueError, match="differ"):
    losses.kl_penalty(lp, ref[:, :2])


def test_kl_jits_without_retrace():
  traces = []

  @jax.jit
  def f(a, b, m):
    traces.append(1)
    return losses.kl_penalty(a, b, kind="k3", mask=m, agg="seq-mean-token-mean")

  x = jnp.zeros((2, 3))
  f(x, x, jnp.ones((2, 3), bool))
  f(x + 1, x, jnp.zeros((2, 3), bool))
  assert len(traces) == 1


def test_entropy():
  logits = jnp.array([[[0., 0., 0., 0.], [10., 0., 0., 0.]]])
  h = np.asarray(losses.entropy_from_logits(logits))
  p = np.exp(np.array([10., 0, 0, 0])) / np.exp(np.array([10., 0, 0, 0])).sum()
  np.testing.assert_allclose(h, [[np.log(4), -(p * np.log(p)).sum()]], rtol=1e-4)
  bonus = losses.entropy_bonus(jnp.asarray(h), jnp.array([[True, False]]), "token-mean")
  assert float(bonus) == pytest.approx(np.log(4), rel=1e-6)


def test_overlong_penalty_matches_dapo():
  max_len, cache = 20480, 4096
  lengths = np.array([0, 16384, 16385, 18432, 20480, 20481, 99999])
  expected = [0., 0., -1 / 4096, -0.5, -1., -1., -1.]
  got = losses.overlong_penalty(jnp.asarray(lengths), max_len, cache)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  got2d = losses.overlong_penalty(jnp.asarray(lengths[:6].reshape(2, 3)), max_len, cache)
  np.testing.assert_allclose(got2d, np.reshape(expected[:6], (2, 3)), rtol=1e-6)
  f = jax.jit(lambda l: losses.overlong_penalty(l, 20, 4))
  np.testing.assert_allclose(f(jnp.array([16, 18, 21])), [0., -0.5, -1.])
  with pytest.raises(ValueError, match="cache_len"):
    losses.overlong_penalty(lengths, 10, 11)
  with pytest.raises(ValueError, match="max_len"):
    losses.overlong_penalty(lengths, 0, 0)
