r"""DAPO-style dynamic sampling on countdown with surplus informative groups kept in a FIFO replay buffer.

Dynamic sampling (arXiv 2503.14476) refills until every group of the batch has differing
rewards; the informative groups beyond the batch are not thrown away but stored
(`replay.fifo`) and offered first at the next steps (at most `replay.max_staleness` updates
old), their PPO ratio taken against their behaviour log-probs.

  python -m experiments.launch.train --config=configs/countdown_dapo_replay.py --workdir=/tmp/rollouts_dapo_replay
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "countdown_grpo.py"), arg)
  config.control.dynamic_sampling = True
  config.replay.name = "fifo"
  config.replay.capacity = 64 if arg != "smoke" else 8
  config.replay.max_staleness = 2
  config.rl.clip_high = 0.28
  return config
