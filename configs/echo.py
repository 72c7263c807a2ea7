r"""ECHO (arXiv 2602.02150) on arithmetic: tree rollouts, confidence-adaptive clipping, hybrid shaping.

`configs/tree_grpo.py`'s tree rollouts (each prompt grows one tree of 8 leaves, branching at
high-entropy tokens), with ECHO's two update rules:

- `rl.echo_clip`: each response's symmetric clip range grows with its confidence (its mean
  DeepConf token confidence, min-max normalised in its group) from 0.1 to 0.28;
- `rl.echo_shaping = 0.5`: every token's advantage is scaled by 0.5 + 0.5 H_t / mean H (its
  entropy against the response's mean), and positive ones by the normalised confidence.

The paper's forms are given in words; these are ours (METHODS 9.4).

  python experiments/train.py --config=configs/echo.py --workdir=/tmp/rollouts_echo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "tree_grpo.py"), arg)
  config.rl.echo_clip = True
  config.rl.echo_eps_lo = 0.1
  config.rl.echo_eps_hi = 0.28
  config.rl.echo_shaping = 0.5
  return config
