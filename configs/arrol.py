r"""Arithmetic GRPO with ARRoL online pruning (arXiv 2603.24840).

Each prompt starts 12 rollouts; after 8 tokens a logistic quality head on the policy's
hidden state (trained on the fly on finished rollouts' outcomes) keeps 8 of them, a balanced
mix of likely successes and likely failures, and only those run to the end. The pruned
rows cost their 8-token prefix.

  python -m experiments.launch.train --config=configs/arrol.py --workdir=/tmp/rollouts_arrol
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.generator = "arrol"
  config.rollout.generator_kwargs = f"oversample=0.5,at={8 if arg != 'smoke' else 4},target=0.5"
  return config
