"""APRIL partial rollouts through the pipeline: stop at B finished groups, resume the rest, lose nothing."""

import jax
import numpy as np
import pytest

from rollouts_jax import models, replay, sampling
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop

from tests.pipeline.test_stages import EXAMPLES, TOK, _exp


def _pipeline(exp):
  cfg = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, eos_token_ids=(TOK.eos_id,), pad_token_id=TOK.pad_id)
  params = models.init_params(cfg, jax.random.key(0))
  # Make EOS likely enough that lengths spread over the budget (a long tail, as in real rollouts).
  params["embed"] = params["embed"].at[TOK.eos_id].multiply(6.0)
  return loop.build_pipeline(exp, cfg, TOK, EXAMPLES), params


def _group_key(batch, g):
  return int(np.asarray(batch.prompt_index)[g])


def test_april_uses_b_finished_groups_and_resumes_the_rest_under_newer_versions():
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 24, "generator": "april",
                      "generator_kwargs": "over_provision=1.0"})
  p, params = _pipeline(exp)
  state = p.init_state()
  assert p.generator.wants(state.generator) == 8   # ceil(4 * (1 + 1.0)) fresh prompts: the store is empty
  started, used = [], []
  stored_before = {}
  saw_resumed_unfinished = False
  for step in range(5):
    s = jax.device_get(state.generator)   # APRIL's store
    valid = np.asarray(s.valid)
    for slot in np.flatnonzero(valid):
      stored_before[int(np.asarray(s.data.prompt_index)[slot])] = (
          np.asarray(s.data.completion_ids)[slot], np.asarray(s.data.completion_mask)[slot],
          np.asarray(s.data.behaviour_logprobs)[slot], np.asarray(s.data.policy_version)[slot])
    n_stored = int(valid.sum())
    assert p.generator.wants(state.generator) == 8 - n_stored
    batch, state, info = p.collect(state, params, step, jax.random.key(step))
    started += [None] * int(info["rollouts"] // 4)
    B, N, T = batch.completion_ids.shape
    assert B == 4
    assert info["april/resumed_groups"] == n_stored
    full = sampling.SamplingConfig(max_new_tokens=24, eos_id=TOK.eos_id)
    ids, m = np.asarray(batch.completion_ids), np.asarray(batch.completion_mask)
    assert np.asarray(sampling.finished_rows(np.pad(ids, ((0, 0), (0, 0), (0, 24 - T))),
                                             np.pad(m, ((0, 0), (0, 0), (0, 24 - T))), full)).all()
    for g in range(B):
      idx = _group_key(batch, g)
      used.append(idx)
      if idx in stored_before:  # resumed: the old prefix is kept token for token, with its versions
        old_ids, old_mask, old_lp, old_v = stored_before.pop(idx)
        L = min(T, old_ids.shape[-1])
        np.testing.assert_array_equal(ids[g][..., :L][old_mask[..., :L]], old_ids[..., :L][old_mask[..., :L]])
        np.testing.assert_array_equal(np.asarray(batch.behaviour_logprobs)[g][..., :L][old_mask[..., :L]],
                                      old_lp[..., :L][old_mask[..., :L]])
        v = np.asarray(batch.policy_version)[g]
        assert (v[..., :L][old_mask[..., :L]] == old_v[..., :L][old_mask[..., :L]]).all()
        newer = m[g] & ~np.pad(old_mask, ((0, 0), (0, max(0, T - old_mask.shape[-1]))))[..., :T]
        if newer.any():
          saw_resumed_unfinished = True
          assert (v[newer] == step).all() and (old_v[old_mask] < step).all()
  # Nothing lost: every group started was used or is still stored.
  in_store = int(np.asarray(state.generator.valid).sum())
  assert len(started) == len(used) + in_store
  assert saw_resumed_unfinished   # the run exercised a resume under a newer policy version
  assert info["april/off_policy_token_frac"] >= 0.0 and 0.0 <= info["rollout/padding_frac"] < 1.0


def test_april_state_checkpoints_and_resumes_bitwise():
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 24, "generator": "april",
                      "generator_kwargs": "over_provision=1.0"})
  p, params = _pipeline(exp)
  state = p.init_state()
  batch, state, _ = p.collect(state, params, 0, jax.random.key(0))
  leaves, tree = jax.tree_util.tree_flatten(state)
  restored = jax.tree_util.tree_unflatten(tree, [np.asarray(x) for x in leaves])   # as orbax gives it back
  a, _, _ = p.collect(state, params, 1, jax.random.key(1))
  b, _, _ = p.collect(restored, params, 1, jax.random.key(1))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("sections,match", [
    ({"rollout": {"generator": "april", "generator_kwargs": "over_provision=0"}},
     "rollout.generator_kwargs: generator 'april' setting 'over_provision' must be a number > 0, got 0"),
    ({"rollout": {"generator": "april"}, "control": {"dynamic_sampling": True}},
     "rollout.generator='april' does not combine with control.dynamic_sampling"),
    ({"rollout": {"partial_rollouts": True}}, r"rollout.partial_rollouts is now rollout.generator='april'"),
])
def test_partial_rollouts_config_errors_name_the_key(sections, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(_exp(**sections))


def test_old_april_keys_read_as_the_april_generator():
  old = {"rollout.partial_rollouts": True, "rollout.over_provision": 1.0, "rollout.generator": "sample"}
  assert config_lib.upgrade_flat(old) == {"rollout.generator": "april",
                                          "rollout.generator_kwargs": "over_provision=1.0"}
  assert config_lib.upgrade_flat({"rollout.partial_rollouts": False, "rollout.over_provision": 0.5}) == {}


def test_partial_store_refuses_to_drop_groups():
  ex = sampling.RolloutBatch.empty(2, 2, 3, 4)
  buf = replay.partial_rollouts(3, ex)
  s = buf.add(buf.init(), ex.replace(sample_mask=np.ones((2, 2), bool), prompt_index=np.array([1, 2])))
  with pytest.raises(ValueError, match="do not fit"):
    buf.add(s, ex.replace(sample_mask=np.ones((2, 2), bool)))
  out, s = buf.sample(s, None, 3)
  assert sorted(np.asarray(out.prompt_index).tolist()) == [-1, 1, 2] and int(s.size) == 0
