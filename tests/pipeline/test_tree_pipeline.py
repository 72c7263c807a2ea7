"""Tree rollouts through the pipeline: leaves are the samples, TreeRL node values the token advantages."""

import jax
import numpy as np
import pytest

from rollouts_jax.training import config as config_lib
from rollouts_jax.training import rl_step as rl

from tests.pipeline.test_stages import _exp, _pipeline

KW = "init_rows=1,entropy_min=0.3,min_depth=1,min_gap=2,width_h_low=0.1,width_h_high=1.0,width_beta=0.0," \
     "branch_tokens=sample,prune=False,delta_entropy_min=-10.0"  # a random policy has flat entropy


def test_tree_batch_shares_prefixes_and_carries_node_advantages():
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 10, "generator": "tree", "generator_kwargs": KW})
  p, params = _pipeline(exp)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  B, N, T = batch.completion_ids.shape
  leaves = np.asarray(batch.sample_mask)
  assert info["tree/branches"] > 0 and info["tree/leaves"] == leaves.sum()
  # Shared prefixes are decoded once: fewer tokens decoded than the leaves hold.
  assert info["generated_tokens"] < np.asarray(batch.lengths)[leaves].sum()
  adv = np.asarray(batch.token_advantages)
  assert adv.shape == (B, N, T)
  assert (adv[~np.asarray(batch.completion_mask)] == 0).all() and (adv[~leaves] == 0).all()
  r = np.asarray(batch.rewards)
  for b in range(B):
    if np.ptp(r[b][leaves[b]]) == 0:   # a tree whose leaves all score the same teaches nothing
      assert (adv[b] == 0).all()
  # The update consumes them (per-token advantages in place of the recipe's).
  base = config_lib.RLConfig(steps=2, learning_rate=1e-3, warmup_steps=0)
  state = rl.init_train_state(params, rl.rl_optimizer(base))
  _, m = rl.rl_step(state, jax.tree_util.tree_map(np.asarray, batch), None, cfg=p.cfg, rl=base)
  assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("rollout,extra,match", [
    ({"generator": "forest"}, {}, "rollout.generator"),
    ({"generator": "tree", "generator_kwargs": "branches=3"}, {}, "rollout.generator_kwargs.*'branches'"),
    ({"generator": "tree"}, {"replay": {"name": "fifo"}}, "replay.name"),
])
def test_tree_config_errors_name_the_key(rollout, extra, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(_exp(rollout=rollout, **extra))


@pytest.mark.parametrize("rl,match", [({"echo_clip": True}, "rollout.generator='tree'"),
                                      ({"echo_shaping": 0.5}, "rollout.generator='tree'")])
def test_echo_options_need_tree_rollouts(rl, match):
  from rollouts_jax.training import config as config_lib
  with pytest.raises(ValueError, match=match):
    config_lib.from_config_dict({"rl": rl})
  with pytest.raises(ValueError, match="rl.echo_shaping"):
    config_lib.from_config_dict({"rl": {"echo_shaping": 1.5}, "rollout": {"generator": "tree"}})
