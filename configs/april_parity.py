r"""APRIL learning parity (`experiments/studies/april_parity.py`): one arm per config argument.

Arms, on the miniature of `configs/repro_base.py` (arithmetic with 1- to 3-digit operands,
so completions have a length spread; 8 prompts a step x 8 samples, 80 steps), with no
dynamic sampling in either arm, so each step trains on 8 finished groups:

  sync   synchronous rollouts: every step samples 8 fresh groups and waits for the longest row
  april  APRIL partial rollouts (arXiv 2509.18521): every step requests ceil(8 * 1.5) = 12
         groups (stored unfinished groups first), stops decoding once 8 have finished, stores
         the other 4 to be resumed next step under the newer policy; stale tokens are weighted
         by the truncated importance ratio (rl.tis_cap = 2)

  python -m experiments.launch.train --config=configs/april_parity.py:april --workdir=/tmp/april_parity
"""

import os

from rollouts_jax.training.config import apply_smoke, load_config_file, parse_config_arg


def _sync(config):
  config.rollout.generator = "sample"


def _april(config):
  config.rollout.generator = "april"
  config.rollout.generator_kwargs = "over_provision=0.5"
  config.rl.tis_cap = 2.0


ARMS = {"sync": _sync, "april": _april}


def get_config(arg=None):
  words = parse_config_arg(arg or next(iter(ARMS)), allowed=tuple(ARMS) + ("smoke",))
  arms = [w for w in words if w != "smoke"] or [next(iter(ARMS))]
  if len(arms) != 1:
    raise ValueError(f"Name one arm; arms: {', '.join(ARMS)}.")
  smoke = "smoke" in words
  config = load_config_file(os.path.join(os.path.dirname(__file__), "repro_base.py"), "smoke" if smoke else None)
  config.control.dynamic_sampling = False   # equal finished groups per step in both arms
  ARMS[arms[0]](config)
  if smoke:
    apply_smoke(config)
  return config
