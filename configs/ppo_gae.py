r"""PPO with a learned value function and GAE (Schulman et al. 2016, arXiv 1506.02438), verl's defaults.

The default arithmetic task and policy; `rl.advantage="gae"` adds a critic (the policy's trunk
with a zero-initialised scalar head, its own AdamW) to the train state and its checkpoints. Token
advantages are GAE (gamma 1, lambda 0.95) over the critic's values before each update, whitened
over the batch's completion tokens; the critic's loss is verl's clipped value loss
(cliprange_value 0.5).

  python -m experiments.launch.train --config=configs/ppo_gae.py --workdir=/tmp/rollouts_ppo_gae
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rl.advantage = "gae"
  config.rl.advantage_kwargs = "gamma=1.0,lam=0.95"
  # The critic learns faster than the policy (verl's examples: critic lr 10x the actor's).
  config.rl.critic_learning_rate = 1.5e-3
  config.rl.critic_cliprange_value = 0.5
  config.rl.critic_loss_coef = 1.0
  config.rl.critic_grad_clip = 1.0
  return config
