"""Metrics: the JSON-lines logger, TensorBoard events read back with TensorBoard's own reader,
resume truncation (purge_step), and plots."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from rollouts_jax.io import metrics, plots

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is a test extra: pip install -e '.[test]'")


def tb_scalars(tb_dir):
  """{tag: [(step, value)]} as TensorBoard shows them: every event file of the run, in order,
  with TensorBoard's purging of orphaned steps (restarts) applied."""
  acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_round_trip_through_tensorboard(tmp_path):
  with metrics.MetricsLogger(tmp_path) as log:
    log.log(0, {"loss": 1.25, "acc": np.float32(0.5), "phase": "rl", "none": None})
    log.log(10, {"kl": jnp.asarray(0.125), "nan": float("nan"), "inf": -math.inf, "flag": np.bool_(True)})
    log.log(2**40, {"big_step": np.int64(3), "eval/gsm8k/pass@1": 0.75})
  got = tb_scalars(tmp_path / "tb")
  assert set(got) == {"loss", "acc", "kl", "nan", "inf", "flag", "big_step", "eval/gsm8k/pass@1"}  # tags kept
  assert got["loss"] == [(0, 1.25)] and got["acc"] == [(0, 0.5)] and got["kl"] == [(10, 0.125)]
  assert got["nan"][0][0] == 10 and math.isnan(got["nan"][0][1]) and got["inf"] == [(10, -math.inf)]
  assert got["flag"] == [(10, 1.0)]
  assert got["big_step"] == [(2**40, 3.0)] and got["eval/gsm8k/pass@1"] == [(2**40, 0.75)]


def test_two_loggers_never_share_a_file(tmp_path):
  a, b = metrics.MetricsLogger(tmp_path / "a"), metrics.MetricsLogger(tmp_path / "a")
  a.log(1, {"x": 1.0})
  b.log(2, {"y": 2.0})
  a.close()
  b.close()
  files = sorted((tmp_path / "a" / "tb").glob("events.out.tfevents.*"))
  assert len(files) == 2  # opened within the same second: still two files
  assert tb_scalars(tmp_path / "a" / "tb") == {"x": [(1, 1.0)], "y": [(2, 2.0)]}


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
  assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
  assert tb_scalars(tmp_path / "tb") == {"reward_mean": [(1, 0.25), (2, 0.5)], "eval/gsm8k/pass@1": [(2, 0.125)]}
  assert not metrics.MetricsLogger(tmp_path / "off", tensorboard=False).close() and not (tmp_path / "off" / "tb").exists()


def test_resume_appends_and_truncates(tmp_path):
  with metrics.MetricsLogger(tmp_path) as log:
    for s in range(1, 7):
      log.log(s, {"reward_mean": s, "kl": 0.5 * s})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "rew')                     # a line torn by a kill
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 7))
  # The run restarts from its step-4 checkpoint; after the restart it logs reward_mean only.
  with metrics.MetricsLogger(tmp_path) as log:
    log.truncate_after(4)
    for s in range(5, 9):
      log.log(s, {"reward_mean": 10 * s})
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 9))
  assert [r["reward_mean"] for r in rows] == [1, 2, 3, 4, 50, 60, 70, 80]
  got = tb_scalars(tmp_path / "tb")
  assert got["reward_mean"] == [(s, float(s if s <= 4 else 10 * s)) for s in range(1, 9)]
  # kl was not logged again: only purge_step removes its orphaned steps 5 and 6.
  assert got["kl"] == [(s, 0.5 * s) for s in range(1, 5)]
  # A third open without truncation only appends.
  with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(9, {"reward_mean": 90})
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 10))


def test_truncate_without_new_logs_still_truncates_tensorboard(tmp_path):
  # A run resumed at its last checkpoint may log nothing more; TensorBoard must still end there.
  with metrics.MetricsLogger(tmp_path) as log:
    for s in range(0, 6):
      log.log(s, {"reward_mean": s})
  with metrics.MetricsLogger(tmp_path) as log:
    log.truncate_after(3)
  assert tb_scalars(tmp_path / "tb") == {"reward_mean": [(s, float(s)) for s in range(4)]}
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_truncate_after_a_torn_event_file(tmp_path):
  # A kill mid-write leaves a torn last record; TensorBoard reads up to it, and the resumed run's
  # file (purge_step) continues the series.
  with metrics.MetricsLogger(tmp_path) as log:
    for s in range(1, 6):
      log.log(s, {"reward_mean": s})
  (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
  path.write_bytes(path.read_bytes()[:-5])
  with metrics.MetricsLogger(tmp_path) as log:
    log.truncate_after(2)
    log.log(3, {"reward_mean": 30.0})
  assert tb_scalars(tmp_path / "tb") == {"reward_mean": [(1, 1.0), (2, 2.0), (3, 30.0)]}


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


def test_progress_bar_of_a_fresh_run_starts_at_zero_without_warnings(tmp_path, capsys):
  """The loop truncates a fresh run after step -1 and logs its before-eval at step 0."""
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")                 # tqdm's "clamping frac" would raise here
    with metrics.MetricsLogger(tmp_path, tensorboard=False, total_steps=4) as log:
      log.truncate_after(-1)
      assert log._bar.n == 0
      log.log(0, {"eval/pass@1": 0.1})
      assert log._bar.n == 0
      for s in range(1, 6):                        # a step past the total does not overrun it
        log.log(s, {"reward_mean": 0.5})
      assert log._bar.n == 4
  err = capsys.readouterr().err
  assert "-1/4" not in err and "-100%" not in err and "4/4" in err


def test_progress_bar_clock_starts_at_the_resumed_step(tmp_path):
  """Time spent before the first RL step (an SFT warm start, the restore) is not charged to the steps."""
  with metrics.MetricsLogger(tmp_path, tensorboard=False, total_steps=10) as log:
    log._bar.start_t -= 3600.0                     # an hour of warm start since the logger opened
    log.truncate_after(3)                          # resumed at step 3
    assert log._bar.n == log._bar.initial == 3
    assert log._bar.format_dict["elapsed"] < 60
    log.log(4, {"reward_mean": 0.5})
    assert log._bar.n == 4


def test_smooth_matches_recurrence():
  x = np.array([4.0, 0.0, 2.0, 8.0])
  w = 0.6
  acc, want = 0.0, []
  for t, v in enumerate(x, 1):
    acc = w * acc + (1 - w) * v
    want.append(acc / (1 - w**t))
  np.testing.assert_allclose(plots.smooth(x, w), want)
  np.testing.assert_array_equal(plots.smooth(x, 0.0), x)
  np.testing.assert_allclose(plots.smooth(np.full(5, 3.0), 0.9), 3.0)   # debiased: no warm-up dip
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    plots.smooth(x, 1.0)


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
  paths = plots.plot_curves(jsonl, tmp_path / "plots")
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
  sel = plots.plot_curves(jsonl, tmp_path / "sel", keys=["kl", "eval/*", "custom_thing"], smoothing=0.0)
  assert [p.rsplit("/", 1)[-1] for p in sel] == ["kl.png", "eval.png", "custom_thing.png"]
  assert all(_is_png(p) for p in sel)
  assert plots.plot_curves(jsonl, tmp_path / "none", keys=["missing_*"]) == []


def _pixels_near(im, rgb, tol=40):
  arr = np.asarray(im.convert("RGB"), np.int32)
  return int((np.abs(arr - np.asarray(rgb)).sum(-1) < tol).sum())


def test_plot_eval_is_drawn_as_measured_and_reward_mean_stays_visible(tmp_path):
  import matplotlib.colors as mcolors
  with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
    log.log(0, {"eval/pass@1": 0.30, "eval/maj@8": 0.41})
    for s in range(1, 101):
      r = 0.3 + 0.005 * s + 0.05 * np.sin(s)
      # No dynamic sampling: the two reward series are equal.
      log.log(s, {"reward_mean": r, "reward_mean_sampled": r})
    log.log(100, {"eval/pass@1": 0.78, "eval/maj@8": 0.80})
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  groups = plots.group_keys(list(dict.fromkeys(k for r in rows for k in r if k not in ("step", "time"))))
  # Eval: two points, drawn exactly (no EMA: the last drawn value is the measured 0.78), with markers.
  fig = plots.draw_group("eval", [(k, *plots._series(rows, k)) for k in groups["eval"]], smoothing=0.6)
  lines = {l.get_label(): l for l in fig.axes[0].get_lines() if not l.get_label().startswith("_")}
  assert lines["eval/pass@1"].get_ydata().tolist() == [0.30, 0.78]
  assert lines["eval/maj@8"].get_ydata().tolist() == [0.41, 0.80]
  assert all(l.get_marker() == "o" for l in lines.values())
  # Reward: two equal series with distinct colour and style; the legend names both.
  fig = plots.draw_group("reward", [(k, *plots._series(rows, k)) for k in groups["reward"]], smoothing=0.6)
  ax = fig.axes[0]
  labelled = {l.get_label(): l for l in ax.get_lines() if not l.get_label().startswith("_")}
  a, b = labelled["reward_mean"], labelled["reward_mean_sampled"]
  assert a.get_color() != b.get_color() and a.get_linestyle() != b.get_linestyle()
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["reward_mean", "reward_mean_sampled"]
  # Drawn on top of each other, both colours still show in the PNG (the wider solid line under
  # the thinner dashed one).
  paths = plots.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "plots")
  with Image.open(tmp_path / "plots" / "reward.png") as im:
    for line in (a, b):
      rgb = [int(255 * c) for c in mcolors.to_rgb(line.get_color())]
      assert _pixels_near(im, rgb) > 300, line.get_label()
  assert sorted(p.rsplit("/", 1)[-1] for p in paths) == ["eval.png", "reward.png"]


def test_plot_curves_importable_from_the_training_package():
  from rollouts_jax import training
  assert training.plot_curves is plots.plot_curves and not hasattr(metrics, "plot_curves")
