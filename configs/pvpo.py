r"""PVPO (arXiv 2508.21104): a static baseline from reference-policy rollouts of each prompt.

A_i = r_i - mean(r_ref), where r_ref are the rewards of `reward.ref_samples` rollouts of the
initial (warm-start) policy on the same prompt. As in the paper they are pre-sampled for every
training prompt before the first step (`control.name = "pvpo"`), and the selector skips the
prompts the reference always or never solves (`control.pvpo_presample`); `reward.ref_refresh`
> 0 would recompute a prompt's anchors after that many steps. A group whose samples all agree
still gets a gradient when it differs from its anchor.

  python -m experiments.launch.train --config=configs/pvpo.py --workdir=/tmp/rollouts_pvpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "pvpo"
  config.control.name = "pvpo"
  config.reward.ref_samples = 8
  config.reward.ref_refresh = 0
  if arg == "smoke":
    config.reward.ref_samples = 2
  return config
