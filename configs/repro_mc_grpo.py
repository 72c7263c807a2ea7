r"""Reproduction study `mc_grpo` (MC-GRPO, arXiv 2601.22582): one arm per config argument.

Arms (GRPO's mean baseline vs MC-GRPO's median baseline over G+1 samples with the pivot
sample left out of the loss), on the miniature of `configs/repro_base.py`:

  g2_mean    GRPO, G = 2 samples a prompt
  g2_median  MC-GRPO, G + 1 = 3 samples a prompt (2 carry gradient)
  g8_mean    GRPO, G = 8
  g8_median  MC-GRPO, G + 1 = 9

  python -m experiments.launch.train --config=configs/repro_mc_grpo.py:g2_median --workdir=/tmp/repro_mc
"""

import os
import runpy

from rollouts_jax.training.config import apply_smoke

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_base.py"))


def _arm(advantage, num_samples):
  def edit(config):
    config.rl.advantage = advantage
    config.rollout.num_samples = num_samples
  return edit


ARMS = {"g2_mean": _arm("grpo", 2), "g2_median": _arm("mc_grpo", 3),
        "g8_mean": _arm("grpo", 8), "g8_median": _arm("mc_grpo", 9)}


def get_config(arg=None):
  arm, smoke = _BASE["parse_arm"](arg, ARMS)
  config = _BASE["get_config"]("smoke" if smoke else None)
  ARMS[arm](config)
  if smoke:
    apply_smoke(config)
  return config
