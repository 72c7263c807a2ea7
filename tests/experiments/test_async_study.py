"""The async study's summary and verdict on hand-made run results (no training)."""

import json

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def study():
  return load_script("studies.async_study")


def _run(arm, seed, after, curve):
  return {"arm": arm, "seed": seed, "eval/pass@1 after": after, "eval/pass@1 gain": after - 0.4,
          "reward_last10": sum(curve) / len(curve), "staleness_mean": 0.0 if arm == "sync" else 1.0,
          "trainer_busy": 0.5, "step_s": 1.0, "reward_curve": curve}


def test_summary_means_curves_and_verdict(study, tmp_path):
  runs = [_run("sync", s, a, [0.1, 0.3]) for s, a in enumerate((0.40, 0.42, 0.44))]
  runs += [_run("s1", s, a, [0.2, 0.4, 0.6]) for s, a in enumerate((0.41, 0.43, 0.45))]   # +0.01: noise
  runs += [_run("s2", s, a, [0.0, 0.0]) for s, a in enumerate((0.10, 0.12))]               # far below
  table = study.summarize(runs)
  assert list(table) == ["sync", "s1", "s2"]
  assert table["sync"]["pass@1 after"]["mean"] == pytest.approx(0.42)
  assert table["sync"]["pass@1 after"]["spread"] == pytest.approx(0.02)
  assert table["s2"]["seeds"] == [0, 1]
  assert table["s1"]["curve"] == pytest.approx([0.2, 0.4, 0.6])
  verdict = study.verdict(table)
  assert "s1 - sync = +0.010" in verdict and "s1 - sync = +0.010 (se 0.016): within 2 se" in verdict
  assert "s2 - sync = -0.310" in verdict and "BELOW" in verdict
  doc = study.write(runs, tmp_path, ["s2/seed2"], plot=False)
  md = (tmp_path / "async_study.md").read_text()
  assert md.count("\n| s") == 3 and "Not run: s2/seed2." in md
  assert json.loads((tmp_path / "async_study.json").read_text())["verdict"] == doc["verdict"]


def test_unknown_arm_is_refused(study):
  with pytest.raises(SystemExit, match="Unknown arm"):
    study.main(["--arms=s3", "--report_only"])
