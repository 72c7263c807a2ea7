r"""TTRL (arXiv 2504.16084): majority-vote pseudo-labels, no ground truth read during RL.

The default arithmetic task and warm start; each group's reward is agreement with the
group's majority answer (the task's extractor; answers the task judges equal are merged).
References are never read by the RL stages (the held-out evaluation still grades against
the test split's answers). Votes over 16 samples per prompt.

  python -m experiments.launch.train --config=configs/ttrl.py --workdir=/tmp/rollouts_ttrl
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.reward.name = "ttrl"
  if arg != "smoke":
    config.rollout.num_samples = 16
    config.control.prompts_per_step = 16
  return config
