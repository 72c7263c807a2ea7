r"""Uniqueness-aware GRPO on countdown ("Rewarding the Rare", arXiv 2601.08763): rare strategies earn more.

Correct samples are reweighted by |strategy cluster|^-alpha, where a sample's strategy is
the canonical structure of its expression (commutative chains flattened and sorted: `(3+5)*2`
and `2*(5+3)` are one strategy, `3*2+5*2` another; `tasks.Countdown.strategy`). The paper
clusters with an LLM judge; `advantages.cluster_by_judge` keeps that path for real models.

  python -m experiments.launch.train --config=configs/countdown_uniqueness.py --workdir=/tmp/rollouts_uniqueness
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "countdown_grpo.py"), arg)
  config.rl.advantage = "uniqueness_grpo"
  config.rl.advantage_kwargs = "alpha=0.5"
  config.reward.clusters = "strategy"
  return config
