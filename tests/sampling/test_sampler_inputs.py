"""Invalid prompts get a clear ValueError before anything compiles (numpy and JAX inputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.sampling import generate

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64)
PARAMS = models.init_params(CFG, jax.random.key(0))
CONF = sampling.SamplingConfig(num_samples=2, max_new_tokens=4, prompt_buckets=())


def _prompts():
  ids = np.array([[0, 0, 5, 6], [7, 8, 9, 10]], np.int32)
  mask = np.array([[False, False, True, True], [True, True, True, True]])
  return ids, mask


def _expect_error(ids, mask, match, conf=CONF):
  before = generate.sample_jit._cache_size()
  for convert in (np.asarray, jnp.asarray):
    with pytest.raises(ValueError, match=match):
      sampling.sample(CFG, PARAMS, convert(ids), convert(mask), jax.random.key(0), conf)
  assert generate.sample_jit._cache_size() == before  # nothing was compiled


def test_ids_outside_vocabulary():
  ids, mask = _prompts()
  _expect_error(np.where(ids == 9, CFG.vocab_size, ids), mask, r"vocab_size=40\)")
  _expect_error(np.where(ids == 9, -3, ids), mask, "got ids from -3")


def test_padding_ids_are_not_checked_and_do_not_matter():
  ids, mask = _prompts()
  conf = CONF.replace(greedy=True)
  a = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf)
  b = sampling.sample(CFG, PARAMS, np.where(mask, ids, -1), mask, jax.random.key(0), conf)
  np.testing.assert_array_equal(np.asarray(a.completion_ids), np.asarray(b.completion_ids))


def test_all_padding_row():
  ids, mask = _prompts()
  mask[0] = False
  _expect_error(ids, mask, "at least one real token")


def test_right_padding():
  ids, mask = _prompts()
  mask[1] = [True, True, True, False]
  _expect_error(ids, mask, "left-padded")


def test_prompt_plus_budget_beyond_positions():
  ids, mask = _prompts()
  _expect_error(ids, mask, "max_position_embeddings 64", CONF.replace(max_new_tokens=61))
  # exactly at the limit is fine (4 prompt tokens + 60 new tokens = 64 positions)
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), CONF.replace(max_new_tokens=60))
  assert out.completion_ids.shape == (2, 2, 60)


def test_package_names_are_the_functions_not_the_modules():
  """`sampling.sample` / `continue_from` are the functions (the modules are `generate` and `resume`)."""
  from rollouts_jax.sampling import resume  # pylint: disable=g-import-not-at-top
  assert sampling.sample is generate.sample and sampling.continue_from is resume.continue_from
  assert sampling.SamplingConfig is sampling.config.SamplingConfig
