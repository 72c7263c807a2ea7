r"""Reproduction study `brorl` (BroRL, arXiv 2510.01180): rollouts per prompt vs update steps.

Arms, on the miniature of `configs/repro_base.py` with 2 prompts a step and 60 steps (so
that N = 128 stays affordable on one core):

  n8         N = 8 samples a prompt, 60 steps
  n32        N = 32, 60 steps
  n128       N = 128, 60 steps
  n8_steps4  N = 8, 240 steps (4x the updates; the rollouts of n32)

  python -m experiments.launch.train --config=configs/repro_brorl.py:n128 --workdir=/tmp/repro_brorl
"""

import os
import runpy

from rollouts_jax.training.config import apply_smoke

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_base.py"))


def _arm(num_samples, step_factor=1):
  def edit(config, smoke=False):
    config.control.prompts_per_step = 2
    config.rollout.num_samples = num_samples
    config.rl.steps = 60 * step_factor
    if smoke:   # the arms stay distinct in miniature: N / 4 samples (at least 2), step_factor steps
      config.rollout.num_samples = max(num_samples // 4, 2)
      config.rl.steps = step_factor
  return edit


ARMS = {"n8": _arm(8), "n32": _arm(32), "n128": _arm(128), "n8_steps4": _arm(8, 4)}


def get_config(arg=None):
  arm, smoke = _BASE["parse_arm"](arg, ARMS)
  config = _BASE["get_config"]("smoke" if smoke else None)
  if smoke:
    apply_smoke(config)
  ARMS[arm](config, smoke)
  return config
