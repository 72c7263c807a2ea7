"""Training metrics: a JSON-lines log, TensorBoard event files and a progress bar.

`metrics.jsonl` holds one JSON object per logged step. JSON has no NaN or infinity, so a
non-finite float is written as the string "NaN", "Infinity" or "-Infinity"; `read_jsonl`
turns exactly these three strings back into floats.

TensorBoard event files are written by `tensorboardX.SummaryWriter` under `<workdir>/tb/`.
A resumed run calls `MetricsLogger.truncate_after(step)`: the JSON log is cut after `step`
and a new event file starts with `purge_step=step + 1`, a `SessionLog.START` event that
makes TensorBoard drop the old run's events from that step on, so each step shows once.

Plots live in `rollouts_jax.io.plots` (which reads this module's logs; this one imports nothing of it).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import time
from typing import Any, Mapping

import numpy as np

def _numeric(value) -> float | None:
  """A float for a real scalar (Python, numpy or jax, also 0-d / size-1 arrays), else None."""
  if isinstance(value, (bool, np.bool_)):
    return float(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    arr = np.asarray(value)
    if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
      return float(arr.reshape(()))
  return None


# ----------------------------------------------------------------------------------------------
# TensorBoard


def _event_files(tb_dir: pathlib.Path) -> list[pathlib.Path]:
  return sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else []


def _open_summary_writer(tb_dir: pathlib.Path, purge_step: int | None = None, flush_secs: int = 10):
  """A `tensorboardX.SummaryWriter` writing a new event file in `tb_dir`.

  Event files are named `events.out.tfevents.<unix seconds>.<host><suffix>` and opened for
  writing from scratch, so the suffix holds a sequence number one above the number of
  event files already there: two writers opened within the same second never share a
  file, and a later writer's file sorts after an earlier one's, which is the order in
  which TensorBoard reads them (so a purge applies to the older files).
  """
  from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  tb_dir.mkdir(parents=True, exist_ok=True)
  seq = len(_event_files(tb_dir))
  while list(tb_dir.glob(f"events.out.tfevents.*.{seq:06d}.{os.getpid()}")):
    seq += 1
  return SummaryWriter(str(tb_dir), purge_step=purge_step, flush_secs=flush_secs,
                       filename_suffix=f".{seq:06d}.{os.getpid()}")


def _write_scalars(writer, step: int, values: Mapping[str, float]) -> None:
  """One Event at `step` holding a `simple_value` per (tag, value).

  Goes through the writer's FileWriter with tensorboardX's own `Summary` message rather than
  `add_scalar`, which would rename tags with characters outside [-/\\w.] (e.g.
  `eval/pass@1` -> `eval/pass_1`); here the tags equal the metrics.jsonl keys.
  """
  from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top
  summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
  writer.file_writer.add_summary(summary, global_step=int(step))


# ----------------------------------------------------------------------------------------------
# JSON lines

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _json_value(key: str, value):
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (numbers.Integral, np.integer)):
    return int(value)
  v = _numeric(value)
  if v is None:
    raise ValueError(f"metric {key!r} must be a scalar, a string or None; got {type(value).__name__} "
                     f"{getattr(value, 'shape', '')}.")
  arr = np.asarray(value)
  if np.issubdtype(arr.dtype, np.integer):
    return int(arr.reshape(()))
  if math.isnan(v):
    return "NaN"
  if math.isinf(v):
    return "Infinity" if v > 0 else "-Infinity"
  return v


def _decode_json_value(value):
  if isinstance(value, str) and value in _NONFINITE:
    return _NONFINITE[value]
  return value


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """Rows of a metrics.jsonl file, with "NaN"/"Infinity"/"-Infinity" strings back as floats.

  A malformed last line (a run killed mid-write) is skipped; a malformed line elsewhere raises
  ValueError naming its line number.

  >>> import tempfile, os
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with MetricsLogger(d, tensorboard=False) as log:
  ...     log.log(1, {"loss": float("nan"), "reward_mean": 0.25})
  ...   row, = read_jsonl(os.path.join(d, "metrics.jsonl"))
  ...   row["step"], math.isnan(row["loss"]), row["reward_mean"]
  (1, True, 0.25)
  """
  lines = pathlib.Path(path).read_text().splitlines()
  rows = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    except ValueError as e:
      if i == len(lines) - 1:
        continue
      raise ValueError(f"{path}: line {i + 1} is not a JSON object: {e}") from None
    rows.append({k: _decode_json_value(v) for k, v in row.items()})
  return rows


_POSTFIX_KEYS = ("reward_mean", "accuracy", "loss", "kl", "entropy", "response_length")


class NullLogger:
  """The metrics logger of a process other than the first in a multi-process run: writes nothing."""

  def log(self, step, metrics):
    del step, metrics

  def truncate_after(self, step):
    del step

  def close(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass


class MetricsLogger:
  """Logs per-step metrics to `<workdir>/metrics.jsonl`, TensorBoard and a progress bar.

  Each `log(step, metrics)` appends `{"step": step, "time": unix_time, **metrics}` as one JSON
  line (flushed at once), writes the numeric metrics as TensorBoard scalars under
  `<workdir>/tb/` (`tensorboardX`; the tags are the metric names), moves the tqdm bar to
  `step` and, every `print_every` steps, prints a line. Opening a workdir that has a log
  appends to it; a resumed run calls `truncate_after(step)` with its restored step so that
  each step appears once, in the JSON log and in TensorBoard (`purge_step`).

  Args:
    workdir: the run folder (created if missing).
    tensorboard: write TensorBoard event files.
    total_steps: show a tqdm bar with this total (None: no bar).
    desc: the bar's label.
    print_every: print the metrics every this many steps (0: never).

  >>> import tempfile, os
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with MetricsLogger(d) as log:
  ...     for step in range(1, 4):
  ...       log.log(step, {"reward_mean": step / 10})
  ...   [r["step"] for r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
  [1, 2, 3]
  """

  def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True,
               total_steps: int | None = None, desc: str = "train", print_every: int = 0):
    if print_every < 0:
      raise ValueError(f"print_every must be >= 0, got {print_every}.")
    self.workdir = pathlib.Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.jsonl_path = self.workdir / "metrics.jsonl"
    self.tb_dir = self.workdir / "tb"
    self._tensorboard = tensorboard
    self._print_every = print_every
    self._file = open(self.jsonl_path, "a")
    self._tb = None  # a tensorboardX SummaryWriter, created on first use (after any truncation)
    self._bar = None
    if total_steps is not None:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=total_steps, desc=desc, dynamic_ncols=True)

  def truncate_after(self, step: int) -> None:
    """Drops logged rows with step > `step` from the JSON log and the TensorBoard series.

    The JSON log is rewritten without them. For TensorBoard, a new event file starts
    with `purge_step=step + 1` (when event files exist and TensorBoard logging is on):
    readers drop every older event at a step > `step`. Later logs append.
    """
    self._file.close()
    lines = self.jsonl_path.read_text().splitlines() if self.jsonl_path.exists() else []
    kept = []
    for line in lines:
      try:
        row = json.loads(line)
      except ValueError:
        continue  # a torn line from a killed run
      if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
        kept.append(line + "\n")
    tmp = self.jsonl_path.with_name(self.jsonl_path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, self.jsonl_path)
    self._file = open(self.jsonl_path, "a")
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._tensorboard and _event_files(self.tb_dir):
      self._tb = _open_summary_writer(self.tb_dir, purge_step=int(step) + 1)
      self._tb.flush()
    if self._bar is not None:
      # The bar restarts here at the resumed step (0 when no checkpoint: truncation after -1): its
      # clock and rate count from now, not from the logger's creation (an SFT warm start, the
      # restore and the first compile happen in between).
      done = max(0, min(step, self._bar.total or step))
      self._bar.reset(total=self._bar.total)
      self._bar.initial = self._bar.n = done
      self._bar.refresh()

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` (scalars, strings or None) at `step`; see the class docstring."""
    if self._file is None:
      raise ValueError("MetricsLogger is closed.")
    for reserved in ("step", "time"):
      if reserved in metrics:
        raise ValueError(f"metric name {reserved!r} is reserved by MetricsLogger.")
    step = int(step)
    row = {"step": step, "time": time.time()}
    row.update({str(k): _json_value(str(k), v) for k, v in metrics.items()})
    self._file.write(json.dumps(row, allow_nan=False) + "\n")
    self._file.flush()
    numeric = {k: v for k, v in metrics.items()
               if not isinstance(v, str) and v is not None and _numeric(v) is not None}
    if self._tensorboard and numeric:
      if self._tb is None:
        self._tb = _open_summary_writer(self.tb_dir)
      _write_scalars(self._tb, step, {str(k): _numeric(v) for k, v in numeric.items()})
      self._tb.flush()
    if self._bar is not None:
      self._bar.update(max(0, min(step, self._bar.total or step) - self._bar.n))
      shown = [k for k in _POSTFIX_KEYS if k in numeric][:4] or list(numeric)[:3]
      self._bar.set_postfix({k: f"{_numeric(numeric[k]):.4g}" for k in shown}, refresh=False)
    if self._print_every and step % self._print_every == 0:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      body = " ".join(f"{k}={_numeric(v):.4g}" if k in numeric else f"{k}={v}"
                      for k, v in metrics.items())
      tqdm.write(f"step {step}: {body}")

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
