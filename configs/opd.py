r"""On-policy distillation on arithmetic: full rollouts (GKD-style reverse KL per token).

The teacher is the same warm-start recipe trained longer (400 SFT steps against the
student's 275; built once and cached). The student samples; the teacher scores each of its
tokens; a token's advantage is log p_teacher - log p_student (the single-sample reverse
KL), in place of a reward-based advantage. See METHODS 9.6 and `training/pipeline.py`.

  python -m experiments.launch.train --config=configs/opd.py --workdir=/tmp/rollouts_opd
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.teacher_sft_steps = 400 if arg != "smoke" else config.sft.steps + 5
  config.rollout.distill = "opd"
  return config
