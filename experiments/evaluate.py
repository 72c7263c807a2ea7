r"""Evaluates a policy on a test split: pass@1, pass@k (unbiased estimator), maj@k, greedy accuracy.

  # the final policy of a training run (its config and latest intact checkpoint):
  python experiments/evaluate.py --workdir=/tmp/rollouts_default
  # a Hugging Face checkpoint folder on a benchmark:
  python experiments/evaluate.py --config=configs/gsm8k_qwen.py:/path/to/ckpt --config.eval.k=8

Params holding NaN or inf are refused (exit status 2) instead of being scored; a damaged
latest checkpoint is skipped for the newest intact one. Ctrl-C exits cleanly (status 130).
"""

import dataclasses
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from rollouts_jax.training import interrupts

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "..", "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "A training workdir: evaluates its latest checkpoint with its config.")
flags.DEFINE_integer("num_examples", 0, "Override eval.num_examples (0: keep).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  interrupts.install()
  try:
    _run()
  except KeyboardInterrupt:
    print("Interrupted: evaluation stopped.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)  # no interpreter teardown while XLA threads may still run


def _run():
  from rollouts_jax.training import checkpoint  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  if FLAGS.workdir:
    with open(os.path.join(FLAGS.workdir, "config.json")) as f:
      exp = config_lib.from_config_dict(json.load(f))
  else:
    exp = config_lib.from_config_dict(FLAGS.config)
  if FLAGS.num_examples:
    exp = dataclasses.replace(exp, eval=dataclasses.replace(exp.eval, num_examples=FLAGS.num_examples))
  train, test = loop.load_task(exp)
  cfg, params, tokenizer = loop.load_policy(exp, train)
  where = "the initial policy"
  try:
    if FLAGS.workdir:
      where = f"the latest intact checkpoint of {FLAGS.workdir}"
      params = loop.latest_params(exp, FLAGS.workdir, params)
    checkpoint.check_finite(params, f"The params of {where}")
  except (checkpoint.NonFiniteStateError, checkpoint.CheckpointDamagedError) as e:
    print(f"Refused to evaluate: {e}", file=sys.stderr)
    sys.exit(2)
  result = loop.evaluate(exp, cfg, params, tokenizer, list(test[:exp.eval.num_examples]))
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
