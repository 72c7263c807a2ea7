r"""Launches an RL experiment (SFT warm start if configured, then the RL loop).

  python -m experiments.launch.train --config=configs/default.py --workdir=/tmp/rollouts_default
  python -m experiments.launch.train --config=configs/default.py:smoke --workdir=/tmp/smoke \
      --config.rl.steps=3

Re-running with the same --workdir resumes from the last checkpoint. Before any work the
workdir is locked (a second training process on it is refused) and tied to its config: a
rerun whose settings change results (task, model, learning rate ...) is refused with the
differing keys named, unless --allow_config_change. Ctrl-C stops at the next safe point
(never inside XLA or a checkpoint write) with one line; a second Ctrl-C exits at once.
"""

import dataclasses
import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rollouts_jax import sharding
from rollouts_jax.io import interrupts

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "..", "..", "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Output folder (checkpoints, metrics, plots); resumes if it exists.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.DEFINE_bool("allow_config_change", False,
                  "Continue a workdir whose saved config differs in settings that change results "
                  "(the old config.json is kept as config.<time>.json).")
flags.mark_flag_as_required("workdir")
sharding.define_distributed_flags()
FLAGS = flags.FLAGS


def _latest_checkpoint(workdir) -> str:
  folder = pathlib.Path(workdir) / "checkpoints"
  steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
  return f"step {steps[-1]}" if steps else "the start (no checkpoint yet)"


def _exit_interrupted(workdir, message: str | None = None, code: int = 130) -> None:
  """One line, then exit `code` without interpreter teardown (XLA and orbax threads may still run)."""
  print(message or f"Interrupted: {workdir} resumes from {_latest_checkpoint(workdir)} when run again.",
        file=sys.stderr)
  try:
    from rollouts_jax import rewards  # pylint: disable=g-import-not-at-top
    rewards.shutdown_default_pools()
  except BaseException:  # pylint: disable=broad-except
    pass
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  interrupts.install()
  try:
    _run()
  except KeyboardInterrupt:
    _exit_interrupted(FLAGS.workdir)
  except OSError as e:
    from rollouts_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
    if not isinstance(e, checkpoint.CheckpointDiskFullError):
      raise
    _exit_interrupted(FLAGS.workdir, f"Stopped: {e.strerror}", code=1)


def _run():
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(FLAGS.config)  # fails on unknown keys before anything compiles
  sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                  auto=FLAGS.distributed_auto)
  import jax  # pylint: disable=g-import-not-at-top
  primary = jax.process_index() == 0
  lock = None
  try:  # before any work: one process per workdir, and the workdir's own config
    lock = workdir_lib.lock_workdir(FLAGS.workdir) if primary else None
    claimed = workdir_lib.check_workdir_config(FLAGS.workdir, dataclasses.asdict(exp),
                                               allow_change=FLAGS.allow_config_change, write=primary)
  except (workdir_lib.WorkdirLockedError, workdir_lib.ConfigMismatchError) as e:
    print(f"Refused: {e}", file=sys.stderr)
    sys.exit(2)
  if claimed["changes"]:
    logging.warning("Config changed with --allow_config_change: %s", "; ".join(claimed["changes"]))
  try:
    from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
    logging.info("JAX %s, process %d/%d, devices: %s", jax.__version__, jax.process_index(),
                 jax.process_count(), jax.devices())
    summary = loop.train(exp, FLAGS.workdir, progress=FLAGS.progress)
  finally:
    if lock is not None:
      lock.release()
  for phase in ("before", "after"):
    if phase in summary:
      print(f"{phase} RL: " + ", ".join(f"{k}={v:.3f}" for k, v in summary[phase].items()))


if __name__ == "__main__":
  app.run(main)
