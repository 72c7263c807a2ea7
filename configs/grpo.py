r"""GRPO (DeepSeekMath, arXiv 2402.03300): group mean baseline, group std scaling.

The default arithmetic task and policy with the `grpo` advantage recipe.

  python -m experiments.launch.train --config=configs/grpo.py --workdir=/tmp/rollouts_grpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "grpo"
  return config
