"""Learning-curve PNGs from a metrics.jsonl file (written by `metrics.MetricsLogger`).

One PNG per metric group. Long training curves are drawn raw (faint) and smoothed with
TensorBoard's debiased EMA; short series (fewer than `MIN_POINTS_TO_SMOOTH` points) and the
evaluation group (`eval/*`: typically two points, before and after RL) are drawn exactly as
logged, with markers, so the last drawn point is the last measured value. Curves that share
a group get distinct colours, line styles and widths, and the thinner, dashed ones are drawn
on top, so two equal series (e.g. `reward_mean` and `reward_mean_sampled` without dynamic
sampling) both stay visible.
"""

from __future__ import annotations

import fnmatch
import math
import os
import pathlib
from typing import Iterable, Sequence

import numpy as np

# (file name, key patterns): one PNG per group; a key goes to the first group that matches.
METRIC_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "reward", "reward_*")),
    ("accuracy", ("accuracy", "accuracy_*", "acc")),
    ("response_length", ("response_length", "response_length_*", "length_*")),
    ("entropy", ("entropy", "entropy_*")),
    ("kl", ("kl", "kl_*")),
    ("clip_frac", ("clip_frac", "clip_frac_*")),
    ("grad_norm", ("grad_norm", "grad_norm_*")),
    ("loss", ("loss", "loss_*", "pg_loss")),
    ("learning_rate", ("lr", "learning_rate")),
    ("eval", ("eval/*",)),
)

# Groups drawn as measured, never smoothed (few points each; smoothing would move the last one).
UNSMOOTHED_GROUPS: tuple[str, ...] = ("eval",)

# Series shorter than this are drawn as measured, with markers.
MIN_POINTS_TO_SMOOTH = 10

# The i-th curve of a group: (line style, line width); later curves are thinner and drawn on top.
_STYLES = (("-", 2.6), ("--", 1.6), (":", 1.6), ("-.", 1.2))


def smooth(values: Sequence[float], weight: float) -> np.ndarray:
  """TensorBoard-style debiased exponential moving average (weight 0: no smoothing).

  s_t = weight * s_{t-1} + (1 - weight) * x_t with s_0 = 0, divided by (1 - weight**t).

  Args:
    values: the series.
    weight: the EMA weight in [0, 1).
  Returns:
    The smoothed series (float64), same length.

  >>> smooth([1.0, 3.0], 0.5).tolist()   # [1, (0.5 * 0.5 + 0.5 * 3) / 0.75]
  [1.0, 2.3333333333333335]
  """
  if not 0.0 <= weight < 1.0:
    raise ValueError(f"smoothing weight must be in [0, 1), got {weight}.")
  x = np.asarray(values, np.float64)
  out = np.empty_like(x)
  acc, count = 0.0, 0
  for i, v in enumerate(x):
    count += 1
    acc = weight * acc + (1.0 - weight) * v
    out[i] = acc / (1.0 - weight ** count)
  return out


def _series(rows: Iterable[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  steps, values = [], []
  for row in rows:
    v = row.get(key)
    if v is None or isinstance(v, str) or "step" not in row:
      continue
    v = float(v)
    if math.isfinite(v):
      steps.append(row["step"])
      values.append(v)
  return np.asarray(steps), np.asarray(values)


def group_keys(all_keys: Sequence[str], keys: Sequence[str] | None = None) -> dict[str, list[str]]:
  """Assigns metric names to the groups of `METRIC_GROUPS` (first matching group wins).

  Args:
    all_keys: metric names, in the order they should be drawn.
    keys: glob patterns selecting metrics (None: all); a selected metric that belongs to
      no group gets a group of its own (named after it, "/" -> "_").
  Returns:
    {group name: [metric names]} in `METRIC_GROUPS` order, then the ungrouped selections;
    groups may be empty.

  >>> g = group_keys(["kl", "reward_mean", "reward_mean_sampled", "eval/pass@1", "custom"])
  >>> g["reward"], g["eval"], "custom" in g
  (['reward_mean', 'reward_mean_sampled'], ['eval/pass@1'], False)
  """
  if keys is not None:
    all_keys = [k for k in all_keys if any(fnmatch.fnmatchcase(k, p) for p in keys)]
  groups: dict[str, list[str]] = {name: [] for name, _ in METRIC_GROUPS}
  for k in all_keys:
    for name, patterns in METRIC_GROUPS:
      if any(fnmatch.fnmatchcase(k, p) for p in patterns):
        groups[name].append(k)
        break
    else:
      if keys is not None:
        groups.setdefault(k.replace("/", "_"), []).append(k)
  return groups


def draw_group(name: str, series: Sequence[tuple[str, np.ndarray, np.ndarray]], smoothing: float = 0.6):
  """A matplotlib `Figure` (700x420 px) with one group's curves.

  Args:
    name: the group name (the title; `UNSMOOTHED_GROUPS` are never smoothed).
    series: (metric name, steps, values) per curve, in drawing order.
    smoothing: the EMA weight in [0, 1) for series long enough to smooth.
  Returns:
    The figure (Agg canvas attached); the labelled line of each metric carries its name.

  >>> fig = draw_group("eval", [("eval/pass@1", np.array([0, 100]), np.array([0.4, 0.78]))])
  >>> line, = [l for l in fig.axes[0].get_lines() if l.get_label() == "eval/pass@1"]
  >>> line.get_ydata().tolist(), line.get_marker()
  ([0.4, 0.78], 'o')
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(7, 4.2), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for i, (k, steps, values) in enumerate(series):
    color = f"C{i % 10}"
    style, width = _STYLES[min(i, len(_STYLES) - 1)]
    z = 2 + i  # later (thinner, broken) lines on top of earlier (thicker, solid) ones
    smoothed = (smoothing > 0 and name not in UNSMOOTHED_GROUPS and len(values) >= MIN_POINTS_TO_SMOOTH)
    if smoothed:
      ax.plot(steps, values, color=color, alpha=0.25, linewidth=1, linestyle=style, zorder=z)
      ax.plot(steps, smooth(values, smoothing), color=color, linewidth=width, linestyle=style, zorder=z,
              label=k)
    else:
      ax.plot(steps, values, color=color, linewidth=width, linestyle=style, zorder=z, label=k,
              marker="o" if len(values) < 30 else None, markersize=6 if len(values) < 5 else 3)
      if len(values) < 5:  # a few points: print the values
        for x, y in zip(steps, values):
          ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(4, 4 + 9 * i), fontsize=7,
                      color=color)
  ax.set_xlabel("step")
  ax.set_title(name)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  return fig


def plot_curves(jsonl_path: str | os.PathLike, out_dir: str | os.PathLike,
                keys: Sequence[str] | None = None, smoothing: float = 0.6) -> list[str]:
  """One PNG per metric group (reward, accuracy, response_length, entropy, kl, clip_frac_*,
  grad_norm, loss, learning rate, eval/*) from a metrics.jsonl file.

  Long curves are drawn raw (faint) and smoothed; short ones and `eval/*` as measured,
  with markers (see the module docstring). Groups with no finite value are skipped.

  Args:
    jsonl_path: a file written by `MetricsLogger`.
    out_dir: where the PNGs go (created if missing); file names are `<group>.png`.
    keys: glob patterns selecting which metrics to plot (None: every metric in a group);
      a selected metric that belongs to no group gets its own PNG.
    smoothing: the EMA weight in [0, 1).

  Returns:
    The written file paths, in group order.

  >>> import tempfile
  >>> from rollouts_jax.io.metrics import MetricsLogger
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with MetricsLogger(d, tensorboard=False) as log:
  ...     for s in range(5):
  ...       log.log(s, {"reward_mean": s / 4, "kl": 0.01 * s})
  ...   [os.path.basename(p) for p in plot_curves(os.path.join(d, "metrics.jsonl"), d)]
  ['reward.png', 'kl.png']
  """
  from rollouts_jax.io.metrics import read_jsonl  # pylint: disable=g-import-not-at-top

  smooth([], smoothing)  # validates the weight before any work
  rows = read_jsonl(jsonl_path)
  all_keys: list[str] = []
  for row in rows:
    all_keys.extend(k for k in row if k not in ("step", "time") and k not in all_keys)
  groups = group_keys(all_keys, keys)

  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, members in groups.items():
    series = [(k, *_series(rows, k)) for k in members]
    series = [(k, s, v) for k, s, v in series if len(s)]
    if not series:
      continue
    fig = draw_group(name, series, smoothing)
    path = out / f"{name}.png"
    fig.savefig(path, format="png")
    written.append(str(path))
  return written
