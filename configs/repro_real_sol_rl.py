r"""Reproduction study `real_sol_rl`: the arms of `configs/repro_sol_rl.py` on SmolLM2-135M-Instruct.

The base is `configs/repro_real_base.py` (chat addition, temperature 0.7, 24 steps of 8 prompts).

  python -m experiments.launch.train --config=configs/repro_real_sol_rl.py:ARM --workdir=/tmp/real_sol_rl
"""

import os
import runpy

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_real_base.py"))


def get_config(arg=None):
  return _BASE["study_config"]("sol_rl", arg)
