r"""MC-GRPO (arXiv 2601.22582): median baseline over G+1 = 9 samples, the pivot sample left out of the loss.

The default arithmetic task and policy with the `mc_grpo` advantage recipe.

  python -m experiments.launch.train --config=configs/mc_grpo.py --workdir=/tmp/rollouts_mc_grpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "mc_grpo"
  config.rollout.num_samples = 9
  return config
