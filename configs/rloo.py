r"""RLOO (arXiv 2402.14740): leave-one-out mean baseline.

The default arithmetic task and policy with the `rloo` advantage recipe.

  python -m experiments.launch.train --config=configs/rloo.py --workdir=/tmp/rollouts_rloo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "rloo"
  return config
