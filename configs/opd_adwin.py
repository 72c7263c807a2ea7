r"""On-policy distillation on arithmetic: ADWIN, a window adapted from periodic full-rollout probes.

The teacher is the same warm-start recipe trained longer (400 SFT steps against the
student's 275; built once and cached). The student samples; the teacher scores each of its
tokens; a token's advantage is log p_teacher - log p_student (the single-sample reverse
KL), in place of a reward-based advantage. See METHODS 9.6 and `training/pipeline.py`.

  python -m experiments.launch.train --config=configs/opd_adwin.py --workdir=/tmp/rollouts_opd_adwin
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.rollout.teacher_sft_steps = 400 if arg != "smoke" else config.sft.steps + 5
  config.rollout.distill = "opd"
  config.rollout.generator = "adwin"
  config.rollout.generator_kwargs = f"window={12 if arg != 'smoke' else 8},every=5,gamma=0.25,tau=0.9"
  return config
