r"""Launches an RL experiment (SFT warm start if configured, then the RL loop).

  python experiments/train.py --config=configs/default.py --workdir=/tmp/rollouts_default
  python experiments/train.py --config=configs/default.py:smoke --workdir=/tmp/smoke \
      --config.rl.steps=3

Re-running with the same --workdir resumes from the last checkpoint.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from rollouts_jax import sharding

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "..", "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Output folder (checkpoints, metrics, plots); resumes if it exists.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.mark_flag_as_required("workdir")
sharding.define_distributed_flags()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(FLAGS.config)  # fails on unknown keys before anything compiles
  sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                  auto=FLAGS.distributed_auto)
  import jax  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  logging.info("JAX %s, process %d/%d, devices: %s", jax.__version__, jax.process_index(), jax.process_count(),
               jax.devices())
  summary = loop.train(exp, FLAGS.workdir, progress=FLAGS.progress)
  for phase in ("before", "after"):
    if phase in summary:
      print(f"{phase} RL: " + ", ".join(f"{k}={v:.3f}" for k, v in summary[phase].items()))


if __name__ == "__main__":
  app.run(main)
