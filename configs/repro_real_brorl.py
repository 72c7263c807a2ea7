r"""Reproduction study `real_brorl`: the arms of `configs/repro_brorl.py` on SmolLM2-135M-Instruct.

The base is `configs/repro_real_base.py` (chat addition, temperature 0.7); BroRL's arms take 2
prompts a step with N = 8, 32 or 128 samples each for 24 steps, and N = 8 for 96 steps (4x the
updates).

  python -m experiments.launch.train --config=configs/repro_real_brorl.py:n128 --workdir=/tmp/real_brorl
"""

import os
import runpy

_BASE = runpy.run_path(os.path.join(os.path.dirname(__file__), "repro_real_base.py"))


def get_config(arg=None):
  return _BASE["study_config"]("brorl", arg)
