r"""Does bounded-staleness asynchronous RL learn like the synchronous loop? (AReaL's claim, in miniature.)

  python -m experiments.studies.async_study --seeds=3
  python -m experiments.studies.async_study --report_only

Arms, each the reproduction miniature (`configs/repro_base.py`: arithmetic, 8 prompts x 8
samples a step, 80 steps, 200 held-out prompts) with:

  sync          max_staleness 0 (the synchronous loop)
  s1            max_staleness 1, proximal policy = params before the update, masked behaviour
                weight (cap 2)  -- AReaL's decoupled PPO
  s2            max_staleness 2, the same
  s2_snapshot   max_staleness 2, the ratio against the exact generating version's params
  s2_ewma       max_staleness 2, the ratio against a moving average of the params (beta 0.7)

Every seed of every arm starts from one SFT warm start (seed 0's), so seeds differ only in
the RL run. Runs go one at a time through `experiments.launch.train` (`harness`), seed-major, each in its own
workdir; a run with a `result.json` is reused and a killed one resumes from its checkpoint.
Writes `experiments/studies/results/async_study.{json,md,png}`: per arm, held-out pass@1 after RL and its
gain, the training reward of the last 10 steps, the mean staleness and the trainer's busy
fraction (mean +- sample sd over seeds), and the reward curves.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

from experiments.studies import harness, reproduce

CONFIG = "configs/repro_base.py"
ARMS = {
    "sync": [],
    "s1": ["async_rl.max_staleness=1", "rl.tis_cap=2.0", "rl.tis_mode=mask"],
    "s2": ["async_rl.max_staleness=2", "rl.tis_cap=2.0", "rl.tis_mode=mask"],
    "s2_snapshot": ["async_rl.max_staleness=2", "async_rl.old_logprobs=snapshot", "rl.tis_cap=2.0",
                    "rl.tis_mode=mask"],
    "s2_ewma": ["async_rl.max_staleness=2", "async_rl.old_logprobs=ewma", "rl.tis_cap=2.0", "rl.tis_mode=mask"],
}
COLUMNS = {"pass@1 after": "eval/pass@1 after", "pass@1 gain": "eval/pass@1 gain",
           "train reward, last 10": "reward_last10", "staleness": "staleness_mean",
           "trainer busy": "trainer_busy", "s/step": "step_s"}


def run_metrics(workdir: pathlib.Path) -> dict:
  """`reproduce.run_result` plus the async loop's means and the reward curve."""
  out = reproduce.run_result(workdir)
  steps = harness.read_steps(workdir)
  mean = lambda key, default: sum(r.get(key, default) for r in steps) / max(len(steps), 1)
  out["staleness_mean"] = mean("async/staleness_mean", 0.0)
  out["trainer_busy"] = sum(r["time/update"] for r in steps) / max(sum(r["time/step"] for r in steps), 1e-9)
  out["step_s"] = sorted(r["time/step"] for r in steps)[len(steps) // 2] if steps else None
  out["reward_curve"] = [r["reward_mean"] for r in steps]
  return out


def summarize(results: list[dict]) -> dict:
  """{arm: {column: mean_spread + values}, "curve": mean reward per step} for arms with runs."""
  table = harness.aggregate(results, ARMS, COLUMNS)
  for arm, row in table.items():
    curves = [r["reward_curve"] for r in sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])]
    length = min(len(c) for c in curves)
    row["curve"] = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
  return table


def verdict(table: dict) -> str:
  """Each async arm's pass@1 after RL against sync's, in standard errors of the difference."""
  if "sync" not in table:
    return "no synchronous runs"
  parts = []
  for arm in table:
    if arm == "sync":
      continue
    d, se = harness.diff(table, arm, "sync", "pass@1 after")
    if d is None:
      continue
    word = "within 2 se" if abs(d) <= 2 * se else "above sync by > 2 se" if d > 0 else "BELOW sync by > 2 se"
    parts.append(f"{arm} - sync = {d:+.3f} (se {se:.3f}): {word}")
  return "; ".join(parts) or "no async runs"


def write(results: list[dict], out_dir: pathlib.Path, missing: list[str], plot: bool = True) -> dict:
  table = summarize(results)
  doc = {"config": CONFIG, "arms": {a: ARMS[a] for a in ARMS}, "table": table, "verdict": verdict(table),
         "not_run": missing, "runs": results}
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "async_study.json").write_text(json.dumps(doc, indent=1))
  lines = ["# Asynchronous RL at bounded staleness vs the synchronous loop (miniature)", "",
           f"Config: `{CONFIG}` (arithmetic, 8 prompts x 8 samples, 80 steps) with each arm's overrides; "
           "one warm start for every run.", "",
           f"Verdict (pass@1 after RL): {doc['verdict']}.", ""]
  lines += harness.markdown_table(table, list(COLUMNS), lambda c: 2 if c == "s/step" else 3)
  if missing:
    lines += ["", "Not run: " + ", ".join(missing) + "."]
  (out_dir / "async_study.md").write_text("\n".join(lines) + "\n")
  if plot and table:
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, row in table.items():
      curve = row["curve"]
      k = 5
      smooth = [sum(curve[max(0, i - k + 1):i + 1]) / len(curve[max(0, i - k + 1):i + 1]) for i in range(len(curve))]
      ax1.plot(range(1, len(curve) + 1), smooth, label=f"{arm} (n={len(row['seeds'])})")
    ax1.set_xlabel("RL step")
    ax1.set_ylabel("training reward (mean over seeds, 5-step mean)")
    ax1.legend(fontsize=7)
    harness.bar_panel(ax2, table, "pass@1 after", title="held-out pass@1 after RL (mean +- sd, dots: seeds)")
    fig.tight_layout()
    fig.savefig(out_dir / "async_study.png", dpi=110)
    plt.close(fig)
  return doc


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--runs_dir", default=os.path.join(tempfile.gettempdir(), "rollouts_async_study"))
  parser.add_argument("--results_dir", default=str(harness.RESULTS))
  parser.add_argument("--threads", type=int, default=1)
  parser.add_argument("--stop_at", default=None, help="HH:MM UTC after which no new run starts")
  parser.add_argument("--report_only", action="store_true")
  args = parser.parse_args(argv)
  runs_dir, results_dir = pathlib.Path(args.runs_dir), pathlib.Path(args.results_dir)
  arms = [a for a in args.arms.split(",") if a]
  for a in arms:
    if a not in ARMS:
      raise SystemExit(f"Unknown arm {a!r}; arms: {', '.join(ARMS)}.")
  env = harness.child_env(args.threads, runs_dir / "jax_cache")
  base = []

  def run(arm, seed, workdir):
    if not base:
      base.extend(harness.ensure_warm_start(CONFIG, env=env))
    print(f"[async] {arm}/seed{seed} ...", flush=True)
    result = harness.train_run(workdir, CONFIG, base + ARMS[arm] + [f"seed={seed}"], env=env,
                               record=lambda w: dict(run_metrics(w), arm=arm, seed=seed), label=f"[async] {arm}/seed{seed}")
    print(f"[async] {arm}/seed{seed}: pass@1 after {result.get('eval/pass@1 after'):.3f} "
          f"({result['wall_s']:.0f} s)", flush=True)
    return result

  results, missing = harness.run_grid(arms, args.seeds, runs_dir, run, report_only=args.report_only,
                                      stop_at=args.stop_at,
                                      save=lambda results, missing: write(results, results_dir, missing, plot=False))
  doc = write(results, results_dir, missing)
  print(doc["verdict"])


if __name__ == "__main__":
  main()
