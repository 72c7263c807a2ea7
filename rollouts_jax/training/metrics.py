"""Training metrics: a JSON-lines log, TensorBoard event files, a progress bar and plots.

TensorBoard files are written by hand (no TensorFlow, no tensorboard package): each record is
TFRecord-framed,

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | payload | uint32 masked_crc32c(payload)

with masked_crc = ((crc >> 15) | (crc << 17)) + 0xA282EAD8 (mod 2**32), and each payload is an
`Event` protobuf (tensorflow/core/util/event.proto):

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

`metrics.jsonl` holds one JSON object per logged step. JSON has no NaN or infinity, so a
non-finite float is written as the string "NaN", "Infinity" or "-Infinity"; `read_jsonl`
turns exactly these three strings back into floats.
"""

from __future__ import annotations

import fnmatch
import json
import math
import numbers
import os
import pathlib
import socket
import struct
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

# ----------------------------------------------------------------------------------------------
# CRC32C (Castagnoli)

_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _make_crc32c_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
    table.append(crc)
  return tuple(table)


_CRC32C_TABLE = _make_crc32c_table()


def _crc32c_python(data: bytes) -> int:
  crc = 0xFFFFFFFF
  table = _CRC32C_TABLE
  for b in data:
    crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _fast_crc32c():
  """A compiled CRC32C from an installed package, if any (they are optional)."""
  try:
    import google_crc32c  # pytype: disable=import-error
    if google_crc32c.implementation == "c":
      return lambda data: google_crc32c.value(bytes(data))
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    import crc32c as crc32c_pkg  # pytype: disable=import-error
    return lambda data: crc32c_pkg.crc32c(bytes(data))
  except Exception:  # pylint: disable=broad-except
    return None


_CRC32C_IMPL = _fast_crc32c() or _crc32c_python


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`, as used by TFRecord files.

  Uses a compiled implementation when `google_crc32c` or `crc32c` is installed, else a
  table-driven pure-Python one (fine for the small records metrics produce).

  >>> hex(crc32c(b"123456789"))
  '0xe3069283'
  """
  return _CRC32C_IMPL(data)


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC: rotate right by 15 bits and add 0xA282EAD8 (mod 2**32)."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _frame_record(payload: bytes) -> bytes:
  length = struct.pack("<Q", len(payload))
  return (length + struct.pack("<I", masked_crc32c(length)) + payload
          + struct.pack("<I", masked_crc32c(payload)))


def _iter_records(data: bytes, path: Any = "<bytes>") -> Iterator[bytes]:
  """Payloads of TFRecord-framed `data`; raises ValueError on a bad CRC or a truncated record."""
  pos = 0
  while pos < len(data):
    if pos + 12 > len(data):
      raise ValueError(f"{path}: truncated record header at byte {pos}.")
    length_bytes = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", length_bytes)
    (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    if masked_crc32c(length_bytes) != length_crc:
      raise ValueError(f"{path}: CRC mismatch in the length of the record at byte {pos}.")
    end = pos + 12 + length + 4
    if end > len(data):
      raise ValueError(f"{path}: truncated record at byte {pos} (needs {length} payload bytes).")
    payload = data[pos + 12:pos + 12 + length]
    (payload_crc,) = struct.unpack("<I", data[end - 4:end])
    if masked_crc32c(payload) != payload_crc:
      raise ValueError(f"{path}: CRC mismatch in the payload of the record at byte {pos}.")
    yield payload
    pos = end


# ----------------------------------------------------------------------------------------------
# Minimal protobuf encoding of tensorflow.Event

def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative int64
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint((field << 3) | wire_type)


def _len_delimited(field: int, payload: bytes) -> bytes:
  return _key(field, 2) + _varint(len(payload)) + payload


def _encode_event(wall_time: float, step: int | None = None, file_version: str | None = None,
                  scalars: Sequence[tuple[str, float]] = ()) -> bytes:
  out = _key(1, 1) + struct.pack("<d", wall_time)
  if step is not None:
    out += _key(2, 0) + _varint(int(step))
  if file_version is not None:
    out += _len_delimited(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _len_delimited(1, _len_delimited(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value))
        for tag, value in scalars)
    out += _len_delimited(5, summary)
  return out


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    if pos >= len(buf):
      raise ValueError("truncated varint in protobuf message.")
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return result, pos
    shift += 7


def _parse_fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
  """(field number, wire type, raw value) of a protobuf message; unknown fields included."""
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _read_varint(buf, pos)
    elif wire == 1:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == 2:
      n, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + n], pos + n
    elif wire == 5:
      value, pos = buf[pos:pos + 4], pos + 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}.")
    if pos > len(buf):
      raise ValueError("truncated protobuf message.")
    yield field, wire, value


def _decode_event(payload: bytes) -> dict:
  event: dict = {"wall_time": None, "step": 0, "file_version": None, "scalars": []}
  for field, wire, value in _parse_fields(payload):
    if field == 1 and wire == 1:
      event["wall_time"] = struct.unpack("<d", value)[0]
    elif field == 2 and wire == 0:
      event["step"] = value - (1 << 64) if value >= 1 << 63 else value
    elif field == 3 and wire == 2:
      event["file_version"] = value.decode()
    elif field == 5 and wire == 2:
      for f, w, v in _parse_fields(value):
        if f != 1 or w != 2:
          continue
        tag, simple = None, None
        for vf, vw, vv in _parse_fields(v):
          if vf == 1 and vw == 2:
            tag = vv.decode()
          elif vf == 2 and vw == 5:
            simple = struct.unpack("<f", vv)[0]
        if tag is not None and simple is not None:
          event["scalars"].append((tag, simple))
  return event


def read_events(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """Scalars of a TensorBoard event file, with every record's CRCs checked.

  Args:
    path: an `events.out.tfevents.*` file.

  Returns:
    [(step, tag, value)] in file order; values are the stored float32s as Python floats.

  Raises:
    ValueError: on a CRC mismatch, a truncated record or a malformed Event.

  >>> import tempfile
  >>> with tempfile.TemporaryDirectory() as d:
  ...   w = EventFileWriter(d)
  ...   w.scalars(3, {"loss": 0.5})
  ...   w.close()
  ...   read_events(w.path)
  [(3, 'loss', 0.5)]
  """
  data = pathlib.Path(path).read_bytes()
  out = []
  for payload in _iter_records(data, path):
    event = _decode_event(payload)
    out.extend((event["step"], tag, value) for tag, value in event["scalars"])
  return out


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


class EventFileWriter:
  """Appends scalar summaries to a new TensorBoard event file in `logdir`.

  The file is `events.out.tfevents.<int time>.<hostname>` (with a counter suffix if that
  name exists). Its first record carries `file_version = "brain.Event:2"`.

  Args:
    logdir: folder, created if missing.
    flush_secs: buffered records are flushed at least this often (on the next write).

  >>> import tempfile
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with EventFileWriter(d) as w:
  ...     w.scalars(1, {"a": 1.0, "b": 2.0})
  ...   read_events(w.path)
  [(1, 'a', 1.0), (1, 'b', 2.0)]
  """

  def __init__(self, logdir: str | os.PathLike, *, flush_secs: float = 10.0):
    self.logdir = pathlib.Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    base = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    path, counter = self.logdir / base, 0
    while True:
      try:
        self._file = open(path, "xb")  # never clobber another writer's file
        break
      except FileExistsError:
        counter += 1
        path = self.logdir / f"{base}.{counter}"
    self.path = path
    self._flush_secs = flush_secs
    self._last_flush = time.time()
    self._write(_encode_event(time.time(), step=0, file_version="brain.Event:2"))
    self.flush()

  def _write(self, payload: bytes) -> None:
    if self._file is None:
      raise ValueError(f"EventFileWriter for {self.path} is closed.")
    self._file.write(_frame_record(payload))
    if time.time() - self._last_flush > self._flush_secs:
      self.flush()

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """Writes one Event at `step` holding a simple_value per (tag, value) item.

    Values must be real scalars (Python, numpy, or jax 0-d arrays); they are stored as
    float32, so NaN and infinities are kept.
    """
    items = []
    for tag, value in values.items():
      v = _numeric(value)
      if v is None:
        raise ValueError(f"TensorBoard scalar {tag!r} must be a real number, got {value!r}.")
      items.append((str(tag), v))
    if items:
      self._write(_encode_event(time.time(), step=int(step), scalars=items))

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
      self._last_flush = time.time()

  def close(self) -> None:
    if self._file is not None:
      self._file.flush()
      self._file.close()
      self._file = None

  def __enter__(self) -> "EventFileWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _truncate_event_file(path: pathlib.Path, max_step: int) -> None:
  """Rewrites an event file without its events after `max_step` (file_version is kept)."""
  data = path.read_bytes()
  kept, dropped = [], False
  try:
    for payload in _iter_records(data, path):
      event = _decode_event(payload)
      if event["file_version"] is None and event["step"] > max_step:
        dropped = True
      else:
        kept.append(payload)
  except ValueError:
    dropped = True  # a torn tail record from a killed run: drop it and whatever follows
  if dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(_frame_record(p) for p in kept))
    os.replace(tmp, path)


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


class MetricsLogger:
  """Logs per-step metrics to `<workdir>/metrics.jsonl`, TensorBoard and a progress bar.

  Each `log(step, metrics)` appends `{"step": step, "time": unix_time, **metrics}` as one JSON
  line (flushed at once), writes the numeric metrics as TensorBoard scalars under
  `<workdir>/tb/`, moves the tqdm bar to `step` and, every `print_every` steps, prints a line.
  Opening a workdir that has a log appends to it; a resumed run calls `truncate_after(step)`
  with its restored step so that each step appears once.

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
    self._tb: EventFileWriter | None = None  # created on first use, after any truncation
    self._bar = None
    if total_steps is not None:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=total_steps, desc=desc, dynamic_ncols=True)

  def truncate_after(self, step: int) -> None:
    """Drops logged rows (and TensorBoard events) with step > `step`; later logs append."""
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
    if self.tb_dir.exists():
      for path in sorted(self.tb_dir.glob("events.out.tfevents.*")):
        if not path.name.endswith(".tmp"):
          _truncate_event_file(path, step)
    if self._bar is not None:
      self._bar.n = min(step, self._bar.total or step)
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
        self._tb = EventFileWriter(self.tb_dir)
      self._tb.scalars(step, numeric)
      self._tb.flush()
    if self._bar is not None:
      self._bar.update(step - self._bar.n)
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


# ----------------------------------------------------------------------------------------------
# Plots

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


def smooth(values: Sequence[float], weight: float) -> np.ndarray:
  """TensorBoard-style debiased exponential moving average (weight 0: no smoothing).

  s_t = weight * s_{t-1} + (1 - weight) * x_t with s_0 = 0, divided by (1 - weight**t).

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


def plot_curves(jsonl_path: str | os.PathLike, out_dir: str | os.PathLike,
                keys: Sequence[str] | None = None, smoothing: float = 0.6) -> list[str]:
  """One PNG per metric group (reward, accuracy, response_length, entropy, kl, clip_frac_*,
  grad_norm, loss, learning rate, eval/*) from a metrics.jsonl file.

  Each curve is drawn raw (faint) and smoothed. Groups with no finite value are skipped.

  Args:
    jsonl_path: a file written by `MetricsLogger`.
    out_dir: where the PNGs go (created if missing); file names are `<group>.png`.
    keys: glob patterns selecting which metrics to plot (None: every metric in a group);
      a selected metric that belongs to no group gets its own PNG.
    smoothing: the EMA weight in [0, 1).

  Returns:
    The written file paths, in group order.

  >>> import tempfile, os
  >>> with tempfile.TemporaryDirectory() as d:
  ...   with MetricsLogger(d, tensorboard=False) as log:
  ...     for s in range(5):
  ...       log.log(s, {"reward_mean": s / 4, "kl": 0.01 * s})
  ...   [os.path.basename(p) for p in plot_curves(os.path.join(d, "metrics.jsonl"), d)]
  ['reward.png', 'kl.png']
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  smooth([], smoothing)  # validates the weight before any work
  rows = read_jsonl(jsonl_path)
  all_keys: list[str] = []
  for row in rows:
    all_keys.extend(k for k in row if k not in ("step", "time") and k not in all_keys)
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

  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, members in groups.items():
    series = [(k, *_series(rows, k)) for k in members]
    series = [(k, s, v) for k, s, v in series if len(s)]
    if not series:
      continue
    fig = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (k, steps, values) in enumerate(series):
      color = f"C{i % 10}"
      if smoothing > 0 and len(values) > 1:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, smooth(values, smoothing), color=color, linewidth=1.8, label=k)
      else:
        ax.plot(steps, values, color=color, linewidth=1.8, marker="o" if len(values) < 30 else None,
                markersize=3, label=k)
    ax.set_xlabel("step")
    ax.set_title(name)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, format="png")
    written.append(str(path))
  return written
