r"""Reproduction study `sol_rl` (Sol-RL, arXiv 2604.06916): FP4 exploration, full-precision training.

Arms, on the miniature of `configs/repro_base.py` (8 completions a prompt trained on):

  full       8 full-precision samples a prompt, all trained on
  fp4_subset an NVFP4 copy of the policy samples 16 a prompt; the 4 best and 4 worst are
             trained on (log-probs recomputed in full precision)
  fp4_naive  8 NVFP4 samples a prompt, all trained on (no pool, no selection)
  mxfp4_naive  8 MXFP4 samples a prompt, all trained on

  python -m experiments.launch.train --config=configs/repro_sol_rl.py:fp4_subset --workdir=/tmp/repro_sol
"""

import os
import runpy

from rollouts_jax.training.config import apply_smoke

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_base.py"))


def _arm(fp4, pool):
  def edit(config):
    config.rollout.num_samples = 8
    if fp4:
      config.rollout.generator = "sol_rl"
      config.rollout.generator_kwargs = f"fmt={fp4},pool={pool},subset=contrastive"
  return edit


ARMS = {"full": _arm("", 0), "fp4_subset": _arm("nvfp4", 16), "fp4_naive": _arm("nvfp4", 0),
        "mxfp4_naive": _arm("mxfp4", 0)}


def get_config(arg=None):
  arm, smoke = _BASE["parse_arm"](arg, ARMS)
  config = _BASE["get_config"]("smoke" if smoke else None)
  ARMS[arm](config)
  if smoke:
    apply_smoke(config)
    if "pool=16" in config.rollout.generator_kwargs:
      config.rollout.generator_kwargs = config.rollout.generator_kwargs.replace(
          "pool=16", f"pool={2 * config.rollout.num_samples}")
  return config
