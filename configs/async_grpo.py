r"""Asynchronous GRPO: rollouts of step s come from the policy after s - 1 updates (AReaL, arXiv 2505.24298).

The default arithmetic task and policy. A producer thread generates the next batch while the
trainer updates on this one (`rollout/source.py`); the PPO ratio is taken against the
params before each update and the behaviour policy is importance-weighted with AReaL's mask
cap (decoupled PPO). Arguments (comma-separated):

  ewma      the proximal policy is a moving average of the params (PPO-EWMA)
  snapshot  the ratio is taken against the exact params that generated each token
  stale2    a staleness bound of 2 instead of 1
  mesh8     4 rollout devices and 4 training devices (run with
            XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU)
  smoke     the tiny variant of the default config

  python -m experiments.launch.train --config=configs/async_grpo.py --workdir=/tmp/rollouts_async
  python -m experiments.launch.train --config=configs/async_grpo.py:snapshot,stale2 --workdir=/tmp/rollouts_async2
"""

import os

from rollouts_jax.training.config import apply_smoke, load_config_file, parse_config_arg


def get_config(arg=None):
  words = parse_config_arg(arg, ("ewma", "snapshot", "stale2", "mesh8", "smoke"))
  if "ewma" in words and "snapshot" in words:
    raise ValueError("configs/async_grpo.py: choose one of 'ewma' and 'snapshot'.")
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"))
  config.rl.advantage = "grpo"
  config.async_rl.max_staleness = 2 if "stale2" in words else 1
  config.async_rl.old_logprobs = "ewma" if "ewma" in words else "snapshot" if "snapshot" in words else "recompute"
  config.rl.tis_cap = 2.0
  config.rl.tis_mode = "mask"
  if "mesh8" in words:
    config.mesh.shape = (4, 1, 1)
    config.mesh.preset = "pure_dp"
    config.mesh.rollout_shape = (4, 1, 1)
  if "smoke" in words:
    apply_smoke(config)
  return config
