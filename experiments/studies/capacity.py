r"""Capacity of a disaggregated run (R rollout, T trainer workers): predicted step time, throughput, staleness.

  python -m experiments.studies.capacity --mode=cluster     # the 64 + 16 GPU, 7B example (no run)
  python -m experiments.studies.capacity --mode=measure --steps=8 --workdir=/tmp/capacity

The model (`training.disaggregated`'s lockstep schedule): a round moves the weights (handoff),
then generates one batch on R rollout workers while T trainers update on the batch S rounds older,
then moves the batch. Per step, with K tokens:

  gen = K c_sample / R,  train = K c_train / T,  comm = handoff + K c_move
  S = 0:  step = comm + gen + train          S >= 1:  step = comm + max(gen, train)

and every trained batch is exactly S versions old after the first S steps (`batch_version`).
ECHO-2's overlap model (`rollout.source.capacity`) gives the smallest S that hides generation.
`measure` calibrates c_sample, c_train and the communication from a local 1 + 1, S = 0 run,
predicts 1 + 1, 2 + 1 and 2 + 2 (S = 1; T = 2 trainers are data parallel), runs them, prints
predicted vs measured, and the 1 + 1 throughput against the one-process loop. Time it on a quiet
machine (other work skews it).
"""

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys

from absl import app, flags

from rollouts_jax.rollout import source as source_lib

flags.DEFINE_enum("mode", "cluster", ["cluster", "measure"], "cluster: the 7B example; measure: local runs.")
flags.DEFINE_string("config", "configs/default.py:smoke", "Config of the measured runs.")
flags.DEFINE_integer("steps", 8, "RL steps per measured run (the first two are dropped: compilation).")
flags.DEFINE_string("workdir", "/tmp/rollouts_capacity", "Where the measured runs write.")
FLAGS = flags.FLAGS
_REPO = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Costs:
  """Per-token costs of one worker (seconds) and the per-step weight hand-off."""
  sample_s: float        # generation (decode + scoring + control) per token, one rollout worker
  train_s: float         # update per token, one trainer worker
  handoff_s: float       # weights to the rollout workers, per step
  move_s: float = 0.0    # batch to the trainers, per token


def predict(c: Costs, tokens: float, rollouts: int, R: int, T: int, S: int) -> dict:
  gen, train = tokens * c.sample_s / R, tokens * c.train_s / T
  comm = c.handoff_s + tokens * c.move_s
  step = comm + gen + train if S == 0 else comm + max(gen, train)
  echo = source_lib.capacity(train_s=train, handoff_s=comm, rollouts_per_s=rollouts / gen,
                                 batch_rollouts=rollouts, staleness=max(S, 1))
  return {"R": R, "T": T, "S": S, "gen_s": gen, "train_s": train, "comm_s": comm, "step_s": step,
          "tokens_per_s": tokens / step, "staleness": S, "min_staleness_to_hide_gen": echo.min_staleness,
          "trainer_busy": train / step, "rollout_busy": gen / step}


def cluster_example() -> None:
  """64 rollout + 16 trainer H100s, a 7B policy. Assumptions (stated, not measured here):

  decode 2,500 tokens/s per GPU (batched, long completions); update 8N FLOPs/token (6N fwd+bwd,
  2N the old log-prob forward) at 40% of 989 TFLOP/s = 7,000 tokens/s per GPU; weights 14 GB (bf16)
  broadcast at 25 GB/s = 0.56 s; batches 4,096 rollouts x 1,024 tokens; batch move 12 bytes/token at 25 GB/s.
  """
  tokens, rollouts = 4096 * 1024, 4096
  c = Costs(sample_s=1 / 2500, train_s=1 / 7000, handoff_s=14e9 / 25e9, move_s=12 / 25e9)
  print(cluster_example.__doc__)
  print(f"{'R':>4} {'T':>4} {'S':>2} {'gen s':>7} {'train s':>8} {'step s':>7} {'tok/s':>9} {'ECHO-2 min S':>13} {'busy T':>7}")
  for R, T, S in ((64, 16, 0), (64, 16, 1), (64, 16, 2), (48, 32, 1), (56, 24, 1), (72, 8, 1)):
    p = predict(c, tokens, rollouts, R, T, S)
    print(f"{R:>4} {T:>4} {S:>2} {p['gen_s']:7.1f} {p['train_s']:8.1f} {p['step_s']:7.1f} {p['tokens_per_s']:9.0f} "
          f"{p['min_staleness_to_hide_gen']:>13} {p['trainer_busy']:7.2f}")


def _run(name: str, R: int, S: int, one_process: bool = False, T: int = 1) -> list[dict]:
  workdir = pathlib.Path(FLAGS.workdir) / name
  if workdir.exists():
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(workdir)
  over = [f"--config.rl.steps={FLAGS.steps}", f"--config.async_rl.max_staleness={S}", "--config.rl.tis_cap=2.0",
          "--config.checkpoint.every=0", "--config.eval.every=0"]
  if one_process:
    cmd = [sys.executable, "-m", "experiments.launch.train", f"--config={FLAGS.config}", f"--workdir={workdir}",
           "--progress=false", *over]
  else:
    cmd = [sys.executable, "-m", "experiments.launch.cluster", f"--config={FLAGS.config}", f"--workdir={workdir}",
           f"--num_rollout_processes={R}", f"--num_trainer_processes={T}", *over]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{name} failed: {out.stderr[-2000:]}")
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if "time/step" in r and r["step"] > 2]


def _med(rows, key, default=0.0):
  vals = [r[key] for r in rows if key in r]
  return statistics.median(vals) if vals else default


def measure() -> None:
  base = _run("one_process", 1, 0, one_process=True)
  sync = _run("r1_t1_s0", 1, 0)
  tokens, rollouts = _med(sync, "generated_tokens"), _med(sync, "rollouts")
  gen, train, step = _med(sync, "async/collect_s"), _med(sync, "time/update"), _med(sync, "time/step")
  c = Costs(sample_s=gen / tokens, train_s=train / tokens, handoff_s=max(0.0, step - gen - train))
  print(f"calibrated on 1+1, S=0: c_sample={c.sample_s * 1e6:.1f} us/token, c_train={c.train_s * 1e6:.1f} us/token, "
        f"comm={c.handoff_s * 1e3:.1f} ms/step ({tokens:.0f} tokens/step)")
  print(f"{'run':>12} {'pred step s':>12} {'meas step s':>12} {'pred tok/s':>11} {'meas tok/s':>11} {'gap':>4}")
  for name, R, T, S in (("r1_t1_s0", 1, 1, 0), ("r1_t1_s1", 1, 1, 1), ("r2_t1_s1", 2, 1, 1), ("r2_t2_s1", 2, 2, 1)):
    rows = sync if name == "r1_t1_s0" else _run(name, R, S, T=T)
    p = predict(c, tokens, rollouts, R, T, S)
    meas = _med(rows, "time/step")
    print(f"{name:>12} {p['step_s']:12.3f} {meas:12.3f} {p['tokens_per_s']:11.0f} "
          f"{_med(rows, 'generated_tokens') / meas:11.0f} {_med(rows, 'disagg/version_gap'):4.0f}")
  one = _med(base, "time/step")
  print(f"one process: {one:.3f} s/step, {_med(base, 'generated_tokens') / one:.0f} tokens/s; "
        f"1+1 (S=0) / one process throughput = {one / step:.3f}; where 1+1's step goes: generate {gen:.3f} s, "
        f"update {train:.3f} s, transfers and waits {step - gen - train:.3f} s")


def main(argv):
  del argv
  cluster_example() if FLAGS.mode == "cluster" else measure()


if __name__ == "__main__":
  app.run(main)
