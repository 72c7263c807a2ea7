r"""Co-Reward: two views of each question reward each other by majority vote; no references read.

Each prompt is also asked in a label-preserving rewrite (the operands of `a + b` swapped:
`tasks.Arithmetic.rewrite`); the original's samples are rewarded by agreement with the
rewrite's majority answer and vice versa, and both views train (2 x prompts_per_step groups).

  python -m experiments.launch.train --config=configs/co_reward.py --workdir=/tmp/rollouts_co_reward
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.reward.name = "co_reward"
  if arg != "smoke":
    config.control.prompts_per_step = 16
  return config
