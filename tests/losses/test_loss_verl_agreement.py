"""SAPO, Clip-Cov, KL-Cov and the adaptive KL controller: verl's values and gradients, and properties.

verl is not a test dependency (its package imports ray, pandas and tensordict at the top), so
its outputs are written here as numbers: each VERL entry is what verl 0.9.1's
`core_algos.get_policy_loss_fn(kind)` returned on the batch below (torch float32,
`ActorConfig(clip_ratio=0.2)` with the listed settings, no rollout weights): the loss and
d loss / d log_prob on the valid tokens. The adaptive KL sequence is verl's
`AdaptiveKLController(0.05, 0.1, 1000)` after `update(kl, 64)` for each listed KL.

Where the value differs on purpose (SAPO's constant shift, Clip-Cov's detached tokens keeping
their value) the test checks the documented relation; the gradients are verl's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import losses

OLD = np.array([[-1.0, -0.5, -2.0, -1.5], [-0.3, -1.2, -0.7, 0.0], [-2.2, -0.1, -0.9, -1.1]], np.float32)
LP = (OLD + np.array([[0.3, -0.1, 0.05, 0.0], [-0.4, 0.2, 0.1, 0.0], [0.15, -0.25, 0.5, 0.0]], np.float32)
      ).astype(np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
ADV_SEQ = np.array([1.5, -0.8, 0.4], np.float32)
ADV_TOK = np.array([[1.5, 0.2, -0.6, 0.0], [-0.8, 1.1, 0.0, 0.0], [0.4, -1.3, 2.0, 0.7]], np.float32)

# (kind, advantages, agg, settings) -> (verl's loss, verl's gradient on the valid tokens)
VERL = [
    ("sapo", "seq", "seq-mean-token-mean", {}, -0.8422182202339172,
     [[-0.2182302028, -0.1504652947, -0.1750967950, 0.0], [0.0867511034, 0.1606730968, 0.0, 0.0],
      [-0.0384753011, -0.0256450009, -0.0495579988, -0.0333333015]]),
    ("sapo", "tok", "seq-mean-token-mean", {"tau_pos": 2.0, "tau_neg": 3.0}, -0.679758608341217,
     [[-0.1995397061, -0.0199264996, 0.0696718022, 0.0], [0.0706448033, -0.2132962942, 0.0, 0.0],
      [-0.0377309993, 0.0757232010, -0.1852551997, -0.0583333001]]),
    # One candidate (token [0, 1], covariance 0.383 in (0.3, 5), not clipped) and room for one.
    ("clip_cov", "seq", "token-mean", {"clip_cov_lb": 0.3, "clip_cov_ub": 5.0}, -0.37955984473228455,
     [[0.0, 0.0, -0.1752118021, 0.0], [0.0, 0.1085691005, 0.0, 0.0],
      [-0.0516370982, -0.0346134007, 0.0, -0.0444444008]]),
    ("clip_cov", "tok", "token-mean", {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0},
     -0.5761889815330505,
     [[0.0, -0.0201075003, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.0516370982, 0.0, 0.0, -0.0777778029]]),
    ("kl_cov", "seq", "token-mean", {}, -0.5857017040252686,
     [[-0.2249764949, -0.1619172990, -0.1752118021, 0.0], [0.0595839992, 0.1085691005, 0.0, 0.0],
      [-0.0516370982, -0.0346134007, -0.0732764974, -0.0444444008]]),
    ("kl_cov", "tok", "seq-mean-token-sum", {"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}, -1.5940051078796387,
     [[-0.3415960968, -0.0603225008, 0.5435876250, 0.0], [0.1787520051, -0.1145144030, 0.0, 0.0],
      [-0.1549112052, 0.3374803066, -0.7658141851, -0.2333333045]]),
]

VERL_ADAPTIVE_KL = [0.04936, 0.048728192, 0.048728192, 0.049351912857599996, 0.049983617342177274,
                    0.0493438270401974]


def _loss(kind, adv, agg, settings, lp=LP, **kw):
  a = ADV_SEQ if adv == "seq" else ADV_TOK
  return losses.policy_loss(jnp.asarray(lp), jnp.asarray(OLD), jnp.asarray(a), jnp.asarray(MASK), kind=kind,
                            clip_low=0.2, clip_high=0.2, agg=agg, kind_kwargs=settings, **kw)


@pytest.mark.parametrize("kind,adv,agg,settings,verl_loss,verl_grad", VERL)
def test_matches_verl(kind, adv, agg, settings, verl_loss, verl_grad):
  (loss, metrics), grad = jax.value_and_grad(lambda lp: _loss(kind, adv, agg, settings, lp), has_aux=True)(
      jnp.asarray(LP))
  np.testing.assert_allclose(np.where(MASK, np.asarray(grad), 0), verl_grad, rtol=1e-5, atol=2e-7)
  a = np.broadcast_to(ADV_SEQ[:, None], MASK.shape) if adv == "seq" else ADV_TOK
  if kind == "sapo":
    # The token loss is verl's -f(r) A plus the constant -(1 - 2 / tau) A.
    tau = np.where(a > 0, settings.get("tau_pos", 1.0), settings.get("tau_neg", 1.05))
    shift = float(losses.aggregate(jnp.asarray(-a * (1 - 2 / tau)), jnp.asarray(MASK), agg))
    assert float(loss) == pytest.approx(verl_loss + shift, rel=1e-6)
  elif kind == "clip_cov":
    # verl zeroes the detached tokens' loss; here they keep it: the value is ppo_clip's.
    ppo, _ = _loss("ppo_clip", adv, agg, None)
    assert float(loss) == pytest.approx(float(ppo), rel=1e-6)
    assert float(metrics["cov_frac"]) == pytest.approx(1 / 9)
  else:
    assert float(loss) == pytest.approx(verl_loss, rel=1e-6)


def test_adaptive_kl_controller_matches_verl():
  ctrl = losses.adaptive_kl_controller(0.05, target_kl=0.1, horizon=1000)
  state, got = ctrl.init(), []
  for kl in [0.0, 0.05, 0.1, 0.3, 0.12, 0.08]:
    state = ctrl.update(state, kl, 64)
    got.append(float(state.kl_coef))
  np.testing.assert_allclose(got, VERL_ADAPTIVE_KL, rtol=1e-6)
  # By hand: KL 0 -> error clipped to -0.2 -> x (1 - 0.2 * 64 / 1000) = x 0.9872.
  assert got[0] == pytest.approx(0.05 * 0.9872, rel=1e-6)
  # A non-finite KL leaves the coefficient alone (verl would turn it into NaN); jit works.
  same = jax.jit(ctrl.update)(state, jnp.nan, 64)
  assert float(same.kl_coef) == float(state.kl_coef)
  fixed = losses.fixed_kl_controller(0.2)
  assert float(fixed.update(fixed.init(), 5.0, 64).kl_coef) == pytest.approx(0.2)


# ------------------------------------------------------------------ properties

def test_sapo_gate():
  # On policy the gradient is the plain policy gradient -A d log pi (the gate's weight is 1 at r = 1) ...
  on = jnp.asarray(OLD)
  grad_at = lambda kind: np.asarray(jax.grad(lambda lp: losses.policy_loss(
      lp, on, jnp.asarray(ADV_TOK), jnp.asarray(MASK), kind=kind, agg="token-mean")[0])(on))
  np.testing.assert_allclose(grad_at("sapo"), grad_at("ppo_clip"), rtol=1e-6, atol=1e-7)
  # ... and it decays smoothly far off policy, where ppo_clip's is cut to 0 or kept whole.
  def weight(log_ratio, a=1.0, tau=1.0):
    f = lambda lp: losses.policy_loss(lp, jnp.zeros((1, 1)), jnp.full((1,), a), jnp.ones((1, 1), bool), kind="sapo",
                                      kind_kwargs={"tau_pos": tau, "tau_neg": tau})[0]
    return -float(jax.grad(f)(jnp.full((1, 1), log_ratio))[0, 0]) / a
  ws = [weight(x) for x in (0.0, 0.2, 0.5, 1.0, 2.0)]
  assert ws[0] == pytest.approx(1.0, rel=1e-6)
  assert all(w > 0 for w in ws) and ws[-1] < 0.5
  assert weight(1.0, tau=4.0) < weight(1.0, tau=1.0)    # a larger temperature gates harder
  # The value is -A on policy.
  loss, m = losses.policy_loss(on, on, jnp.asarray(ADV_TOK), jnp.asarray(MASK), kind="sapo", agg="token-mean")
  assert float(loss) == pytest.approx(-ADV_TOK[MASK].mean(), rel=1e-6)
  assert float(m["clip_frac_low"]) == 0 and float(m["clip_frac_high"]) == 0


def test_clip_cov_detaches_exactly_the_top_covariance_candidates():
  rng = np.random.default_rng(0)
  S, T = 8, 25
  old = rng.normal(size=(S, T)).astype(np.float32) - 2
  lp = old + rng.uniform(-0.05, 0.05, (S, T)).astype(np.float32)   # nothing clipped by the ratio
  a = rng.normal(size=(S, T)).astype(np.float32) * 2
  mask = np.arange(T)[None] < rng.integers(10, T + 1, S)[:, None]
  n = int(mask.sum())
  settings = {"clip_cov_ratio": 0.02, "clip_cov_lb": 0.5, "clip_cov_ub": 2.0}
  k = max(int(0.02 * n), 1)
  cov = (a - a[mask].mean()) * (lp - lp[mask].mean())
  candidates = mask & (cov > 0.5) & (cov < 2.0)
  assert candidates.sum() > k > 1
  top = np.argsort(-np.where(candidates, cov, -np.inf), axis=None)[:k]
  expected = np.zeros(mask.size, bool)
  expected[top] = True
  expected = expected.reshape(mask.shape)
  f = lambda x, kind, s: losses.policy_loss(x, jnp.asarray(old), jnp.asarray(a), jnp.asarray(mask), kind=kind,
                                            kind_kwargs=s)
  (loss, m), g = jax.value_and_grad(lambda x: f(x, "clip_cov", settings), has_aux=True)(jnp.asarray(lp))
  (ppo, _), g_ppo = jax.value_and_grad(lambda x: f(x, "ppo_clip", None), has_aux=True)(jnp.asarray(lp))
  g, g_ppo = np.asarray(g), np.asarray(g_ppo)
  assert (g[expected] == 0).all() and (g_ppo[expected] != 0).all()
  np.testing.assert_array_equal(g[~expected], g_ppo[~expected])
  assert float(loss) == float(ppo) and float(m["cov_frac"]) == pytest.approx(k / n)


def test_kl_cov_penalizes_exactly_the_top_covariance_tokens():
  rng = np.random.default_rng(1)
  S, T = 6, 20
  old = rng.normal(size=(S, T)).astype(np.float32) - 2
  lp = old + rng.uniform(-0.3, 0.3, (S, T)).astype(np.float32)
  a = np.repeat(rng.normal(size=(S, 1)), T, 1).astype(np.float32)
  mask = np.arange(T)[None] < rng.integers(5, T + 1, S)[:, None]
  n = int(mask.sum())
  k = max(int(0.1 * n), 1)
  cov = (a - a[mask].mean()) * (lp - lp[mask].mean())
  chosen = np.zeros(mask.size, bool)
  chosen[np.argsort(-np.where(mask, cov, -np.inf), axis=None)[:k]] = True
  chosen = chosen.reshape(mask.shape)
  loss, m = losses.policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(a), jnp.asarray(mask), kind="kl_cov",
                               agg="seq-mean-token-sum", kind_kwargs={"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5})
  token = -a * np.exp(lp - old) + np.where(chosen, 0.5 * np.abs(lp - old), 0)
  expected = np.mean([token[i][mask[i]].sum() for i in range(S)])
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  assert float(m["cov_frac"]) == pytest.approx(k / n)


def test_kind_settings_are_checked():
  assert losses.check_kind_kwargs("kl_cov", {}) == {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}
  assert losses.check_kind_kwargs("clip_cov", {"clip_cov_ub": 6}) == {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                                                                       "clip_cov_ub": 6.0}
  for kind, bad, match in [("sapo", {"tau": 1.0}, "takes no settings tau"),
                           ("sapo", {"tau_pos": 0.0}, "tau_pos must be > 0"),
                           ("clip_cov", {"clip_cov_ratio": 2.0}, "in \\(0, 1\\]"),
                           ("clip_cov", {"clip_cov_lb": 5.0}, "clip_cov_lb must be < clip_cov_ub"),
                           ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef"),
                           ("kl_cov", {"kl_cov_ratio": "a lot"}, "must be a number"),
                           ("gspo", {"tau_pos": 1.0}, "takes no settings")]:
    with pytest.raises(ValueError, match=match):
      losses.check_kind_kwargs(kind, bad, key="rl.loss_kwargs")
  lp = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="dual_clip"):
    losses.policy_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2), bool), kind="sapo", dual_clip=3.0)
  with pytest.raises(ValueError, match="kind"):
    losses.policy_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2), bool), kind="dro")
