"""Sol-RL: subset selection (extremes, ties, duplicates, errors), gathering, full-precision rescoring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax import models, sampling
from rollouts_jax.control.subset import select_subset
from rollouts_jax.sampling import sol_rl

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2)
PARAMS = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 3 else x,
                                models.init_params(CFG, jax.random.key(0)))


# ----------------------------------------------------------------------------- selection


def test_contrastive_picks_the_extremes():
  r = np.array([[0.1, 0.9, 0.5, 0.3, 0.7, 0.2],
                [5.0, -1.0, 2.0, 3.0, 0.0, 4.0]])
  idx = select_subset(r, 4)
  # best two (descending), then worst two (ascending)
  np.testing.assert_array_equal(idx, [[1, 4, 0, 5], [0, 5, 1, 4]])
  assert idx.dtype == np.int32
  # odd k: one extra worst
  np.testing.assert_array_equal(select_subset(r, 3), [[1, 0, 5], [0, 1, 4]])
  # device input gives the same answer
  np.testing.assert_array_equal(select_subset(jnp.asarray(r), 4), idx)


def test_contrastive_ties_are_deterministic_and_never_repeat():
  equal = np.zeros((1, 6))
  np.testing.assert_array_equal(select_subset(equal, 4), [[0, 1, 2, 3]])
  binary = np.array([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
  # best: the two lowest-index 1s; worst: the lowest-index 0s among the rest
  np.testing.assert_array_equal(select_subset(binary, 4), [[0, 1, 2, 3]])
  np.testing.assert_array_equal(select_subset(binary, 5), [[0, 1, 2, 3, 5]])
  # k == M takes everything once
  np.testing.assert_array_equal(np.sort(select_subset(binary, 6)), [np.arange(6)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=12), st.integers(1, 12))
def test_contrastive_halves_bound_the_rest(rewards, k):
  """Property: distinct indices; best half >= every unpicked reward >= worst half."""
  r = np.asarray(rewards, float)[None]
  M = r.shape[1]
  k = min(k, M)
  idx = select_subset(r, k)[0]
  assert len(set(idx.tolist())) == k
  best, worst = r[0, idx[:k // 2]], r[0, idx[k // 2:]]
  rest = np.delete(r[0], idx)
  if rest.size:
    assert best.size == 0 or best.min() >= rest.max()
    assert worst.max() <= rest.min()
  assert np.all(np.diff(best) <= 0) and np.all(np.diff(worst) >= 0)
  np.testing.assert_array_equal(select_subset(r, k)[0], idx)  # deterministic


def test_duplicate_completions_count_once():
  r = np.array([[1.0, 1.0, 0.8, 0.3, 0.0, 0.0]])
  ids = np.array([[[7, 2, 0], [7, 2, 0], [8, 2, 0], [9, 9, 2], [5, 2, 0], [5, 2, 0]]])
  # Without ids the two copies of each extreme fill the subset.
  np.testing.assert_array_equal(select_subset(r, 4), [[0, 1, 4, 5]])
  # With ids the distinct completions {0, 2, 3, 4} come first.
  np.testing.assert_array_equal(select_subset(r, 4, completion_ids=ids), [[0, 2, 4, 3]])
  # Too few distinct completions: all of them, then repeats by the same rule.
  same = np.repeat(ids[:, :1], 6, axis=1)
  np.testing.assert_array_equal(select_subset(r, 3, completion_ids=same), [[0, 1, 4]])
  # deviation from the whole pool's mean (0.517), over the distinct completions
  np.testing.assert_array_equal(select_subset(r, 2, mode="deviation", completion_ids=ids), [[4, 0]])


def test_deviation_picks_the_farthest_from_the_mean():
  r = np.array([[0.0, 0.5, 1.0, 0.5, 0.4]])  # mean 0.48: |dev| = .48 .02 .52 .02 .08
  np.testing.assert_array_equal(select_subset(r, 2, mode="deviation"), [[2, 0]])
  np.testing.assert_array_equal(select_subset(r, 3, mode="deviation"), [[2, 0, 4]])


def test_random_is_uniform_without_replacement_and_keyed():
  B, M, k = 400, 6, 2
  r = np.zeros((B, M))
  key = jax.random.key(0)
  idx = select_subset(r, k, mode="random", key=key)
  assert all(len(set(row)) == k for row in idx.tolist())
  np.testing.assert_array_equal(idx, select_subset(r, k, mode="random", key=key))
  assert not np.array_equal(idx, select_subset(r, k, mode="random", key=jax.random.key(1)))
  counts = np.bincount(idx.ravel(), minlength=M)
  expected = B * k / M
  sd = np.sqrt(B * (k / M) * (1 - k / M))
  assert np.all(np.abs(counts - expected) < 5 * sd), counts


def test_selection_errors():
  r = np.zeros((2, 4))
  with pytest.raises(ValueError, match="k=5 .* M=4"):
    select_subset(r, 5)
  with pytest.raises(ValueError, match="k=0"):
    select_subset(r, 0)
  with pytest.raises(ValueError, match="mode"):
    select_subset(r, 2, mode="best")
  with pytest.raises(ValueError, match="key"):
    select_subset(r, 2, mode="random")
  with pytest.raises(ValueError, match="finite"):
    select_subset(np.array([[0.0, np.nan]]), 1)
  with pytest.raises(ValueError, match="completion_ids"):
    select_subset(r, 2, completion_ids=np.zeros((2, 3, 5), np.int32))
  with pytest.raises(ValueError, match=r"\[B, M\]"):
    select_subset(np.zeros(4), 2)


def test_gather_samples_slices_every_field():
  B, M, T = 2, 5, 3
  base = np.arange(B * M * T).reshape(B, M, T)
  out = sampling.SampleOutput(completion_ids=jnp.asarray(base, jnp.int32), completion_mask=jnp.asarray(base % 2 == 0),
                              logprobs=jnp.asarray(-base, jnp.float32), policy_logprobs=jnp.asarray(-2.0 * base),
                              entropy=jnp.asarray(0.5 * base), lengths=jnp.asarray(base.sum(-1), jnp.int32))
  idx = np.array([[4, 0], [2, 3]])
  sub = sol_rl.gather_samples(out, idx)
  for name in ("completion_ids", "completion_mask", "logprobs", "policy_logprobs", "entropy", "lengths"):
    full = np.asarray(getattr(out, name))
    np.testing.assert_array_equal(getattr(sub, name), np.stack([full[b, idx[b]] for b in range(B)]))
  with pytest.raises(ValueError, match=r"\[0, 5\)"):
    sol_rl.gather_samples(out, np.array([[5, 0], [0, 1]]))
  with pytest.raises(ValueError, match="B=2"):
    sol_rl.gather_samples(out, np.array([[0, 1]]))


# ------------------------------------------------------------------- rescoring and two stages


def _prompts():
  P = 6
  lens = np.array([6, 4, 1])
  rng = np.random.default_rng(0)
  ids = rng.integers(3, CFG.vocab_size, size=(3, P)).astype(np.int32)
  mask = np.arange(P)[None] >= (P - lens)[:, None]
  return np.where(mask, ids, 0), mask


CONF = sampling.SamplingConfig(num_samples=4, max_new_tokens=5, temperature=0.8, top_k=12, eos_id=5,
                               pad_id=0, prompt_buckets=(8,))


def _by_hand_logprobs(params, ids, mask, completions, config):
  """Row-by-row forward on exactly prompt + completion (no padding beyond the prompt's)."""
  B, K, T = completions.shape
  plp = np.zeros((B, K, T))
  lp = np.zeros((B, K, T))
  tempered = np.zeros((B, K, T))
  for b in range(B):
    prompt = ids[b][mask[b]]
    for j in range(K):
      seq = np.concatenate([prompt, completions[b, j]])[None]
      logits = models.forward(CFG, params, jnp.asarray(seq))[0, len(prompt) - 1:-1]
      tgt = completions[b, j]
      plp[b, j] = np.asarray(jax.nn.log_softmax(logits))[np.arange(T), tgt]
      proc = jax.nn.log_softmax(sampling.process_logits(logits, config))
      lp[b, j] = np.asarray(proc)[np.arange(T), tgt]
      tempered[b, j] = np.asarray(jax.nn.log_softmax(logits / config.temperature))[np.arange(T), tgt]
  return plp, lp, tempered


def test_recompute_equals_log_softmax_of_forward_under_full_params():
  ids, mask = _prompts()
  fp4_params = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="xla")
  out = sampling.sample(CFG, fp4_params, ids, mask, jax.random.key(1), CONF)
  full, stats = sol_rl.recompute_logprobs(CFG, PARAMS, ids, mask, out, CONF)
  plp, lp, tempered = _by_hand_logprobs(PARAMS, ids, mask, np.asarray(out.completion_ids), CONF)
  m = np.asarray(out.completion_mask)
  np.testing.assert_allclose(full.policy_logprobs, np.where(m, plp, 0), atol=1e-4)
  # Inside the full-precision top-k: the sampling log-prob; outside: the temperature-only one.
  inside = np.isfinite(lp)
  assert (m & ~inside).any() and (m & inside).any()  # FP4 tokens land on both sides here
  np.testing.assert_allclose(full.logprobs, np.where(m, np.where(inside, lp, tempered), 0), atol=1e-4)
  assert stats["out_of_support_frac"] == pytest.approx((m & ~inside).sum() / m.sum())
  np.testing.assert_array_equal(full.completion_ids, out.completion_ids)
  assert float(np.abs(np.asarray(full.policy_logprobs) - np.asarray(out.policy_logprobs)).max()) > 1e-3  # FP4 != full


def test_recompute_under_the_sampling_params_reproduces_the_sampler():
  ids, mask = _prompts()
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(2), CONF)
  full, stats = sol_rl.recompute_logprobs(CFG, PARAMS, ids, mask, out, CONF, num_chunks=3)
  for name in ("logprobs", "policy_logprobs", "entropy"):
    np.testing.assert_allclose(getattr(full, name), getattr(out, name), atol=1e-4)
  assert stats["out_of_support_frac"] == 0.0
  with pytest.raises(ValueError, match="num_chunks"):
    sol_rl.recompute_logprobs(CFG, PARAMS, ids, mask, out, CONF, num_chunks=5)


def test_recompute_batch_sets_the_trainers_logprobs_and_keeps_the_explorers():
  """Sol-RL's stage 2 on a RolloutBatch: old log-probs = the trainer's tempered full-precision ones."""
  from rollouts_jax.training import rl_step as rl
  ids, mask = _prompts()
  fp4_params = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="xla")
  conf = CONF.replace(top_k=0)
  out = sampling.sample(CFG, fp4_params, ids, mask, jax.random.key(4), conf)
  P = sampling.bucket_length(ids.shape[1], conf.prompt_buckets)
  ids, mask = sampling.left_pad_to(ids, mask, P, 0)
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(3), policy_version=0)
  full, stats = sol_rl.recompute_batch(CFG, PARAMS, batch, temperature=conf.temperature, num_chunks=3)
  np.testing.assert_array_equal(full.behaviour_logprobs, batch.behaviour_logprobs)  # the explorer's, kept
  tokens, attn, P = rl._rows(batch)
  lp, _ = rl.completion_logprobs(CFG, PARAMS, tokens, attn, P, temperature=conf.temperature)
  m = np.asarray(batch.completion_mask)
  np.testing.assert_allclose(full.old_logprobs, np.where(m, np.asarray(lp).reshape(m.shape), 0), atol=1e-5)
  assert stats["fp4_logprob_gap"] > 0
  with pytest.raises(ValueError, match="num_chunks"):
    sol_rl.recompute_batch(CFG, PARAMS, batch, num_chunks=5)
