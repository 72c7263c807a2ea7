"""The update reports how far the sampler's log-probs are from the trainer's (before the update)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig

CFG = models.ModelConfig(model_type="llama", vocab_size=24, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
TEMPERATURE = 0.7
KEYS = ("mismatch_mean", "mismatch_max", "mismatch_frac_gt_0.1")


def _sampled_batch(params):
  """A batch the fp32 policy `params` sampled itself: 2 prompts, 4 samples each, rewards 0/1."""
  rng = np.random.default_rng(0)
  ids = np.asarray(rng.integers(3, 24, (2, 5)), np.int32)
  mask = np.ones((2, 5), bool)
  ids[1, :2], mask[1, :2] = 0, False   # a left-padded prompt
  conf = sampling.SamplingConfig(num_samples=4, max_new_tokens=6, temperature=TEMPERATURE, eos_id=5,
                                 prompt_buckets=())
  out = sampling.sample(CFG, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(1), conf)
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(2), policy_version=0)
  return batch.replace(rewards=np.asarray([[1, 0, 0, 1], [0, 1, 1, 1]], np.float32))


# How rl_step finds the trainer's log-probs before the update: the first (only) minibatch's
# forward passes; the old log-probs it computes for several minibatches; one more pass when
# the batch brings its own old log-probs (here the behaviour ones, as replay sets them, which
# must not be mistaken for the trainer's).
ROUTES = {
    "one_update": (dict(), False),
    "epochs_stored_old": (dict(ppo_epochs=2), True),
    "minibatches": (dict(num_minibatches=2, micro_batch_size=2), False),
    "minibatches_stored_old": (dict(num_minibatches=2), True),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_mismatch_is_zero_on_the_samplers_batch_and_shows_a_shift(route):
  settings, stored_old = ROUTES[route]
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, **settings)
  params = models.init_params(CFG, jax.random.key(3))
  batch = _sampled_batch(params)
  assert np.asarray(batch.completion_mask).sum() > 8
  shifted = batch.replace(behaviour_logprobs=batch.behaviour_logprobs + 0.5)
  if stored_old:
    batch = batch.replace(old_logprobs=batch.behaviour_logprobs)
    shifted = shifted.replace(old_logprobs=shifted.behaviour_logprobs)
  step = lambda b: rl.rl_step(rl.init_train_state(params, rl.rl_optimizer(conf)), b, None, cfg=CFG, rl=conf,
                              temperature=TEMPERATURE)
  state, m = step(batch)
  assert int(state.step) == conf.ppo_epochs * conf.num_minibatches
  assert set(KEYS) <= set(m)
  assert float(m["mismatch_mean"]) < 1e-4
  assert float(m["mismatch_max"]) < 1e-3
  assert float(m["mismatch_frac_gt_0.1"]) == 0.0
  _, m = step(shifted)
  np.testing.assert_allclose(float(m["mismatch_mean"]), 0.5, atol=1e-4)
  np.testing.assert_allclose(float(m["mismatch_max"]), 0.5, atol=1e-3)
  assert float(m["mismatch_frac_gt_0.1"]) == 1.0


def test_mismatch_counts_only_tokens_in_the_loss():
  # A sample left out of the loss (sample_mask) and positions past each completion's end do not
  # count, however far off their behaviour log-probs are.
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0)
  params = models.init_params(CFG, jax.random.key(3))
  batch = _sampled_batch(params)
  cmask = np.asarray(batch.completion_mask)
  behaviour = np.where(cmask, batch.behaviour_logprobs, 7.0)
  behaviour[0, 1] += 3.0
  sample_mask = np.ones((2, 4), bool)
  sample_mask[0, 1] = False
  batch = batch.replace(behaviour_logprobs=behaviour, sample_mask=sample_mask)
  _, m = rl.rl_step(rl.init_train_state(params, rl.rl_optimizer(conf)), batch, None, cfg=CFG, rl=conf,
                    temperature=TEMPERATURE)
  assert float(m["mismatch_max"]) < 1e-3


def test_logprob_mismatch_by_hand():
  sampler = jnp.array([[-1.0, -2.0, -0.5, 0.0], [-3.0, -1.0, -1.0, -1.0]])
  trainer = jnp.array([[-1.0, -2.3, -0.45, -5.0], [-2.0, -1.0, -1.0, -1.0]])
  mask = jnp.array([[True, True, True, False], [True, False, False, False]])
  m = rl.logprob_mismatch(sampler, trainer, mask)
  np.testing.assert_allclose(float(m["mismatch_mean"]), (0.3 + 0.05 + 1.0) / 4, rtol=1e-5)
  np.testing.assert_allclose(float(m["mismatch_max"]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(m["mismatch_frac_gt_0.1"]), 0.5)
  empty = rl.logprob_mismatch(sampler, trainer, jnp.zeros_like(mask))
  assert all(float(v) == 0.0 for v in empty.values())


def test_top_k_behaviour_log_probs_are_the_truncated_distribution_and_need_the_is_correction():
  """Our documented choice: with top-k the behaviour log-probs are mu's (the truncated law that
  drew the tokens), above the full softmax pi the update scores; the config demands rl.tis_cap,
  whose weight min(pi / mu, cap) is below 1 on exactly those tokens."""
  from rollouts_jax.training import config as config_lib
  params = models.init_params(CFG, jax.random.key(3))
  rng = np.random.default_rng(0)
  ids, mask = np.asarray(rng.integers(3, 24, (2, 5)), np.int32), np.ones((2, 5), bool)
  conf = sampling.SamplingConfig(num_samples=4, max_new_tokens=6, temperature=TEMPERATURE, eos_id=5, top_k=3,
                                 prompt_buckets=())
  out = sampling.sample(CFG, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(1), conf)
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(2), policy_version=0)
  B, N, T = batch.completion_ids.shape
  tokens = np.concatenate([np.repeat(ids, N, 0), np.asarray(batch.completion_ids).reshape(B * N, T)], 1)
  attn = np.concatenate([np.repeat(mask, N, 0), np.asarray(batch.completion_mask).reshape(B * N, T)], 1)
  full, _ = models.token_logprobs(CFG, params, tokens, attn, 5, temperature=TEMPERATURE)
  m = np.asarray(batch.completion_mask).reshape(B * N, T)
  gap = (np.asarray(batch.behaviour_logprobs).reshape(B * N, T) - np.asarray(full))[m]
  assert (gap > 1e-4).all()                        # mu renormalises the top 3: every kept token gains mass
  weights = np.minimum(np.exp(-gap), 2.0)          # the TIS weight of each token
  assert (weights < 1.0).all()
  with pytest.raises(ValueError, match="rollout.top_k=3 samples from a truncated distribution.*rl.tis_cap"):
    config_lib.from_config_dict({"rollout": {"top_k": 3}})
  with pytest.raises(ValueError, match="rollout.top_p=0.9 does not combine with rollout.distill"):
    config_lib.from_config_dict({"rollout": {"top_p": 0.9, "distill": "opd"}, "rl": {"tis_cap": 2.0}})
  assert config_lib.from_config_dict({"rollout": {"top_k": 3}, "rl": {"tis_cap": 2.0}}).rl.tis_cap == 2.0
