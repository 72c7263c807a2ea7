r"""Launches a disaggregated RL run: rollout processes apart from trainer processes (`training.disaggregated`).

A whole local cluster from one command (one CPU device per process, gloo collectives):

  python -m experiments.launch.cluster --config=configs/default.py:smoke --workdir=/tmp/cluster \
      --num_rollout_processes=2 --num_trainer_processes=1 --config.async_rl.max_staleness=1 \
      --config.rl.tis_cap=2.0 --config.rl.steps=4

One process of a real cluster (the same flags on every host, its own --process_id):

  python -m experiments.launch.cluster --config=... --workdir=/shared/run \
      --num_rollout_processes=64 --num_trainer_processes=1 \
      --coordinator_address=host0:12345 --process_id=$RANK

Processes 0 .. T-1 train, T .. T+R-1 roll out. With T > 1 the trainers are data parallel (each
batch's groups split between them; T must divide control.prompts_per_step), e.g. 2 + 2:

  python -m experiments.launch.cluster --config=configs/default.py:smoke --workdir=/tmp/cluster22 \
      --num_rollout_processes=2 --num_trainer_processes=2 --config.async_rl.max_staleness=1 \
      --config.rl.tis_cap=2.0 --config.rl.steps=4

The local launcher supervises its processes: when one dies (or is killed) it stops the others
and, with --max_restarts > 0, starts the cluster again, which resumes from the last checkpoint.
Named errors: the coordinator's port in
use (CoordinatorAddressInUseError), a process that never joins within --join_timeout_s
(ProcessNeverJoinedError), different configs across processes (ConfigMismatchAcrossProcessesError).
Each process's output goes to <workdir>/logs/process_<id>.attempt<k>.log.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.abspath(os.path.join(_HERE, "..", ".."))
config_flags.DEFINE_config_file("config", os.path.join(_REPO, "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Output folder (checkpoints, metrics, logs); resumes if it exists.")
flags.DEFINE_integer("num_rollout_processes", 1, "R: processes that run the rollout pipeline.")
flags.DEFINE_integer("num_trainer_processes", 1, "T: processes that run the update (process ids 0 .. T-1).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (a real cluster; local: a free port).")
flags.DEFINE_integer("process_id", None, "This process's id in a real cluster; unset: launch a local cluster.")
flags.DEFINE_integer("join_timeout_s", 120, "Seconds every process has to join the runtime.")
flags.DEFINE_integer("heartbeat_timeout_s", 30, "Seconds without a heartbeat before JAX declares a process dead.")
flags.DEFINE_integer("max_restarts", 0, "Local cluster: restarts from the last checkpoint after a process fails.")
flags.DEFINE_string("fault_kill", "", "Fault drill: 'PROCESS:STEP' makes that process SIGKILL itself when its round "
                    "STEP begins; 'PROCESS:STEP:update' (a trainer) in the middle of step STEP, after its update "
                    "and metrics row, before its checkpoint (local cluster: in the first attempt only).")
flags.DEFINE_string("skip_process_ids", "", "Testing: comma-separated process ids the local launcher never starts.")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS

_LAUNCHER_ONLY = ("max_restarts", "fault_kill", "skip_process_ids")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _child_argv(argv, process_id: int, address: str, fault: str) -> list[str]:
  keep = [a for a in argv[1:] if not any(a.startswith(f"--{k}") for k in _LAUNCHER_ONLY + ("process_id",
                                                                                             "coordinator_address"))]
  return [sys.executable, "-u", "-m", "experiments.launch.cluster", *keep, f"--process_id={process_id}",
          f"--coordinator_address={address}"] + ([f"--fault_kill={fault}"] if fault else [])


def _stop(procs) -> None:
  for p in procs:
    if p is not None and p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.time() + 10
  for p in procs:
    if p is None:
      continue
    try:
      p.wait(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _attempt(argv, workdir: pathlib.Path, attempt: int, num: int) -> tuple[bool, str]:
  """One start of the local cluster; (finished, why not)."""
  from rollouts_jax.training import disaggregated  # pylint: disable=g-import-not-at-top
  address = f"localhost:{_free_port()}"
  logs = workdir / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  skip = {int(x) for x in FLAGS.skip_process_ids.split(",") if x.strip()}
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS") or "cpu", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep))
  paths = [logs / f"process_{i}.attempt{attempt}.log" for i in range(num)]
  procs = []
  for i in range(num):
    if i in skip:
      procs.append(None)
      continue
    with open(paths[i], "w") as out:
      procs.append(subprocess.Popen(_child_argv(argv, i, address, FLAGS.fault_kill if attempt == 0 else ""),
                                    cwd=_REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
  try:
    while True:
      codes = [None if p is None else p.poll() for p in procs]
      live = [p for p in procs if p is not None]
      if all(p.poll() == 0 for p in live) and not skip:
        return True, ""
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed or (skip and all(p.poll() is not None for p in live)):
        break
      time.sleep(0.2)
  finally:
    _stop(procs)
  texts = [paths[i].read_text(errors="replace") if procs[i] is not None else "" for i in range(num)]
  for t in texts:
    if "CoordinatorAddressInUseError" in t:
      raise disaggregated.CoordinatorAddressInUseError(98, t[t.index("CoordinatorAddressInUseError"):].split("\n")[0])
    if "ConfigMismatchAcrossProcessesError" in t:
      raise disaggregated.ConfigMismatchAcrossProcessesError(
          t[t.index("ConfigMismatchAcrossProcessesError"):].split("\n")[0])
  unjoined = [i for i, t in enumerate(texts) if disaggregated.JOINED_MARK not in t]
  # Waiting processes called jax.distributed.initialize (JAX logs "Connecting to ..."); the missing ones never did.
  missing = [i for i in unjoined if "Connecting to JAX distributed service" not in texts[i]] or unjoined
  timed_out = any("RegisterTask" in t or "DEADLINE_EXCEEDED" in t for t in texts)
  if missing and (skip or timed_out):
    raise disaggregated.ProcessNeverJoinedError(
        f"Process(es) {missing} did not join the runtime at {address} within --join_timeout_s="
        f"{FLAGS.join_timeout_s}; the cluster was stopped (logs: {logs}).")
  failed = [i for i in range(num) if procs[i].returncode not in (0, None)]
  first = min(failed, key=lambda i: os.path.getmtime(paths[i])) if failed else None
  tail = texts[first].strip().splitlines()[-1:] if first is not None else []
  return False, f"process {first} exited with code {procs[first].returncode}: {' '.join(tail)[:300]} (log: {paths[first]})"


def _local(argv) -> None:
  workdir = pathlib.Path(FLAGS.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  num = FLAGS.num_rollout_processes + FLAGS.num_trainer_processes
  for attempt in range(FLAGS.max_restarts + 1):
    ok, why = _attempt(sys.argv, workdir, attempt, num)
    if ok:
      summary = workdir / "summary.json"
      print(f"Cluster of {FLAGS.num_trainer_processes} trainer + {FLAGS.num_rollout_processes} rollout processes "
            f"finished; {summary}", flush=True)
      return
    print(f"Attempt {attempt}: {why}; the cluster was stopped.", flush=True)
    if attempt < FLAGS.max_restarts:
      print(f"Restarting from the last checkpoint ({attempt + 1}/{FLAGS.max_restarts}).", flush=True)
  raise SystemExit(f"The cluster failed: {why} (--max_restarts={FLAGS.max_restarts} exhausted).")


def _process() -> None:
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import disaggregated  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(FLAGS.config)   # unknown keys fail before the runtime is joined
  num = FLAGS.num_rollout_processes + FLAGS.num_trainer_processes
  if FLAGS.coordinator_address is None:
    raise app.UsageError("--process_id needs --coordinator_address.")
  kill = kill_update = None
  if FLAGS.fault_kill:
    parts = FLAGS.fault_kill.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "update"):
      raise app.UsageError(f"--fault_kill={FLAGS.fault_kill!r}: expected 'PROCESS:STEP' or 'PROCESS:STEP:update'.")
    if int(parts[0]) == FLAGS.process_id:
      if len(parts) == 3:
        kill_update = int(parts[1])
      else:
        kill = int(parts[1])
  disaggregated.join(FLAGS.coordinator_address, num, FLAGS.process_id, join_timeout_s=FLAGS.join_timeout_s,
                     heartbeat_timeout_s=FLAGS.heartbeat_timeout_s)
  out = disaggregated.train(exp, FLAGS.workdir, num_trainers=FLAGS.num_trainer_processes, kill_at_round=kill,
                            kill_in_update=kill_update)
  if "after" in out:
    print("after RL: " + ", ".join(f"{k}={v:.3f}" for k, v in out["after"].items()), flush=True)
  print(f"DISAGG_DONE {FLAGS.process_id}", flush=True)
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.shutdown()


def main(argv):
  if FLAGS.process_id is None:
    _local(argv)
  else:
    _process()


if __name__ == "__main__":
  app.run(main)
