r"""The embedded default (SFT warm start on 3-digit addition, then GRPO) with LoRA: only adapters train.

  python -m experiments.launch.train --config=configs/lora.py --workdir=/tmp/rollouts_lora
  python -m experiments.launch.train --config=configs/lora.py:smoke --workdir=/tmp/lora_smoke

`configs/default.py` with rank-8 adapters (alpha 16, scale 2) on every projection of the policy
(q, k, v, o, gate, up, down); the embedding and the norms stay at the warm start. The optimizer
state holds the adapters alone and checkpoints hold adapters + optimizer state (the warm start is
rebuilt from its cache on resume). The learning rate is 10x the full fine-tuning one, the ratio
"LoRA Without Regret" (Schulman et al., Thinking Machines 2025) finds best for LoRA.
`python -m experiments.launch.evaluate --workdir=/tmp/rollouts_lora --export_hf=/tmp/lora_hf` writes the
merged policy (and the adapters alone under lora_adapter/).
"""

import os

from rollouts_jax.training.config import load_config_file


def get_config(arg=None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "default.py"), arg)
  config.lora.rank = 8
  config.lora.alpha = 16.0
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.rl.learning_rate = 1.5e-3   # default.py's 1.5e-4 x 10
  return config
