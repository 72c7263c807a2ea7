r"""Builds (or reuses) the SFT warm start of a config, without RL.

  python -m experiments.launch.sft --config=configs/default.py
  python -m experiments.launch.sft --config=configs/countdown_grpo.py --config.sft.steps=2000

Prints the folder of the warm start (a Hugging Face checkpoint plus tokenizer) and its
held-out accuracy.
"""

import os

from absl import app, flags
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "..", "..", "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(FLAGS.config)
  train, test = loop.load_task(exp)
  cfg, params, tokenizer, folder = loop.warm_start(
      exp, train, log_fn=lambda step, m: print(f"sft step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in m.items())))
  print(f"warm start: {folder}")
  result = loop.evaluate(exp, cfg, params, tokenizer, list(test[:exp.eval.num_examples]))
  print(", ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
  app.run(main)
