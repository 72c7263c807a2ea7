r"""GRPO with LoRA on the real model: `configs/smollm2_addition.py` (SmolLM2-135M-Instruct on chat
addition) training rank-16 adapters on every projection instead of all 135M parameters.

  python -m experiments.launch.train --config=configs/smollm2_lora.py --workdir=/tmp/smollm2_lora
  python -m experiments.launch.train --config=configs/smollm2_lora.py:smoke --workdir=/tmp/smollm2_lora_smoke

The adapters (rank 16, alpha 32: scale 2; 4.9M parameters over the 30 layers' q, k, v, o, gate, up
and down) are the only trained parameters: the optimizer state is ~4% of full fine-tuning's and a
checkpoint holds adapters + optimizer state (~60 MB instead of ~1.6 GB; the base reloads from the
GGUF file). The learning rate is 10x smollm2_addition's (the LoRA / full ratio of "LoRA Without
Regret", Schulman et al., Thinking Machines 2025). `experiments/benchmarks/bench_lora.py` measures the
optimizer-state bytes and the update's step time against full fine-tuning on this model.
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "smollm2_addition.py"), arg)
  config.lora.rank = 16
  config.lora.alpha = 32.0
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.rl.learning_rate = 1e-4   # smollm2_addition.py's 1e-5 x 10
  return config
