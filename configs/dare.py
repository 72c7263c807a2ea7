r"""DARE (arXiv 2601.21804): label-free rewards from the whole answer distribution, with an exploration bonus.

Each sample's reward is the uncertainty-weighted share of its answer in the group (mean token
entropy as the uncertainty) plus alpha * (1 - share) * (1 - uncertainty); no references read.

  python -m experiments.launch.train --config=configs/dare.py --workdir=/tmp/rollouts_dare
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "ttrl.py"), arg)
  config.reward.name = "dare"
  config.reward.dare_alpha = 0.5
  config.reward.dare_tau = 0.1
  return config
