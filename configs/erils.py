r"""Arithmetic GRPO with ERILS external rollouts from a stronger local policy (METHODS 9.7).

The external policy is the same warm-start recipe trained longer (400 SFT steps against the
student's 275; built once and cached). Each group holds the student's 8 rollouts and 4 of
the external policy's; an external rollout that does not end within the budget is masked
out (length control), and the advantage normalizes each source apart (`rl.advantage=erils`).
External tokens are trained without an importance ratio (their log-probs are another
policy's), so `rl.tis_cap` stays 0.

  python -m experiments.launch.train --config=configs/erils.py --workdir=/tmp/rollouts_erils
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.external_samples = 4
  config.rollout.teacher_sft_steps = 400 if arg != "smoke" else config.sft.steps + 5
  config.rl.advantage = "erils"
  return config
