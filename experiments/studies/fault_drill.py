r"""Fault drill: kill a training run with SIGKILL at random moments, resume it, compare the result.

  python -m experiments.studies.fault_drill --kills=5 --steps=6
  python -m experiments.studies.fault_drill --kills=3 --steps=4 -- --config.rl.num_samples=4

Runs `experiments.launch.train` on `configs/default.py:smoke` (`--config.rl.steps=<steps>`, one
checkpoint per step) twice, in fresh folders: once uninterrupted (the reference, which also
gives the run's duration T), then again, killing the whole process group with SIGKILL and restarting it with the same
command, `kills` times, before letting it finish. Kills land in turn at a random time in
[min_delay_s, T] (data preparation, the SFT warm start, compilation, evaluation, a step), while
a checkpoint is being written, and at a random moment within 2 s after a checkpoint appeared
(a rollout or an update of the next step). The drill then compares the
final checkpoints' arrays (params, optimizer state, step) bit for bit and checks that the
metrics log has the rows of the uninterrupted run (no step repeated by a resume).

Prints `kills survived / kills tried: S/K` (a kill is survived when the next start resumes
without an error; kills that would land after the run already finished are not tried) and
whether the final state equals the uninterrupted run's. Exit status 0 only when every kill was
survived and the states are equal.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from experiments.studies import harness

REPO = harness.REPO


def _command(workdir: pathlib.Path, steps: int, extra: list[str]) -> list[str]:
  return harness.launch_command("train", f"--config={REPO / 'configs' / 'default.py'}:smoke", f"--workdir={workdir}",
                                f"--config.rl.steps={steps}", "--progress=false", *extra)


def _env(cache: pathlib.Path) -> dict:
  env = dict(os.environ)
  env["ROLLOUTS_JAX_CACHE"] = str(cache)  # the warm start and TFDS files are built inside the drill
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
  return env


def _start(cmd, env, log_path: pathlib.Path) -> subprocess.Popen:
  log = open(log_path, "w")  # pylint: disable=consider-using-with
  return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)


def _tail(path: pathlib.Path, n: int = 15) -> str:
  lines = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith(("I1", "W1"))]
  return "\n".join(lines[-n:])


#: Where kills land, in turn: at a random time; while a checkpoint is being written (orbax's
#: temporary folder exists, or the step exists without its checksums yet); at a random moment
#: of the step after a checkpoint appeared.
KILL_POINTS = ("random_time", "during_checkpoint_write", "after_checkpoint")


def _steps(folder: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in folder.glob("[0-9]*") if p.name.isdigit()) if folder.is_dir() else []


def _writing(folder: pathlib.Path) -> bool:
  if not folder.is_dir():
    return False
  for p in folder.iterdir():
    if ".orbax-checkpoint-tmp" in p.name or (p.name.isdigit() and not (p / "checksums.json").exists()):
      return True
  return False


def _run_until_kill(proc, kind, ckpt_dir: pathlib.Path, rng, args, ref_seconds):
  """Returns (exit code, None) if the run ended by itself, else (None, where it was killed)."""
  start, t0 = set(_steps(ckpt_dir)), time.monotonic()
  deadline = t0 + args.run_timeout_s
  delay = rng.uniform(args.min_delay_s, max(args.min_delay_s + 1.0, ref_seconds))
  kill_at = t0 + delay if kind == "random_time" else None
  where = f"after {delay:.1f} s" if kind == "random_time" else ""
  while time.monotonic() < deadline:
    rc = proc.poll()
    if rc is not None:
      return rc, None
    now = time.monotonic()
    if kind == "during_checkpoint_write" and _writing(ckpt_dir):
      where = f"while a checkpoint was being written ({now - t0:.1f} s)"
      break
    if kind == "after_checkpoint" and kill_at is None and set(_steps(ckpt_dir)) - start:
      kill_at = now + rng.uniform(0.0, 2.0)
      where = f"{kill_at - now:.2f} s after checkpoint {max(_steps(ckpt_dir))} appeared"
    if kill_at is not None and now >= kill_at:
      break
    time.sleep(0.002)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  return None, where


def _final_state(workdir: pathlib.Path):
  from rollouts_jax.io.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(workdir / "checkpoints", save_every=1) as ckpt:
    return ckpt.read()


def _compare(ref, got) -> list[str]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  a, _ = jax.tree_util.tree_flatten_with_path(ref)
  b, _ = jax.tree_util.tree_flatten_with_path(got)
  if [p for p, _ in a] != [p for p, _ in b]:
    return ["the two final states have different structures"]
  diffs = []
  for (path, x), (_, y) in zip(a, b):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      diffs.append(jax.tree_util.keystr(path, simple=True, separator="/"))
  return diffs


def _metric_steps(workdir: pathlib.Path) -> list[int]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  steps = []
  for line in path.read_text().splitlines():
    try:
      steps.append(int(json.loads(line)["step"]))
    except (ValueError, KeyError, TypeError):
      continue
  return steps


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kills", type=int, default=5)
  parser.add_argument("--steps", type=int, default=6, help="RL steps of the smoke run")
  parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
  parser.add_argument("--min_delay_s", type=float, default=3.0)
  parser.add_argument("--run_timeout_s", type=float, default=900.0)
  parser.add_argument("--root", default="", help="folder for the runs (default: a temporary one, removed)")
  parser.add_argument("extra", nargs="*", help="more flags for train.py (after --)")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root) if args.root else pathlib.Path(tempfile.mkdtemp(prefix="fault_drill_"))
  root.mkdir(parents=True, exist_ok=True)
  rng = random.Random(args.seed)

  # 1. The uninterrupted reference.
  ref_dir = root / "reference"
  t0 = time.monotonic()
  proc = _start(_command(ref_dir, args.steps, args.extra), _env(root / "cache-reference"), root / "reference.log")
  rc = proc.wait(timeout=args.run_timeout_s)
  ref_seconds = time.monotonic() - t0
  if rc != 0:
    print(f"The uninterrupted run failed (exit {rc}):\n{_tail(root / 'reference.log')}")
    return 2
  print(f"uninterrupted run: {ref_seconds:.1f} s, {args.steps} steps")

  # 2. The same run, killed and restarted.
  drill_dir, env = root / "drill", _env(root / "cache-drill")
  cmd = _command(drill_dir, args.steps, args.extra)
  tried, survived, attempt, finished = 0, 0, 0, False
  pending_kill = False  # a kill happened; the next start must resume without an error
  while tried < args.kills and not finished:
    attempt += 1
    kind = KILL_POINTS[(attempt - 1) % len(KILL_POINTS)]
    log = root / f"drill-{attempt}.log"
    proc = _start(cmd, env, log)
    rc, where = _run_until_kill(proc, kind, drill_dir / "checkpoints", rng, args, ref_seconds)
    if rc is None:  # killed
      if pending_kill:
        survived += 1  # the previous kill's restart ran until this kill without an error
      tried += 1
      pending_kill = True
      print(f"kill {tried}: SIGKILL {where} (steps on disk: {_steps(drill_dir / 'checkpoints')})", flush=True)
      continue
    if rc != 0:
      print(f"start {attempt} failed after a kill (exit {rc}):\n{_tail(log)}")
      pending_kill = False
      break
    if pending_kill:
      survived += 1
      pending_kill = False
    finished = True
  if not finished:  # let it finish
    attempt += 1
    log = root / f"drill-{attempt}.log"
    rc = _start(cmd, env, log).wait(timeout=args.run_timeout_s)
    if rc == 0 and pending_kill:
      survived += 1
    elif rc != 0:
      print(f"the final resume failed (exit {rc}):\n{_tail(log)}")

  # 3. Compare.
  equal, detail = False, "no final checkpoint"
  try:
    ref_state, _, ref_step = _final_state(ref_dir)
    got_state, _, got_step = _final_state(drill_dir)
    diffs = _compare(ref_state, got_state)
    equal = not diffs and ref_step == got_step
    import jax  # pylint: disable=g-import-not-at-top
    n = len(jax.tree_util.tree_leaves(ref_state))
    detail = (f"bitwise, {n} arrays, step {got_step}" if equal else
              f"step {ref_step} vs {got_step}; differing: {', '.join(diffs[:8])}")
  except Exception as e:  # pylint: disable=broad-except
    detail = f"{type(e).__name__}: {e}"
  rows_equal = collections.Counter(_metric_steps(drill_dir)) == collections.Counter(_metric_steps(ref_dir))
  print(f"kills survived / kills tried: {survived}/{tried}")
  print(f"final state equal to the uninterrupted run: {'yes' if equal else 'NO'} ({detail})")
  print(f"metrics.jsonl rows per step as in the uninterrupted run: {'yes' if rows_equal else 'no'}")
  if not args.root:
    shutil.rmtree(root, ignore_errors=True)
  else:
    print(f"runs and logs kept in {root}")
  return 0 if equal and survived == tried and tried > 0 else 1


if __name__ == "__main__":
  sys.exit(main())
