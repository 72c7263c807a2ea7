r"""A training run's record for the repository: before/after table, curves and a results JSON.

  python -m experiments.launch.run_report --workdir=/tmp/smollm2_addition --name=smollm2_addition

Reads the workdir that `experiments.launch.train` wrote (`config.json`, `metrics.jsonl`,
`summary.json`) and writes `experiments/studies/results/<name>.json` (the held-out evaluations at every
evaluated step, the before/after change, training minutes summed from the logged step times,
the seed and the command), `experiments/studies/results/<name>.png` (training reward and accuracy,
held-out pass@1 and greedy accuracy, entropy and response length) and prints the README table.
"""

import json
import pathlib
import sys

from absl import app, flags

_HERE = pathlib.Path(__file__).resolve().parent
flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
flags.DEFINE_string("name", None, "Results name: experiments/studies/results/<name>.{json,png}.", required=True)
flags.DEFINE_string("command", "", "The command that made the run (recorded as given).")
FLAGS = flags.FLAGS


def read_run(workdir: pathlib.Path) -> dict:
  """Steps, evaluations and timings of a workdir's metrics.jsonl (the last record of a step wins)."""
  train, evals = {}, {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    rec = json.loads(line)
    step = int(rec["step"])
    if any(k.startswith("eval/") for k in rec):
      evals[step] = {k: v for k, v in rec.items() if k.startswith("eval/")}
    if "time/step" in rec:   # a step's record (an evaluation may share it)
      train[step] = rec
  return {"train": dict(sorted(train.items())), "evals": dict(sorted(evals.items()))}


def summarize(workdir: pathlib.Path, command: str = "") -> dict:
  run = read_run(workdir)
  config = json.loads((workdir / "config.json").read_text())
  first, last = min(run["evals"]), max(run["evals"])
  before, after = run["evals"][first], run["evals"][last]
  seconds = sum(r.get("time/step", 0.0) for r in run["train"].values())
  keep = ("reward_mean_sampled", "accuracy", "entropy", "response_length", "mismatch_mean", "mismatch_max",
          "refills", "time/sample", "time/update", "time/step")
  return {
      "command": command,
      "seed": config.get("seed"),
      "config": config,
      "steps": len(run["train"]),
      "training_minutes": seconds / 60.0,
      "before": before, "after": after,
      "change": {k: after[k] - before[k] for k in before if k in after},
      "evals": {str(s): e for s, e in run["evals"].items()},
      "train": {str(s): {k: r[k] for k in keep if k in r} for s, r in run["train"].items()},
  }


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [int(s) for s in result["train"]]
  col = lambda k: [result["train"][str(s)].get(k, float("nan")) for s in steps]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  axes[0].plot(steps, col("reward_mean_sampled"), label="training reward (sampled)")
  axes[0].set_xlabel("RL step"); axes[0].legend(); axes[0].set_ylim(0, 1)
  es = [int(s) for s in result["evals"]]
  for key, label in (("eval/pass@1", "held-out pass@1 (T=1)"), ("eval/greedy_accuracy", "held-out greedy")):
    have = [s for s in es if key in result["evals"][str(s)]]   # greedy accuracy: first and last evaluation
    axes[1].plot(have, [result["evals"][str(s)][key] for s in have], "o-", label=label)
  axes[1].set_xlabel("RL step"); axes[1].set_ylim(0, 1); axes[1].legend()
  axes[2].plot(steps, col("entropy"), label="entropy (nats/token)")
  axes[2].plot(steps, [v / 10 for v in col("response_length")], label="response length / 10")
  axes[2].set_xlabel("RL step"); axes[2].legend()
  fig.suptitle(f"{path.stem}: seed {result['seed']}, {result['steps']} steps, "
               f"{result['training_minutes']:.0f} training minutes")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def table(result: dict) -> str:
  rows = ["| held-out (200 problems) | before RL | after RL | change |", "| --- | --- | --- | --- |"]
  for key in result["before"]:
    if key in result["after"]:
      rows.append(f"| {key.removeprefix('eval/')} | {result['before'][key]:.3f} | {result['after'][key]:.3f} | "
                  f"{result['change'][key]:+.3f} |")
  return "\n".join(rows)


def main(argv):
  del argv
  workdir = pathlib.Path(FLAGS.workdir)
  result = summarize(workdir, FLAGS.command)
  out = _HERE.parent / "studies" / "results"
  out.mkdir(exist_ok=True)
  (out / f"{FLAGS.name}.json").write_text(json.dumps(result, indent=1) + "\n")
  plot(result, out / f"{FLAGS.name}.png")
  print(table(result))
  print(f"{result['steps']} steps, {result['training_minutes']:.1f} training minutes; "
        f"wrote {out / FLAGS.name}.json and .png")


if __name__ == "__main__":
  sys.exit(app.run(main))
