r"""Countdown with APRIL partial rollouts (arXiv 2509.18521; `RLsys-Foundation/APRIL`).

Each step requests ceil(1.5 * prompts_per_step) groups (groups left unfinished by the last
step first), stops decoding as soon as prompts_per_step groups have finished, and stores
the rest, finished or not, to be resumed next step under the newer policy. Long rollouts no
longer hold up the batch; a resumed group mixes policy versions, and every token keeps the
behaviour log-prob of the version that produced it, so the update weights it by the
truncated importance ratio (rl.tis_cap) against the policy before the update.

  python -m experiments.launch.train --config=configs/countdown_april.py --workdir=/tmp/rollouts_april
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "countdown_grpo.py"), arg)
  config.control.dynamic_sampling = False   # APRIL stops on finished groups, not informative ones
  config.rollout.generator = "april"
  config.rollout.generator_kwargs = "over_provision=0.5"
  config.rl.tis_cap = 2.0
  return config
