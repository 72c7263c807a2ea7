r"""ECHO (arXiv 2602.02150) as the paper runs it: test-time RL on entropy-branched, pruned trees.

ECHO is test-time RL: the reward is TTRL's majority-vote agreement (no answers are read), the
rollouts are trees (`rollout.generator = "tree"`), and the update is GRPO with no KL at
temperature 0.8 (the paper's `examples/ttrl_echo` script). The tree generator runs with all of
ECHO's rollout rules on:

- branching where the entropy passes `entropy_min` and rises by `delta_entropy_min`, children
  starting from the top-`width` tokens (`branch_tokens=top`), with the confidence-adaptive
  width 1 + alpha (H - h_low)/(h_high - h_low) - beta (G - tau)/|tau| (alpha 2, beta 1);
- pruning of rows whose tail confidence declines for 3 steps below `tail_conf_max`, or whose
  entropy spikes for 3 steps (`prune=True`);
- the update rules `rl.echo_clip` (each response's clip range from 0.1 to 0.28 by its
  group-normalised confidence) and `rl.echo_shaping = 0.5` (entropy and confidence shaping).

The paper's thresholds are for Qwen2.5 (and its G <= 1.2 cannot fire as written, see
`sampling/tree.py`); here they are set from the arithmetic warm start, measured on 64 test
prompts x 4 samples: token entropy median 0.027 nats, 90th percentile 0.41; token confidence
C (top-5) median 6.8, and at tokens with H >= 0.3 (22% of them) 3.8 / 4.3 / 4.5 at the 10th /
50th / 90th percentile, so tau = 4.3 and the tail-decline trigger at 4.3. Each tree starts
from 4 independent rows (with 1, the warm start branches so rarely that a prompt ends with 2.8
leaves of 8, too few votes); on 64 training prompts that gives 6.75 leaves a prompt, 192
branches and 27 pruned rows. The update forms are ours (METHODS 9.4).

  python -m experiments.launch.train --config=configs/echo.py --workdir=/tmp/rollouts_echo
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.reward.name = "ttrl"
  config.rollout.temperature = 0.8
  config.rl.kl_coef = 0.0
  config.rollout.generator = "tree"
  config.rollout.generator_kwargs = (
      "init_rows=4,min_depth=1,min_gap=2,entropy_min=0.3,delta_entropy_min=0.2,branch_tokens=top,"
      "width_alpha=2.0,width_beta=1.0,width_h_low=0.1,width_h_high=1.0,width_tau=4.3,"
      "prune=True,decline_steps=3,tail_conf_max=4.3,spike_entropy_min=0.5")
  config.rl.echo_clip = True
  config.rl.echo_eps_lo = 0.1
  config.rl.echo_eps_hi = 0.28
  config.rl.echo_shaping = 0.5
  return config
