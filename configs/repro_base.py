r"""The miniature every reproduction study starts from (`experiments/studies/reproduce.py`).

The default arithmetic task, model and SFT warm start (`configs/default.py`), shrunk so one
RL run takes a minute or two on one CPU core: 8 prompts a step, 80 RL steps, a 200-prompt
held-out evaluation (4 samples each at temperature 1). The learning rate stays the default's
1.5e-4 (3e-4 with 8 prompts a step drove this policy's reward to 0 within 40 steps). Like the
main job, the held-out accuracy first dips (about 30 steps) and then recovers.

  python -m experiments.launch.train --config=configs/repro_base.py --workdir=/tmp/repro_base

`reproduce.py` runs every seed from one warm start (seed 0's, passed as a local checkpoint
with `model.init=hf`), so seeds differ only in the RL run.

The study configs (`configs/repro_STUDY.py:ARM[,smoke]`) read their argument with `parse_arm`;
they load this file with `runpy.run_path`, as `configs/` is not a package.
"""

import os

from rollouts_jax.training.config import apply_smoke, load_config_file, parse_config_arg


def parse_arm(arg, arms):
  """The arm and the smoke flag of a study config's argument (`"g2_median,smoke"`).

  Args:
    arg: comma-separated words: at most one arm name and optionally "smoke"; None or empty
      (or "smoke" alone) means the first arm.
    arms: the study's arm names (an ordered mapping or sequence; the first is the default).

  Returns:
    (arm name, smoke: bool).

  Raises:
    ValueError: an unknown word, or more than one arm.

  >>> parse_arm("b,smoke", ("a", "b"))
  ('b', True)
  >>> parse_arm(None, ("a", "b"))
  ('a', False)
  >>> parse_arm("a,b", ("a", "b"))
  Traceback (most recent call last):
  ...
  ValueError: Name one arm; arms: a, b.
  """
  names = tuple(arms)
  words = parse_config_arg(arg or names[0], allowed=names + ("smoke",))
  chosen = [w for w in words if w != "smoke"] or [names[0]]
  if len(chosen) != 1:
    raise ValueError(f"Name one arm; arms: {', '.join(names)}.")
  return chosen[0], "smoke" in words


def get_config(arg=None):
  smoke = "smoke" in parse_config_arg(arg)
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), "smoke" if smoke else None)
  config.control.prompts_per_step = 8
  config.rl.steps = 80
  config.eval.num_examples = 200
  config.checkpoint.every = 10
  if smoke:
    apply_smoke(config)
  return config

