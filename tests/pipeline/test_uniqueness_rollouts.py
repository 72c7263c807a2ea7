"""Uniqueness-aware advantages on real countdown rollouts of a warm-started policy (slow)."""

import pathlib

import jax
import numpy as np
import pytest

from rollouts_jax import advantages
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_strategy_clusters_make_uniqueness_differ_from_grpo_on_sampled_groups(tmp_path, monkeypatch):
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  cd = config_lib.load_config_file(REPO / "configs" / "countdown_uniqueness.py")
  cd.data.num_train = 4000
  cd.reward.num_workers = 0
  exp = config_lib.from_config_dict(cd)
  train, _ = loop.load_task(exp)
  cfg, params, tokenizer = loop.load_policy(exp, train)
  pipe = loop.build_pipeline(exp, cfg, tokenizer, train)
  batch, _, info = pipe.collect(pipe.init_state(), params, 0, jax.random.key(0))
  r = np.asarray(batch.rewards)
  ids = np.asarray(batch.cluster_ids)
  # Groups whose correct samples fall in strategy clusters of different sizes (a common and a rare
  # strategy): there the rarity weights differ from sample to sample.
  def sizes(b):
    c = ids[b][r[b] >= 1].tolist()
    return {c.count(x) for x in c}
  multi = [b for b in range(r.shape[0]) if len(sizes(b)) > 1]
  assert multi, "no sampled group had a common and a rare correct strategy"
  uniq, _ = advantages.apply(advantages.uniqueness_grpo(alpha=0.5), r, mask=batch.sample_mask, cluster_ids=ids)
  grpo, _ = advantages.apply(advantages.grpo(), r, mask=batch.sample_mask)
  diff = np.abs(np.asarray(uniq) - np.asarray(grpo)).max(axis=1)
  assert (diff[multi] > 1e-3).all()
  assert info["clusters_per_group"] > 1
