r"""Arithmetic GRPO with CaT rewards (Compute as Teacher, arXiv 2509.14234): no references read.

Each step, the frozen initial policy (the anchor) is shown each group's distinct answers and
the question, and writes one reference answer (greedy); a rollout's reward is 1 when its
answer equals the reference's (the task's programmatic equivalence). A synthesis without an
answer gives its group 0. The small arithmetic model was never trained to reconcile
candidates, so here the anchor mostly answers the question itself; a chat checkpoint
(`gsm8k_qwen.py` with `--config.reward.name=cat`) reads the candidates as intended.

  python -m experiments.launch.train --config=configs/cat.py --workdir=/tmp/rollouts_cat
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.reward.name = "cat"
  config.data.max_prompt_len = 64
  return config
