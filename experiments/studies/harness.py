"""The studies' one harness: arm x seed training runs (resumable), their records, tables and plots.

A study is a set of arms, each a config (`path:arg`) plus overrides, run for every seed through
`experiments.launch.train`, one process at a time, seed-major, each in its own workdir
(`runs_dir/ARM/seedS`). A run whose `result.json` exists is reused; a killed one is started
again on its workdir and resumes from its last checkpoint. Tables give each column as mean +-
sample standard deviation over seeds.

>>> mean_spread([1.0, 2.0, 3.0])
{'mean': 2.0, 'spread': 1.0, 'se': 0.5773502691896258, 'n': 3}
"""

from __future__ import annotations

import ast
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results"


# ---------------------------------------------------------------------------------------------
# Configs, warm starts, processes
# ---------------------------------------------------------------------------------------------

def launch_command(launcher: str, *args: str) -> list[str]:
  """The command line of `experiments.launch.<launcher>` (run with cwd=REPO)."""
  return [sys.executable, "-m", f"experiments.launch.{launcher}", *args]


def set_override(config, item: str) -> None:
  """Applies "a.b.c=value" (a Python literal, else a string) to a ConfigDict in place."""
  key, _, raw = item.partition("=")
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  if isinstance(node[leaf], float) and isinstance(value, int):
    value = float(value)
  node[leaf] = value


def load_config(config: str, overrides: Sequence[str] = ()):
  """The ConfigDict of "configs/X.py[:arg]" (relative to the repository) with `overrides` applied."""
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  path, _, arg = config.partition(":")
  cfg = config_lib.load_config_file(REPO / path, arg or None)
  for item in overrides:
    set_override(cfg, item)
  return cfg


def load_experiment(config: str, overrides: Sequence[str] = (), *, check: bool = True):
  """`load_config` as a typed ExperimentConfig."""
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.from_config_dict(load_config(config, overrides), check=check)


def warm_start_folder(exp, sft_steps: int | None = None) -> pathlib.Path:
  """Where the warm-start cache keeps the SFT warm start of `exp` (trained `sft_steps` steps)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from rollouts_jax import tasks  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import policy  # pylint: disable=g-import-not-at-top
  sft = exp.sft if sft_steps is None else dataclasses.replace(exp.sft, steps=int(sft_steps))
  root = pathlib.Path(sft.cache_dir) if sft.cache_dir else tasks.cache_root() / "warmstart"
  return root / f"{exp.data.task}-{policy.warm_start_key(exp.data, exp.tokenizer, exp.model, sft, exp.seed)}"


def hf_overrides(folder: pathlib.Path) -> list[str]:
  """Overrides that start a run from the policy saved in `folder` (weights and `tokenizer.json`).

  >>> hf_overrides(pathlib.Path("ws"))
  ['model.init=hf', 'model.path=ws', 'tokenizer.path=ws/tokenizer.json']
  """
  return ["model.init=hf", f"model.path={folder}", f"tokenizer.path={folder / 'tokenizer.json'}"]


def ensure_warm_start(config: str, overrides: Sequence[str] = (), *, env: dict, in_process: bool = False,
                      check: bool = True, log: Callable[[str], None] = print) -> list[str]:
  """Overrides that load the config's seed-0 SFT warm start as a local checkpoint (built first if absent).

  A config that starts from a shipped model (`model.init="gguf"`) needs none: [].
  """
  exp = load_experiment(config, overrides, check=check)
  if exp.model.init == "gguf":
    return []
  folder = warm_start_folder(exp)
  if not (folder / "done.json").exists():
    log(f"building the warm start of {config}")
    if in_process:
      from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
      train, _ = loop.load_task(exp)
      loop.warm_start(exp, train)
    else:
      cmd = launch_command("sft", f"--config={config}", *[f"--config.{o}" for o in overrides])
      subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
  return hf_overrides(folder)


def child_env(threads: int, cache_dir: pathlib.Path) -> dict:
  """The environment of a training subprocess: `threads` CPU threads, a persistent compile cache."""
  env = dict(os.environ)
  if threads:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        f"intra_op_parallelism_threads={threads}").strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
      env[var] = str(threads)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_dir))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  return env


def deadline(stop_at: str | datetime.datetime | None,
             now: datetime.datetime | None = None) -> datetime.datetime | None:
  """The UTC moment "HH:MM" names: its next occurrence after `now` (a study started at 22:30 with
  "00:40" stops starting runs 2 h 10 min later, past midnight). A datetime passes through; None: never.

  >>> at = datetime.datetime(2026, 12, 6, 22, 30, tzinfo=datetime.timezone.utc)
  >>> str(deadline("00:40", at)), str(deadline("23:00", at))
  ('2026-12-07 00:40:00+00:00', '2026-12-06 23:00:00+00:00')
  """
  if stop_at is None or isinstance(stop_at, datetime.datetime):
    return stop_at
  if not stop_at:
    return None
  try:
    hh, mm = (int(x) for x in stop_at.split(":"))
    now = now or datetime.datetime.now(datetime.timezone.utc)
    at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
  except ValueError as e:
    raise ValueError(f"--stop_at={stop_at!r} is not a UTC time HH:MM ({e}).") from e
  return at if at > now else at + datetime.timedelta(days=1)


def past(stop_at: datetime.datetime | None) -> bool:
  """Whether the UTC time is at or after the `deadline` (None: never)."""
  return stop_at is not None and datetime.datetime.now(datetime.timezone.utc) >= stop_at


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def read_steps(workdir: pathlib.Path) -> list[dict]:
  """The training rows of `metrics.jsonl`, one per step (the last written wins: a resumed run
  rewrites the steps after its checkpoint), in step order."""
  steps = {}
  for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
    if line.strip():
      row = json.loads(line)
      if "reward_mean" in row:
        steps[row["step"]] = row
  return [steps[k] for k in sorted(steps)]


def train_run(workdir: pathlib.Path, config: str, overrides: Sequence[str], *, env: dict,
              record: Callable[[pathlib.Path], dict], label: str,
              in_process: Callable[[], Any] | None = None) -> dict[str, Any]:
  """Runs (or reuses, or resumes) one training run in `workdir`; its record, also in `result.json`.

  Args:
    workdir: the run's folder.
    config: "configs/X.py[:arg]".
    overrides: "key=value" config overrides.
    env: the subprocess's environment (`child_env`).
    record: the finished run's numbers from its workdir; "wall_s" (summed over restarts) and
      "load1" (the 1-minute load at the first start and the last end) are added.
    label: names the run in errors.
    in_process: trains in this process instead of a `launch.train` subprocess.

  Raises:
    RuntimeError: the training process failed (its time so far is kept for the restart).
  """
  result_file = workdir / "result.json"
  if result_file.exists():
    return json.loads(result_file.read_text())
  workdir.mkdir(parents=True, exist_ok=True)
  spent_file = workdir / "wall_s.json"
  spent = json.loads(spent_file.read_text()) if spent_file.exists() else {}
  load0, t0 = os.getloadavg()[0], time.time()
  code = 0
  if in_process is not None:
    in_process()
  else:
    cmd = launch_command("train", f"--config={config}", f"--workdir={workdir}", "--progress=false",
                         *[f"--config.{o}" for o in overrides])
    with open(workdir / "train.log", "a") as log:
      code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
  spent = {"wall_s": spent.get("wall_s", 0.0) + time.time() - t0,
           "load": spent.get("load", []) + [[load0, os.getloadavg()[0]]]}
  if code:
    spent_file.write_text(json.dumps(spent))
    raise RuntimeError(f"{label} failed (exit {code}); see {workdir}/train.log")
  result = dict(record(workdir), wall_s=spent["wall_s"], load1=[spent["load"][0][0], spent["load"][-1][1]])
  result_file.write_text(json.dumps(result, indent=1))
  return result


def run_grid(arms: Sequence[str], seeds: int, runs_dir: pathlib.Path, run: Callable[[str, int, pathlib.Path], dict],
             *, report_only: bool = False, stop_at: str | datetime.datetime | None = None,
             only: Sequence[str] | None = None,
             recorded: Callable[[str, int, pathlib.Path], dict | None] | None = None,
             save: Callable[[list, list], Any] | None = None,
             log: Callable[[str], None] = print) -> tuple[list[dict], list[str]]:
  """Every arm x seed, seed-major (seed 0 of every arm first, so a study stopped early is balanced).

  Args:
    arms: arm names in order.
    seeds: seeds per arm (0 .. seeds-1).
    runs_dir: parent of the runs' workdirs (`runs_dir/ARM/seedS`).
    run: (arm, seed, workdir) -> the run's record (`train_run`); RuntimeError marks it failed.
    report_only: start no run: finished ones are reported, the rest listed as not run.
    stop_at: "HH:MM" UTC after which no new run starts (its next occurrence), or a `deadline`.
    only: None, or the arms that may start runs; the others are reported from their records or
      finished workdirs (so a study re-run for one arm keeps the rest of its table).
    recorded: (arm, seed, workdir) -> an earlier record to take instead of running, or None.
    save: called with (results, missing) after every arm x seed.
    log: progress lines.

  Returns:
    (records, the "ARM/seedS" not run).
  """
  results, missing, stop_at = [], [], deadline(stop_at)
  for seed in range(seeds):
    for arm in arms:
      workdir = runs_dir / arm / f"seed{seed}"
      earlier = recorded(arm, seed, workdir) if recorded and not (workdir / "result.json").exists() else None
      if earlier is not None:
        results.append(earlier)
      elif not (workdir / "result.json").exists() and (report_only or past(stop_at) or
                                                         (only is not None and arm not in only)):
        missing.append(f"{arm}/seed{seed}")
        continue
      else:
        try:
          results.append(run(arm, seed, workdir))
        except RuntimeError as e:
          log(str(e))
          missing.append(f"{arm}/seed{seed} (failed)")
      if save is not None:
        save(results, missing)
  return results, missing


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------

def mean_spread(values: Sequence[float]) -> dict[str, Any]:
  """Mean, sample standard deviation (ddof=1; 0 for one value), standard error and n of the finite values."""
  vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
  n = len(vals)
  if not n:
    return {"mean": None, "spread": None, "se": None, "n": 0}
  mean = sum(vals) / n
  spread = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
  return {"mean": mean, "spread": spread, "se": spread / math.sqrt(n), "n": n}


def aggregate(results: Sequence[dict], arms: Sequence[str], columns: dict[str, str]) -> dict[str, dict[str, Any]]:
  """{arm: {"seeds", column: mean_spread + "values" (per seed, in seed order)}} for arms with runs.

  Args:
    results: run records, each with "arm", "seed" and the keys `columns` names.
    arms: the arms, in table order.
    columns: {column: key of a record}.
  """
  table = {}
  for arm in arms:
    runs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
    if not runs:
      continue
    row = {"seeds": [r["seed"] for r in runs]}
    for column, key in columns.items():
      values = [r.get(key) for r in runs]
      row[column] = dict(mean_spread(values), values=values)
    table[arm] = row
  return table


def mean_se(table: dict, arm: str, column: str) -> tuple[float | None, float | None]:
  """(mean, standard error) of a table cell, or (None, None)."""
  cell = table.get(arm, {}).get(column)
  return (cell["mean"], cell["se"] or 0.0) if cell and cell["mean"] is not None else (None, None)


def diff(table: dict, a: str, b: str, column: str) -> tuple[float | None, float | None]:
  """(mean of a - mean of b, its standard error), or (None, None) if either arm is missing."""
  ma, sa = mean_se(table, a, column)
  mb, sb = mean_se(table, b, column)
  if ma is None or mb is None:
    return None, None
  return ma - mb, math.sqrt(sa ** 2 + sb ** 2)


def cell(c: dict | None, digits: int = 3) -> str:
  """A table cell as "mean +- spread" (the mean alone for one seed, "n/a" for none)."""
  if not c or c["mean"] is None:
    return "n/a"
  if c["n"] < 2:
    return f"{c['mean']:.{digits}f}"
  return f"{c['mean']:.{digits}f} +- {c['spread']:.{digits}f}"


def markdown_table(table: dict, columns: Sequence[str], digits: Callable[[str], int] = lambda c: 3) -> list[str]:
  """The table's Markdown lines: one row per arm, one cell per column, the seed count last."""
  lines = ["| arm | " + " | ".join(columns) + " | seeds |", "|---|" + "---|" * (len(columns) + 1)]
  for arm, row in table.items():
    lines.append(f"| {arm} | " + " | ".join(cell(row[c], digits(c)) for c in columns) + f" | {len(row['seeds'])} |")
  return lines


def pyplot():
  """matplotlib.pyplot on the file-only backend."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def bar_panel(ax, table: dict, column: str, *, title: str | None = None, colors=None, rotation: int = 20) -> None:
  """Bars of a column's mean +- spread per arm, each seed's value a dot."""
  arms = list(table)
  cells = [table[a][column] for a in arms]
  style = dict(color=colors, alpha=0.5) if colors else dict(color="#8fb3d9", edgecolor="#35618f")
  ax.bar(range(len(arms)), [c["mean"] or 0.0 for c in cells], yerr=[c["spread"] or 0.0 for c in cells], capsize=4,
         **style)
  for i, c in enumerate(cells):
    vals = [v for v in c["values"] if v is not None]
    ax.plot([i] * len(vals), vals, "o", color="#222", ms=3)
  ax.set_xticks(range(len(arms)))
  ax.set_xticklabels(arms, rotation=rotation)
  ax.set_title(column if title is None else title, fontsize=9)
