"""ECHO's confidence-adaptive clipping against the plain PPO clip."""

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import losses
from rollouts_jax.losses import echo


def _batch(seed=0, S=6, T=5):
  rng = np.random.default_rng(seed)
  old = jnp.asarray(rng.normal(size=(S, T)) - 1, jnp.float32)
  new = old + jnp.asarray(rng.normal(size=(S, T)) * 0.3, jnp.float32)
  adv = jnp.asarray(rng.normal(size=(S,)), jnp.float32)
  mask = jnp.asarray(rng.random((S, T)) < 0.8)
  conf = jnp.asarray(rng.random(S), jnp.float32)
  return new, old, adv, mask, conf


def test_equal_eps_is_ppo_clip():
  new, old, adv, mask, conf = _batch()
  for agg in ("token-mean", "seq-mean-token-mean"):
    f = lambda lp: echo.echo_policy_loss(lp, old, adv, mask, conf, eps_lo=0.2, eps_hi=0.2, agg=agg)[0]
    g = lambda lp: losses.policy_loss(lp, old, adv, mask, kind="ppo_clip", clip_low=0.2, clip_high=0.2, agg=agg)[0]
    np.testing.assert_allclose(f(new), g(new), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(new), jax.grad(g)(new), rtol=1e-6, atol=1e-8)


def test_low_confidence_gets_the_tighter_trust_region():
  """Ratio 1.2 with A > 0: inside 1 + 0.28 (confident response, gradient flows), outside 1 + 0.1 (clipped)."""
  old = jnp.zeros((2, 3))
  new = old + jnp.log(1.2)
  adv, mask = jnp.ones((2,)), jnp.ones((2, 3), bool)
  conf = jnp.array([0., 1.])
  grad = jax.grad(lambda lp: echo.echo_policy_loss(lp, old, adv, mask, conf, eps_lo=0.1, eps_hi=0.28)[0])(new)
  assert np.all(np.asarray(grad[0]) == 0) and np.all(np.asarray(grad[1]) < 0)
  _, metrics = echo.echo_policy_loss(new, old, adv, mask, conf, eps_lo=0.1, eps_hi=0.28)
  np.testing.assert_allclose(metrics["clip_frac_high"], 0.5)
