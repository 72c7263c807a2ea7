r"""Asynchronous vs synchronous RL steps on 8 host devices (4 rollout + 4 training), same run.

  python -m experiments.benchmarks.bench_async                     # default config, 4 + 4 CPU devices
  python -m experiments.benchmarks.bench_async --steps=8 --reps=3 --staleness=1,2

Each repetition runs the same short RL job (the default config's warm start and task) once
per arm, in alternating order, on a rollout mesh of 4 devices and a training mesh of 4 other
devices: `max_staleness=0` (the synchronous loop: generate, then update) and each staleness
bound in `--staleness` (a producer thread generates the next batches on the rollout mesh
while the trainer updates). From each run's per-step metrics, leaving out the first
`--warmup` steps (compilation):

  rollouts/s       rollouts trained per second of wall time (sum of rollouts / sum of step time)
  trainer busy     the share of step time the trainer spends in its update
  step s           median seconds per step

and the ratio of each async arm to the synchronous one (medians over repetitions), plus the
capacity model's prediction (ECHO-2, `rollout.source.capacity`) from the sync arm's
measured times. On a 2-core CPU the two meshes share the same cores, so the overlap can only
hide host-side work (scoring, batching, Python) and idle cores; it is a check of the machinery,
and the accelerator numbers are the real test. Timings taken while other processes use the CPU
are flagged (load average in the output).

Writes experiments/benchmarks/results/bench_async.json.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def arm_config(staleness: int, steps: int, smoke: bool):
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke" if smoke else None)
  c.rl.steps = steps
  c.eval.num_examples = 8
  c.eval.batch_size = 8
  c.checkpoint.every = 1000
  c.mesh.shape = (4, 1, 1)
  c.mesh.preset = "pure_dp"
  c.mesh.rollout_shape = (4, 1, 1)
  c.async_rl.max_staleness = staleness
  c.rl.tis_cap = 2.0
  c.rl.tis_mode = "mask"
  return config_lib.from_config_dict(c)


def measure(workdir: pathlib.Path, warmup: int) -> dict:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "loss" in r and r["step"] > warmup]
  total = sum(r["time/step"] for r in steps)
  return {"rollouts_per_s": sum(r["rollouts"] for r in steps) / total,
          "trainer_busy": sum(r["time/update"] for r in steps) / total,
          "step_s": statistics.median(r["time/step"] for r in steps),
          "update_s": statistics.median(r["time/update"] for r in steps),
          "sample_s": statistics.median(r["time/sample"] for r in steps),
          "staleness_max": max(r.get("async/staleness_max", 0.0) for r in steps),
          "capacity_idle_pred_s": statistics.median(r.get("async/capacity_learner_idle_s", 0.0) for r in steps),
          "steps": len(steps)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--staleness", default="1")
  parser.add_argument("--smoke", action="store_true", help="the tiny model (a check that it runs)")
  parser.add_argument("--out", default=str(REPO / "experiments" / "benchmarks" / "results" / "bench_async.json"))
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  from rollouts_jax.rollout import source as source_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, found {jax.device_count()}")
  arms = [0] + [int(s) for s in args.staleness.split(",") if s]
  load_start = os.getloadavg()
  if load_start[0] > 1.5:
    print(f"WARNING: load average {load_start[0]:.1f}: other processes use the CPU; timings are not clean.")
  per_arm = {a: [] for a in arms}
  root = pathlib.Path(tempfile.mkdtemp(prefix="bench_async_"))
  for rep in range(args.reps):
    order = arms if rep % 2 == 0 else arms[::-1]
    for a in order:
      workdir = root / f"s{a}_rep{rep}"
      t0 = time.perf_counter()
      loop.train(arm_config(a, args.steps, args.smoke), workdir, progress=False)
      m = measure(workdir, args.warmup)
      m["wall_s"] = time.perf_counter() - t0
      per_arm[a].append(m)
      print(f"rep {rep} staleness {a}: {m['rollouts_per_s']:.1f} rollouts/s, trainer busy {m['trainer_busy']:.2f}, "
            f"step {m['step_s']:.2f} s", flush=True)
  med = lambda a, k: statistics.median(m[k] for m in per_arm[a])
  sync = per_arm[0]
  B = arm_config(0, args.steps, args.smoke)
  batch_rollouts = B.control.prompts_per_step * B.rollout.num_samples
  cap = {s: source_lib.capacity(med(0, "update_s"), 0.0, batch_rollouts / med(0, "sample_s"), batch_rollouts, s,
                                producer_share=0.5).__dict__ for s in arms}
  out = {"devices": "8 host (CPU) devices: 4 rollout + 4 training", "steps": args.steps, "warmup": args.warmup,
         "reps": args.reps, "load_start": load_start, "load_end": os.getloadavg(), "smoke": args.smoke,
         "arms": {str(a): {"median": {k: med(a, k) for k in sync[0]}, "runs": per_arm[a]} for a in arms},
         "ratios_vs_sync": {str(a): {"rollouts_per_s": med(a, "rollouts_per_s") / med(0, "rollouts_per_s"),
                                     "trainer_busy": med(a, "trainer_busy") / med(0, "trainer_busy")}
                            for a in arms if a},
         "capacity_from_sync_times": cap}
  print(json.dumps({"ratios_vs_sync": out["ratios_vs_sync"],
                    "busy": {a: med(a, "trainer_busy") for a in arms},
                    "rollouts_per_s": {a: med(a, "rollouts_per_s") for a in arms},
                    "load": [load_start[0], out["load_end"][0]]}, indent=1))
  if not args.smoke:
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
