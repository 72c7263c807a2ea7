"""Log-probs over chunks of positions: the same values and gradients as all at once, less memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax import models
from rollouts_jax.models import scoring
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig

CFG = models.ModelConfig(model_type="llama", vocab_size=37, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
P, T = 4, 7


def _rows(cfg, R=3, seed=0):
  """Left-padded prompts of P tokens, then T completion tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.vocab_size, (R, P + T))
  mask = np.ones((R, P + T), bool)
  mask[0, :2] = False   # a shorter prompt
  tokens[~mask] = 0
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "temperature"))
def _score(params, tokens, mask, *, cfg, chunk, temperature):
  return scoring.token_logprobs(cfg, params, tokens, mask, P, temperature=temperature, chunk=chunk)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_logprobs_and_entropies_equal_unchunked(tied):
  cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
  params = models.init_params(cfg, jax.random.key(1))
  tokens, mask = _rows(cfg)
  lp0, ent0 = _score(params, tokens, mask, cfg=cfg, chunk=0, temperature=0.7)
  assert lp0.shape == ent0.shape == (3, T)
  for chunk in (1, 3, T + 3):   # 3 does not divide T = 7: the last chunk is padded; T + 3: one chunk
    lp, ent = _score(params, tokens, mask, cfg=cfg, chunk=chunk, temperature=0.7)
    assert lp.shape == ent.shape == (3, T)
    np.testing.assert_allclose(lp, lp0, rtol=1e-5, atol=1e-5, err_msg=f"chunk={chunk}")
    np.testing.assert_allclose(ent, ent0, rtol=1e-5, atol=1e-5, err_msg=f"chunk={chunk}")


def test_negative_chunk_is_refused():
  params = models.init_params(CFG, jax.random.key(1))
  tokens, mask = _rows(CFG)
  with pytest.raises(ValueError, match="chunk must be >= 0"):
    scoring.token_logprobs(CFG, params, tokens, mask, P, chunk=-1)


def test_gradient_through_chunks_equals_unchunked():
  params = models.init_params(CFG, jax.random.key(2))
  tokens, mask = _rows(CFG, seed=1)
  adv = jnp.asarray(np.random.default_rng(3).normal(size=(3, T)), jnp.float32)

  def loss(p, chunk):
    lp, ent = scoring.token_logprobs(CFG, p, tokens, mask, P, temperature=0.8, chunk=chunk)
    return -jnp.mean(lp * adv) - 0.1 * jnp.mean(ent)

  v0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(p, 0)))(params)
  v3, g3 = jax.jit(jax.value_and_grad(lambda p: loss(p, 3)))(params)
  np.testing.assert_allclose(v3, v0, rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(g0))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), g3, g0)
  assert float(jnp.max(jnp.abs(g3["lm_head"]))) > 0


def _batch(B=2, N=4, Pb=5, Tb=6, V=24, seed=0):
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(1, Pb + 1, size=B)
  pmask = np.arange(Pb)[None] >= (Pb - prompt_lens)[:, None]
  lengths = rng.integers(1, Tb + 1, size=(B, N))
  cmask = np.arange(Tb)[None, None] < lengths[..., None]
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, V, (B, Pb)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, V, (B, N, Tb)), jnp.int32),
      completion_mask=jnp.asarray(cmask),
      behaviour_logprobs=jnp.zeros((B, N, Tb)), policy_version=jnp.zeros((B, N, Tb), jnp.int32),
      rewards=jnp.asarray(rng.integers(0, 2, (B, N)), jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


def test_rl_step_with_logprob_chunk_gives_the_same_update():
  # Two minibatches and a KL penalty: the loss, the old log-probs and the reference log-probs
  # all go through the chunked path (T = 6, chunks of 4).
  cfg = dataclasses.replace(CFG, vocab_size=24)
  base = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, num_minibatches=2, kl_coef=0.1)
  chunked = dataclasses.replace(base, logprob_chunk=4)
  params = models.init_params(cfg, jax.random.key(0))
  ref = jax.tree_util.tree_map(lambda x: x + 0.01, params)
  r = _batch()
  state = lambda: rl.init_train_state(params, rl.rl_optimizer(base))
  s0, m0 = rl.rl_step(state(), r, ref, cfg=cfg, rl=base)
  s1, m1 = rl.rl_step(state(), r, ref, cfg=cfg, rl=chunked)
  assert int(s0.step) == int(s1.step) == 2
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), s1.params, s0.params)
  mu = lambda s: optax.tree_utils.tree_get(s.opt_state, "mu")
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(mu(s0)))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
                         mu(s1), mu(s0))
  for k in ("loss", "kl", "policy_entropy", "grad_norm", "mismatch_mean"):
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_chunked_loss_and_gradient_compile_to_less_memory():
  # A 32k vocabulary on a tiny model: the logits dominate; only compiled, never run.
  cfg = models.ModelConfig(model_type="llama", vocab_size=32768, hidden_size=32, intermediate_size=64,
                           num_layers=1, num_heads=2, num_kv_heads=1)
  params = models.init_params(cfg, jax.random.key(0))
  R, Tc, C = 4, 64, 8
  tokens = jnp.zeros((R, P + Tc), jnp.int32)
  mask = jnp.ones((R, P + Tc), bool)

  def temp_bytes(chunk):
    def loss(p):
      lp, ent = scoring.token_logprobs(cfg, p, tokens, mask, P, temperature=0.7, chunk=chunk)
      return jnp.mean(lp) + 0.1 * jnp.mean(ent)
    stats = jax.jit(jax.value_and_grad(loss)).lower(params).compile().memory_analysis()
    return None if stats is None else stats.temp_size_in_bytes

  full, chunked = temp_bytes(0), temp_bytes(C)
  if full is None or chunked is None:
    pytest.skip("this backend reports no compiled memory statistics")
  logits_bytes = R * Tc * cfg.vocab_size * 4
  assert full > logits_bytes            # all positions' logits at once (and more for the backward)
  assert chunked < logits_bytes / 2     # never all of them
  assert chunked < full / 4
