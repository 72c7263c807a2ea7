r"""APRIL learning parity: partial rollouts against synchronous rollouts at equal finished groups.

  python -m experiments.studies.april_parity --seeds=3 --stop_at=13:15
  python -m experiments.studies.april_parity --report_only            # tables from the finished runs

Arms (`configs/april_parity.py:ARM`, the arithmetic miniature of `configs/repro_base.py`, no
dynamic sampling in either arm, 8 finished groups a step):

* `sync`: every step samples 8 fresh groups and waits for its longest row;
* `april` (APRIL, arXiv 2509.18521): every step requests 12 groups (stored ones first), stops
  decoding once 8 have finished and stores the other 4, finished or not, to be resumed next
  step under the newer policy (`rl.tis_cap = 2` weights the stale tokens).

Each seed of each arm is one `experiments.launch.train` run (`harness`) in its own workdir
(`--runs_dir/ARM/seedS`), one training process at a time, seed-major (seed 0 of both arms
first). Runs are resumable: a run whose `result.json` exists is reused and a killed one is
restarted on its workdir (which resumes from its last checkpoint). Every seed starts from
seed 0's SFT warm start, so seeds differ only in the RL run.

Per run it records the held-out pass@1 before and after RL, the training reward curve,
rollout seconds per step, the padding fraction of the decode loop (row-steps that produced
no token: the accelerator-idle proxy), the share of trained tokens from an older policy,
and APRIL's accounting: groups started = groups used + groups still stored at the end, and
the same balance step by step (a group dropped anywhere breaks it). Writes
`experiments/studies/results/april_parity.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

from experiments.studies import harness
from experiments.studies.harness import read_steps

RESULTS = harness.RESULTS
CONFIG = "configs/april_parity.py"
ARMS = ("sync", "april")

# Table columns: {column: key of a run's result}.
METRICS = {
    "pass@1 before": "pass@1 before", "pass@1 after": "pass@1 after", "pass@1 gain": "pass@1 gain",
    "train reward, last 10": "reward_last10", "train reward, all steps": "reward_mean",
    "rollout s/step": "sample_s_per_step", "update s/step": "update_s_per_step",
    "padding frac": "padding_frac", "tokens decoded/step": "tokens_per_step",
    "off-policy token frac": "off_policy_token_frac",
    "groups started": "groups_started", "groups used": "groups_used", "groups stored at end": "groups_stored_end",
    "groups dropped": "groups_dropped",
}
RULE = ("parity held if APRIL's held-out pass@1 after RL and its training reward over the last 10 steps are "
        "each within two standard errors of the synchronous arm's, or above it, and APRIL dropped no group "
        "(started = used + stored, every step); did not hold if either is below by more than two standard "
        "errors or a group was dropped")


# ---------------------------------------------------------------------------------------------
# One run's numbers (pure functions of its workdir's files; tested on hand-made workdirs).
# ---------------------------------------------------------------------------------------------

def _median(values):
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _mean(values):
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def accounting(steps: Sequence[dict], num_samples: int) -> dict[str, Any]:
  """Groups started, used and stored, and whether the balance holds at every step.

  Each step starts `rollouts / num_samples` fresh groups, trains on `groups` finished ones
  and leaves `april/stored_groups` in the store (0 for synchronous rollouts). With nothing
  dropped, stored(t) = stored(t - 1) + started(t) - used(t) at every step, so over the run
  started = used + stored at the end.

  Args:
    steps: the run's training rows in step order (`read_steps`).
    num_samples: N, samples per group.

  Returns:
    {"groups_started", "groups_used", "groups_stored_end", "groups_dropped" (started - used -
    stored at the end), "balance_violations" (steps whose balance fails)}.

  >>> rows = [{"rollouts": 96.0, "groups": 8.0, "april/stored_groups": 4.0},
  ...         {"rollouts": 64.0, "groups": 8.0, "april/stored_groups": 4.0}]
  >>> accounting(rows, 8)
  {'groups_started': 20, 'groups_used': 16, 'groups_stored_end': 4, 'groups_dropped': 0, 'balance_violations': 0}
  """
  started = used = stored = violations = 0
  for row in steps:
    s = int(round(row.get("rollouts", 0.0) / num_samples))
    u = int(round(row.get("groups", 0.0)))
    now = int(round(row.get("april/stored_groups", 0.0)))
    if now != stored + s - u:
      violations += 1
    started, used, stored = started + s, used + u, now
  return {"groups_started": started, "groups_used": used, "groups_stored_end": stored,
          "groups_dropped": started - used - stored, "balance_violations": violations}


def run_result(workdir: pathlib.Path) -> dict[str, Any]:
  """A finished run's record from its `config.json`, `summary.json` and `metrics.jsonl`.

  Returns:
    pass@1 (and every other evaluation metric) before / after / gain, "reward_curve" (the
    training reward of every step), "reward_last10", "reward_mean", medians over steps of
    "sample_s_per_step", "update_s_per_step", "padding_frac", "tokens_per_step", the mean
    "off_policy_token_frac", the `accounting`, "steps" and "groups_per_step" (min, max).
  """
  workdir = pathlib.Path(workdir)
  config = json.loads((workdir / "config.json").read_text())
  config = config.get("config", config)
  summary = json.loads((workdir / "summary.json").read_text())
  steps = read_steps(workdir)
  out: dict[str, Any] = {}
  for phase in ("before", "after"):
    for k, v in summary.get(phase, {}).items():
      out[f"{k.removeprefix('eval/')} {phase}"] = v
  for k in summary.get("after", {}):
    if k in summary.get("before", {}):
      out[f"{k.removeprefix('eval/')} gain"] = summary["after"][k] - summary["before"][k]
  curve = [r["reward_mean"] for r in steps]
  out["reward_curve"] = curve
  out["reward_last10"] = _mean(curve[-10:])
  out["reward_mean"] = _mean(curve)
  out["sample_s_per_step"] = _median([r.get("time/sample") for r in steps])
  out["update_s_per_step"] = _median([r.get("time/update") for r in steps])
  out["padding_frac"] = _median([r.get("rollout/padding_frac") for r in steps])
  out["tokens_per_step"] = _median([r.get("generated_tokens") for r in steps])
  out["off_policy_token_frac"] = _mean([r.get("april/off_policy_token_frac", 0.0) for r in steps])
  out["steps"] = len(steps)
  groups = [r.get("groups", 0.0) for r in steps]
  out["groups_per_step"] = [min(groups, default=0), max(groups, default=0)]
  out.update(accounting(steps, int(config["rollout"]["num_samples"])))
  return out


# ---------------------------------------------------------------------------------------------
# Aggregation, verdict, outputs (pure functions of run records).
# ---------------------------------------------------------------------------------------------

def aggregate(results: Sequence[dict]) -> dict[str, dict[str, Any]]:
  """{arm: {"seeds", column: mean_spread + "values" (per seed, in seed order)}} over METRICS."""
  return harness.aggregate(results, ARMS, METRICS)


def _diff(table, column):
  """(APRIL mean - sync mean, its standard error) or (None, None)."""
  return harness.diff(table, "april", "sync", column)


def verdict(table: dict) -> tuple[bool | None, str]:
  """(held: True / False / None, reason) under RULE."""
  d1, se1 = _diff(table, "pass@1 after")
  dr, ser = _diff(table, "train reward, last 10")
  if d1 is None or dr is None:
    return None, "not both arms ran"
  n = min(table["april"]["pass@1 after"]["n"], table["sync"]["pass@1 after"]["n"])
  dropped = sum(v or 0 for v in table["april"]["groups dropped"]["values"])
  text = (f"APRIL - sync: held-out pass@1 after {d1:+.3f} (se {se1:.3f}), training reward last 10 steps "
          f"{dr:+.3f} (se {ser:.3f}); groups dropped by APRIL: {dropped}")
  if n < 2:
    return None, text + "; one seed per arm gives no standard error"
  if dropped:
    return False, text
  below = [name for d, se, name in ((d1, se1, "pass@1"), (dr, ser, "training reward")) if d < -2 * se]
  if below:
    return False, text + f"; below by more than two standard errors: {', '.join(below)}"
  return True, text


def ratio(table: dict, column: str) -> float | None:
  """sync mean / APRIL mean of a column (e.g. rollout seconds: > 1 means APRIL is faster)."""
  a, s = table.get("april", {}).get(column), table.get("sync", {}).get(column)
  if not a or not s or not a["mean"] or s["mean"] is None:
    return None
  return s["mean"] / a["mean"]


def _digits(column):
  if column.startswith("groups") or column.startswith("tokens"):
    return 0
  return 2 if column.endswith("s/step") else 3


def write_outputs(results: Sequence[dict], out_dir: pathlib.Path, *, planned_seeds: int, missing: Sequence[str] = (),
                  load: dict | None = None, plot: bool = True, stem: str = "april_parity",
                  note: str = "") -> dict[str, Any]:
  """Writes STEM.json and STEM.md (and STEM.png); returns the JSON document."""
  table = aggregate(results)
  held, reason = verdict(table)
  doc = {"note": note, "rule": RULE, "planned_seeds": planned_seeds, "held": held, "verdict": reason,
         "rollout_time_ratio_sync_over_april": ratio(table, "rollout s/step"),
         "padding_frac_ratio_sync_over_april": ratio(table, "padding frac"),
         "load": load or {}, "not_run": list(missing), "arms": table,
         "runs": sorted(results, key=lambda r: (ARMS.index(r["arm"]), r["seed"]))}
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / stem
  path.with_suffix(".json").write_text(json.dumps(doc, indent=1))
  word = {True: "held", False: "did not hold", None: "inconclusive"}[held]
  r = doc["rollout_time_ratio_sync_over_april"]
  lines = ["# APRIL partial rollouts vs synchronous rollouts: learning parity", "",
           "Arithmetic miniature (`configs/april_parity.py`, from `configs/repro_base.py`): 1- to 3-digit "
           "addition, 8 finished groups x 8 samples a step in both arms, 80 steps, no dynamic sampling; APRIL "
           "requests 12 groups a step (over_provision 0.5), stops at 8 finished and resumes the rest next "
           "step (rl.tis_cap 2). Held-out pass@1: 200 test prompts x 4 samples at temperature 1.", "",
           *([note, ""] if note else []),
           f"Verdict: **parity {word}**. {reason}.", "", f"Rule: {RULE}.", "",
           "Rollout time per step, sync / APRIL: " + ("n/a" if r is None else f"{r:.2f}x") +
           " (means of per-run medians; the runs went one after another under the load below, so "
           "`experiments/benchmarks/bench_april.py`, which alternates the two in one process, is the measured ratio).", "",
           "Cells: mean +- sample standard deviation over seeds (n seeds in the last column); groups are "
           "totals over the run.", "",
           *harness.markdown_table(table, list(METRICS), _digits)]
  lines += ["", "Per run:", "", "| arm | seed | pass@1 before | pass@1 after | reward last 10 | rollout s/step | "
            "padding frac | started = used + stored | dropped | balance violations |", "|---|---|---|---|---|---|---|---|---|---|"]
  for run in doc["runs"]:
    f = lambda k, d=3: "n/a" if run.get(k) is None else f"{run[k]:.{d}f}"
    lines.append(f"| {run['arm']} | {run['seed']} | {f('pass@1 before')} | {f('pass@1 after')} | "
                 f"{f('reward_last10')} | {f('sample_s_per_step', 2)} | {f('padding_frac')} | "
                 f"{run.get('groups_started')} = {run.get('groups_used')} + {run.get('groups_stored_end')} | "
                 f"{run.get('groups_dropped')} | {run.get('balance_violations')} |")
  if load:
    lines += ["", "Machine load (1-minute load average on 2 cores, at the start and end of each run): " +
              "; ".join(f"{k} {v[0]:.1f} -> {v[1]:.1f}" for k, v in load.items()) + "."]
  if missing:
    lines += ["", "Not run (not started before the deadline, or failed): " + ", ".join(missing) + "."]
  path.with_suffix(".md").write_text("\n".join(lines) + "\n")
  if plot and table:
    _plot(doc, path.with_suffix(".png"))
  return doc


def _smooth(values, width=8):
  out = []
  for i in range(len(values)):
    window = values[max(0, i - width + 1):i + 1]
    out.append(sum(window) / len(window))
  return out


def _plot(doc: dict, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  colors = {"sync": "#35618f", "april": "#c0504d"}
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), gridspec_kw={"width_ratios": [2.2, 1, 1, 1]})
  ax = axes[0]
  for run in doc["runs"]:
    curve = run.get("reward_curve") or []
    ax.plot(range(1, len(curve) + 1), _smooth(curve), color=colors[run["arm"]], lw=1, alpha=0.8,
            label=f"{run['arm']} seed {run['seed']}")
  ax.set_xlabel("step")
  ax.set_title("training reward (moving mean of 8 steps)", fontsize=9)
  ax.legend(fontsize=6, ncol=2)
  arms = list(doc["arms"])
  for ax, column in zip(axes[1:], ("pass@1 after", "rollout s/step", "padding frac")):
    harness.bar_panel(ax, doc["arms"], column, colors=[colors[a] for a in arms], rotation=0)
  fig.suptitle("APRIL vs synchronous rollouts, arithmetic miniature (mean +- sd over seeds, dots: seeds)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def run_one(arm: str, seed: int, workdir: pathlib.Path, overrides: Sequence[str], env: dict) -> dict[str, Any]:
  """Runs (or reuses, or resumes) one arm x seed; returns its record (also written to result.json)."""
  return harness.train_run(workdir, f"{CONFIG}:{arm}", list(overrides) + [f"seed={seed}"], env=env,
                           record=lambda w: dict(run_result(w), arm=arm, seed=seed), label=f"{arm}/seed{seed}")


def run_all(*, seeds: int, runs_dir: pathlib.Path, results_dir: pathlib.Path, threads: int = 1,
            stop_at: str | None = None, report_only: bool = False, plot: bool = True, stem: str = "april_parity",
            note: str = "", log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs every arm x seed (seed-major, one process at a time) and writes the outputs."""
  env = harness.child_env(threads, runs_dir / "jax_cache")
  overrides = []

  def run(arm, seed, workdir):
    if not overrides:   # seed 0's SFT warm start, built before the first run
      overrides.extend(harness.ensure_warm_start(f"{CONFIG}:{ARMS[0]}", env=env, log=log))
    t0 = time.time()
    result = run_one(arm, seed, workdir, overrides, env)
    log(f"{arm} seed {seed}: pass@1 {result.get('pass@1 before', math.nan):.3f} -> "
        f"{result.get('pass@1 after', math.nan):.3f}, rollout {result['sample_s_per_step']:.2f} s/step, "
        f"padding {result['padding_frac']:.3f}, groups {result['groups_started']} = {result['groups_used']} + "
        f"{result['groups_stored_end']} ({time.time() - t0:.0f} s now)")
    return result

  def save(results, missing, plot=False):
    load = {f"{r['arm']}/seed{r['seed']}": r["load1"] for r in results if r.get("load1")}
    return write_outputs(results, results_dir, planned_seeds=seeds, missing=missing, load=load, plot=plot, stem=stem,
                         note=note)

  results, missing = harness.run_grid(ARMS, seeds, runs_dir, run, report_only=report_only, stop_at=stop_at,
                                      save=save, log=log)
  return save(results, missing, plot)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--runs_dir", default=os.path.join(tempfile.gettempdir(), "rollouts_repro", "april_parity"))
  parser.add_argument("--results_dir", default=str(RESULTS))
  parser.add_argument("--threads", type=int, default=1, help="CPU threads per training process (0: default)")
  parser.add_argument("--stop_at", default=None, help="HH:MM UTC after which no new run starts")
  parser.add_argument("--report_only", action="store_true", help="no training: tables from finished runs")
  parser.add_argument("--no_plot", action="store_true")
  parser.add_argument("--stem", default="april_parity", help="output file names: STEM.{json,md,png}")
  parser.add_argument("--note", default="", help="a line for the report (e.g. which code ran)")
  args = parser.parse_args(argv)
  doc = run_all(seeds=args.seeds, runs_dir=pathlib.Path(args.runs_dir), results_dir=pathlib.Path(args.results_dir),
                threads=args.threads, stop_at=args.stop_at, report_only=args.report_only, plot=not args.no_plot,
                stem=args.stem, note=args.note)
  print(f"{doc['verdict']} -> held={doc['held']}")


if __name__ == "__main__":
  main()
