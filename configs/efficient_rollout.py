r"""Arithmetic GRPO with EfficientRollout's self-speculative rollouts (arXiv 2606.18967).

The policy's NVFP4 copy drafts up to 4 tokens a round and the full-precision policy verifies
them (`rollout.generator = "self_spec"`, `rollouts_jax/rollout/self_spec.py`): the rollouts
are distributed exactly as plain sampling's, so training is GRPO's; what changes is how many
policy forwards a batch takes (`rollout/decode_steps`, `spec/accepted_tokens`). On a CPU,
which has no FP4 units, the drafter is fake-quantized and costs as much as the policy, so
this measures acceptance, not speed.

  python -m experiments.launch.train --config=configs/efficient_rollout.py --workdir=/tmp/rollouts_efficient
  python -m experiments.launch.train --config=configs/efficient_rollout.py --config.rollout.generator=sample \
      --config.rollout.generator_kwargs= --workdir=/tmp/rollouts_plain      # the baseline
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.generator = "self_spec"
  config.rollout.generator_kwargs = "fmt=nvfp4,gamma_max=4"
  return config
