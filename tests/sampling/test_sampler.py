"""The sampler: greedy equivalence, logprobs, distributions, EOS masking, errors, recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.sampling import engine, generate

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2)
PARAMS = models.init_params(CFG, jax.random.key(0))
# Larger weights give peaked, input-dependent distributions (so greedy paths are not trivial).
PARAMS = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 3 else x, PARAMS)


def _prompts(B=3, P=6, seed=0):
  rng = np.random.default_rng(seed)
  lens = np.array([P, 4, 1, 3][:B])
  ids = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
  mask = np.arange(P)[None] >= (P - lens)[:, None]
  return np.where(mask, ids, 0), mask


def test_greedy_equals_argmax_loop_over_forward():
  ids, mask = _prompts()
  T = 7
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(1),
                        sampling.SamplingConfig(num_samples=2, max_new_tokens=T, greedy=True,
                                                prompt_buckets=()))
  seq, seq_mask = jnp.asarray(ids), jnp.asarray(mask)
  expected = []
  for _ in range(T):
    logits = models.forward(CFG, PARAMS, seq, seq_mask)
    nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    expected.append(nxt)
    seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    seq_mask = jnp.concatenate([seq_mask, jnp.ones((seq.shape[0], 1), bool)], axis=1)
  expected = np.stack(expected, axis=1)
  for j in range(2):
    np.testing.assert_array_equal(out.completion_ids[:, j], expected)
  assert len(set(map(tuple, expected.tolist()))) > 1  # the rows really differ


def test_logprobs_equal_log_softmax_of_forward():
  ids, mask = _prompts()
  conf = sampling.SamplingConfig(num_samples=3, max_new_tokens=6, temperature=0.7, top_k=10,
                                 prompt_buckets=())
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(2), conf)
  B, N, T = out.completion_ids.shape
  for j in range(N):
    seq = jnp.concatenate([jnp.asarray(ids), out.completion_ids[:, j]], axis=1)
    seq_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((B, T), bool)], axis=1)
    logits = models.forward(CFG, PARAMS, seq, seq_mask)[:, ids.shape[1] - 1:-1]
    policy = jnp.take_along_axis(jax.nn.log_softmax(logits), out.completion_ids[:, j, :, None], -1)[..., 0]
    processed = sampling.process_logits(logits.reshape(B * T, -1), conf).reshape(B, T, -1)
    used = jnp.take_along_axis(jax.nn.log_softmax(processed), out.completion_ids[:, j, :, None], -1)[..., 0]
    np.testing.assert_allclose(out.policy_logprobs[:, j], policy, atol=1e-4)
    np.testing.assert_allclose(out.logprobs[:, j], used, atol=1e-4)
    probs = jax.nn.softmax(logits)
    ent = -jnp.sum(probs * jax.nn.log_softmax(logits), -1)
    np.testing.assert_allclose(out.entropy[:, j], ent, atol=1e-4)
  assert np.all(np.asarray(out.logprobs) >= np.asarray(out.policy_logprobs) - 1e-3 - 5)  # sanity: finite
  assert np.isfinite(np.asarray(out.logprobs)).all()


def _empirical(logits_V, conf, n=20000, seed=0):
  logits = jnp.broadcast_to(logits_V, (n, logits_V.shape[0]))
  keys = jax.random.key(seed)
  tok, *_ = engine.choose(logits, jax.random.uniform(keys, (n,), jnp.float32), conf)
  return np.bincount(np.asarray(tok), minlength=logits_V.shape[0]) / n


def _target(logits_V, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """Filters applied in sequence, each on the renormalized output of the previous one."""
  p = np.exp(np.asarray(logits_V, np.float64) / temperature)
  p /= p.sum()
  if top_k:
    p = np.where(p >= np.sort(p)[::-1][top_k - 1], p, 0)
    p /= p.sum()
  if top_p < 1:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
  if min_p:
    p = np.where(p >= min_p * p.max(), p, 0)
    p /= p.sum()
  return p


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6), dict(top_k=3),
                                dict(top_p=0.8), dict(temperature=1.5, top_p=0.9, top_k=5),
                                dict(min_p=0.2)])
def test_sampling_frequencies_match_target(kw):
  logits = jnp.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
  conf = sampling.SamplingConfig(**kw)
  freq = _empirical(logits, conf)
  target = _target(logits, **kw)
  n = 20000
  # Chi-square goodness of fit over tokens with positive target mass; excluded tokens never appear.
  assert np.all(freq[target == 0] == 0)
  pos = target > 0
  chi2 = n * np.sum((freq[pos] - target[pos]) ** 2 / target[pos])
  dof = pos.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, (chi2, dof)
  # and a wrong target is rejected by the same statistic (the test has power)
  wrong = _target(logits, temperature=kw.get("temperature", 1.0) * 1.3, top_k=kw.get("top_k", 0),
                  top_p=kw.get("top_p", 1.0), min_p=kw.get("min_p", 0.0))
  chi2_wrong = n * np.sum((freq[pos] - wrong[pos]) ** 2 / np.maximum(wrong[pos], 1e-12))
  assert chi2_wrong > chi2


def test_mask_after_eos_pure_function():
  toks = jnp.array([[5, 2, 7, 2], [1, 1, 1, 1], [2, 3, 3, 3], [4, 9, 4, 9]])
  got = sampling.mask_after_eos(toks, eos_ids=(2, 9))
  np.testing.assert_array_equal(got, [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
  assert sampling.mask_after_eos(toks, eos_ids=()).all()


def test_masking_after_eos_is_exact_and_rows_without_eos_run_to_the_end():
  ids, mask = _prompts(B=4)
  T = 12
  eos = 5
  conf = sampling.SamplingConfig(num_samples=16, max_new_tokens=T, temperature=1.3, eos_id=eos, pad_id=0,
                                 sample_chunk=4)
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(3), conf)
  toks, m = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
  np.testing.assert_array_equal(m, np.asarray(sampling.mask_after_eos(toks, (eos,))))
  assert np.all(toks[~m] == 0)
  for arr in (out.logprobs, out.policy_logprobs, out.entropy):
    assert np.all(np.asarray(arr)[~m] == 0)
  hit = (toks == eos).any(-1)
  assert hit.any() and (~hit).any()  # both kinds of rows occur
  np.testing.assert_array_equal(np.asarray(out.lengths)[~hit], T)
  ends = np.asarray(out.lengths)[hit] - 1
  np.testing.assert_array_equal(toks[hit, ends], eos)


def test_deterministic_and_chunking_preserves_shapes_and_groups():
  ids, mask = _prompts()
  base = dict(num_samples=10, max_new_tokens=5, temperature=1.0, eos_id=3)
  a = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(4), sampling.SamplingConfig(**base))
  b = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(4), sampling.SamplingConfig(**base))
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  c = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(4), sampling.SamplingConfig(**base, sample_chunk=4))
  assert c.completion_ids.shape == (3, 10, 5)
  # Greedy decoding is chunk-independent: every sample of a prompt is the same.
  g = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(4),
                      sampling.SamplingConfig(num_samples=10, max_new_tokens=5, greedy=True, sample_chunk=3))
  assert np.all(np.asarray(g.completion_ids) == np.asarray(g.completion_ids)[:, :1])
  d = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(5), sampling.SamplingConfig(**base))
  assert not np.array_equal(a.completion_ids, d.completion_ids)


def test_many_samples_chunked():
  ids, mask = _prompts(B=2)
  out = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(6),
                        sampling.SamplingConfig(num_samples=256, max_new_tokens=3, sample_chunk=64))
  assert out.completion_ids.shape == (2, 256, 3)
  # Samples are not copies of one another.
  assert len({tuple(r) for r in np.asarray(out.completion_ids[0]).tolist()}) > 50


def test_no_recompilation_within_a_bucket():
  conf = sampling.SamplingConfig(num_samples=2, max_new_tokens=4, prompt_buckets=(8, 16))
  ids, mask = _prompts(P=5)
  sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf)
  before = generate.sample_jit._cache_size()
  for P, seed in ((6, 1), (7, 2), (8, 3), (5, 4)):
    ids, mask = _prompts(P=P, seed=seed)
    sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(seed), conf)
  assert generate.sample_jit._cache_size() == before
  ids, mask = _prompts(P=9)
  sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf)
  assert generate.sample_jit._cache_size() == before + 1


def test_bucket_padding_does_not_change_greedy_output():
  ids, mask = _prompts(P=5)
  conf = sampling.SamplingConfig(num_samples=1, max_new_tokens=6, greedy=True)
  a = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf.replace(prompt_buckets=()))
  b = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0), conf.replace(prompt_buckets=(32,)))
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-5)


def test_clear_errors():
  ids, mask = _prompts(P=6)
  with pytest.raises(ValueError, match="num_samples must be >= 1"):
    sampling.SamplingConfig(num_samples=0)
  with pytest.raises(ValueError, match="top_p must be in"):
    sampling.SamplingConfig(top_p=1.5)
  with pytest.raises(ValueError, match="top_p must be in"):
    sampling.SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match=r"exceeds the cache length 10"):
    sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0),
                    sampling.SamplingConfig(max_new_tokens=8, cache_len=10, prompt_buckets=()))
  with pytest.raises(ValueError, match="largest prompt bucket 4"):
    sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(0),
                    sampling.SamplingConfig(max_new_tokens=8, prompt_buckets=(4,)))
  bad = mask.copy()
  bad[0] = False
  with pytest.raises(ValueError, match="at least one real token"):
    sampling.sample(CFG, PARAMS, ids, bad, jax.random.key(0), sampling.SamplingConfig(max_new_tokens=2))


def test_inverse_cdf_never_picks_zero_probability_tokens():
  probs = jnp.array([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4 + [[0.0, 0.0, 1.0, 0.0, 0.0]] * 4)
  for seed in range(20):
    tok = np.asarray(engine.inverse_cdf_draw(jax.random.uniform(jax.random.key(seed), (8,), jnp.float32), probs))
    assert np.all(np.asarray(probs)[np.arange(8), tok] > 0)
