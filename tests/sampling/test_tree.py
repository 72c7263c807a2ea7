"""Tree rollouts: equivalence with the sampler, valid continuations, token savings, entropy of branch points."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.sampling import engine
from rollouts_jax.sampling import tree as tree_lib

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2)
# Scaled weights give input-dependent distributions, from peaked to flat (entropy 0.4-2.1 nats).
PARAMS = jax.tree_util.tree_map(lambda x: x * 4 if x.ndim == 3 else x, models.init_params(CFG, jax.random.key(0)))
PARAMS = dict(PARAMS, lm_head=PARAMS["lm_head"] * 40)
T = 16
CONF = sampling.SamplingConfig(num_samples=6, max_new_tokens=T, eos_id=2, prompt_buckets=())
# Thresholds for this small model (median entropy about 1.4 nats).
TREE = tree_lib.TreeConfig(init_rows=1, min_depth=2, min_gap=2, entropy_min=2.0, delta_entropy_min=0.0,
                           width_h_low=0.5, width_h_high=2.0, width_beta=0.0, prune=False)


def _prompts(B=4, P=6, seed=0):
  rng = np.random.default_rng(seed)
  lens = np.array([P, 4, 2, 5][:B])
  ids = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
  mask = np.arange(P)[None] >= (P - lens)[:, None]
  return np.where(mask, ids, 0), mask


@pytest.fixture(scope="module")
def grown():
  ids, mask = _prompts()
  out, info = tree_lib.tree_sample(CFG, PARAMS, ids, mask, jax.random.key(3), CONF, TREE)
  return ids, mask, jax.device_get(out), jax.device_get(info)


def test_no_free_rows_equals_sample():
  """With every row a root there is nothing to fork into: the tree is `sampling.sample`."""
  ids, mask = _prompts()
  ref = sampling.sample(CFG, PARAMS, ids, mask, jax.random.key(3), CONF)
  out, info = tree_lib.tree_sample(CFG, PARAMS, ids, mask, jax.random.key(3), CONF,
                                   TREE.replace(init_rows=CONF.num_samples))
  for f in ("completion_ids", "completion_mask", "logprobs", "policy_logprobs", "entropy", "lengths"):
    np.testing.assert_array_equal(np.asarray(getattr(out, f)), np.asarray(getattr(ref, f)), err_msg=f)
  assert int(info.num_branches.sum()) == 0
  np.testing.assert_array_equal(info.generated_tokens, np.asarray(ref.lengths).sum(1))


def test_leaves_are_continuations_of_their_tree(grown):
  """Leaves share tokens exactly up to their split and differ at it; rows without a leaf are masked out."""
  _, _, out, info = grown
  assert info.num_branches.sum() > 0 and info.leaf_mask.sum() > 2 * info.leaf_mask.shape[0]
  ids, m = out.completion_ids, out.completion_mask
  assert not m[~info.leaf_mask].any() and (ids[~info.leaf_mask] == CONF.pad_id).all()
  for b in range(ids.shape[0]):
    for i in np.flatnonzero(info.leaf_mask[b]):
      p, s = info.parent[b, i], info.branch_step[b, i]
      if p >= 0:  # prefix equal to the parent's up to the branch step (no pruning here, so rows persist)
        np.testing.assert_array_equal(ids[b, i, :s], ids[b, p, :s])
        assert ids[b, i, s] != ids[b, p, s]
      for j in np.flatnonzero(info.leaf_mask[b]):
        s = info.split[b, i, j]
        np.testing.assert_array_equal(ids[b, i, :min(s, T)], ids[b, j, :min(s, T)])
        if i != j and m[b, i, s] and m[b, j, s]:
          assert ids[b, i, s] != ids[b, j, s]
        # one node per shared token: the node ids agree exactly where the tokens are shared
        both = m[b, i] & m[b, j]
        np.testing.assert_array_equal((info.node_id[b, i] == info.node_id[b, j])[both], (np.arange(T) < s)[both])


def _check_against_forward(ids, mask, out):
  B, N, _ = out.completion_ids.shape
  for j in range(N):
    seq = jnp.concatenate([jnp.asarray(ids), jnp.asarray(out.completion_ids[:, j])], axis=1)
    seq_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((B, T), bool)], axis=1)
    logits = models.forward(CFG, PARAMS, seq, seq_mask)[:, ids.shape[1] - 1:-1]
    logp = jax.nn.log_softmax(logits)
    lp = jnp.take_along_axis(logp, jnp.asarray(out.completion_ids[:, j, :, None]), -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    m = out.completion_mask[:, j]
    np.testing.assert_allclose(np.where(m, out.policy_logprobs[:, j], 0), np.where(m, lp, 0), atol=2e-4)
    np.testing.assert_allclose(np.where(m, out.entropy[:, j], 0), np.where(m, ent, 0), atol=2e-4)


def test_copied_cache_gives_the_model_s_logprobs(grown):
  """Forked rows decode from copied KV rows: their log-probs and entropies match a full forward."""
  _check_against_forward(*grown[:3])


def test_generated_tokens_count_shared_prefixes_once(grown):
  _, _, out, info = grown
  lengths = out.lengths.sum(1)
  assert np.all(info.generated_tokens <= lengths)
  forked = info.num_branches > 0  # fewer tokens than the leaves decoded independently would take
  assert forked.any() and np.all(info.generated_tokens[forked] < lengths[forked])
  for b in range(out.lengths.shape[0]):  # exactly the number of distinct (node, position) tokens
    m = out.completion_mask[b]
    pairs = {(int(n), t) for i in range(m.shape[0]) for t in range(T) if m[i, t] for n in [info.node_id[b, i, t]]}
    assert info.generated_tokens[b] == len(pairs)


def _rank_sum_z(x, y):
  """Mann-Whitney z (normal approximation) for 'x tends to be larger than y'."""
  allv = np.concatenate([x, y])
  ranks = np.argsort(np.argsort(allv, kind="stable"), kind="stable") + 1.0
  n1, n2 = len(x), len(y)
  u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
  return (u - n1 * n2 / 2) / math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)


def test_branch_points_sit_at_higher_entropy_than_chance():
  """Chance: any decoded position at which a fork was allowed (depth >= min_depth), each token once."""
  ids, mask = _prompts()
  branch, chance = [], []
  for seed in range(4):
    out, info = jax.device_get(tree_lib.tree_sample(CFG, PARAMS, ids, mask, jax.random.key(10 + seed), CONF, TREE))
    for b in range(ids.shape[0]):
      forks = {(int(info.parent[b, i]), int(info.branch_step[b, i])): info.branch_entropy[b, i]
               for i in range(CONF.num_samples) if info.branch_step[b, i] >= 0}
      branch += list(forks.values())
      tokens = {(int(info.node_id[b, i, t]), t): out.entropy[b, i, t] for i in range(CONF.num_samples)
                for t in range(TREE.min_depth, T) if out.completion_mask[b, i, t]}
      chance += list(tokens.values())
  branch, chance = np.asarray(branch), np.asarray(chance)
  assert len(branch) >= 10
  z = _rank_sum_z(branch, chance)
  assert z > 3.0, (z, branch.mean(), chance.mean())


def test_pruning_frees_rows_and_masks_them():
  ids, mask = _prompts()
  tree = TREE.replace(prune=True, tail_conf_max=None, spike_entropy_min=None, prune_group_conf=2.0, min_depth=3)
  out, info = jax.device_get(tree_lib.tree_sample(CFG, PARAMS, ids, mask, jax.random.key(3), CONF, tree))
  assert info.num_pruned.sum() > 0 and info.num_branches.sum() > 0
  _check_against_forward(ids, mask, out)  # rows reused after pruning hold their new parent's cache
  assert np.all(info.leaf_mask.sum(1) >= 1)  # a prompt keeps a row
  assert not out.completion_mask[~info.leaf_mask].any() and np.all(out.lengths[~info.leaf_mask] == 0)
  # leaves' tokens share exactly up to their split, also after rows were reused
  for b in range(ids.shape[0]):
    leaves = np.flatnonzero(info.leaf_mask[b])
    for i in leaves:
      for j in leaves:
        s = min(info.split[b, i, j], T)
        np.testing.assert_array_equal(out.completion_ids[b, i, :s], out.completion_ids[b, j, :s])


def test_token_budget_bounds_generated_tokens():
  ids, mask = _prompts()
  budget = 2 * T
  out, info = jax.device_get(tree_lib.tree_sample(CFG, PARAMS, ids, mask, jax.random.key(3), CONF,
                                                  TREE.replace(token_budget=budget)))
  assert np.all(info.generated_tokens <= budget)
  assert info.num_branches.sum() > 0


def test_sample_mode_leaves_draw_from_their_own_streams():
  """branch_tokens='sample': from its branch step on (from 0 for a root) each row's token is its own stream's
  draw from the model's distribution, exactly as `sampling.sample` draws sample j, so leaves are policy samples."""
  ids, mask = _prompts()
  key = jax.random.key(3)
  out, info = jax.device_get(tree_lib.tree_sample(CFG, PARAMS, ids, mask, key, CONF,
                                                  TREE.replace(branch_tokens="sample")))
  assert info.num_branches.sum() > 0
  B, M, _ = out.completion_ids.shape
  checked = 0
  for j in range(M):
    seq = jnp.concatenate([jnp.asarray(ids), jnp.asarray(out.completion_ids[:, j])], axis=1)
    seq_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((B, T), bool)], axis=1)
    probs = jax.nn.softmax(models.forward(CFG, PARAMS, seq, seq_mask)[:, ids.shape[1] - 1:-1])
    row_keys = jnp.stack([jax.random.fold_in(key, b * M + j) for b in range(B)])
    for t in range(T):
      drawn = np.asarray(engine.inverse_cdf_draw(engine.row_uniforms(row_keys, t), probs[:, t]))
      own = info.leaf_mask[:, j] & (t >= np.maximum(info.branch_step[:, j], 0)) & out.completion_mask[:, j, t]
      np.testing.assert_array_equal(out.completion_ids[:, j, t][own], drawn[own])
      checked += own.sum()
  assert checked > T
