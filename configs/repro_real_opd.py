r"""Reproduction study `real_opd`: on-policy distillation and ESR on SmolLM2-135M-Instruct.

The student is SmolLM2-135M-Instruct as shipped, on `configs/repro_real_base.py` (chat
addition, temperature 0.7, 24 steps of 8 prompts x 8 samples). The teacher is the same model
after the base's own GRPO run (the `teacher` arm, seed 0: 24 steps on the task's reward),
written as a Hugging Face folder to `TEACHER_DIR` by `experiments/studies/reproduce.py --study=real_opd`
(which builds it first when it is absent). Arms:

  teacher  GRPO on the reward (no teacher): the run the teacher is exported from
  opd      on-policy distillation: each token's advantage is log p_teacher - log p_student on the
           student's own full rollouts (no reward)
  esr      the same, with only the first 12 of the 24 tokens generated and trained
           (`rollout.generator="esr"`, window 12)
  adwin    ESR whose window adapts (`rollout.generator="adwin"`): it starts at 12 and, every 5
           steps, a full-length probe of the step's prompts decides whether it grows or shrinks
           (the probe's tokens count as generated)

  python -m experiments.studies.reproduce --study=real_opd --seeds=2
  python -m experiments.launch.train --config=configs/repro_real_opd.py:esr --workdir=/tmp/real_opd_esr
"""

import os
import runpy

_HERE = os.path.dirname(__file__)
_BASE = runpy.run_path(os.path.join(_HERE, "repro_real_base.py"))
_MINIATURE = runpy.run_path(os.path.join(_HERE, "repro_base.py"))
#: The exported teacher; `$ROLLOUTS_JAX_CACHE` (default ~/.cache/rollouts_jax) holds it, like warm starts.
TEACHER_DIR = os.path.join(os.environ.get("ROLLOUTS_JAX_CACHE", os.path.expanduser("~/.cache/rollouts_jax")),
                           "teachers", "smollm2_addition_grpo24")
ESR_WINDOW = 12
ADWIN_EVERY = 5


def _distill(window=0, generator="esr", extra=""):
  def edit(config):
    config.rollout.distill = "opd"
    config.rollout.teacher_path = TEACHER_DIR
    if window:
      config.rollout.generator = generator
      config.rollout.generator_kwargs = f"window={window}{extra}"
  return edit


ARMS = {"teacher": lambda config: None, "opd": _distill(), "esr": _distill(ESR_WINDOW),
        "adwin": _distill(ESR_WINDOW, "adwin", f",every={ADWIN_EVERY}")}


def get_config(arg=None):
  arm, smoke = _MINIATURE["parse_arm"](arg, ARMS)
  config = _BASE["get_config"]("smoke" if smoke else None)
  ARMS[arm](config)
  if smoke and config.rollout.generator in ("esr", "adwin"):
    window = f"window={max(1, config.rollout.max_new_tokens // 2)}"
    config.rollout.generator_kwargs = window + ("" if config.rollout.generator == "esr" else ",every=1")
  return config
