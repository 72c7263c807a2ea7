r"""Reproduction study `uniqueness` ("Rewarding the Rare", arXiv 2601.08763) on countdown.

Arms, on countdown (`configs/countdown_grpo.py`: its task and warm start) shrunk like
`configs/repro_base.py` (8 prompts a step, 8 samples each, 80 steps, no dynamic sampling);
held-out pass@1 and pass@16 on 100 test prompts (16 samples each):

  grpo        GRPO
  uniqueness  GRPO with correct samples scaled by |strategy cluster|^-0.5, a strategy being
              the canonical structure of the expression (`tasks.Countdown.strategy`)

  python -m experiments.launch.train --config=configs/repro_uniqueness.py:uniqueness --workdir=/tmp/repro_uniq
"""

import os
import runpy

from rollouts_jax.training.config import apply_smoke, load_config_file

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_base.py"))


def _grpo(config):
  config.rl.advantage = "grpo"


def _uniqueness(config):
  config.rl.advantage = "uniqueness_grpo"
  config.rl.advantage_kwargs = "alpha=0.5"
  config.reward.clusters = "strategy"


ARMS = {"grpo": _grpo, "uniqueness": _uniqueness}


def get_config(arg=None):
  arm, smoke = _BASE["parse_arm"](arg, ARMS)
  config = load_config_file(os.path.join(os.path.dirname(__file__), "countdown_grpo.py"), "smoke" if smoke else None)
  config.control.dynamic_sampling = False
  config.control.prompts_per_step = 8
  config.rollout.num_samples = 8
  config.rl.steps = 80
  config.reward.num_workers = 0
  config.eval.num_examples = 100
  config.eval.k = 16
  config.checkpoint.every = 10
  ARMS[arm](config)
  if smoke:
    apply_smoke(config)
  return config
