r"""Arithmetic GRPO on tree rollouts with TreeRL node advantages (ECHO arXiv 2602.02150, TreeRL 2506.11902).

Each prompt grows one tree of 8 leaves: decoding starts from one row and, where the policy's
entropy passes the branching rule, forks a row by copying its KV cache (the shared prefix is
decoded once). Every leaf draws its own tokens (`branch_tokens=sample`), so leaves are policy
samples. The update gives each token its node's TreeRL advantage (G + L) / sqrt(|leaves|)
instead of a per-sample group advantage. The thresholds suit the small arithmetic model
(its median token entropy is 0.03 nats, the 90th percentile 0.40).

  python -m experiments.launch.train --config=configs/tree_grpo.py --workdir=/tmp/rollouts_tree
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.generator = "tree"
  config.rollout.generator_kwargs = ("init_rows=1,entropy_min=0.3,min_depth=1,min_gap=2,width_h_low=0.1,"
                                     "width_h_high=1.0,width_beta=0.0,branch_tokens=sample,prune=False")
  return config
