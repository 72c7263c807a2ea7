"""experiments/studies/reproduce.py: aggregation over seeds, verdict rules, resumability and the smoke form of every study."""

import json
import math

import pytest

from conftest import load_script
from rollouts_jax.training import config as rollout_config

rp = load_script("studies.reproduce")
harness = load_script("studies.harness")


def _run(arm, seed, after, before=0.4, **extra):
  return dict({"arm": arm, "seed": seed, "eval/pass@1 before": before, "eval/pass@1 after": after,
               "eval/pass@1 gain": after - before}, **extra)


def test_mean_spread_is_the_mean_and_sample_std():
  cell = harness.mean_spread([0.5, 0.7, 0.9, float("nan"), None])
  assert cell["n"] == 3
  assert cell["mean"] == pytest.approx(0.7)
  assert cell["spread"] == pytest.approx(0.2)          # ddof=1: sqrt((0.04 + 0 + 0.04) / 2)
  assert cell["se"] == pytest.approx(0.2 / math.sqrt(3))
  assert harness.mean_spread([0.3])["spread"] == 0.0
  assert harness.mean_spread([])["mean"] is None


def test_aggregate_groups_by_arm_in_seed_order_and_skips_arms_without_runs():
  study = rp.STUDIES["mc_grpo"]
  runs = [_run("g8_mean", 1, 0.6), _run("g8_mean", 0, 0.5), _run("g2_mean", 0, 0.3, before=0.5)]
  table = rp.aggregate(study, runs)
  assert set(table) == {"g8_mean", "g2_mean"}                # arms with no run are left out
  assert table["g8_mean"]["seeds"] == [0, 1]
  assert table["g8_mean"]["pass@1 after"]["values"] == [0.5, 0.6]
  assert table["g8_mean"]["pass@1 after"]["mean"] == pytest.approx(0.55)
  assert table["g2_mean"]["pass@1 gain"]["mean"] == pytest.approx(-0.2)
  assert table["g2_mean"]["pass@4 after"]["n"] == 0       # a metric the runs lack is empty, not an error


def test_mc_grpo_verdict_follows_its_rule():
  study = rp.STUDIES["mc_grpo"]
  base = [_run("g2_mean", s, v) for s, v in enumerate([0.40, 0.41, 0.39])]
  big = [_run("g8_mean", s, v) for s, v in enumerate([0.60, 0.61, 0.59])]
  closes = [_run("g2_median", s, v) for s, v in enumerate([0.55, 0.56, 0.54])]
  stays = [_run("g2_median", s, v) for s, v in enumerate([0.41, 0.42, 0.40])]
  assert study.verdict(rp.aggregate(study, base + big + closes))[0] is True
  assert study.verdict(rp.aggregate(study, base + big + stays))[0] is False
  flat = [_run("g8_mean", s, v) for s, v in enumerate([0.40, 0.41, 0.39])]   # no gap to close
  assert study.verdict(rp.aggregate(study, base + flat + closes))[0] is None
  assert study.verdict(rp.aggregate(study, base))[0] is None                 # arms missing


def test_ttrl_and_sol_rl_verdicts():
  ttrl = rp.STUDIES["ttrl"]
  gt = [_run("ground_truth", s, 0.4 + g) for s, g in enumerate([0.20, 0.22, 0.18])]
  near = [_run("ttrl", s, 0.4 + g) for s, g in enumerate([0.15, 0.17, 0.13])]
  collapse = [_run("ttrl", s, 0.4 + g) for s, g in enumerate([-0.30, -0.25, -0.35])]
  assert ttrl.verdict(rp.aggregate(ttrl, gt + near))[0] is True
  assert ttrl.verdict(rp.aggregate(ttrl, gt + collapse))[0] is False
  sol = rp.STUDIES["sol_rl"]
  full = [_run("full", s, 0.4 + g, sample_s_per_step=0.2) for s, g in enumerate([0.10, 0.12, 0.08])]
  same = [_run("fp4_subset", s, 0.4 + g, sample_s_per_step=0.9) for s, g in enumerate([0.09, 0.13, 0.10])]
  worse = [_run("fp4_subset", s, 0.4 + g, sample_s_per_step=0.9) for s, g in enumerate([-0.2, -0.21, -0.19])]
  assert sol.verdict(rp.aggregate(sol, full + same))[0] is True
  assert sol.verdict(rp.aggregate(sol, full + worse))[0] is False


def test_real_opd_verdict_counts_adwin_s_probe_tokens():
  """ESR and ADWIN each must match OPD's accuracy with under 90% of its generated tokens; ADWIN's full-length
  probes count in its tokens, and its window is read from the run's metrics."""
  study = rp.REAL_STUDIES["real_opd"]
  opd = [_run("opd", s, 0.40 + g, generated_tokens=20000.0) for s, g in enumerate([0.0, 0.02])]
  esr = [_run("esr", s, 0.41 + g, generated_tokens=17800.0) for s, g in enumerate([0.0, 0.02])]
  cheap = [_run("adwin", s, 0.40 + g, generated_tokens=15000.0) for s, g in enumerate([0.0, 0.02])]
  costly = [_run("adwin", s, 0.40 + g, generated_tokens=19000.0) for s, g in enumerate([0.0, 0.02])]
  worse = [_run("adwin", s, 0.20 + g, generated_tokens=15000.0) for s, g in enumerate([0.0, 0.02])]
  held, text = study.verdict(rp.aggregate(study, opd + esr + cheap))
  assert held is True and "ADWIN generated 75% of OPD's tokens" in text
  assert study.verdict(rp.aggregate(study, opd + esr + costly))[0] is False   # 95%: saves too little
  assert study.verdict(rp.aggregate(study, opd + esr + worse))[0] is False
  held, text = study.verdict(rp.aggregate(study, opd + esr))                  # ADWIN not run: ESR alone
  assert held is True and "adwin" not in text
  assert study.verdict(rp.aggregate(study, opd))[0] is None


def test_run_result_reads_the_window_and_the_probe_tokens(tmp_path):
  (tmp_path / "summary.json").write_text(json.dumps({"before": {"eval/pass@1": 0.1}, "after": {"eval/pass@1": 0.3}}))
  rows = [{"step": i, "reward_mean": 0.0, "generated_tokens": 100.0, "distill/window": w}
          for i, w in enumerate([12.0, 12.0, 8.0, 8.0])]
  rows[0].update({"distill/probe_tokens": 40.0}), rows[2].update({"distill/probe_tokens": 30.0})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = rp.run_result(tmp_path)
  assert (got["distill_window_mean"], got["distill_window_last"], got["probe_tokens"]) == (10.0, 8.0, 70.0)
  assert got["generated_tokens"] == 400.0 and got["eval/pass@1 gain"] == pytest.approx(0.2)


def test_tables_are_well_formed_and_report_missing_runs(tmp_path):
  study = rp.STUDIES["brorl"]
  runs = [_run(a, s, 0.4 + 0.01 * (i + s), rollouts=100.0 * (i + 1), wall_s=10.0)
          for i, a in enumerate(("n8", "n32", "n128")) for s in range(2)]
  doc = rp.write_outputs(study, runs, tmp_path, planned_seeds=2, smoke=False, missing=["n8_steps4/seed0"])
  on_disk = json.loads((tmp_path / "repro_brorl.json").read_text())
  assert on_disk["arms"]["n32"]["pass@1 after"]["mean"] == pytest.approx(doc["arms"]["n32"]["pass@1 after"]["mean"])
  assert on_disk["not_run"] == ["n8_steps4/seed0"]
  md = (tmp_path / "repro_brorl.md").read_text().splitlines()
  header = next(line for line in md if line.startswith("| arm |"))
  rows = [line for line in md if line.startswith("| n")]
  assert [r.split(" | ")[0] for r in rows] == ["| n8", "| n32", "| n128"]
  assert all(r.count("|") == header.count("|") for r in rows)
  assert "0.405 +- 0.007" in rows[0]                        # mean +- sample sd of 0.40 and 0.41
  assert (tmp_path / "repro_brorl.png").stat().st_size > 0


def test_finished_runs_are_reused_and_not_rerun(tmp_path, monkeypatch):
  """A run with a result file is read back; only the others are trained."""
  study = rp.STUDIES["ttrl"]
  done = tmp_path / "runs" / "ttrl" / "ground_truth" / "seed0"
  done.mkdir(parents=True)
  (done / "result.json").write_text(json.dumps(_run("ground_truth", 0, 0.61, wall_s=5.0)))
  trained = []

  def fake_run_one(study_, arm, seed, workdir, overrides, **kw):
    if (workdir / "result.json").exists():
      return json.loads((workdir / "result.json").read_text())
    trained.append((arm, seed))
    result = _run(arm, seed, 0.5, wall_s=1.0)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "result.json").write_text(json.dumps(result))
    return result

  monkeypatch.setattr(rp, "run_one", fake_run_one)
  monkeypatch.setattr(rp, "warm_start_overrides", lambda *a, **k: [])
  kwargs = dict(seeds=1, runs_dir=tmp_path / "runs", results_dir=tmp_path / "res", plot=False, log=lambda s: None)
  docs = rp.run_studies(["ttrl"], **kwargs)
  assert trained == [("ttrl", 0)]
  assert docs["ttrl"]["arms"]["ground_truth"]["pass@1 after"]["values"] == [0.61]
  trained.clear()
  rp.run_studies(["ttrl"], **kwargs)
  assert trained == []                                      # the second call trains nothing
  docs = rp.run_studies(["ttrl"], **dict(kwargs, seeds=2), report_only=True)
  assert trained == []                                      # report_only never trains
  assert docs["ttrl"]["not_run"] == ["ground_truth/seed1", "ttrl/seed1"]
  del study


def test_running_one_arm_keeps_the_other_arms_recorded_runs(tmp_path, monkeypatch):
  """`--arms=X` starts only X's runs; the results JSON still holds the other arms' recorded runs."""
  study, res = rp.STUDIES["ttrl"], tmp_path / "res"
  recorded = [_run("ground_truth", 0, 0.61, wall_s=5.0, config=rp.run_config("ttrl", "ground_truth", 0))]
  rp.write_outputs(study, recorded, res, planned_seeds=1, smoke=False, missing=[], plot=False)
  trained = []

  def fake_run_one(study_, arm, seed, workdir, overrides, **kw):
    trained.append((arm, seed))
    workdir.mkdir(parents=True)
    (workdir / "result.json").write_text(json.dumps(_run(arm, seed, 0.5, wall_s=1.0)))
    return _run(arm, seed, 0.5, wall_s=1.0)

  monkeypatch.setattr(rp, "run_one", fake_run_one)
  monkeypatch.setattr(rp, "warm_start_overrides", lambda *a, **k: [])
  docs = rp.run_studies(["ttrl"], seeds=2, runs_dir=tmp_path / "runs", results_dir=res, plot=False,
                        arms=["ttrl"], log=lambda s: None)
  assert trained == [("ttrl", 0), ("ttrl", 1)]
  assert docs["ttrl"]["arms"]["ground_truth"]["pass@1 after"]["values"] == [0.61]   # kept, not rerun
  assert docs["ttrl"]["not_run"] == ["ground_truth/seed1"]
  on_disk = json.loads((res / "repro_ttrl.json").read_text())
  assert sorted((r["arm"], r["seed"]) for r in on_disk["runs"]) == [("ground_truth", 0), ("ttrl", 0), ("ttrl", 1)]


def test_stop_at_is_the_next_occurrence_of_the_time():
  import datetime
  utc = datetime.timezone.utc
  at = datetime.datetime(2026, 12, 6, 22, 30, tzinfo=utc)
  assert harness.deadline("00:40", at) == datetime.datetime(2026, 12, 7, 0, 40, tzinfo=utc)   # after midnight
  assert harness.deadline("23:10", at) == datetime.datetime(2026, 12, 6, 23, 10, tzinfo=utc)
  assert harness.deadline(None) is None and not harness.past(None)
  assert harness.past(datetime.datetime(2000, 1, 1, tzinfo=utc))
  with pytest.raises(ValueError, match="--stop_at='9pm' is not a UTC time HH:MM"):
    harness.deadline("9pm")


def test_runs_recorded_in_the_results_json_are_reused_only_while_their_config_is_unchanged(tmp_path, monkeypatch):
  """A study spread over machines: a committed run counts as done when its config is today's."""
  study = rp.STUDIES["ttrl"]
  res = tmp_path / "res"
  gt = rp.run_config("ttrl", "ground_truth", 0)
  assert rp.same_config(gt, rp.run_config("ttrl", "ground_truth", 0))
  assert not rp.same_config(gt, rp.run_config("ttrl", "ground_truth", 1))   # the seed is part of it
  assert not rp.same_config(gt, rp.run_config("ttrl", "ttrl", 0))
  assert not rp.same_config(None, gt)
  # A key added since the run, at its default, leaves it valid; a changed value or default does not.
  added = "rollout.top_k"
  older = {k: v for k, v in gt.items() if k != added}
  assert rp.same_config(older, gt)
  assert not rp.same_config(older, dict(gt, **{added: 7}))
  assert not rp.same_config(dict(gt, **{added: 7}), gt)
  assert not rp.same_config(dict(gt, **{"rollout.gone": 1}), gt)        # a key removed since
  assert rp.same_config(dict(gt, **{"model.path": "/elsewhere"}), gt, ignore=["model.path"])
  recorded = [_run("ground_truth", 0, 0.61, wall_s=5.0, config=gt),
              _run("ttrl", 0, 0.7, wall_s=5.0, config=dict(rp.run_config("ttrl", "ttrl", 0), **{"rl.steps": 1}))]
  rp.write_outputs(study, recorded, res, planned_seeds=1, smoke=False, missing=[], plot=False)
  assert set(rp.committed_runs(res / "repro_ttrl.json")[0]) == {("ground_truth", 0), ("ttrl", 0)}
  assert rp.committed_runs(res / "absent.json") == ({}, {})
  trained = []

  def fake_run_one(study_, arm, seed, workdir, overrides, **kw):
    trained.append((arm, seed))
    workdir.mkdir(parents=True)
    exp = rp._load_exp("ttrl", arm, False, [f"seed={seed}"])
    (workdir / "config.json").write_text(json.dumps(exp.to_dict()))
    (workdir / "result.json").write_text(json.dumps(_run(arm, seed, 0.5, wall_s=1.0)))
    return _run(arm, seed, 0.5, wall_s=1.0)

  monkeypatch.setattr(rp, "run_one", fake_run_one)
  monkeypatch.setattr(rp, "warm_start_overrides", lambda *a, **k: [])
  docs = rp.run_studies(["ttrl"], seeds=1, runs_dir=tmp_path / "runs", results_dir=res, plot=False,
                        log=lambda s: None)
  assert trained == [("ttrl", 0)]                            # the changed one reruns, the other is read
  assert docs["ttrl"]["arms"]["ground_truth"]["pass@1 after"]["values"] == [0.61]
  assert docs["ttrl"]["arms"]["ttrl"]["pass@1 after"]["values"] == [0.5]
  fresh = json.loads((tmp_path / "runs" / "ttrl" / "ttrl" / "seed0" / "result.json").read_text())
  assert rp.same_config(fresh["config"], rp.run_config("ttrl", "ttrl", 0))   # recorded for the next machine


def test_real_studies_apply_each_miniature_arm_s_own_edit_to_the_shipped_smollm2(tmp_path):
  """`real_STUDY` arm = the miniature's arm edit (the keys it changes, same values) on SmolLM2 as shipped."""
  assert set(rp.REAL_STUDIES).isdisjoint(rp.STUDIES)
  for name, study in rp.REAL_STUDIES.items():
    mini = name.removeprefix("real_")
    if mini not in rp.STUDIES:   # a study of its own on the real model (real_opd): tested below
      continue
    base = rp._load_exp(mini, rp.STUDIES[mini].arms[0], False).to_dict()
    for arm in study.arms:
      real = rp._load_exp(name, arm, False)
      mini_steps = rp._load_exp(mini, arm, False).rl.steps
      # 24 steps stand for the miniature's first arm's; an arm with k times those runs 24 k (BroRL's n8_steps4).
      assert real.model.init == "gguf" and real.rl.steps == 24 * mini_steps // base["rl"]["steps"], (name, arm)
      rp.run_config(name, arm, 0)                           # validates, as the training process will
      assert rp.warm_start_overrides(study, False, {}, in_process=True) == []
      edited = rp._load_exp(mini, arm, False).to_dict()          # an arm of the miniature's config
      changed = [(s, k) for s in edited if isinstance(edited[s], dict) for k in edited[s]
                 if edited[s][k] != base[s][k]]
      if arm != study.arms[0]:
        assert changed, (name, arm)                          # each later arm is a real edit
      for section, key in set(changed) - {("rl", "steps")}:   # (steps: scaled, checked above)
        assert real[section][key] == edited[section][key], (name, arm, section, key)


def test_real_opd_distils_from_the_exported_grpo_teacher(tmp_path, monkeypatch):
  """`real_opd`: its arms read the teacher where the harness exports the `teacher` arm's run; the
  teacher is trained and exported once (again only when its run changes) and reported beside the table."""
  study = rp.REAL_STUDIES["real_opd"]
  teacher, opd, esr, adwin = (rp._load_exp("real_opd", a, False) for a in ("teacher", "opd", "esr", "adwin"))
  assert (teacher.rollout.distill, opd.rollout.distill, esr.rollout.distill, adwin.rollout.distill) == (
      "", "opd", "opd", "opd")
  assert (opd.rollout.generator, esr.rollout.generator, esr.rollout.generator_kwargs) == ("sample", "esr", "window=12")
  assert (adwin.rollout.generator, adwin.rollout.generator_kwargs) == ("adwin", "window=12,every=5")
  folder = rp.teacher_folder(study, False)
  assert str(folder) == opd.rollout.teacher_path == esr.rollout.teacher_path == adwin.rollout.teacher_path
  assert rp.run_config("real_opd", "esr", 1)["rollout.teacher_path"] == str(folder)   # read without the folder
  assert rp.warm_start_overrides(study, False, {}, in_process=True) == []             # before the teacher exists
  monkeypatch.setattr(rp, "teacher_folder", lambda s, smoke: tmp_path / "teacher_hf")
  trained, exported = [], []

  def fake_run_one(st, arm, seed, workdir, overrides, **kw):
    trained.append((arm, seed, str(workdir)))
    return {"arm": arm, "seed": seed, "eval/pass@1 before": 0.15, "eval/pass@1 after": 0.45, "eval/maj@8 after": 0.5}

  def fake_export(cmd, **kw):
    exported.append(cmd)
    (tmp_path / "teacher_hf").mkdir(exist_ok=True)
    return type("Done", (), {"returncode": 0, "stderr": ""})()

  monkeypatch.setattr(rp, "run_one", fake_run_one)
  monkeypatch.setattr(rp.subprocess, "run", fake_export)
  got = rp.ensure_teacher(study, tmp_path / "real_opd", [], smoke=False, env={}, in_process=False, log=lambda m: None)
  assert got["eval/pass@1 after"] == 0.45 and trained[0][:2] == ("teacher", 0)
  assert exported and f"--export_hf={tmp_path / 'teacher_hf'}" in exported[0]
  rp.ensure_teacher(study, tmp_path / "real_opd", [], smoke=False, env={}, in_process=False, log=lambda m: None)
  assert len(exported) == 1                                  # exported once
  doc = {"arms": {}}
  (tmp_path / "res").mkdir()
  (tmp_path / "res" / "repro_real_opd.md").write_text("| table |\n")
  result = {"eval/pass@1 before": 0.15, "eval/pass@1 after": 0.45, "eval/maj@8 after": 0.5}
  doc = rp.add_teacher(study, tmp_path / "res", tmp_path / "real_opd", doc, recorded=result)
  assert doc["teacher"] == result
  assert "Teacher: the `teacher` arm" in (tmp_path / "res" / "repro_real_opd.md").read_text()
  assert json.loads((tmp_path / "res" / "repro_real_opd.json").read_text())["teacher"] == result
  # A later machine reads the recorded teacher and keeps it in the JSON after every write, so a
  # study stopped halfway loses no record.
  recorded_run = _run("opd", 0, 0.38, wall_s=5.0, config=rp.run_config("real_opd", "opd", 0))
  rp.write_outputs(study, [recorded_run], tmp_path / "res", planned_seeds=1, smoke=False, missing=[], plot=False)
  rp.add_teacher(study, tmp_path / "res", tmp_path / "real_opd", {"runs": [recorded_run]}, recorded=result)
  writes = []
  real_write = rp.write_outputs

  def spy_write(*a, **k):
    writes.append(1)
    return real_write(*a, **k)

  monkeypatch.setattr(rp, "write_outputs", spy_write)
  kept = []
  original_add = rp.add_teacher

  def checked(study_, results_dir, study_dir, doc_, recorded_):
    kept.append(recorded_ == result)
    return original_add(study_, results_dir, study_dir, doc_, recorded_)

  monkeypatch.setattr(rp, "add_teacher", checked)
  rp.run_studies(["real_opd"], seeds=1, runs_dir=tmp_path / "runs", results_dir=tmp_path / "res", plot=False,
                 report_only=True, log=lambda m: None)
  assert len(writes) == 2 and kept == [True, True]      # after the recorded run, and at the end
  assert json.loads((tmp_path / "res" / "repro_real_opd.json").read_text())["teacher"] == result


def test_run_one_reads_a_finished_workdir_without_training(tmp_path):
  (tmp_path / "result.json").write_text(json.dumps({"arm": "ttrl", "seed": 2, "wall_s": 3.0}))
  out = rp.run_one(rp.STUDIES["ttrl"], "ttrl", 2, tmp_path, [], smoke=True, env={}, in_process=True)
  assert out == {"arm": "ttrl", "seed": 2, "wall_s": 3.0}


def _check_smoke_tables(res, docs, runs_dir, log=()):
  """Each study's table: one row per arm (one seed), sane cells, and the arm's own config run."""
  for name, study in rp.STUDIES.items():
    doc = json.loads((res / f"repro_{name}.json").read_text())
    assert doc == json.loads(json.dumps(docs[name]))
    assert doc["smoke"] and doc["not_run"] == [], "\n".join(log)
    assert list(doc["arms"]) == list(study.arms)            # each arm ran, one seed each
    assert (doc["held"], doc["verdict"]) == study.verdict(doc["arms"])
    for arm, row in doc["arms"].items():
      assert row["seeds"] == [0]
      cell = row["pass@1 after"]
      assert cell["n"] == 1 and 0.0 <= cell["mean"] <= 1.0 and cell["spread"] == 0.0
      # What ran is the arm's smoke config: its rollouts are prompts x samples (the FP4 pool's
      # size where there is one) for its one step.
      exp = json.loads((runs_dir / name / arm / "seed0" / "config.json").read_text())
      want = rp._load_exp(name, arm, smoke=True)
      for key in ("rl.advantage", "rollout.num_samples", "rollout.generator", "rollout.generator_kwargs",
                  "reward.name"):
        section, leaf = key.split(".")
        assert exp[section][leaf] == want[section][leaf], (name, arm, key)
      pool = rollout_config.parse_kwargs(want.rollout.generator_kwargs).get("pool", 0)
      per_prompt = pool or want.rollout.num_samples
      assert row["rollouts"]["mean"] == want.control.prompts_per_step * per_prompt * want.rl.steps, (name, arm)
    md = (res / f"repro_{name}.md").read_text()
    assert md.count("\n| ") == len(study.arms) + 1         # header + one row per arm


def test_smoke_form_of_every_study(tmp_path, monkeypatch):
  """Every arm of every study, one RL step of a tiny model each, in this process.

  All studies start from one randomly initialised policy (no SFT, so nothing is written to the
  warm-start cache) and share compiled programs, compiled with few optimisations, through a
  persistent cache in the project's cache folder, where a later run reads them back (the
  datasets, too, are the cached ones); the runs' learning-curve PNGs are skipped.
  """
  from rollouts_jax import tasks
  from rollouts_jax.training import loop
  jax_cache = tasks.cache_root() / "jax_cache"
  monkeypatch.setattr(loop, "plot_curves", lambda *a, **k: [])
  warm = rp.random_warm_start(tmp_path / "warm")
  with rp.persistent_compile_cache(jax_cache, optimize=False):
    log = []
    docs = rp.run_studies(list(rp.STUDIES), seeds=3, smoke=True, warm_start=warm, runs_dir=tmp_path / "runs",
                          results_dir=tmp_path / "res", plot=False, log=log.append)
  _check_smoke_tables(tmp_path / "res", docs, tmp_path / "runs" / "smoke", log)
  for name in rp.STUDIES:
    config = json.loads((tmp_path / "runs" / "smoke" / name / rp.STUDIES[name].arms[0] / "seed0" /
                         "config.json").read_text())
    assert config["model"]["path"] == str(warm)         # the shared warm start, not an SFT per study


def test_persistent_compile_cache_is_written_and_the_settings_restored(tmp_path):
  import jax
  import jax.numpy as jnp
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_disable_most_optimizations")
  before = [jax.config.values[k] for k in keys]
  with rp.persistent_compile_cache(tmp_path / "jc", optimize=False):
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jc")
    assert jax.config.values["jax_disable_most_optimizations"]
    out = jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
  assert list(out) == [3 * i + 1 for i in range(7)]
  assert any((tmp_path / "jc").iterdir())                  # the program was written there
  assert [jax.config.values[k] for k in keys] == before


@pytest.mark.slow
def test_smoke_form_of_every_arm_with_each_study_s_sft_warm_start(tmp_path, monkeypatch):
  """As the default smoke test, with each study's own SFT warm start and the plots; minutes."""
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  log = []
  docs = rp.run_studies(list(rp.STUDIES), seeds=1, smoke=True, runs_dir=tmp_path / "runs",
                        results_dir=tmp_path / "res", plot=True, log=log.append)
  _check_smoke_tables(tmp_path / "res", docs, tmp_path / "runs" / "smoke", log)
  assert all((tmp_path / "res" / f"repro_{n}.png").exists() for n in rp.STUDIES)
  for name in rp.STUDIES:
    config = json.loads((tmp_path / "runs" / "smoke" / name / rp.STUDIES[name].arms[0] / "seed0" /
                         "config.json").read_text())
    assert "warmstart" in config["model"]["path"]      # the study's own SFT warm start
