r"""On-policy distillation in miniature: the arms of `experiments/studies/distill_study.py`.

The reproduction miniature (`configs/repro_base.py`: 8 prompts a step, a 200-prompt held-out
evaluation, here also every 20 steps for the learning curve) run for 160 RL steps instead of
80 (at 80, full-rollout OPD at this learning rate is still in the dip every run of this policy
shows first, and 1e-3 collapsed it), with the student's per-token advantage
log p_teacher - log p_student on its own rollouts (METHODS 9.6).
The teacher is the same SFT recipe trained for 400 steps instead of the student's 275. Arms
(the config argument):

  opd     full rollouts (up to 40 tokens) generated, scored and trained
  opd_lr3 the same at twice the learning rate (3e-4): is the step size what limits OPD here?
  esr     ESR: only the first 12 tokens generated and trained (`rollout.generator="esr"`)
  esr24   ESR with a 24-token window
  adwin   ADWIN: a window starting at 12, re-sized every 5 steps from a full-rollout probe
  grpo    no teacher: GRPO on the task's reward (the reward-based reference)

With the suffix `_full` (`opd_full`, `esr_full`, `esr24_full`, `adwin_full`) the same rollouts
are trained with the full-vocabulary reverse KL to the teacher at every completion position
(GKD's on-policy loss, `losses.full_reverse_kl`, `rollout.distill="opd_full"`) instead of the
single-sample advantage; `opd_full_lr6` / `esr_full_lr6` / `adwin_full_lr6` take a 4x larger
step (6e-4): a supervised-like loss can. With `_fwd` in place of `_full` (`opd_fwd`, `esr_fwd`,
`adwin_fwd`, `opd_fwd_lr6`) the full-vocabulary loss is the forward KL(teacher || student)
(`rl.distill_kl="forward"`, a cross-entropy to the teacher's soft targets, whose gradient in the
logits is bounded). `_lr3` takes twice the step (3e-4); `opd_full_long` runs 320 RL steps
instead of 160 (the cosine schedule stretched over them), `opd_full_lr3_long` both, and
`opd_lr3_long` is the single-sample control of the latter; `esr_full_lr3_long` and
`esr16_full_lr3_long` are ESR with a 12- and a 16-token window on those settings; `_lr10` takes
a step of 1e-3 (`opd_full_lr10`, `esr_full_lr10`, `esr16_full_lr10`).

With `,mul` the task is multiplication instead (`data.ops="*"`, operands of 1-2 digits: a worked
partial product per digit of the multiplier, then their sums; 8,000 training problems, 500 held
out, answers up to 56 tokens), where the student's divergence from the teacher sits earlier (the
first products): the student is the recipe trained 450 steps (at 275 steps, pass@1 0.09 against
the 600-step teacher's 0.40, and full-vocabulary OPD gained +0.02 in 160 steps), the teacher
600 steps, and `esr16` is ESR with a 16-token window.

Add `,smoke` for a tiny model and one RL step (the test suite; `smoke` alone is the OPD arm's).

  python -m experiments.launch.train --config=configs/distill_arms.py:esr --workdir=/tmp/distill_esr
"""

import os

from rollouts_jax.training.config import load_config_file, parse_config_arg

ARMS = ("opd", "opd_lr3", "esr", "esr16", "esr24", "adwin", "grpo", "opd_full", "esr_full", "esr24_full",
        "adwin_full", "opd_full_lr6", "esr_full_lr6", "adwin_full_lr6", "opd_fwd", "esr_fwd", "esr24_fwd", "adwin_fwd",
        "opd_fwd_lr6", "esr_fwd_lr6", "adwin_fwd_lr6", "opd_full_lr3", "esr_full_lr3", "esr16_full_lr3",
        "esr24_full_lr3", "adwin_full_lr3", "opd_full_long", "opd_full_lr3_long", "opd_lr3_long",
        "esr_full_lr3_long", "esr16_full_lr3_long", "opd_full_lr10", "esr_full_lr10", "esr16_full_lr10",
        "esr16_full_long")
# An arm is its rollouts (opd, esr, esr16, esr24, adwin; grpo: no teacher) and modifiers: full (the
# full-vocabulary reverse KL), fwd (the forward one), lr3 / lr6 / lr10 (learning rate 3e-4 / 6e-4 / 1e-3), long
# (320 RL steps).
LEARNING_RATES = {"lr3": 3e-4, "lr6": 6e-4, "lr10": 1e-3}
STUDENT_SFT_STEPS = {"add": 275, "mul": 450, "mul_strong": 800}   # per task (add: the default config's)
TEACHER_SFT_STEPS = {"add": 400, "mul": 600, "mul_strong": 1200}
WINDOWS = {"esr16": 16, "esr24": 24}           # ESR's k (12 for esr and ADWIN's start)


def get_config(arg=None):
  words = parse_config_arg(arg, ARMS + ("smoke", "mul", "strong"))
  smoke, task = "smoke" in words, "mul" if "mul" in words else "add"
  if "strong" in words:
    if task != "mul":
      raise ValueError(f"distill_arms.py: 'strong' is a variant of 'mul' (write 'ARM,mul,strong'), got {arg!r}.")
    task = "mul_strong"
  arms = [w for w in words if w not in ("smoke", "mul", "strong")] or (["opd"] if smoke else [])   # smoke: OPD's
  if len(arms) != 1 or arms[0] not in ARMS:
    raise ValueError(f"distill_arms.py needs one arm of {ARMS} (and optionally 'mul', 'mul,strong', 'smoke'), "
                     f"got {arg!r}.")
  arm, *mods = arms[0].split("_")
  config = load_config_file(os.path.join(os.path.dirname(__file__), "repro_base.py"), "smoke" if smoke else None)
  config.eval.every = 20 if not smoke else 0
  if task.startswith("mul"):
    config.data.ops, config.data.difficulty = "*", 2
    if not smoke:
      config.data.num_train, config.data.num_test, config.rollout.max_new_tokens = 8000, 500, 56
  if not smoke:
    config.sft.steps = STUDENT_SFT_STEPS[task]
    config.rl.steps = 320 if "long" in mods else 160
  for m in mods:
    if m in LEARNING_RATES:
      config.rl.learning_rate = LEARNING_RATES[m]
  if arm == "grpo":
    return config
  config.rollout.teacher_sft_steps = TEACHER_SFT_STEPS[task] if not smoke else config.sft.steps + 5
  full = "full" in mods or "fwd" in mods
  config.rollout.distill = "opd_full" if full else "opd"
  if "fwd" in mods:
    config.rl.distill_kl = "forward"
  window = WINDOWS.get(arm, 12) if not smoke else 8
  if arm != "opd":   # ESR / ADWIN: the generator that shortens the rollouts
    config.rollout.generator = "adwin" if arm == "adwin" else "esr"
    config.rollout.generator_kwargs = f"window={window}"
  return config
