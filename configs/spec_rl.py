r"""Arithmetic GRPO with SPEC-RL speculative rollouts (arXiv 2509.23232) on a small prompt pool.

SPEC-RL reuses a prompt's rollouts from its previous epoch as drafts, so the training set is
a pool of 256 prompts visited once per 8 steps. From the second epoch on, the policy verifies
last epoch's rollouts in one forward pass, accepts each token with probability
min(1, e^0.5 * p_new / p_old), keeps the accepted prefix and decodes only the rest.

  python -m experiments.launch.train --config=configs/spec_rl.py --workdir=/tmp/rollouts_spec_rl
  python -m experiments.launch.train --config=configs/spec_rl.py --config.rollout.generator=sample ...  # the baseline
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.data.num_train = 256 if arg != "smoke" else config.data.num_train
  config.rollout.generator = "spec_rl"
  config.rollout.generator_kwargs = "lenience=1.6487212707001282"   # e^0.5, the paper's GRPO default
  return config
