r"""XRPO novelty sharpening (arXiv 2510.06672): GRPO advantages, low-likelihood correct samples boosted.

A_i <- A_i + min(max(lam (1 - eta_i), 0), kappa |A_i|) for correct samples, with eta_i the
sample's likelihood (mean token log-prob) relative to its group; the loop supplies each
sample's mean behaviour log-prob as `seq_logprobs`.

  python -m experiments.launch.train --config=configs/xrpo.py --workdir=/tmp/rollouts_xrpo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "xrpo"
  config.rl.advantage_kwargs = "lam=1.0,kappa=0.5"
  return config
