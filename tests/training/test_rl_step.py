"""The jitted RL step: micro-batching is exact, NaN skips, the update moves the policy the right way."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax import models
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig

CFG = models.ModelConfig(model_type="llama", vocab_size=24, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)


def _rollouts(B=4, N=4, P=5, T=6, seed=0):
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(1, P + 1, size=B)
  pmask = np.arange(P)[None] >= (P - prompt_lens)[:, None]
  lengths = rng.integers(1, T + 1, size=(B, N))
  cmask = np.arange(T)[None, None] < lengths[..., None]
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, 24, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, 24, (B, N, T)), jnp.int32),
      completion_mask=jnp.asarray(cmask),
      behaviour_logprobs=jnp.zeros((B, N, T)), policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(rng.integers(0, 2, (B, N)), jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


def _state(rlc, seed=0):
  params = models.init_params(CFG, jax.random.key(seed))
  return rl.init_train_state(params, rl.rl_optimizer(rlc))


# Two modes in the default suite (the per-token mean and Dr. GRPO's constant divisor), all with -m slow.
@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
                                 pytest.param("seq-mean-token-sum", marks=pytest.mark.slow),
                                 "seq-mean-token-sum-norm"])
def test_micro_batching_is_exact(agg):
  base = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, agg=agg, kl_coef=0.0)
  r = _rollouts()
  s_full, m_full = rl.rl_step(_state(base), r, None, cfg=CFG, rl=base)
  micro = dataclasses.replace(base, micro_batch_size=4)
  s_micro, m_micro = rl.rl_step(_state(base), r, None, cfg=CFG, rl=micro)
  # Adam's first moment after one update is (1 - b1) * gradient: compare gradients, which unlike
  # the Adam step itself (about lr * sign(g)) are well conditioned.
  mu_full = optax.tree_utils.tree_get(s_full.opt_state, "mu")
  mu_micro = optax.tree_utils.tree_get(s_micro.opt_state, "mu")
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(mu_full))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=1e-4),
                         mu_full, mu_micro)
  np.testing.assert_allclose(m_full["grad_norm"], m_micro["grad_norm"], rtol=1e-5)
  np.testing.assert_allclose(m_full["loss"], m_micro["loss"], rtol=1e-5, atol=1e-7)
  assert int(s_full.step) == 1


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-sum", marks=pytest.mark.slow),
                                 "seq-mean-token-sum-norm"])
def test_trimming_padding_columns_leaves_the_update_unchanged(agg):
  # The loop cuts completions to the longest one kept; the update must not notice, including
  # Dr. GRPO's constant divisor, which is the generation budget and not the batch width.
  base = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, agg=agg)
  r = _rollouts(T=6)
  wide = r.replace(**{f: jnp.pad(getattr(r, f), ((0, 0), (0, 0), (0, 4)))
                      for f in ("completion_ids", "completion_mask", "behaviour_logprobs", "policy_version")})
  s_wide, m_wide = rl.rl_step(_state(base), wide, None, cfg=CFG, rl=base, max_len=10)
  s_trim, m_trim = rl.rl_step(_state(base), r, None, cfg=CFG, rl=base, max_len=10)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(mu(s_wide)))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=1e-4),
                         mu(s_wide), mu(s_trim))
  np.testing.assert_allclose(m_wide["loss"], m_trim["loss"], rtol=1e-5, atol=1e-7)


def test_update_raises_logprob_of_rewarded_samples():
  conf = RLConfig(steps=20, learning_rate=3e-3, warmup_steps=0, clip_low=0.2, clip_high=0.2)
  r = _rollouts(seed=1)
  state = _state(conf)
  tokens, attn, P = rl._rows(r)
  lp0, _ = rl.completion_logprobs(CFG, state.params, tokens, attn, P)
  for _ in range(5):
    state, m = rl.rl_step(state, r, None, cfg=CFG, rl=conf)
  lp1, _ = rl.completion_logprobs(CFG, state.params, tokens, attn, P)
  mask = r.completion_mask.reshape(lp0.shape)
  seq_delta = np.asarray(jnp.sum((lp1 - lp0) * mask, -1)).reshape(4, 4)
  rew = np.asarray(r.rewards)
  mixed = rew.std(1) > 0
  # In every group with mixed rewards, the mean log-prob change of the rewarded samples beats
  # that of the unrewarded ones.
  for b in np.flatnonzero(mixed):
    assert seq_delta[b][rew[b] == 1].mean() > seq_delta[b][rew[b] == 0].mean()
  assert np.isfinite(m["grad_norm"])


def test_several_epochs_and_minibatches_with_kl():
  conf = RLConfig(steps=5, learning_rate=1e-3, ppo_epochs=2, num_minibatches=2, micro_batch_size=4,
                  kl_coef=0.1, warmup_steps=0)
  r = _rollouts()
  state = _state(conf)
  ref = jax.tree_util.tree_map(jnp.copy, state.params)
  state, m = rl.rl_step(state, r, ref, cfg=CFG, rl=conf)
  assert int(state.step) == 4
  assert float(m["ratio_max"]) > 1.0 or float(m["ratio_min"]) < 1.0  # later updates see a moved policy
  assert float(m["kl"]) >= 0.0 and np.isfinite(float(m["kl"]))


def test_nonfinite_loss_skips_the_update():
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0)
  r = _rollouts()
  r = r.replace(rewards=r.rewards.at[0, 0].set(jnp.nan))
  state = _state(conf)
  before = jax.tree_util.tree_map(np.asarray, state.params)
  state, m = rl.rl_step(state, r, None, cfg=CFG, rl=conf)
  assert float(m["nonfinite"]) == 1.0
  assert int(state.step) == 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.asarray, state.params))


def test_second_call_does_not_recompile():
  conf = RLConfig(steps=5)
  state = _state(conf)
  state, _ = rl.rl_step(state, _rollouts(seed=0), None, cfg=CFG, rl=conf)
  n = rl.rl_step._cache_size()
  state, _ = rl.rl_step(state, _rollouts(seed=3), None, cfg=CFG, rl=conf)
  assert rl.rl_step._cache_size() == n


def test_mc_grpo_pivot_carries_no_gradient():
  conf = RLConfig(steps=5, advantage="mc_grpo", learning_rate=1e-2, warmup_steps=0)
  r = _rollouts(N=5)
  r = r.replace(rewards=jnp.asarray([[1, 0, 1, 0, 1]] * 4, jnp.float32))
  _, m = rl.rl_step(_state(conf), r, None, cfg=CFG, rl=conf)
  full = int(np.asarray(r.completion_mask).sum())
  # exactly one pivot per group left the loss
  pivots_tokens = full - int(m["tokens_in_loss"])
  assert pivots_tokens > 0
  assert np.isfinite(m["loss"])


def test_unknown_recipe_is_named():
  with pytest.raises(ValueError, match="rl.advantage: unknown advantage recipe 'nope'"):
    rl.advantage_transform(RLConfig(advantage="nope"))
  with pytest.raises(ValueError, match="rl.advantage_kwargs.*alhpa"):
    rl.advantage_transform(RLConfig(advantage="uniqueness_grpo", advantage_kwargs="alhpa=1.0"))
  t = rl.advantage_transform(RLConfig(advantage="mc_grpo", advantage_kwargs="mad_fallback=False,eps=1e-3,compensate=True"))
  ref = rl.advantages_lib.mc_grpo(mad_fallback=False, eps=1e-3, compensate=True)
  r = jnp.array([[1., 1., 1., 0., 1.]])
  np.testing.assert_array_equal(rl.advantages_lib.apply(t, r)[0], rl.advantages_lib.apply(ref, r)[0])


def test_frozen_parameters_do_not_move():
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, freeze="embed")
  state = _state(conf)
  before = jax.tree_util.tree_map(np.asarray, state.params)
  state, _ = rl.rl_step(state, _rollouts(seed=2), None, cfg=CFG, rl=conf)
  np.testing.assert_array_equal(before["embed"], np.asarray(state.params["embed"]))
  assert not np.array_equal(before["layers"]["q"], np.asarray(state.params["layers"]["q"]))


def test_loop_only_settings_do_not_recompile_the_update():
  """The update's static arguments hold only update settings: a config that differs in loop-only
  settings (evaluation, checkpoints, prompt selection, dynamic sampling, replay, rewards) reuses it."""
  from rollouts_jax.training import config as config_lib
  a = config_lib.from_config_dict({"rl": {"steps": 5}})
  b = config_lib.from_config_dict({"rl": {"steps": 5}, "eval": {"every": 3, "num_examples": 7},
                                   "checkpoint": {"every": 2}, "control": {"dynamic_sampling": True, "max_refills": 5},
                                   "replay": {"name": "fifo"}, "reward": {"name": "ttrl", "timeout_s": 1.0}})
  state = _state(a.rl)
  state, _ = rl.rl_step(state, _rollouts(seed=0), None, cfg=CFG, rl=a.rl)
  n = rl.rl_step._cache_size()
  state, _ = rl.rl_step(state, _rollouts(seed=1), None, cfg=CFG, rl=b.rl)
  assert rl.rl_step._cache_size() == n
  c = config_lib.from_config_dict({"rl": {"steps": 5, "clip_high": 0.28}})
  state, _ = rl.rl_step(state, _rollouts(seed=1), None, cfg=CFG, rl=c.rl)
  assert rl.rl_step._cache_size() == n + 1  # an update setting does recompile


def test_training_logprobs_use_the_sampling_temperature():
  """At T != 1 the trainer's log-probs of sampled tokens equal the sampler's (so the first ratio is 1)."""
  from rollouts_jax import sampling
  params = models.init_params(CFG, jax.random.key(3))
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 24, (2, 5)), jnp.int32)
  mask = jnp.ones((2, 5), bool)
  conf = sampling.SamplingConfig(num_samples=3, max_new_tokens=6, temperature=0.6, prompt_buckets=())
  out = sampling.sample(CFG, params, ids, mask, jax.random.key(1), conf)
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(2), policy_version=0)
  tokens, attn, P = rl._rows(batch)
  lp, _ = rl.completion_logprobs(CFG, params, tokens, attn, P, temperature=0.6)
  m = np.asarray(out.completion_mask).reshape(lp.shape)
  np.testing.assert_allclose(np.where(m, lp, 0), np.asarray(out.logprobs).reshape(lp.shape), atol=2e-5)
  lp1, _ = rl.completion_logprobs(CFG, params, tokens, attn, P)
  assert np.abs(np.where(m, lp1, 0) - np.asarray(out.logprobs).reshape(lp.shape)).max() > 1e-2


def test_old_logprobs_of_the_batch_set_the_ratio_and_tis_weights_the_behaviour_gap():
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, tis_cap=2.0)
  r = _rollouts(seed=4)
  state = _state(conf)
  tokens, attn, P = rl._rows(r)
  lp, _ = rl.completion_logprobs(CFG, state.params, tokens, attn, P)
  B, N, T = r.completion_ids.shape
  same = r.replace(old_logprobs=lp.reshape(B, N, T), behaviour_logprobs=lp.reshape(B, N, T))
  shifted = same.replace(old_logprobs=same.old_logprobs - 0.5)   # a stale policy: ratios exp(0.5)
  _, m_same = rl.rl_step(_state(conf), same, None, cfg=CFG, rl=conf)
  _, m_shift = rl.rl_step(_state(conf), shifted, None, cfg=CFG, rl=conf)
  assert float(m_same["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
  assert float(m_shift["ratio_min"]) == pytest.approx(np.exp(0.5), rel=1e-4)


def test_token_advantages_replace_the_recipes_and_weight_each_token():
  base = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, agg="token-mean")
  r = _rollouts()
  B, N, T = r.completion_ids.shape
  adv, _ = rl.advantages_lib.apply(rl.advantage_transform(base), r.rewards, mask=r.sample_mask)
  # The recipe's advantage broadcast to every token: the same update as without token advantages.
  s_a, m_a = rl.rl_step(_state(base), r, None, cfg=CFG, rl=base)
  s_b, m_b = rl.rl_step(_state(base), r.replace(token_advantages=jnp.broadcast_to(adv[..., None], (B, N, T))), None,
                        cfg=CFG, rl=base)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), mu(s_a), mu(s_b))
  # Zero advantage on every token but one: only that token's log-prob moves up.
  one = np.zeros((B, N, T), np.float32)
  one[0, 0, 0] = 1.0
  s_c, _ = rl.rl_step(_state(base), r.replace(token_advantages=jnp.asarray(one)), None, cfg=CFG, rl=base)
  tokens, attn, P = rl._rows(r)
  before, _ = rl.completion_logprobs(CFG, _state(base).params, tokens, attn, P, 1.0)
  after, _ = rl.completion_logprobs(CFG, s_c.params, tokens, attn, P, 1.0)
  assert float(after[0, 0]) > float(before[0, 0])


def test_echo_clip_with_equal_bounds_is_ppo_clip_and_differs_otherwise():
  rng = np.random.default_rng(3)
  r = _rollouts(seed=3)
  r = r.replace(old_logprobs=jnp.asarray(rng.normal(-3.0, 0.5, r.completion_ids.shape), jnp.float32),
                confidence=jnp.asarray(rng.uniform(1, 3, r.rewards.shape), jnp.float32))
  plain = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, clip_low=0.2, clip_high=0.2)
  echo = dataclasses.replace(plain, echo_clip=True, echo_eps_lo=0.2, echo_eps_hi=0.2)
  s_plain, m_plain = rl.rl_step(_state(plain), r, None, cfg=CFG, rl=plain)
  s_echo, m_echo = rl.rl_step(_state(echo), r, None, cfg=CFG, rl=echo)
  np.testing.assert_allclose(m_echo["loss"], m_plain["loss"], rtol=1e-6)
  np.testing.assert_allclose(m_echo["clip_frac_low"] + m_echo["clip_frac_high"],
                             m_plain["clip_frac_low"] + m_plain["clip_frac_high"], rtol=1e-6)
  assert float(m_plain["clip_frac_low"] + m_plain["clip_frac_high"]) > 0   # the clip matters here
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                         s_echo.params, s_plain.params)
  wide = dataclasses.replace(echo, echo_eps_lo=0.1, echo_eps_hi=0.28)
  _, m_wide = rl.rl_step(_state(wide), r, None, cfg=CFG, rl=wide)
  assert abs(float(m_wide["loss"]) - float(m_plain["loss"])) > 1e-6
  assert 0.1 < float(m_wide["clip_eps_mean"]) < 0.28


def test_echo_shaping_scales_each_token_by_entropy_and_positive_ones_by_confidence():
  r = rl.Rollouts.empty(1, 2, 1, 2).replace(
      completion_mask=np.ones((1, 2, 2), bool), sample_mask=np.ones((1, 2), bool),
      entropy=np.array([[[1., 3.], [2., 2.]]], np.float32), confidence=np.array([[2., 1.]], np.float32))
  per_sample = rl.echo_shaped(jnp.array([[[1.], [-1.]]]), r, jnp.ones((1, 2), bool), 0.5)
  np.testing.assert_allclose(per_sample, [[[0.75, 1.25], [-1.0, -1.0]]], rtol=1e-6)
  # Per-token advantages of both signs: the confidence factor (0 for the less confident
  # response, normalised in its group) applies to the positive tokens only.
  per_token = rl.echo_shaped(jnp.array([[[2., -2.], [1., -1.]]]), r, jnp.ones((1, 2), bool), 0.5)
  np.testing.assert_allclose(per_token, [[[1.5, -2.5], [0.0, -1.0]]], rtol=1e-6)
  # lambda = 0 with a flat group: unchanged.
  flat = r.replace(confidence=np.array([[1., 1.]], np.float32))
  np.testing.assert_allclose(rl.echo_shaped(jnp.array([[[2., -2.], [1., -1.]]]), flat, jnp.ones((1, 2), bool), 0.0),
                             [[[2., -2.], [1., -1.]]])
