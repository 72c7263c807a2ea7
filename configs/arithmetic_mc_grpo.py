r"""MC-GRPO on arithmetic with multiplication: a harder warm start, 9 samples a prompt.

Median-centered advantages (arXiv 2601.22582) with the std guard for binary rewards (see
`advantages.group_median_baseline`); 2-digit addition and multiplication.

  python -m experiments.launch.train --config=configs/arithmetic_mc_grpo.py --workdir=/tmp/rollouts_mc
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.data.difficulty = 2
  config.data.ops = "+*"
  config.rl.advantage = "mc_grpo"
  config.rollout.num_samples = 9
  config.rollout.max_new_tokens = 64 if arg != "smoke" else 16
  return config
