r"""Countdown with GRPO: reach a target from 3 numbers with + - * / (each number once).

The policy is warm-started by SFT on generated solutions, then trained with GRPO on the
exact countdown verifier (no `eval`; exact rational arithmetic).

  python -m experiments.launch.train --config=configs/countdown_grpo.py --workdir=/tmp/rollouts_countdown
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.data.task = "countdown"
  config.data.difficulty = 2
  config.reward.name = "task"
  config.data.max_prompt_len = 128
  config.rollout.max_new_tokens = 32 if arg != "smoke" else 16
  config.control.dynamic_sampling = True
  return config
