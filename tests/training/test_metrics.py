"""Metrics: CRC32C, TFRecord/Event encoding, the JSON-lines logger, resume truncation, plots."""

import doctest
import json
import math
import struct
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from rollouts_jax.training import metrics


def test_doctests():
  result = doctest.testmod(metrics, raise_on_error=False, verbose=False)
  assert result.attempted >= 8 and result.failed == 0


def test_crc32c_check_values():
  # The standard check value of CRC-32C, and RFC 3720 (iSCSI) B.4 vectors.
  assert metrics.crc32c(b"123456789") == 0xE3069283
  assert metrics._crc32c_python(b"123456789") == 0xE3069283
  assert metrics._crc32c_python(bytes(32)) == 0x8A9136AA
  assert metrics._crc32c_python(b"\xff" * 32) == 0x62A8AB43
  assert metrics._crc32c_python(bytes(range(32))) == 0x46DD794E
  assert metrics._crc32c_python(b"") == 0
  # It is not zlib's CRC-32 (a different polynomial).
  assert metrics._crc32c_python(b"123456789") != zlib.crc32(b"123456789")


def test_masked_crc_is_rotate_plus_constant():
  crc = metrics.crc32c(b"abc")
  rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
  assert metrics.masked_crc32c(b"abc") == (rotated + 0xA282EAD8) % 2**32


def test_varint_matches_protobuf_rules():
  assert metrics._varint(1) == b"\x01"
  assert metrics._varint(300) == b"\xac\x02"
  assert metrics._varint(-1) == b"\xff" * 9 + b"\x01"   # int64 -1 takes ten bytes
  for v in (0, 1, 127, 128, 2**40 + 7):
    assert metrics._read_varint(metrics._varint(v), 0) == (v, len(metrics._varint(v)))


def test_event_bytes_by_hand():
  # Event{wall_time=1.5, step=7, summary{value{tag="a", simple_value=2.0}}}, encoded by hand.
  want = (b"\x09" + struct.pack("<d", 1.5) + b"\x10\x07"
          + b"\x2a\x0a" + b"\x0a\x08" + b"\x0a\x01a" + b"\x15" + struct.pack("<f", 2.0))
  assert metrics._encode_event(1.5, step=7, scalars=[("a", 2.0)]) == want
  assert metrics._decode_event(want) == {"wall_time": 1.5, "step": 7, "file_version": None,
                                         "scalars": [("a", 2.0)]}


def test_event_file_round_trip(tmp_path):
  with metrics.EventFileWriter(tmp_path) as w:
    w.scalars(0, {"loss": 1.25, "acc": np.float32(0.5)})
    w.scalars(10, {"kl": jnp.asarray(0.125), "nan": float("nan"), "inf": -math.inf})
    w.scalars(2**40, {"big_step": 3})
  assert w.path.name.startswith("events.out.tfevents.") and w.path.parent == tmp_path
  events = metrics.read_events(w.path)
  assert events[:3] == [(0, "loss", 1.25), (0, "acc", 0.5), (10, "kl", 0.125)]
  assert events[3][:2] == (10, "nan") and math.isnan(events[3][2])
  assert events[4] == (10, "inf", -math.inf)
  assert events[5] == (2**40, "big_step", 3.0)
  # The first record carries the file version; its framing is length | crc | payload | crc.
  data = w.path.read_bytes()
  (length,) = struct.unpack("<Q", data[:8])
  first = metrics._decode_event(data[12:12 + length])
  assert first["file_version"] == "brain.Event:2"
  assert struct.unpack("<I", data[8:12])[0] == metrics.masked_crc32c(data[:8])
  assert struct.unpack("<I", data[12 + length:16 + length])[0] == metrics.masked_crc32c(data[12:12 + length])


def test_two_writers_never_share_a_file(tmp_path):
  a, b = metrics.EventFileWriter(tmp_path), metrics.EventFileWriter(tmp_path)
  a.scalars(1, {"x": 1.0})
  b.scalars(1, {"x": 2.0})
  a.close()
  b.close()
  assert a.path != b.path
  assert metrics.read_events(a.path) == [(1, "x", 1.0)]
  assert metrics.read_events(b.path) == [(1, "x", 2.0)]


@pytest.mark.parametrize("where", ["length", "payload", "payload_crc"])
def test_corruption_is_detected(tmp_path, where):
  with metrics.EventFileWriter(tmp_path) as w:
    w.scalars(5, {"reward_mean": 0.75})
  data = bytearray(w.path.read_bytes())
  (first_len,) = struct.unpack("<Q", data[:8])
  start = 16 + first_len                       # the second record
  (length,) = struct.unpack("<Q", data[start:start + 8])
  offset = {"length": start + 1, "payload": start + 12 + length // 2,
            "payload_crc": start + 12 + length}[where]
  data[offset] ^= 0x01
  w.path.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="CRC mismatch"):
    metrics.read_events(w.path)


def test_truncated_file_is_detected(tmp_path):
  with metrics.EventFileWriter(tmp_path) as w:
    w.scalars(5, {"reward_mean": 0.75})
  w.path.write_bytes(w.path.read_bytes()[:-3])
  with pytest.raises(ValueError, match="truncated"):
    metrics.read_events(w.path)


def test_scalars_rejects_non_numbers(tmp_path):
  with metrics.EventFileWriter(tmp_path) as w:
    with pytest.raises(ValueError, match="'s'.*real number"):
      w.scalars(1, {"s": "text"})
    with pytest.raises(ValueError, match="real number"):
      w.scalars(1, {"v": np.ones(3)})


def test_logger_jsonl_values_and_nonfinite(tmp_path):
  with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(np.int64(3), {"reward_mean": jnp.float32(0.5), "n": np.int32(4), "flag": np.bool_(True),
                          "kl": float("nan"), "up": np.float64(np.inf), "down": -math.inf,
                          "phase": "rl", "none": None, "arr1": np.array([2.5])})
  raw = (tmp_path / "metrics.jsonl").read_text()
  line = json.loads(raw)  # strict JSON: no bare NaN tokens
  assert "NaN" not in raw.replace('"NaN"', "")
  assert line["kl"] == "NaN" and line["up"] == "Infinity" and line["down"] == "-Infinity"
  assert type(line["n"]) is int and line["flag"] is True and line["step"] == 3
  (row,) = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert row["reward_mean"] == 0.5 and row["arr1"] == 2.5 and row["phase"] == "rl" and row["none"] is None
  assert math.isnan(row["kl"]) and row["up"] == math.inf and row["down"] == -math.inf
  assert abs(row["time"] - __import__("time").time()) < 60
  assert not (tmp_path / "tb").exists()


def test_logger_rejects_bad_metrics(tmp_path):
  with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
    with pytest.raises(ValueError, match="'vec' must be a scalar"):
      log.log(1, {"vec": np.ones(3)})
    with pytest.raises(ValueError, match="reserved"):
      log.log(1, {"step": 2})


def test_logger_writes_tensorboard(tmp_path):
  with metrics.MetricsLogger(tmp_path) as log:
    log.log(1, {"reward_mean": 0.25, "phase": "rl"})
    log.log(2, {"reward_mean": 0.5, "eval/gsm8k/pass@1": 0.125})
  (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
  assert metrics.read_events(path) == [(1, "reward_mean", 0.25), (2, "reward_mean", 0.5),
                                       (2, "eval/gsm8k/pass@1", 0.125)]


def test_resume_appends_and_truncates(tmp_path):
  with metrics.MetricsLogger(tmp_path) as log:
    for s in range(1, 7):
      log.log(s, {"reward_mean": s})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "rew')                     # a line torn by a kill
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 7))
  # The run restarts from its step-4 checkpoint.
  with metrics.MetricsLogger(tmp_path) as log:
    log.truncate_after(4)
    for s in range(5, 9):
      log.log(s, {"reward_mean": 10 * s})
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 9))
  assert [r["reward_mean"] for r in rows] == [1, 2, 3, 4, 50, 60, 70, 80]
  events = []
  for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*")):
    events += metrics.read_events(path)
  assert sorted(events) == [(s, "reward_mean", float(s if s <= 4 else 10 * s)) for s in range(1, 9)]
  # A third open without truncation only appends.
  with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(9, {"reward_mean": 90})
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 10))


def test_read_jsonl_rejects_corrupt_middle_line(tmp_path):
  p = tmp_path / "metrics.jsonl"
  p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match="line 2"):
    metrics.read_jsonl(p)


def test_progress_bar_and_print(tmp_path, capsys):
  with metrics.MetricsLogger(tmp_path, tensorboard=False, total_steps=10, print_every=2) as log:
    for s in range(1, 4):
      log.log(s, {"reward_mean": 0.5, "loss": 1.0})
    assert log._bar.n == 3
    log.truncate_after(2)
    assert log._bar.n == 2
  out = capsys.readouterr().out
  assert "step 2: reward_mean=0.5 loss=1" in out and "step 1:" not in out and "step 3:" not in out


def test_smooth_matches_recurrence():
  x = np.array([4.0, 0.0, 2.0, 8.0])
  w = 0.6
  acc, want = 0.0, []
  for t, v in enumerate(x, 1):
    acc = w * acc + (1 - w) * v
    want.append(acc / (1 - w**t))
  np.testing.assert_allclose(metrics.smooth(x, w), want)
  np.testing.assert_array_equal(metrics.smooth(x, 0.0), x)
  np.testing.assert_allclose(metrics.smooth(np.full(5, 3.0), 0.9), 3.0)   # debiased: no warm-up dip
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    metrics.smooth(x, 1.0)


def _is_png(path):
  with open(path, "rb") as f:
    head = f.read(8)
  return head == b"\x89PNG\r\n\x1a\n"


def test_plot_curves(tmp_path):
  rng = np.random.default_rng(0)
  with metrics.MetricsLogger(tmp_path / "run", tensorboard=False) as log:
    for s in range(40):
      m = {"reward_mean": rng.random(), "accuracy": rng.random(), "response_length": 100 + s,
           "entropy": 1.0 - s / 80, "kl": float("nan") if s == 3 else 1e-3 * s,
           "clip_frac_low": 0.01, "clip_frac_high": 0.02, "grad_norm": 1.0 + rng.random(),
           "phase": "rl", "custom_thing": 1.0}
      if s % 10 == 0:
        m["eval/gsm8k/pass@1"] = s / 40
        m["eval/gsm8k/maj@8"] = s / 30
      log.log(s, m)
  jsonl = tmp_path / "run" / "metrics.jsonl"
  paths = metrics.plot_curves(jsonl, tmp_path / "plots")
  names = [p.rsplit("/", 1)[-1] for p in paths]
  # Groups without any logged key (loss, learning_rate) are skipped; ungrouped keys too.
  assert names == ["reward.png", "accuracy.png", "response_length.png", "entropy.png", "kl.png",
                   "clip_frac.png", "grad_norm.png", "eval.png"]
  for p in paths:
    assert _is_png(p)
    with Image.open(p) as im:
      im.verify()
    with Image.open(p) as im:
      assert im.size == (700, 420)
      # Not a blank canvas: the curves put many distinct colours in the image.
      assert len(im.convert("RGB").getcolors(maxcolors=100000)) > 20
  # Selecting keys: only those; an ungrouped key asked for by name gets its own PNG.
  sel = metrics.plot_curves(jsonl, tmp_path / "sel", keys=["kl", "eval/*", "custom_thing"], smoothing=0.0)
  assert [p.rsplit("/", 1)[-1] for p in sel] == ["kl.png", "eval.png", "custom_thing.png"]
  assert all(_is_png(p) for p in sel)
  assert metrics.plot_curves(jsonl, tmp_path / "none", keys=["missing_*"]) == []
