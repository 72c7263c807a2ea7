r"""Dr. GRPO (arXiv 2503.20783): group mean baseline, no std scaling, constant-length loss normalization.

The default arithmetic task and policy with the `dr_grpo` advantage recipe.

  python -m experiments.launch.train --config=configs/dr_grpo.py --workdir=/tmp/rollouts_dr_grpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "dr_grpo"
  config.rl.agg = "seq-mean-token-sum-norm"
  return config
