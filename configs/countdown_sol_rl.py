r"""Sol-RL on countdown: explore with an NVFP4 copy of the policy, train on a contrastive subset.

Each step samples a pool of 16 completions per prompt with the FP4-quantized policy
(linear layers through the FP4 matmul), scores the pool, keeps the 4 best and 4 worst
(duplicates counted once), recomputes their log-probs in full precision and trains on them
(FP4 Explore, BF16 Train; arXiv 2604.06916).

  python -m experiments.launch.train --config=configs/countdown_sol_rl.py --workdir=/tmp/rollouts_sol_rl
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "countdown_grpo.py"), arg)
  config.control.dynamic_sampling = False
  config.rollout.num_samples = 8 if arg != "smoke" else 4
  config.rollout.generator = "sol_rl"
  config.rollout.generator_kwargs = f"fmt=nvfp4,pool={16 if arg != 'smoke' else 8},subset=contrastive"
  return config
