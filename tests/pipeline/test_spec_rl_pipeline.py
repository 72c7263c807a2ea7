"""SPEC-RL in the pipeline: a prompt's previous rollouts are drafts on its next visit."""

import jax
import numpy as np
import pytest

from rollouts_jax import models, replay, rollout
from rollouts_jax.training import config as config_lib

from tests.pipeline.test_stages import EXAMPLES, _exp, _pipeline


def _spec_exp(**kw):
  return _exp(rollout={"num_samples": 4, "max_new_tokens": 12, "generator": "spec_rl", **kw})


def test_second_epoch_reuses_drafts_and_decodes_less():
  pool = EXAMPLES[:8]
  p, params = _pipeline(_spec_exp(), examples=pool)
  state = p.init_state()
  first = {}
  for step in range(2):   # epoch 1: no drafts, plain sampling
    batch, state, info = p.collect(state, params, step, jax.random.key(step))
    assert "spec/draft_tokens" not in info
    for g, i in enumerate(np.asarray(batch.prompt_index)):
      first[int(i)] = (np.asarray(batch.completion_ids)[g], np.asarray(batch.completion_mask)[g])
  assert set(first) == set(range(8)) and bool(np.asarray(state.generator.valid).all())
  # Epoch 2 under the same policy: every draft token is accepted, nothing is decoded.
  batch, state2, info = p.collect(state, params, 2, jax.random.key(2))
  assert info["spec/draft_tokens"] > 0 and info["spec/accepted_tokens"] == info["spec/draft_tokens"]
  assert info["generated_tokens"] == 0 and info["rollout/decode_steps"] == 0
  for g, i in enumerate(np.asarray(batch.prompt_index)):
    ids, mask = first[int(i)]
    T = batch.completion_ids.shape[-1]
    np.testing.assert_array_equal(np.asarray(batch.completion_mask)[g], mask[..., :T])
    np.testing.assert_array_equal(np.where(mask[..., :T], np.asarray(batch.completion_ids)[g], 0),
                                  np.where(mask[..., :T], ids[..., :T], 0))
  # A changed policy rejects some tokens: it decodes from the cut, and fewer tokens than afresh.
  # (Random tiny policies are near uniform, so any two stay within e^0.5 of each other and the
  # default lenience accepts everything: exact acceptance, l = 1, here.)
  moved = models.init_params(p.cfg, jax.random.key(9))
  p.generator = rollout.build("spec_rl", p.generator_context, lenience=1.0)   # (the same draft store)
  batch, _, info = p.collect(state, moved, 2, jax.random.key(2))
  assert 0 < info["spec/accepted_tokens"] < info["spec/draft_tokens"]
  assert 0 < info["generated_tokens"] < np.asarray(batch.lengths).sum()
  assert np.asarray(batch.behaviour_logprobs)[np.asarray(batch.completion_mask)].max() <= 0


def test_draft_store_round_trip_and_config_errors():
  store = replay.draft_store(5, 2, 4)
  s = store.init()
  s = store.put(s, np.array([3, -1]), np.full((2, 2, 3), 7), np.ones((2, 2, 3), bool), np.full((2, 2, 3), -.5), 4)
  ids, mask, lp, valid = store.get(s, np.array([3, 1, -1]))
  assert valid.tolist() == [True, False, False] and int(np.asarray(s.version)[3]) == 4
  assert mask[0, :, :3].all() and not mask[0, :, 3].any() and not mask[1:].any()
  assert (ids[0, :, :3] == 7).all() and (lp[0, :, :3] == -.5).all()
  with pytest.raises(ValueError, match="rollout.generator.*'spec'.*spec_rl"):
    config_lib.validate(_exp(rollout={"generator": "spec"}))
  p, _ = _pipeline(_spec_exp())
  with pytest.raises(ValueError, match="rollout.generator_kwargs.*'lenience'"):
    rollout.build("spec_rl", p.generator_context, lenience=0.0)
  with pytest.raises(ValueError, match="control.prune"):
    config_lib.validate(_exp(rollout={"generator": "spec_rl"}, control={"prune": "arrol"}))
