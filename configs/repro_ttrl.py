r"""Reproduction study `ttrl` (TTRL, arXiv 2504.16084): one arm per config argument.

Arms, on the miniature of `configs/repro_base.py` with 8 samples a prompt:

  ground_truth  GRPO on the task's verifier (reads the reference answers)
  ttrl          GRPO on agreement with the group's majority answer (no reference read in RL)

The held-out evaluation of both arms grades against the test split's answers.

  python -m experiments.launch.train --config=configs/repro_ttrl.py:ttrl --workdir=/tmp/repro_ttrl
"""

import os
import runpy

from rollouts_jax.training.config import apply_smoke

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_base.py"))


def _arm(reward):
  def edit(config):
    config.reward.name = reward
    config.rollout.num_samples = 8
  return edit


ARMS = {"ground_truth": _arm("task"), "ttrl": _arm("ttrl")}


def get_config(arg=None):
  arm, smoke = _BASE["parse_arm"](arg, ARMS)
  config = _BASE["get_config"]("smoke" if smoke else None)
  ARMS[arm](config)
  if smoke:
    apply_smoke(config)
  return config
