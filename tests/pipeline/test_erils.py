"""ERILS: external rollouts join each group, length-controlled, normalized apart from the policy's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages, models
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import rl_step as rl

from tests.pipeline.test_stages import TOK, _exp, _pipeline


def test_per_source_normalization_on_hand_made_groups():
  r = jnp.array([[1., 0., 0., 0., 1., 1., 1., 0.],
                 [0., 0., 0., 0., 1., 1., 1., 1.]])
  src = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]] * 2)
  adv, _ = advantages.apply(advantages.erils(ddof=0), r, source_ids=src)
  adv = np.asarray(adv)
  on = np.asarray(r[0, :4])
  np.testing.assert_allclose(adv[0, :4], (on - on.mean()) / on.std(), rtol=1e-3)
  ext = np.asarray(r[0, 4:])
  np.testing.assert_allclose(adv[0, 4:], (ext - ext.mean()) / ext.std(), rtol=1e-3)
  # Group 2: the policy never succeeds and the external policy always does. Jointly they
  # would give large advantages; apart, each source is uniform and teaches nothing.
  np.testing.assert_array_equal(adv[1], 0.0)
  joint, _ = advantages.apply(advantages.grpo(ddof=0), r)
  assert np.abs(np.asarray(joint)[1]).max() > 0.9
  with pytest.raises(ValueError, match="source_ids"):
    advantages.apply(advantages.erils(), r)


def test_pipeline_mixes_external_rollouts_into_groups(monkeypatch):
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 8, "external_samples": 2, "teacher_sft_steps": 5},
             rl={"advantage": "erils"})
  # Build with a stand-in external policy (no SFT here): a different random model.
  from rollouts_jax.training import build
  monkeypatch.setattr(build, "warm_start", lambda e, ex: (None, "external", None, None))
  p, params = _pipeline(exp)
  other = models.init_params(p.cfg, jax.random.key(3))
  other["lm_head"] = other["lm_head"].at[:, TOK.eos_id].add(3.0)   # ends often, but not always, within 8
  p.teacher_params = other
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  B, NK, _ = batch.completion_ids.shape
  assert NK == 6
  src = np.asarray(batch.source_ids)
  assert (src[:, :4] == 0).all() and (src[:, 4:] == 1).all()
  ext_mask = np.asarray(batch.sample_mask)[:, 4:]
  # Length control: exactly the external rollouts that ended with EOS are kept.
  ids, m = np.asarray(batch.completion_ids)[:, 4:], np.asarray(batch.completion_mask)[:, 4:]
  L = m.sum(-1)
  ended = (L > 0) & (np.take_along_axis(ids, np.maximum(L - 1, 0)[..., None], -1)[..., 0] == TOK.eos_id)
  np.testing.assert_array_equal(ext_mask, ended)
  assert info["erils/rejected_overlong"] == (~ended).sum() and 0 < ended.sum() < ended.size
  assert (np.asarray(batch.policy_version)[:, 4:] == -1).all()
  base = config_lib.RLConfig(steps=2, learning_rate=1e-3, warmup_steps=0, advantage="erils")
  _, metrics = rl.rl_step(rl.init_train_state(params, rl.rl_optimizer(base)), jax.tree_util.tree_map(np.asarray, batch),
                          None, cfg=p.cfg, rl=base)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("rollout,rl_section,match", [
    ({"external_samples": 2}, {"advantage": "erils"}, "rollout.teacher_sft_steps"),
    ({"external_samples": 2, "teacher_sft_steps": 5}, {}, "rl.advantage='erils'"),
    ({}, {"advantage": "erils"}, "rollout.external_samples"),
    ({"external_samples": 2, "teacher_sft_steps": 5}, {"advantage": "erils", "tis_cap": 2.0}, "rl.tis_cap"),
])
def test_erils_config_errors_name_the_key(rollout, rl_section, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(_exp(rollout=rollout, rl=rl_section))
