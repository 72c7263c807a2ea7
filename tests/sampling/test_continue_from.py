"""`sampling.continue_from`: partial rollouts resume where they stopped, with nothing lost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling

CFG = models.ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=96)
PARAMS = models.init_params(CFG, jax.random.key(0))
OTHER = models.init_params(CFG, jax.random.key(7))
EOS = 3
CONF = sampling.SamplingConfig(num_samples=6, max_new_tokens=20, eos_id=EOS, prompt_buckets=(8, 16))


def _prompts():
  ids = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 20, 21]], np.int32)
  return ids, ids > 0


def _cut(out, lengths_BxN):
  """The first `lengths` tokens of each row, right-padded to the longest."""
  L = int(lengths_BxN.max())
  t = np.arange(L)
  mask = t < lengths_BxN[..., None]
  ids = np.where(mask, np.asarray(out.completion_ids)[..., :L], 0)
  lp = np.where(mask, np.asarray(out.logprobs)[..., :L], 0)
  return ids, mask, lp


def test_resuming_a_sample_reproduces_it():
  ids, mask = _prompts()
  key = jax.random.key(11)
  full = sampling.sample(CFG, PARAMS, ids, mask, key, CONF)
  rng = np.random.default_rng(0)
  full_len = np.asarray(full.lengths)
  cut = np.minimum(rng.integers(0, 12, size=full_len.shape), full_len)
  pre_ids, pre_mask, pre_lp = _cut(full, cut)
  resumed = sampling.continue_from(CFG, PARAMS, ids, mask, pre_ids, pre_mask, key, CONF, prefix_logprobs=pre_lp)
  same_rows = (np.asarray(resumed.completion_ids) == np.asarray(full.completion_ids)).all(-1)
  # The same uniforms at the same positions: only prefill-vs-decode rounding can flip a draw.
  assert same_rows.mean() >= 0.9, same_rows
  rows = np.nonzero(same_rows)
  np.testing.assert_array_equal(np.asarray(resumed.completion_mask)[rows], np.asarray(full.completion_mask)[rows])
  np.testing.assert_allclose(np.asarray(resumed.logprobs)[rows], np.asarray(full.logprobs)[rows], atol=2e-4)
  # Prefix log-probs are the given ones, bit for bit.
  L = pre_ids.shape[-1]
  np.testing.assert_array_equal(np.where(pre_mask, np.asarray(resumed.logprobs)[..., :L], 0), pre_lp)


def test_continuation_logprobs_are_the_policy_at_the_right_positions():
  """The continuing policy's log-probs of its own tokens equal a teacher-forced forward."""
  ids, mask = _prompts()
  conf = CONF.replace(temperature=1.0)
  first = sampling.sample(CFG, OTHER, ids, mask, jax.random.key(1), conf.replace(max_new_tokens=5, eos_id=None))
  pre_mask = np.ones(first.completion_ids.shape, bool)
  pre_mask[0, 0, 3:] = False   # ragged prefixes
  pre_mask[1, 2, :] = False    # an empty prefix: a fresh sample
  out = sampling.continue_from(CFG, PARAMS, ids, mask, np.asarray(first.completion_ids) * pre_mask, pre_mask,
                               jax.random.key(2), conf, prefix_logprobs=np.asarray(first.logprobs) * pre_mask)
  B, N, T = out.completion_ids.shape
  P = ids.shape[1]
  rows = np.concatenate([np.repeat(ids, N, 0), np.asarray(out.completion_ids).reshape(B * N, T)], 1)
  rmask = np.concatenate([np.repeat(mask, N, 0), np.asarray(out.completion_mask).reshape(B * N, T)], 1)
  ref = np.asarray(models.token_logprobs(CFG, PARAMS, jnp.asarray(rows), jnp.asarray(rmask), P)[0]).reshape(B, N, T)
  new = np.asarray(out.completion_mask) & ~np.pad(pre_mask, ((0, 0), (0, 0), (0, T - pre_mask.shape[-1])))
  assert new.sum() > 50
  np.testing.assert_allclose(np.asarray(out.policy_logprobs)[new], ref[new], atol=2e-4)
  # Prefix positions keep the earlier policy's behaviour log-probs, not the new policy's.
  np.testing.assert_array_equal(np.asarray(out.logprobs)[..., :5][pre_mask], np.asarray(first.logprobs)[pre_mask])


def test_finished_rows_are_not_extended():
  ids, mask = _prompts()
  pre = np.full((3, 2, 4), 30, np.int32)
  pre_mask = np.ones_like(pre, bool)
  pre[0, 0, 1] = EOS                       # ended by EOS at position 1
  pre_mask[0, 0, 2:] = False
  finished = np.zeros((3, 2), bool)
  finished[2, 1] = True                    # declared finished
  conf = CONF.replace(max_new_tokens=8)
  out = sampling.continue_from(CFG, PARAMS, ids, mask, pre, pre_mask, jax.random.key(0), conf, finished=finished)
  lengths = np.asarray(out.lengths)
  assert lengths[0, 0] == 2 and lengths[2, 1] == 4
  assert (np.asarray(out.completion_ids)[0, 0, 2:] == conf.pad_id).all()
  ended = np.asarray(sampling.finished_rows(out.completion_ids, out.completion_mask, conf))
  assert (ended | finished).all() and not ended[2, 1]  # a declared-finished row stays as it was
  full = sampling.continue_from(CFG, PARAMS, ids, mask, np.full((3, 2, 8), 30), np.ones((3, 2, 8), bool),
                                jax.random.key(0), conf)
  np.testing.assert_array_equal(np.asarray(full.lengths), 8)  # a full-length prefix is done


def test_stop_after_groups_then_resume_is_the_uninterrupted_sample():
  """APRIL: stop once k groups are complete, resume the rest later; nothing is lost."""
  ids, mask = _prompts()
  conf = CONF.replace(max_new_tokens=24)
  key = jax.random.key(5)
  B, N = 3, conf.num_samples
  empty = np.zeros((B, N, 0), np.int32)
  whole = sampling.continue_from(CFG, PARAMS, ids, mask, empty, empty.astype(bool), key, conf)
  part = sampling.continue_from(CFG, PARAMS, ids, mask, empty, empty.astype(bool), key, conf, stop_after_groups=1)
  done = np.asarray(sampling.finished_rows(part.completion_ids, part.completion_mask, conf))
  assert done.all(axis=1).sum() >= 1
  assert int(np.asarray(part.lengths).sum()) <= int(np.asarray(whole.lengths).sum())
  # Every token of the partial run is the start of the uninterrupted run.
  pm = np.asarray(part.completion_mask)
  np.testing.assert_array_equal(np.asarray(part.completion_ids)[pm], np.asarray(whole.completion_ids)[pm])
  resumed = sampling.continue_from(CFG, PARAMS, ids, mask, np.asarray(part.completion_ids), pm, key, conf,
                                   prefix_logprobs=np.asarray(part.logprobs), finished=done)
  same = (np.asarray(resumed.completion_ids) == np.asarray(whole.completion_ids)).all(-1)
  assert same.mean() >= 0.9
  assert np.asarray(sampling.finished_rows(resumed.completion_ids, resumed.completion_mask, conf)).all()


def test_one_resumed_row_among_fresh_and_finished_rows_is_the_uninterrupted_sample():
  """Only rows that hold a prefix and still run are re-read (padded to a bucket of rows); the
  others start from their prompt, sharing its keys, and every row is the uninterrupted sample."""
  ids, mask = _prompts()
  key = jax.random.key(3)
  full = sampling.sample(CFG, PARAMS, ids, mask, key, CONF)
  lengths = np.asarray(full.lengths)
  cut = np.zeros_like(lengths)
  cut[1, 2] = min(4, lengths[1, 2] - 1)     # the one row that resumes mid-way
  cut[0, 0] = lengths[0, 0]                 # a row handed over complete
  pre_ids, pre_mask, pre_lp = _cut(full, cut)
  out = sampling.continue_from(CFG, PARAMS, ids, mask, pre_ids, pre_mask, key, CONF, prefix_logprobs=pre_lp)
  same = (np.asarray(out.completion_ids) == np.asarray(full.completion_ids)).all(-1)
  assert same.mean() >= 0.9, same
  assert same[1, 2] and same[0, 0] and same[-1, -1]
  np.testing.assert_array_equal(np.asarray(out.lengths)[same], lengths[same])
  np.testing.assert_allclose(np.asarray(out.logprobs)[same], np.asarray(full.logprobs)[same], atol=2e-4)


def test_bad_inputs_have_clear_errors():
  ids, mask = _prompts()
  pre = np.ones((3, 2, 4), np.int32)
  with pytest.raises(ValueError, match="left-aligned"):
    m = np.ones_like(pre, bool)
    m[0, 0, 1] = False
    sampling.continue_from(CFG, PARAMS, ids, mask, pre, m, jax.random.key(0), CONF)
  with pytest.raises(ValueError, match="max_new_tokens=2"):
    sampling.continue_from(CFG, PARAMS, ids, mask, pre, pre > 0, jax.random.key(0), CONF.replace(max_new_tokens=2))
  with pytest.raises(ValueError, match=r"\[B=3, N, L\]"):
    sampling.continue_from(CFG, PARAMS, ids, mask, pre[:2], pre[:2] > 0, jax.random.key(0), CONF)
  with pytest.raises(ValueError, match="prefix_logprobs"):
    sampling.continue_from(CFG, PARAMS, ids, mask, pre, pre > 0, jax.random.key(0), CONF,
                           prefix_logprobs=np.zeros((3, 2, 3)))
  with pytest.raises(ValueError, match="stop_after_groups"):
    sampling.continue_from(CFG, PARAMS, ids, mask, pre, pre > 0, jax.random.key(0), CONF, stop_after_groups=4)
