"""Policy losses: formulas, clipping gradients, GSPO / CISPO / TIS, metrics, jit."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import losses
from rollouts_jax.losses.aggregation import AGG_MODES


def _batch(seed=0, s=6, t=7, spread=0.4):
  rng = np.random.default_rng(seed)
  old = rng.normal(size=(s, t)).astype(np.float32) - 2
  lp = (old + rng.uniform(-spread, spread, size=(s, t))).astype(np.float32)
  adv = rng.choice([-1.5, -0.5, 0.7, 2.0], size=s).astype(np.float32)
  lengths = rng.integers(1, t + 1, size=s)
  mask = np.arange(t)[None] < lengths[:, None]
  mask[-1] = False  # an excluded sequence (e.g. a pivot)
  return jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


def _np_aggregate(v, m, agg, max_len=None):
  return float(losses.aggregate(jnp.asarray(v), jnp.asarray(m), agg, max_len))


def test_ppo_clip_hand_example():
  # ratios 1.5 (A=1, clipped at 1.2) and 0.5 (A=-1, clipped at 0.8); token-mean of
  # -min(rA, clip(r)A) = mean(-1.2, 0.8) = -0.2.
  lp = jnp.log(jnp.array([[0.75, 0.25]]))
  old = jnp.log(jnp.array([[0.5, 0.5]]))
  adv = jnp.array([[1., -1.]])
  loss, m = losses.policy_loss(lp, old, adv, jnp.ones((1, 2), bool), kind="ppo_clip",
                               clip_low=0.2, clip_high=0.2)
  assert float(loss) == pytest.approx(-0.2, rel=1e-6)
  assert float(m["clip_frac_low"]) == 0.5 and float(m["clip_frac_high"]) == 0.5
  assert float(m["ratio_max"]) == pytest.approx(1.5) and float(m["ratio_min"]) == pytest.approx(0.5)
  assert float(m["ratio_mean"]) == pytest.approx(1.0)
  assert float(m["approx_kl"]) == pytest.approx(((0.5 - np.log(1.5)) + (-0.5 - np.log(0.5))) / 2)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_clip_matches_formula(agg):
  lp, old, adv, mask = _batch()
  loss, _ = losses.policy_loss(lp, old, adv, mask, "ppo_clip", 0.2, 0.28, agg)
  r = np.exp(np.asarray(lp, np.float64) - np.asarray(old))
  a = np.asarray(adv)[:, None]
  tok = -np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
  assert float(loss) == pytest.approx(_np_aggregate(tok, mask, agg), rel=1e-5)
  # Per-token advantages that equal the per-sequence ones give the same loss.
  loss2, _ = losses.policy_loss(lp, old, jnp.broadcast_to(adv[:, None], lp.shape), mask,
                                "ppo_clip", 0.2, 0.28, agg)
  assert float(loss2) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_clip_gradient_vanishes_exactly_where_clip_is_active(agg):
  lp, old, adv, mask = _batch(seed=1, s=8, t=9, spread=0.6)
  clip_low, clip_high = 0.2, 0.28
  g = jax.grad(lambda x: losses.policy_loss(x, old, adv, mask, "ppo_clip", clip_low, clip_high,
                                            agg)[0])(lp)
  g = np.asarray(g)
  r = np.exp(np.asarray(lp) - np.asarray(old))
  a = np.broadcast_to(np.asarray(adv)[:, None], r.shape)
  m = np.asarray(mask)
  active = ((a > 0) & (r > 1 + clip_high)) | ((a < 0) & (r < 1 - clip_low))
  assert (active & m).sum() > 3 and (~active & m).sum() > 3  # the example covers both cases
  assert (g[active] == 0).all()
  assert (g[~m] == 0).all()
  assert (g[~active & m] != 0).all()
  # Where it flows, the gradient is -A r times the aggregation weight (token-mean: 1/#tokens).
  if agg == "token-mean":
    free = ~active & m
    np.testing.assert_allclose(g[free], (-a * r)[free] / m.sum(), rtol=1e-5)


def test_dapo_clip_higher_is_asymmetric():
  ratios = np.array([1.25, 1.30, 0.81, 0.79], np.float32)
  adv = jnp.array([1., 1., -1., -1.])
  old = jnp.zeros((4, 1))
  lp = jnp.asarray(np.log(ratios))[:, None]
  mask = jnp.ones((4, 1), bool)
  g = jax.grad(lambda x: losses.policy_loss(x, old, adv, mask, kind="ppo_clip", clip_low=0.2,
                                            clip_high=0.28, agg="token-mean")[0])(lp)
  np.testing.assert_array_equal(np.asarray(g)[:, 0] != 0, [True, False, True, False])
  _, m = losses.policy_loss(lp, old, adv, mask, kind="ppo_clip", clip_low=0.2, clip_high=0.28)
  assert float(m["clip_frac_high"]) == 0.25 and float(m["clip_frac_low"]) == 0.25


def test_dual_clip_bounds_negative_advantages():
  lp = jnp.log(jnp.array([[5.], [2.], [5.]]))
  old = jnp.zeros((3, 1))
  adv = jnp.array([-1., -1., 1.])
  mask = jnp.ones((3, 1), bool)
  f = lambda x: losses.policy_loss(x, old, adv, mask, kind="ppo_clip", dual_clip=3.,
                                   agg="seq-mean-token-sum")
  (loss, m), g = jax.value_and_grad(f, has_aux=True)(lp)
  # tokens: min(5, 3) = 3; min(2, 3) = 2 (r A); A > 0, r = 5: clipped at -1.2.
  assert float(loss) == pytest.approx((3. + 2. - 1.2) / 3, rel=1e-6)
  np.testing.assert_array_equal(np.asarray(g)[:, 0] != 0, [False, True, False])
  assert float(m["dual_clip_frac"]) == pytest.approx(1 / 3)
  plain, _ = losses.policy_loss(lp, old, adv, mask, kind="ppo_clip", agg="seq-mean-token-sum")
  assert float(plain) == pytest.approx((5. + 2. - 1.2) / 3, rel=1e-6)


def _gspo_sequence_level(lp, old, adv, mask, eps_low, eps_high, agg):
  """GSPO with the sequence ratio broadcast over tokens (no stop-gradient trick)."""
  m = mask.astype(jnp.float32)
  seq_log = jnp.sum(m * (lp - old), -1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1)
  s = jnp.broadcast_to(jnp.exp(seq_log), lp.shape)
  a = adv[:, None]
  tok = -jnp.minimum(s * a, jnp.clip(s, 1 - eps_low, 1 + eps_high) * a)
  return losses.aggregate(tok, mask, agg)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_matches_sequence_level_value_and_gradient(agg):
  lp, old, adv, mask = _batch(seed=2, spread=0.2)
  eps_low, eps_high = 0.02, 0.03
  f = lambda x: losses.policy_loss(x, old, adv, mask, "gspo", eps_low, eps_high, agg)[0]
  ref = lambda x: _gspo_sequence_level(x, old, adv, mask, eps_low, eps_high, agg)
  assert float(f(lp)) == pytest.approx(float(ref(lp)), rel=1e-5)
  g, g_ref = jax.grad(f)(lp), jax.grad(ref)(lp)
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-8)
  # Some sequences are clipped and have zero gradient, others not.
  rows = np.abs(np.asarray(g)).sum(-1)[np.asarray(mask).any(-1)]
  assert (rows == 0).any() and (rows > 0).any()


def test_gspo_ratio_metrics_are_sequence_ratios():
  lp = jnp.log(jnp.array([[2., 0.5, 1.], [1., 1., 1.]]))
  old = jnp.zeros((2, 3))
  mask = jnp.array([[True, True, False], [True, True, True]])
  _, m = losses.policy_loss(lp, old, jnp.array([1., 1.]), mask, kind="gspo", clip_low=3e-4,
                            clip_high=4e-4, agg="seq-mean-token-mean")
  # sequence 1: exp(mean(log 2, log 0.5)) = 1; sequence 2: 1.
  assert float(m["ratio_max"]) == pytest.approx(1.) and float(m["ratio_min"]) == pytest.approx(1.)
  assert float(m["clip_frac_high"]) == 0.


@pytest.mark.parametrize("agg", AGG_MODES)
def test_cispo_clips_the_weight_not_the_gradient(agg):
  lp, old, adv, mask = _batch(seed=3, spread=0.6)
  f = lambda x: losses.policy_loss(x, old, adv, mask, "cispo", 0.2, 0.28, agg)
  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(lp)
  r = np.exp(np.asarray(lp, np.float64) - np.asarray(old))
  w = np.clip(r, 0.8, 1.28)
  a = np.broadcast_to(np.asarray(adv)[:, None], r.shape)
  m = np.asarray(mask)
  assert float(loss) == pytest.approx(_np_aggregate(-w * a, m, agg), rel=1e-5)
  # d loss / d lp = -w A times the aggregation weight, also where the ratio is clipped.
  unit = np.asarray(jax.grad(lambda v: losses.aggregate(v, mask, agg))(jnp.zeros_like(lp)))
  np.testing.assert_allclose(g, -w * a * unit, rtol=1e-5, atol=1e-8)
  clipped = ((r < 0.8) | (r > 1.28)) & m
  assert clipped.any() and (np.asarray(g)[clipped] != 0).all()
  assert float(metrics["clip_frac_high"]) == pytest.approx((r > 1.28)[m].mean())


@pytest.mark.parametrize("kind", losses.KINDS)
def test_truncated_importance_sampling(kind):
  lp, old, adv, mask = _batch(seed=4)
  f = lambda x, **kw: losses.policy_loss(x, old, adv, mask, kind, 0.2, 0.28, "token-mean", **kw)
  base_loss, base_grad = jax.value_and_grad(lambda x: f(x)[0])(lp)
  same_loss, same_grad = jax.value_and_grad(lambda x: f(x, rollout_logprobs=old)[0])(lp)
  assert float(same_loss) == pytest.approx(float(base_loss), rel=1e-6)
  np.testing.assert_allclose(same_grad, base_grad, rtol=1e-6)
  rollout = old + jnp.asarray(np.random.default_rng(5).normal(size=old.shape) * 0.5, jnp.float32)
  w = np.minimum(np.exp(np.asarray(old) - np.asarray(rollout)), 1.5)
  tis_grad = jax.grad(lambda x: f(x, rollout_logprobs=rollout, tis_cap=1.5)[0])(lp)
  np.testing.assert_allclose(tis_grad, np.asarray(base_grad) * w, rtol=1e-5, atol=1e-8)
  _, metrics = f(lp, rollout_logprobs=rollout, tis_cap=1.5)
  m = np.asarray(mask)
  assert float(metrics["tis_weight_mean"]) == pytest.approx(w[m].mean(), rel=1e-5)
  assert float(metrics["tis_clip_frac"]) == pytest.approx((w == 1.5)[m].mean(), rel=1e-5)


@pytest.mark.parametrize("kind", losses.KINDS)
def test_masked_importance_weights_drop_tokens_but_keep_the_denominator(kind):
  """AReaL's behaviour cap: a token with pi_prox / pi_behav > cap gets weight 0 (not cap), and the
  token-mean still divides by every valid token."""
  lp, old, adv, mask = _batch(seed=4)
  rollout = old + jnp.asarray(np.random.default_rng(5).normal(size=old.shape) * 0.5, jnp.float32)
  raw = np.exp(np.asarray(old) - np.asarray(rollout))
  f = lambda x, **kw: losses.policy_loss(x, old, adv, mask, kind, 0.2, 0.28, "token-mean", rollout_logprobs=rollout,
                                         tis_cap=1.5, **kw)
  base_grad = jax.grad(lambda x: losses.policy_loss(x, old, adv, mask, kind, 0.2, 0.28, "token-mean")[0])(lp)
  grad = jax.grad(lambda x: f(x, tis_mode="mask")[0])(lp)
  w = np.where(raw > 1.5, 0.0, raw)
  m = np.asarray(mask)
  assert ((raw > 1.5) & m).any() and ((raw <= 1.5) & m).any()
  np.testing.assert_allclose(grad, np.asarray(base_grad) * w, rtol=1e-5, atol=1e-8)
  assert float(f(lp, tis_mode="mask")[1]["tis_weight_mean"]) == pytest.approx(w[m].mean(), rel=1e-5)
  with pytest.raises(ValueError, match="tis_mode"):
    f(lp, tis_mode="clip")


@pytest.mark.parametrize("kind", losses.KINDS)
def test_on_policy_metrics_and_junk_in_padding(kind):
  lp, _, adv, mask = _batch(seed=6)
  junk = jnp.where(mask, lp, jnp.nan)
  old_junk = jnp.where(mask, lp, 1e4)
  f = lambda x: losses.policy_loss(x, old_junk, adv, mask, kind, 0.2, 0.28, "seq-mean-token-mean")
  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(junk)
  assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()
  assert (np.asarray(g)[~np.asarray(mask)] == 0).all()
  assert set(metrics) >= {"clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean",
                          "ratio_max", "ratio_min"}
  for v in metrics.values():
    assert v.shape == () and v.dtype == jnp.float32
  assert float(metrics["approx_kl"]) == 0. and float(metrics["ratio_mean"]) == 1.
  assert float(metrics["clip_frac_low"]) == 0. and float(metrics["clip_frac_high"]) == 0.
  # On-policy, every kind has the policy-gradient value -mean A.
  a = np.broadcast_to(np.asarray(adv)[:, None], mask.shape)
  assert float(loss) == pytest.approx(_np_aggregate(-a, mask, "seq-mean-token-mean"), rel=1e-6)
  empty, em = losses.policy_loss(lp, lp, adv, jnp.zeros_like(mask), kind)
  assert float(empty) == 0. and float(em["ratio_max"]) == 1.


def test_jit_all_kinds_and_modes_without_retrace():
  lp, old, adv, mask = _batch(seed=7)
  for kind, agg in itertools.product(losses.KINDS, AGG_MODES):
    traces = []

    @jax.jit
    def step(x, o, a, m, ro):
      traces.append(1)
      return jax.value_and_grad(
          lambda y: losses.policy_loss(y, o, a, m, kind=kind, clip_low=0.2, clip_high=0.28,
                                       agg=agg, rollout_logprobs=ro, tis_cap=2.)[0])(x)

    out1 = step(lp, old, adv, mask, old)
    out2 = step(lp + 0.1, old, -adv, ~mask, old - 0.1)
    jax.block_until_ready((out1, out2))
    assert len(traces) == 1, (kind, agg)
    eager = losses.policy_loss(lp + 0.1, old, -adv, ~mask, kind, 0.2, 0.28, agg,
                               rollout_logprobs=old - 0.1, tis_cap=2.)[0]
    assert float(out2[0]) == pytest.approx(float(eager), rel=1e-5, abs=1e-7)
  # Static strings can also go in as static arguments.
  f = jax.jit(losses.policy_loss, static_argnames=("kind", "agg"))
  loss, metrics = f(lp, old, adv, mask, kind="gspo", agg="seq-mean-token-mean")
  assert np.isfinite(float(loss)) and "approx_kl" in metrics


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="ppo"), "kind"),
    (dict(agg="mean"), "agg"),
    (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_high=-0.1), "clip_high"),
    (dict(kind="cispo", dual_clip=3.), "dual_clip"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(tis_cap=0.), "tis_cap"),
    (dict(advantages=jnp.zeros(3)), "advantages"),
    (dict(mask=jnp.ones((2, 2), bool)), "shape"),
    (dict(rollout_logprobs=jnp.zeros((2, 2))), "rollout_logprobs"),
])
def test_bad_input_raises_value_error(kwargs, match):
  args = dict(logprobs=jnp.zeros((2, 3)), old_logprobs=jnp.zeros((2, 3)),
              advantages=jnp.zeros(2), mask=jnp.ones((2, 3), bool))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    losses.policy_loss(**args)
