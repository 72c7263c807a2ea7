"""The shared-prefix decode: outputs independent of chunking, views and attention kernel; bounded memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.sampling import engine, generate

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2)
PARAMS = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 3 else x, models.init_params(CFG, jax.random.key(0)))


def _prompts(B=3, P=6, seed=0):
  rng = np.random.default_rng(seed)
  lens = np.array([P, 4, 1, 3][:B])
  ids = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
  mask = np.arange(P)[None] >= (P - lens)[:, None]
  return np.where(mask, ids, 0), mask


def _assert_same(a, b, atol=1e-5):
  np.testing.assert_array_equal(np.asarray(a.completion_ids), np.asarray(b.completion_ids))
  np.testing.assert_array_equal(np.asarray(a.completion_mask), np.asarray(b.completion_mask))
  for f in ("logprobs", "policy_logprobs", "entropy"):
    np.testing.assert_allclose(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), atol=atol)


def test_outputs_do_not_depend_on_the_chunk():
  """Each sample draws from its own stream: chunk 1, 3, automatic and all-at-once agree."""
  ids, mask = _prompts()
  base = sampling.SamplingConfig(num_samples=7, max_new_tokens=10, temperature=1.2, top_k=12, eos_id=3)
  outs = [sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(1), base.replace(sample_chunk=c))
          for c in (1, 3, 7)]
  outs.append(sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(1),
                              base.replace(decode_memory_mb=0.001)))  # automatic: one sample per chunk
  for o in outs[1:]:
    _assert_same(outs[0], o)
  assert len({tuple(r) for r in np.asarray(outs[0].completion_ids[0]).tolist()}) > 1


def test_cache_views_do_not_change_outputs():
  """Attending through growing views (several compiled loops) equals one full-length view."""
  ids, mask = _prompts(P=5)
  base = sampling.SamplingConfig(num_samples=3, max_new_tokens=20, temperature=1.0)
  a = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(2), base.replace(length_segments=1))
  b = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(2), base.replace(length_segments=3))
  assert engine.cache_views(20, 3) == (8, 16, 20)
  _assert_same(a, b)


@pytest.mark.parametrize("implementation", ["naive", "pallas"])
def test_attention_implementations_agree(implementation):
  ids, mask = _prompts(B=2, P=4)
  conf = sampling.SamplingConfig(num_samples=2, max_new_tokens=5, greedy=True, prompt_buckets=())
  a = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf)
  b = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0),
                      conf.replace(attention_implementation=implementation))
  _assert_same(a, b, atol=1e-4)


def _temp_bytes(N, P=32, **kw):
  ids = jnp.ones((2, P), jnp.int32)
  mask = jnp.ones((2, P), bool)
  conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=8, prompt_buckets=(), **kw)
  compiled = generate.sample_jit.lower(CFG, conf, PARAMS, ids, mask, jax.random.key(0)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_peak_memory_bounded_by_the_budget_not_by_n():
  """With the default automatic chunk, the decode's scratch memory stops growing with N."""
  budget = dict(decode_memory_mb=0.05)
  assert engine.auto_sample_chunk(CFG, sampling.SamplingConfig(num_samples=64, max_new_tokens=8,
                                                                    **budget), 2) < 64
  small, large = _temp_bytes(64, **budget), _temp_bytes(256, **budget)
  assert large <= small * 1.1 + 64 * 1024, (small, large)  # outputs [B, N, T] are not scratch


def test_prompt_keys_are_not_copied_per_sample():
  """A longer prompt costs the same scratch memory with 16 samples per prompt as with 1."""
  grow = lambda n: _temp_bytes(n, P=256, sample_chunk=n) - _temp_bytes(n, P=32, sample_chunk=n)
  per_sample_kv = 2 * CFG.num_layers * 2 * (256 - 32) * CFG.num_kv_heads * CFG.head_dim * 4  # B=2, k and v
  extra = grow(16) - grow(1)
  assert extra < 2 * per_sample_kv, (extra, per_sample_kv)  # copies per sample would be 15x
