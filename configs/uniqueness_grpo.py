r"""Uniqueness-aware GRPO (arXiv 2601.08763): correct samples reweighted by 1/|cluster|^alpha, clusters by final answer.

The default arithmetic task and policy with the `uniqueness_grpo` advantage recipe.

  python experiments/train.py --config=configs/uniqueness_grpo.py --workdir=/tmp/rollouts_uniqueness_grpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "uniqueness_grpo"
  return config
