r"""On-policy distillation in miniature: the arms of `experiments/distill_study.py`.

The reproduction miniature (`configs/repro_base.py`: 8 prompts a step, a 200-prompt held-out
evaluation, here also every 20 steps for the learning curve) run for 160 RL steps instead of
80 (at 80, full-rollout OPD at this learning rate is still in the dip every run of this policy
shows first, and 1e-3 collapsed it), with the student's per-token advantage
log p_teacher - log p_student on its own rollouts (METHODS 9.6).
The teacher is the same SFT recipe trained for 400 steps instead of the student's 275. Arms
(the config argument):

  opd     full rollouts (up to 40 tokens) generated, scored and trained
  opd_lr3 the same at twice the learning rate (3e-4): is the step size what limits OPD here?
  esr     ESR: only the first 12 tokens generated and trained (`distill_window`)
  esr24   ESR with a 24-token window
  adwin   ADWIN: a window starting at 12, re-sized every 5 steps from a full-rollout probe
  grpo    no teacher: GRPO on the task's reward (the reward-based reference)

With the suffix `_full` (`opd_full`, `esr_full`, `esr24_full`, `adwin_full`) the same rollouts
are trained with the full-vocabulary reverse KL to the teacher at every completion position
(GKD's on-policy loss, `losses.full_reverse_kl`, `rollout.distill=..._full`) instead of the
single-sample advantage; `opd_full_lr6` / `esr_full_lr6` / `adwin_full_lr6` take a 4x larger
step (6e-4): a supervised-like loss can. With `_fwd` in place of `_full` (`opd_fwd`, `esr_fwd`,
`adwin_fwd`, `opd_fwd_lr6`) the full-vocabulary loss is the forward KL(teacher || student)
(`rl.distill_kl="forward"`, a cross-entropy to the teacher's soft targets, whose gradient in the
logits is bounded).

Add `,smoke` for a tiny model and one RL step (the test suite; `smoke` alone is the OPD arm's).

  python experiments/train.py --config=configs/distill_arms.py:esr --workdir=/tmp/distill_esr
"""

import os

from rollouts_jax.training.config import load_config_file, parse_config_arg

ARMS = ("opd", "opd_lr3", "esr", "esr24", "adwin", "grpo", "opd_full", "esr_full", "esr24_full", "adwin_full",
        "opd_full_lr6", "esr_full_lr6", "adwin_full_lr6", "opd_fwd", "esr_fwd", "esr24_fwd", "adwin_fwd",
        "opd_fwd_lr6", "esr_fwd_lr6", "adwin_fwd_lr6")
FULL_LR = 6e-4
TEACHER_SFT_STEPS = 400


def get_config(arg=None):
  words = parse_config_arg(arg, ARMS + ("smoke",))
  smoke = "smoke" in words
  arms = [w for w in words if w != "smoke"] or (["opd"] if smoke else [])   # `smoke` alone: the OPD arm
  if len(arms) != 1 or arms[0] not in ARMS:
    raise ValueError(f"distill_arms.py needs one arm of {ARMS} (and optionally 'smoke'), got {arg!r}.")
  arm = arms[0]
  forward = "_fwd" in arm
  full = "_full" in arm or forward
  lr6 = arm.endswith("_lr6")
  arm = arm.replace("_full", "").replace("_fwd", "").replace("_lr6", "")
  config = load_config_file(os.path.join(os.path.dirname(__file__), "repro_base.py"), "smoke" if smoke else None)
  config.eval.every = 20 if not smoke else 0
  if not smoke:
    config.rl.steps = 160
  if arm == "grpo":
    return config
  config.rollout.teacher_sft_steps = TEACHER_SFT_STEPS if not smoke else config.sft.steps + 5
  config.rollout.distill = {"esr24": "esr", "opd_lr3": "opd"}.get(arm, arm) + ("_full" if full else "")
  if arm == "opd_lr3":
    config.rl.learning_rate = 3e-4
  if lr6:
    config.rl.learning_rate = FULL_LR
  if forward:
    config.rl.distill_kl = "forward"
  window = {"esr24": 24}.get(arm, 12)
  config.rollout.distill_window = window if not smoke else 8
  return config
