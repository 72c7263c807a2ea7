"""REPLAY contract: fixed-capacity buffers of rollout groups (FIFO, prioritized)."""

import jax
import numpy as np
import pytest

from rollouts_jax import replay
from rollouts_jax.sampling.batch import RolloutBatch

N, P, T = 2, 3, 4


def _groups(ids, version=0, live=None):
  """Groups whose prompt_index is `ids` (and whose tokens carry that id, to check the payload)."""
  B = len(ids)
  b = RolloutBatch.empty(B, N, P, T)
  tok = np.repeat(np.asarray(ids, np.int32)[:, None, None], N, 1).repeat(T, 2)
  return b.replace(completion_ids=tok, completion_mask=np.ones((B, N, T), bool),
                   sample_mask=np.ones((B, N), bool) if live is None else np.asarray(live),
                   policy_version=np.full((B, N, T), version, np.int32),
                   prompt_index=np.asarray(ids, np.int32))


def test_fifo_returns_oldest_first_once_and_masks_empty_slots():
  buf = replay.fifo(5, _groups([0]))
  s = buf.init()
  s = buf.add(s, _groups([10, 11]))
  s = buf.add(s, _groups([12]))
  out, s = buf.sample(s, jax.random.key(0), 2)
  assert np.asarray(out.prompt_index).tolist() == [10, 11]
  np.testing.assert_array_equal(np.asarray(out.completion_ids)[:, 0, 0], [10, 11])  # payload travels
  out, s = buf.sample(s, jax.random.key(0), 3)
  assert np.asarray(out.prompt_index).tolist() == [12, -1, -1]
  assert np.asarray(out.sample_mask).tolist() == [[True, True], [False, False], [False, False]]
  assert int(s.size) == 0


def test_fifo_overwrites_the_oldest_when_full_and_skips_dead_groups():
  buf = replay.fifo(3, _groups([0]))
  s = buf.init()
  for i in range(5):
    s = buf.add(s, _groups([i]))
  s = buf.add(s, _groups([98, 99], live=[[False, False], [True, False]]))  # 98 has no live sample
  out, s = buf.sample(s, jax.random.key(0), 3)
  assert np.asarray(out.prompt_index).tolist() == [3, 4, 99]


def test_fifo_drops_groups_older_than_the_staleness_bound():
  buf = replay.fifo(4, _groups([0]), max_staleness=2)
  s = buf.init()
  s = buf.add(s, _groups([1], version=0))
  s = buf.add(s, _groups([2], version=3))
  out, s = buf.sample(s, jax.random.key(0), 2, version=4)
  assert np.asarray(out.prompt_index).tolist() == [2, -1]


def test_fifo_is_jittable_and_its_state_is_a_pytree():
  buf = replay.fifo(4, _groups([0]))
  s = buf.add(buf.init(), _groups([5, 6]))
  leaves, tree = jax.tree_util.tree_flatten(s)
  s2 = jax.tree_util.tree_unflatten(tree, [np.asarray(x) for x in leaves])
  eager, _ = buf.sample(s2, jax.random.key(0), 2)
  jitted, _ = jax.jit(buf.sample, static_argnums=2)(s2, jax.random.key(0), 2)
  jax.tree_util.tree_map(np.testing.assert_array_equal, eager, jitted)
  with pytest.raises(ValueError, match="capacity"):
    buf.add(s, _groups(list(range(5))))


def test_unknown_buffer_names_the_key():
  assert replay.get("none") is None and replay.get("fifo") is replay.fifo
  with pytest.raises(ValueError, match="replay.name: unknown replay buffer 'lifo'"):
    replay.get("lifo")


def _draw_freq(buf, state, draws=2000, **kw):
  """How often each stored prompt comes out first when one group is sampled (fresh keys; one
  vmapped call over the keys, each draw the same as a call of its own)."""
  keys = jax.vmap(jax.random.key)(np.arange(draws))
  first = np.asarray(jax.jit(jax.vmap(lambda k: buf.sample(state, k, 1, **kw)[0].prompt_index[0]))(keys)).tolist()
  return {p: first.count(p) / draws for p in set(first)}


@pytest.mark.parametrize("alpha,want", [(0.0, 0.5), (1.0, 0.75), (2.0, 0.9)])
def test_prioritized_draws_groups_in_proportion_to_priority_to_the_alpha(alpha, want):
  buf = replay.prioritized(4, _groups([0]), alpha=alpha)
  state = buf.add(buf.init(), _groups([1, 3]), priority_B=np.array([1.0, 3.0]))
  assert _draw_freq(buf, state)[3] == pytest.approx(want, abs=0.04)


def test_prioritized_evicts_the_least_useful_and_never_stores_groups_that_teach_nothing():
  buf = replay.prioritized(2, _groups([0]))
  state = buf.add(buf.init(), _groups([1, 3]), priority_B=np.array([1.0, 3.0]))
  state = buf.add(state, _groups([2]), priority_B=np.array([2.0]))
  assert sorted(np.asarray(state.data.prompt_index)[np.asarray(state.valid)].tolist()) == [2, 3]
  flat = _groups([7]).replace(rewards=np.ones((1, N), np.float32))            # all samples equal
  assert float(replay.prioritized(2, _groups([0])).add(buf.init(), flat).valid.sum()) == 0
  batch, state = buf.sample(state, jax.random.key(0), 2)                      # each comes out once
  assert sorted(np.asarray(batch.prompt_index).tolist()) == [2, 3] and int(state.valid.sum()) == 0


def test_prioritized_discounts_stale_groups():
  buf = replay.prioritized(4, _groups([0]), staleness_decay=0.5)
  state = buf.add(buf.init(), _groups([1], version=0), priority_B=np.array([1.0]))
  state = buf.add(state, _groups([2], version=2), priority_B=np.array([1.0]))
  assert _draw_freq(buf, state, version=2)[2] == pytest.approx(0.8, abs=0.04)   # 1 vs 0.5 ** 2
  assert _draw_freq(buf, state)[2] == pytest.approx(0.5, abs=0.04)              # no version: no decay
