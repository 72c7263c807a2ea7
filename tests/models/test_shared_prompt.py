"""A group's prompt run once for its samples (`models.forward_shared_prompt`, `rl.shared_prompt`): the row
form's hidden states, log-probs, gradients and updates, to float rounding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models
from rollouts_jax.models import lora
from rollouts_jax.models import value as value_lib
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig
from rollouts_jax.types import teacher_forced_rows

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
# Qwen-style: biases on q/k/v and per-head q/k norms, untied head, remat.
QWEN = dataclasses.replace(CFG, model_type="qwen2", qkv_bias=True, qk_norm=True, tie_word_embeddings=False, remat=True)


def _rollouts(B=3, N=4, P=6, T=5, seed=0):
  rng = np.random.default_rng(seed)
  pmask = np.arange(P)[None] >= (P - rng.integers(1, P + 1, size=B))[:, None]   # left padding, 1..P real
  cmask = np.arange(T)[None, None] < rng.integers(1, T + 1, size=(B, N))[..., None]
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, 40, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask), completion_ids=jnp.asarray(rng.integers(3, 40, (B, N, T)), jnp.int32),
      completion_mask=jnp.asarray(cmask), behaviour_logprobs=jnp.asarray(rng.normal(-2, 0.3, (B, N, T)), jnp.float32),
      policy_version=jnp.zeros((B, N, T), jnp.int32), rewards=jnp.asarray(rng.integers(0, 2, (B, N)), jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


def _diff(a, b):
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


@pytest.mark.parametrize("cfg", [CFG, QWEN], ids=["llama", "qwen"])
def test_hidden_states_equal_the_rows_at_every_real_position(cfg):
  r = _rollouts()
  params = models.init_params(cfg, jax.random.key(1))
  hp, hc = models.forward_shared_prompt(cfg, params, r.prompt_ids, r.prompt_mask, r.completion_ids)
  tokens, attn = teacher_forced_rows(r.prompt_ids, r.prompt_mask, r.completion_ids)
  rows = models.forward(cfg, params, tokens, attn, return_hidden=True)
  B, N, T = r.completion_ids.shape
  P = r.prompt_ids.shape[1]
  assert _diff(hc.reshape(B * N, T, -1), rows[:, P:]) <= 1e-5
  real = np.repeat(np.asarray(r.prompt_mask), N, axis=0)
  assert np.max(np.abs(np.repeat(np.asarray(hp), N, axis=0) - np.asarray(rows[:, :P]))[real]) <= 1e-5


@pytest.mark.parametrize("share,chunk", [(4, 0), (2, 3)])
def test_logprobs_and_gradients_equal_the_rows(share, chunk):
  """Blocks of `share` rows (a whole group, or half of one) against every row on its own, with the head
  chunked or not; the gradient of a loss over the completion log-probs too, also for LoRA adapters."""
  r = _rollouts()
  tokens, attn = teacher_forced_rows(r.prompt_ids, r.prompt_mask, r.completion_ids)
  P = r.prompt_ids.shape[1]
  base = models.init_params(CFG, jax.random.key(2))
  adapters = lora.init_adapters(CFG, jax.random.key(3), rank=2, targets="q,v,down")
  adapters = {n: dict(ab, b=0.1 * jnp.ones_like(ab["b"])) for n, ab in adapters.items()}
  for params in (base, lora.apply(base, adapters, alpha=4.0, rank=2)):
    def loss(p, s):
      lp, ent = models.token_logprobs(CFG, p, tokens, attn, P, temperature=0.7, chunk=chunk, share=s)
      w = jnp.arange(lp.size, dtype=jnp.float32).reshape(lp.shape) / lp.size
      return jnp.sum(w * lp) + 0.1 * jnp.sum(ent), (lp, ent)
    (v1, (lp1, ent1)), g1 = jax.value_and_grad(loss, has_aux=True)(params, 1)
    (vs, (lps, ents)), gs = jax.value_and_grad(loss, has_aux=True)(params, share)
    assert _diff(lps, lp1) <= 1e-5 and _diff(ents, ent1) <= 1e-5
    assert abs(float(vs) - float(v1)) <= 1e-4
    assert _diff(gs, g1) <= 1e-5 * max(1.0, _diff(g1, jax.tree_util.tree_map(jnp.zeros_like, g1)))


@pytest.mark.parametrize("cfg", [CFG, QWEN], ids=["llama", "qwen"])
def test_vocabulary_logprobs_and_critic_values_equal_the_rows(cfg):
  """Full-vocabulary distillation's scorer and the critic's values (and their gradients) with each
  group's prompt run once, against every row on its own."""
  r = _rollouts()
  tokens, attn = teacher_forced_rows(r.prompt_ids, r.prompt_mask, r.completion_ids)
  P = r.prompt_ids.shape[1]
  params = models.init_params(cfg, jax.random.key(6))
  w = jnp.asarray(np.random.default_rng(0).normal(size=(tokens.shape[0], tokens.shape[1] - P)), jnp.float32)

  def vocab_loss(p, share):
    logp = models.vocab_logprobs(cfg, p, tokens, attn, P, temperature=0.7, share=share)
    return jnp.sum(w[..., None] * jnp.exp(logp) * jnp.arange(cfg.vocab_size)) / w.size, logp
  (v1, logp1), g1 = jax.value_and_grad(vocab_loss, has_aux=True)(params, 1)
  (v4, logp4), g4 = jax.value_and_grad(vocab_loss, has_aux=True)(params, 4)
  assert _diff(logp4, logp1) <= 1e-5 and abs(float(v4) - float(v1)) <= 1e-5 and _diff(g4, g1) <= 1e-5
  assert _diff(logp1, jnp.zeros_like(logp1)) > 1.0   # real log-probs, not a degenerate tensor

  critic = value_lib.init_critic(params)
  critic[value_lib.HEAD] = {"w": params["embed"][7].astype(jnp.float32), "b": jnp.asarray(0.3)}
  value_loss = lambda c, share: jnp.sum(w * value_lib.completion_values(cfg, c, tokens, attn, P, share))
  rows = value_lib.completion_values(cfg, critic, tokens, attn, P)
  assert _diff(rows, value_lib.critic_forward(cfg, critic, tokens, attn)[:, P - 1:-1]) == 0.0
  assert _diff(value_lib.completion_values(cfg, critic, tokens, attn, P, 2), rows) <= 1e-5
  assert float(jnp.std(rows)) > 1e-3
  assert _diff(jax.grad(value_loss)(critic, 4), jax.grad(value_loss)(critic, 1)) <= 1e-5


def test_a_share_that_does_not_divide_the_rows_is_named():
  r = _rollouts()
  tokens, attn = teacher_forced_rows(r.prompt_ids, r.prompt_mask, r.completion_ids)
  with pytest.raises(ValueError, match="share=5 rows per prompt must divide the 12 rows"):
    models.token_logprobs(CFG, models.init_params(CFG, jax.random.key(0)), tokens, attn, 6, share=5)


@pytest.mark.parametrize("settings", [
    dict(micro_batch_size=4), dict(micro_batch_size=2, num_minibatches=2, kl_coef=0.1),
    pytest.param(dict(micro_batch_size=6, ppo_epochs=2, tis_cap=2.0), marks=pytest.mark.slow)],
    ids=["groups_per_micro", "half_groups_kl", "blocks_of_2_epochs"])
def test_the_update_with_shared_prompts_is_the_row_update(settings):
  """`rl.shared_prompt` (blocks of gcd(micro_batch_size, N) rows) against the row form: the same
  loss, metrics and params after two steps, old / reference / trainer log-probs included."""
  r = _rollouts()
  params = models.init_params(CFG, jax.random.key(4))
  ref = models.init_params(CFG, jax.random.key(5))
  out = {}
  for shared in (False, True):
    # Adam's eps 1e-6: with 1e-8 a gradient entry of ~1e-9 turns float rounding (another summation order)
    # into a full-size step, which would test Adam's conditioning rather than the shared prompt.
    conf = RLConfig(steps=4, learning_rate=1e-2, warmup_steps=0, adam_eps=1e-6, shared_prompt=shared, **settings)
    state = rl.init_train_state(params, rl.rl_optimizer(conf))
    step = jax.jit(rl.rl_step, static_argnames=("cfg", "rl", "temperature", "max_len"))
    for _ in range(2):
      state, m = step(state, r, ref, cfg=CFG, rl=conf, temperature=0.8)
    out[shared] = (state.params, m)
  (p0, m0), (p1, m1) = out[False], out[True]
  assert _diff(p1, p0) <= 1e-5 and _diff(p0, params) > 1e-3   # the params moved, the same way
  for k in ("loss", "pg_loss", "grad_norm", "mismatch_mean", "policy_entropy"):
    assert abs(float(m1[k]) - float(m0[k])) <= 1e-4 * max(1.0, abs(float(m0[k]))), k


@pytest.mark.parametrize("kind", ["gae_critic", "full_vocab_distill"])
def test_the_critic_and_full_vocabulary_updates_with_shared_prompts_are_the_row_updates(kind):
  """PPO with a value model (old values, the critic's loss and step) and full-vocabulary distillation
  (the student's vocabulary log-probs) with `rl.shared_prompt`, against the row form: the same
  metrics, policy and critic after two steps."""
  r = _rollouts()
  params = models.init_params(CFG, jax.random.key(7))
  settings = dict(advantage="gae", critic_learning_rate=1e-2) if kind == "gae_critic" else {}
  if kind == "full_vocab_distill":
    teacher = models.init_params(CFG, jax.random.key(8))
    r = r.replace(teacher_logprobs=models.batch_logprobs(teacher, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                                         r.completion_mask, cfg=CFG, vocab=True))
  out = {}
  for shared in (False, True):
    conf = RLConfig(steps=4, learning_rate=1e-2, warmup_steps=0, adam_eps=1e-6, micro_batch_size=4,
                    shared_prompt=shared, **settings)
    state = rl.train_state_init(conf)(params)
    step = jax.jit(rl.rl_step, static_argnames=("cfg", "rl", "temperature", "max_len"))
    for _ in range(2):
      state, m = step(state, r, None, cfg=CFG, rl=conf, temperature=0.8)
    out[shared] = (state, m)
  (s0, m0), (s1, m1) = out[False], out[True]
  assert _diff(s1.params, s0.params) <= 1e-5 and _diff(s0.params, params) > 1e-3
  keys = ("vf_loss", "vpred_mean", "critic_grad_norm", "grad_norm") if kind == "gae_critic" else ("distill_kl",
                                                                                                   "grad_norm")
  for k in keys:
    assert abs(float(m1[k]) - float(m0[k])) <= 1e-4 * max(1.0, abs(float(m0[k]))), k
  if kind == "gae_critic":
    assert _diff(s1.critic.params, s0.critic.params) <= 1e-5
    assert _diff(s0.critic.params, value_lib.init_critic(params)) > 1e-3   # the critic moved, the same way
