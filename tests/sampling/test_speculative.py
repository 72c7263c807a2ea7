"""Speculative rollouts: SPEC-RL's draft verification and the FP4 self-drafter.

The distribution tests compare empirical sequence frequencies with the exact sequence
distribution of `sampling.sample` (every sequence of a tiny vocabulary scored by a
teacher-forced forward), by a chi-square goodness-of-fit test whose threshold is the chi-square
quantile for the bins the sample count supports (expected count >= 5), at a false-alarm rate of
1e-3 per test. The same statistic rejects the drafts themselves and the inexact SPEC-RL forms,
so the test has power.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from rollouts_jax import models, sampling
from rollouts_jax.sampling import sol_rl
from rollouts_jax.sampling import speculative as spec

V, T, EOS = 8, 3, 1
CFG = models.ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1)


def _policy(seed, head_scale=15.0):
  """A random policy with input-dependent, far-from-uniform next-token distributions."""
  p = models.init_params(CFG, jax.random.key(seed))
  return jax.tree_util.tree_map(
      lambda x: x * 8 if x.ndim == 3 else (x * head_scale if x.ndim == 2 and x.shape[1] == V else x), p)


TARGET, OTHER = _policy(0), _policy(1)
PROMPT = np.array([[2, 5, 6]], np.int32)
PMASK = PROMPT > 0
NS = 3000
CONF = sampling.SamplingConfig(num_samples=NS, max_new_tokens=T, eos_id=EOS, prompt_buckets=(), temperature=0.9,
                               top_k=6)
ALPHA = 1e-3


def _exact(params, conf=CONF):
  """{sequence (cut after EOS): probability} under `sample(params)` for PROMPT, by enumeration."""
  seqs = np.array(list(itertools.product(range(V), repeat=T)), np.int32)
  toks = np.concatenate([np.repeat(PROMPT, len(seqs), 0), seqs], 1)
  logits = models.forward(CFG, params, jnp.asarray(toks))[:, PROMPT.shape[1] - 1:-1]
  lp = jax.nn.log_softmax(sampling.process_logits(logits.reshape(-1, V), conf), -1)
  lp = np.take_along_axis(np.asarray(lp).reshape(len(seqs), T, V), seqs[..., None], -1)[..., 0]
  dist = {}
  for s, l in zip(seqs, lp):
    e = np.nonzero(s == EOS)[0]
    n = e[0] + 1 if len(e) else T
    dist.setdefault(tuple(s[:n]), float(np.exp(l[:n].sum())))
  return dist


def _counts(out):
  ids, mask = np.asarray(out.completion_ids)[0], np.asarray(out.completion_mask)[0]
  counts = {}
  for r in range(ids.shape[0]):
    k = tuple(ids[r][mask[r]])
    counts[k] = counts.get(k, 0) + 1
  return counts, ids.shape[0]


def _chi2_test(out, dist):
  """(statistic, threshold, impossible outcomes): sequences with expected count >= 5 are bins, the rest one bin."""
  counts, n = _counts(out)
  impossible = sum(c for k, c in counts.items() if dist.get(k, 0.0) == 0.0)
  big = [k for k, p in dist.items() if n * p >= 5]
  expected = np.array([n * dist[k] for k in big] + [n * (1.0 - sum(dist[k] for k in big))])
  observed = np.array([counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)])
  if expected[-1] < 1.0:  # the rare rest holds almost nothing: fold it into the largest bin
    i = int(np.argmax(expected[:-1]))
    expected[i] += expected[-1]
    observed[i] += observed[-1]
    expected, observed = expected[:-1], observed[:-1]
  stat = float(((observed - expected) ** 2 / expected).sum())
  dof = len(expected) - 1
  return stat, float(scipy_stats.chi2.ppf(1 - ALPHA, dof)), impossible


@pytest.fixture(scope="module")
def exact_target():
  return _exact(TARGET)


@pytest.fixture(scope="module")
def drafts():
  return sampling.sample(CFG, OTHER, PROMPT, PMASK, jax.random.key(2), CONF)


def test_the_test_has_power(exact_target, drafts):
  """`sample(TARGET)` passes; the other policy's samples (the drafts) fail by far."""
  stat, thr, bad = _chi2_test(sampling.sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(1), CONF), exact_target)
  assert bad == 0 and stat < thr, (stat, thr)
  assert len(exact_target) > 20 and abs(sum(exact_target.values()) - 1) < 1e-4
  stat, thr, _ = _chi2_test(drafts, exact_target)
  assert stat > 10 * thr, (stat, thr)


def test_exact_residual_matches_sample_distribution(exact_target, drafts):
  out, stats = spec.speculative_sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(3), CONF,
                                       drafts=spec.Drafts.from_output(drafts), draft_params=OTHER)
  stat, thr, bad = _chi2_test(out, exact_target)
  assert bad == 0 and stat < thr, (stat, thr)
  # Both outcomes of the test occurred many times (the check covers acceptance and the residual).
  assert 0.1 * stats["draft_tokens"] < stats["accepted_tokens"] < 0.9 * stats["draft_tokens"], stats
  assert stats["rejected_rows"] > 0.1 * NS and stats["fully_accepted_rows"] > 0.05 * NS, stats
  # SPEC-RL's forms are not exact: the free draw after a cut, and a lenience > 1.
  free, _ = spec.speculative_sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(3), CONF,
                                    drafts=spec.Drafts.from_output(drafts), residual=False)
  stat_free, thr, _ = _chi2_test(free, exact_target)
  assert stat_free > thr, (stat_free, thr)


@pytest.mark.slow
def test_lenient_acceptance_is_not_exact(exact_target, drafts):
  out, _ = spec.speculative_sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(3), CONF,
                                   drafts=spec.Drafts.from_output(drafts), draft_params=OTHER, lenience=math.exp(0.5))
  stat, thr, _ = _chi2_test(out, exact_target)
  assert stat > thr, (stat, thr)


def test_self_speculative_matches_sample_distribution(exact_target):
  """An unrelated drafter (many rejections, residual draws and bonus tokens) and the FP4 self-copy."""
  out, stats = spec.self_speculative_sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(4), CONF, draft_params=OTHER,
                                            gamma_max=2)
  stat, thr, bad = _chi2_test(out, exact_target)
  assert bad == 0 and stat < thr, (stat, thr)
  assert stats["speculated"] and 0.05 < stats["acceptance_rate"] < 0.9, stats
  out, stats = spec.self_speculative_sample(CFG, TARGET, PROMPT, PMASK, jax.random.key(5), CONF, gamma_max=2)
  stat, thr, bad = _chi2_test(out, exact_target)
  assert bad == 0 and stat < thr, (stat, thr)
  assert stats["acceptance_rate"] > 0.3, stats   # the FP4 copy is close to the policy


# ------------------------------------------------------------------ properties on a wider model

W_CFG = models.ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_position_embeddings=96)
W_PARAMS = jax.tree_util.tree_map(lambda x: x * 4 if x.ndim == 3 else x, models.init_params(W_CFG, jax.random.key(0)))
W_OTHER = jax.tree_util.tree_map(lambda x: x * 4 if x.ndim == 3 else x, models.init_params(W_CFG, jax.random.key(7)))
W_CONF = sampling.SamplingConfig(num_samples=6, max_new_tokens=12, eos_id=3, prompt_buckets=(8,), temperature=0.8)


def _w_prompts():
  ids = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 20, 21]], np.int32)
  return ids, ids > 0


def test_same_policy_drafts_are_all_accepted_and_reused():
  ids, mask = _w_prompts()
  d = sampling.sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(1), W_CONF)
  for kw in (dict(residual=False), dict(draft_params=W_PARAMS)):
    out, stats = spec.speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(2), W_CONF,
                                         drafts=spec.Drafts.from_output(d), **kw)
    assert stats["accepted_tokens"] == stats["draft_tokens"] == int(np.asarray(d.lengths).sum()), stats
    assert stats["fully_accepted_rows"] == 18 and stats["rows_continued"] == 0 and stats["decode_steps"] == 0
    np.testing.assert_array_equal(out.completion_ids, d.completion_ids)
    np.testing.assert_array_equal(out.completion_mask, d.completion_mask)
    np.testing.assert_allclose(out.logprobs, d.logprobs, atol=1e-4)


def test_lenience_accepts_more():
  """With the same key (the same uniforms), acceptance is monotone in the lenience."""
  ids, mask = _w_prompts()
  d = spec.Drafts.from_output(sampling.sample(W_CFG, W_OTHER, ids, mask, jax.random.key(1), W_CONF))
  acc = []
  for lenience in (1.0, math.exp(0.5), 20.0):
    _, stats = spec.speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(2), W_CONF, drafts=d,
                                       residual=False, lenience=lenience)
    acc.append(stats["accepted_tokens"])
  assert acc[0] < acc[1] <= acc[2], acc


def _check_fields(out, params, ids, mask, conf):
  """Tokens masked after EOS, and log-probs / entropies equal to a teacher-forced rescoring under `params`."""
  toks, m = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
  np.testing.assert_array_equal(m, np.asarray(sampling.mask_after_eos(toks, conf.eos_ids)) & m)
  assert not (m[..., 1:] & ~m[..., :-1]).any()
  assert np.all(toks[~m] == conf.pad_id)
  np.testing.assert_array_equal(np.asarray(out.lengths), m.sum(-1))
  ended = (toks == conf.eos_ids[0]).any(-1) | (m.sum(-1) == toks.shape[-1])
  assert ended.all()
  ref, _ = sol_rl.recompute_logprobs(W_CFG, params, ids, mask, out, conf)
  for f in ("logprobs", "policy_logprobs", "entropy"):
    np.testing.assert_allclose(getattr(out, f), getattr(ref, f), atol=2e-4, err_msg=f)


def test_outputs_and_stats_with_ragged_drafts():
  ids, mask = _w_prompts()
  full = sampling.sample(W_CFG, W_OTHER, ids, mask, jax.random.key(1), W_CONF)
  dm = np.array(full.completion_mask)
  dm[0, 0, 2:] = False   # a short draft that did not end: accepted whole, it is continued
  dm[1, 3, :] = False    # an empty draft: sampled afresh
  d = spec.Drafts(ids=full.completion_ids, mask=jnp.asarray(dm), logprobs=full.logprobs)
  out, stats = spec.speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(5), W_CONF, drafts=d,
                                       draft_params=W_OTHER)
  _check_fields(out, W_PARAMS, ids, mask, W_CONF)
  assert stats["draft_tokens"] == dm.sum()
  assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
  # Every token is an accepted draft token, a replacement or a decoded one.
  assert int(np.asarray(out.lengths).sum()) == (stats["accepted_tokens"] + stats["rejected_rows"]
                                                + stats["generated_tokens"]), stats
  assert stats["rows_continued"] >= 1 and 1 <= stats["decode_steps"] <= W_CONF.max_new_tokens
  assert stats["fully_accepted_rows"] + stats["rejected_rows"] == (dm.sum(-1) > 0).sum()
  # Accepted prefixes are the drafts' tokens.
  same = np.asarray(out.completion_ids) == np.asarray(full.completion_ids)
  kept = np.cumprod(same & dm, axis=-1).sum(-1)
  assert kept.sum() >= stats["accepted_tokens"]


def test_self_speculative_fields_switch_and_same_policy():
  ids, mask = _w_prompts()
  out, stats = spec.self_speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(3), W_CONF, gamma_max=3,
                                            draft_params=W_OTHER)
  _check_fields(out, W_PARAMS, ids, mask, W_CONF)
  assert stats["speculated"] and stats["accepted_tokens"] <= stats["tested_tokens"] <= stats["draft_tokens"]
  # Each round commits at least one token per live row, at most gamma_max + 1.
  longest = int(np.asarray(out.lengths).max())
  assert -(-longest // 4) <= stats["rounds"] <= longest
  # The policy as its own drafter: every draft is accepted.
  _, same = spec.self_speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(3), W_CONF, gamma_max=3,
                                         draft_params=W_PARAMS)
  assert same["acceptance_rate"] == 1.0, same
  # The switch: too many rows, or too little expected gain -> plain sampling, the same draws.
  plain = sampling.sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(3), W_CONF)
  for kw in (dict(max_spec_rows=17), dict(acceptance_ema=0.05, min_expected_speedup=1.0)):
    off, st = spec.self_speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(3), W_CONF, **kw)
    assert not st["speculated"]
    np.testing.assert_array_equal(off.completion_ids, plain.completion_ids)


def test_greedy_equals_greedy_sample():
  ids, mask = _w_prompts()
  conf = W_CONF.replace(greedy=True)
  plain = sampling.sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(0), conf)
  d = spec.Drafts.from_output(sampling.sample(W_CFG, W_OTHER, ids, mask, jax.random.key(0), conf))
  out, _ = spec.speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(1), conf, drafts=d)
  np.testing.assert_array_equal(out.completion_ids, plain.completion_ids)
  out, _ = spec.self_speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(1), conf, draft_params=W_OTHER)
  np.testing.assert_array_equal(out.completion_ids, plain.completion_ids)


def test_gamma_rule():
  alphas = np.linspace(0.0, 0.99, 12)
  g = [int(spec.choose_gamma(a, 8, 0.2)) for a in alphas]
  assert g == sorted(g) and g[0] == 1 and g[-1] == 8   # longer drafts as acceptance grows
  assert int(spec.choose_gamma(0.9, 8, 0.0)) == 8        # free drafts: always the longest
  for a, gam in ((0.0, 3), (0.5, 1), (0.8, 5)):
    simulated = np.mean([1 + np.argmax(np.append(np.random.default_rng(i).random(gam) >= a, True))
                         for i in range(4000)])
    assert abs(spec.expected_tokens(a, gam) - simulated) < 0.1
  assert spec.expected_speedup(0.05, 4, 0.5) < 1 < spec.expected_speedup(0.95, 4, 0.1)


def test_bad_inputs_raise_clear_errors():
  ids, mask = _w_prompts()
  d = spec.Drafts.from_output(sampling.sample(W_CFG, W_OTHER, ids, mask, jax.random.key(1), W_CONF))
  call = lambda drafts, **kw: spec.speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(0), W_CONF,
                                                      drafts=drafts, **kw)
  with pytest.raises(ValueError, match=r"drafts.ids must be \[B, N, T\]"):
    call(d.replace(ids=d.ids[:, :, :5]), residual=False)
  with pytest.raises(ValueError, match=r"drafts.logprobs must be \[B, N, T\]"):
    call(d.replace(logprobs=d.logprobs[:2]), residual=False)
  with pytest.raises(ValueError, match="left-aligned"):
    call(d.replace(mask=d.mask.at[0, 0, 0].set(False).at[0, 0, 1].set(True)), residual=False)
  with pytest.raises(ValueError, match="draft_params"):
    call(d)
  with pytest.raises(ValueError, match="lenience"):
    call(d, residual=False, lenience=0.0)
  with pytest.raises(ValueError, match="vocab_size"):
    call(d.replace(ids=d.ids.at[0, 0, 0].set(W_CFG.vocab_size)), residual=False)
  with pytest.raises(TypeError, match="Drafts"):
    call(d.ids, residual=False)
  with pytest.raises(ValueError, match="gamma_max"):
    spec.self_speculative_sample(W_CFG, W_PARAMS, ids, mask, jax.random.key(0), W_CONF, gamma_max=0)
