"""ARRoL online pruning: the quality head, the pruning rule, and the pipeline that uses them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import control
from rollouts_jax.control import arrol
from rollouts_jax.training import config as config_lib

from tests.pipeline.test_stages import _exp, _pipeline


def test_head_learns_a_linear_success_signal_and_counts_examples():
  rng = np.random.default_rng(0)
  h = rng.normal(size=(512, 16)).astype(np.float32)
  direction = rng.normal(size=16)
  y = (h / np.sqrt((h ** 2).mean(1, keepdims=True))) @ direction > 0
  head = arrol.head_init(16)
  mask = np.ones(512, bool)
  mask[400:] = False   # held out
  for _ in range(4):
    head = arrol.head_update(head, jnp.asarray(h), jnp.asarray(y), jnp.asarray(mask))
  p = np.asarray(arrol.head_predict(head, jnp.asarray(h[400:])))
  assert ((p > 0.5) == y[400:]).mean() > 0.9
  assert int(head.examples) == 4 * 400
  # No rows: nothing changes (and nothing is counted).
  same = arrol.head_update(head, jnp.asarray(h), jnp.asarray(y), jnp.zeros(512, bool))
  np.testing.assert_array_equal(np.asarray(same.w), np.asarray(head.w))
  assert int(same.examples) == int(head.examples)


def test_prune_keeps_a_balanced_mix_when_ready_and_a_random_subset_before():
  rng = np.random.default_rng(1)
  p = rng.uniform(size=(6, 12)).astype(np.float32)
  keep = arrol.prune(jnp.asarray(p), 8, jax.random.key(0), target=0.5)
  order = np.argsort(-p, axis=1)
  for b in range(6):
    assert set(np.asarray(keep)[b]) == set(order[b, :4]) | set(order[b, -4:])
  all_top = arrol.prune(jnp.asarray(p), 8, jax.random.key(0), target=1.0)
  assert all(set(np.asarray(all_top)[b]) == set(order[b, :8]) for b in range(6))
  early = np.asarray(arrol.prune(jnp.asarray(p), 8, jax.random.key(0), ready=False))
  assert all(len(set(row)) == 8 for row in early.tolist())
  later = np.asarray(arrol.prune(jnp.asarray(p), 8, jax.random.key(1), ready=False))
  assert (early != later).any()   # random, keyed
  with pytest.raises(ValueError, match="1..12"):
    arrol.prune(jnp.asarray(p), 13, jax.random.key(0))


def test_pipeline_prunes_prefixes_and_trains_the_head():
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 12, "generator": "arrol",
                      "generator_kwargs": "oversample=1.0,at=4,min_examples=8"})
  p, params = _pipeline(exp)
  state = p.init_state()
  assert int(state.generator.head.examples) == 0
  batch, state, info = p.collect(state, params, 0, jax.random.key(0))
  B, N, _ = batch.completion_ids.shape
  assert (B, N) == (4, 4)
  assert info["arrol/pruned_rows"] == 16 and info["rollouts"] == 32 and info["arrol/head_ready"] == 0.0
  assert int(state.generator.head.examples) == 16        # the survivors' outcomes
  assert 0.0 <= info["arrol/head_accuracy"] <= 1.0
  kept_tokens = int(np.asarray(batch.lengths).sum())
  assert kept_tokens < info["generated_tokens"] <= kept_tokens + 16 * 4   # pruned rows cost <= prune_at each
  batch2, state2, info2 = p.collect(state, params, 1, jax.random.key(1))
  assert info2["arrol/head_ready"] == 1.0 and int(state2.generator.head.examples) == 32
  # The head is part of the checkpointed state: a restored copy continues identically.
  leaves, tree = jax.tree_util.tree_flatten(state)
  restored = jax.tree_util.tree_unflatten(tree, [np.asarray(x) for x in leaves])
  again, _, _ = p.collect(restored, params, 1, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(again.completion_ids), np.asarray(batch2.completion_ids))


@pytest.mark.parametrize("kwargs,match", [
    ("oversampling=1.0", "has no setting 'oversampling'"),
    ("at=8", "'at' must be an integer in \\[1, rollout.max_new_tokens=8\\)"),
    ("at=4,oversample=0.0", "'oversample' must be a number > 0"),
    ("at=4,target=1.5", "'target' must be in \\[0, 1\\]"),
])
def test_arrol_config_errors_name_the_key(kwargs, match):
  with pytest.raises(ValueError, match="rollout.generator_kwargs.*" + match):
    _exp(rollout={"generator": "arrol", "generator_kwargs": kwargs})
