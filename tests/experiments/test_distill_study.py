"""experiments/studies/distill_study.py: curves, token counts, gap closure and verdicts on hand-made runs."""

import json
import math

import pytest

from conftest import load_script

ds = load_script("studies.distill_study")

TEACHER = {"eval/pass@1": 0.95, "eval/greedy_accuracy": 0.99, "eval/pass@4": 1.0}


def _rows(tokens_per_step, evals, steps=80, probe_every=0, probe_tokens=0, window=None):
  """Metrics rows of a hand-made run: constant tokens a step, mid-run evaluations at given steps."""
  rows = [{"step": 0, "eval/pass@1": 0.45}]   # the "before" row carries no reward_mean
  for s in range(1, steps + 1):
    r = {"step": s, "reward_mean": 0.5, "generated_tokens": float(tokens_per_step), "time/sample": 1.0,
         "time/update": 0.5, "distill/reverse_kl": 1.0 / s}
    if probe_every and (s - 1) % probe_every == 0:
      r["generated_tokens"] += probe_tokens
      r["distill/probe_tokens"] = float(probe_tokens)
    if window is not None:
      r["distill/window"] = float(window)
    if s in evals:
      r["eval/pass@1"] = evals[s]
    rows.append(r)
  rows.append({"step": steps, "eval/pass@1": 0.9})   # the "after" row, logged apart
  return rows


def _summary(before, after, greedy_before=0.8, greedy_after=0.95):
  return {"before": {"eval/pass@1": before, "eval/greedy_accuracy": greedy_before, "eval/pass@4": 0.8},
          "after": {"eval/pass@1": after, "eval/greedy_accuracy": greedy_after, "eval/pass@4": 0.9}}


def test_curve_accumulates_tokens_and_places_evaluations_at_their_steps():
  rows = _rows(100, {20: 0.6, 40: 0.7, 60: 0.8})
  curve = ds.curve_from_rows(rows, 0.45, 0.9)
  assert curve == [(0, 0, 0.45), (20, 2000, 0.6), (40, 4000, 0.7), (60, 6000, 0.8), (80, 8000, 0.9)]


def test_a_resumed_run_counts_a_rewritten_step_once():
  rows = _rows(100, {20: 0.6})
  rows.insert(15, dict(rows[10]))   # step 10 logged twice (killed after logging, resumed before the checkpoint)
  assert ds.curve_from_rows(rows, 0.45, 0.9)[-1] == (80, 8000, 0.9)


def test_tokens_to_reach_interpolates_and_takes_the_first_crossing():
  curve = [(0, 0, 0.4), (20, 1000, 0.8), (40, 2000, 0.5), (60, 3000, 0.9)]
  assert ds.tokens_to_reach(curve, 0.6) == pytest.approx(500.0)   # first crossing, not the later one
  assert ds.tokens_to_reach(curve, 0.3) == 0.0
  assert ds.tokens_to_reach(curve, 0.95) is None
  # The interpolated count is monotone in the level.
  levels = [0.41, 0.5, 0.6, 0.7, 0.8]
  counts = [ds.tokens_to_reach(curve, lv) for lv in levels]
  assert counts == sorted(counts)


def test_gap_closed_is_zero_at_the_start_and_one_at_the_teacher():
  assert ds.gap_closed(0.45, 0.45, 0.95) == 0.0
  assert ds.gap_closed(0.45, 0.95, 0.95) == pytest.approx(1.0)
  assert ds.gap_closed(0.45, 0.2, 0.95) < 0
  assert ds.gap_closed(0.95, 0.97, 0.95) is None   # no gap to close


def test_run_summary_separates_probe_tokens_and_counts_teacher_scored_tokens():
  rows = _rows(200, {20: 0.6, 40: 0.7, 60: 0.75}, probe_every=5, probe_tokens=1000, window=12)
  r = ds.run_summary(_summary(0.45, 0.8), rows, teacher=TEACHER, distill=True)
  assert r["probe_tokens"] == 16 * 1000
  assert r["generated_tokens"] == 80 * 200 + 16 * 1000
  assert r["trained_tokens"] == 80 * 200
  assert r["teacher_scored_tokens"] == r["generated_tokens"]
  assert r["pass@1 gap closed"] == pytest.approx((0.8 - 0.45) / (0.95 - 0.45))
  assert r["greedy gap closed"] == pytest.approx((0.95 - 0.8) / (0.99 - 0.8))
  assert r["half_gap_level"] == pytest.approx(0.7)
  # 0.7 is reached at the step-40 evaluation; tokens then: 40 * 200 plus the probes of steps 1, 6, ..., 36 (8).
  assert r["tokens_to_half_gap"] == pytest.approx(40 * 200 + 8 * 1000)
  assert r["mean_window"] == 12.0
  assert r["reverse_kl_first10"] > r["reverse_kl_last10"]
  reward_run = ds.run_summary(_summary(0.45, 0.5), _rows(300, {}), teacher=TEACHER, distill=False)
  assert reward_run["teacher_scored_tokens"] == 0.0
  assert reward_run["tokens_to_half_gap"] is None   # never reached 0.7


def _result(arm, seed, after, tokens, before=0.45, half=None):
  return {"arm": arm, "seed": seed, "pass@1 before": before, "pass@1 after": after,
          "pass@1 gap closed": ds.gap_closed(before, after, 0.95), "greedy after": 0.95, "greedy gap closed": 0.5,
          "generated_tokens": tokens, "probe_tokens": 0.0, "teacher_scored_tokens": tokens,
          "tokens_to_half_gap": half, "mean_window": None, "wall_s": 100.0,
          "curve": [[0, 0, before], [80, tokens, after]]}


def test_aggregate_averages_seeds_and_counts_those_that_reached_half_the_gap():
  results = [_result("opd", 0, 0.80, 20000, half=9000), _result("opd", 1, 0.84, 22000, half=11000),
             _result("esr", 0, 0.70, 6000, half=3000), _result("esr", 1, 0.60, 6000)]
  t = ds.aggregate(results)
  assert list(t) == ["opd", "esr"]
  assert t["opd"]["pass@1 after"]["mean"] == pytest.approx(0.82)
  assert t["opd"]["pass@1 after"]["spread"] == pytest.approx(math.sqrt(2) * 0.02)
  assert t["opd"]["tokens to half gap"]["mean"] == pytest.approx(10000)
  assert t["opd"]["reached half gap"] == 2
  assert t["esr"]["reached half gap"] == 1
  assert t["esr"]["tokens to half gap"]["mean"] == pytest.approx(3000)   # the seed that reached it


def test_verdict_holds_only_for_arms_that_match_opd_at_a_fraction_of_its_tokens():
  results = [_result("opd", s, a, 20000) for s, a in enumerate((0.80, 0.82, 0.84))]
  results += [_result("esr", s, a, 6000) for s, a in enumerate((0.81, 0.82, 0.83))]       # as good, 30 %
  results += [_result("adwin", s, a, 15000) for s, a in enumerate((0.81, 0.82, 0.83))]   # as good, 75 %
  results += [_result("esr24", s, a, 8000) for s, a in enumerate((0.60, 0.61, 0.62))]    # cheap but worse
  v = ds.verdict(ds.aggregate(results))
  assert v["approaches"][0] is True   # (0.82 - 0.45) / 0.5 = 74 % of the gap
  assert v["fraction"]["esr"][0] is True
  assert v["fraction"]["adwin"][0] is False
  assert v["fraction"]["esr24"][0] is False
  stalled = [_result("opd", s, a, 20000) for s, a in enumerate((0.50, 0.52, 0.48))]
  assert ds.verdict(ds.aggregate(stalled))["approaches"][0] is False   # 10 % of the gap
  assert ds.verdict(ds.aggregate([_result("esr", 0, 0.8, 10)]))["approaches"][0] is None   # no OPD run
  assert "se 0.0" in v["approaches"][1]   # three seeds: the gain's standard error
  flat = [_result("opd", s, a, 20000) for s, a in enumerate((0.44, 0.46, 0.45))]          # OPD learned nothing
  flat += [_result("esr", s, a, 6000) for s, a in enumerate((0.45, 0.44, 0.46))]
  ok, why = ds.verdict(ds.aggregate(flat))["fraction"]["esr"]
  assert ok is None and "not judged" in why
  one = ds.verdict(ds.aggregate([_result("opd", 0, 0.8, 20000)]))["approaches"][1]
  assert "one seed: no standard error" in one and "se 0.000" not in one


def test_outputs_are_written_and_the_table_names_every_arm(tmp_path):
  results = [_result("opd", 0, 0.8, 20000, half=9000), _result("esr", 0, 0.78, 6000, half=2500)]
  gap = {"275": {"eval/pass@1": 0.45, "eval/greedy_accuracy": 0.83, "eval/pass@4": 0.84},
         "400": {"eval/pass@1": 0.95, "eval/greedy_accuracy": 0.99, "eval/pass@4": 1.0}}
  doc = ds.write_outputs(results, tmp_path, teacher_gap=gap, student_steps=275, teacher_steps=400, planned_seeds=1,
                         missing=["adwin/seed0"], plot=False)
  assert doc["teacher_pass@1"] == 0.95
  assert json.loads((tmp_path / "distill.json").read_text())["verdict"] == json.loads(json.dumps(doc["verdict"]))
  md = (tmp_path / "distill.md").read_text()
  for label in (ds.LABELS["opd"], ds.LABELS["esr"], "| 400 | teacher | 0.950", "adwin/seed0"):
    assert label in md


def test_kl_share_is_monotone_in_the_window_and_whole_at_the_full_length():
  rng = __import__("numpy").random.default_rng(0)
  kl = rng.exponential(0.2, size=(16, 10))
  lengths = rng.integers(3, 11, size=16)
  mask = __import__("numpy").arange(10)[None, :] < lengths[:, None]
  out = ds.kl_share(kl, mask, [1, 3, 6, 10])
  shares = [out[k] for k in ("1", "3", "6", "10")]
  assert shares == sorted(shares)
  assert out["10"] == pytest.approx(1.0)
  assert out["mean_length"] == pytest.approx(lengths.mean())
  assert out["total"] == pytest.approx((kl * mask).sum(-1).mean())   # padding carries nothing


def test_matched_budget_reads_the_reference_curve_at_the_arms_token_count():
  opd = [_result("opd", s, 0.8, 20000) for s in (0, 1)]   # curves: 0.45 at 0 tokens -> 0.8 at 20000
  esr = [_result("esr", 0, 0.6, 5000), _result("esr", 1, 0.7, 10000), _result("esr", 2, 0.9, 10000)]
  m = ds.matched_budget(opd + esr, "esr")
  assert m["seeds"] == [0, 1]   # seed 2 has no OPD run to compare with
  assert m["arm_after"] == pytest.approx(0.65)
  assert m["reference_at_budget"] == pytest.approx((0.45 + 0.35 * 0.25 + 0.45 + 0.35 * 0.5) / 2)
  assert ds.value_at_tokens([[0, 0, 0.4], [80, 100, 0.5]], 200) is None   # past the reference's end
  assert ds.matched_budget(esr, "esr") is None
  dear = ds.matched_budget(opd + [_result("adwin", 0, 0.7, 25000)], "adwin")   # more tokens than OPD used
  assert dear["reference_at_budget"] == pytest.approx(0.8)   # OPD's final value


def test_first_divergence_and_error_summary_place_mistakes_against_the_windows():
  ref = "7+9+0=16\n4+8+1=13\n<answer>136</answer>"
  assert ds.first_divergence(ref, ref) == len(ref)
  assert ds.first_divergence("7+9+0=15\n", ref) == 7              # a wrong digit
  assert ds.first_divergence("7+9+0=16\n4+8", ref) == 12          # stopped early: where it ran out
  assert ds.first_divergence(ref.replace("136", "146"), ref) == ref.index("136") + 1
  out = ds.error_summary({0: 7, 1: 30, 4: 12, 9: 11}, 20, [12, 24], teacher_wrong={1, 4, 5})
  assert out == {"prompts": 20, "wrong": 4, "median_position": 12, "shared": 2, "12": 0.5, "24": 0.75}
  assert ds.error_summary({}, 20, [12]) == {"prompts": 20, "wrong": 0, "median_position": None, "shared": 0,
                                            "12": None}


def test_the_report_tabulates_where_each_policy_goes_wrong(tmp_path):
  errors = {"start": ds.error_summary({0: 8, 1: 8, 2: 30}, 200, [12, 24], teacher_wrong={0}),
            "esr": ds.error_summary({0: 9, 3: 26, 4: 27, 5: 40}, 200, [12, 24], teacher_wrong={0})}
  doc = ds.write_outputs([_result("opd", 0, 0.8, 20000)], tmp_path, teacher_gap={}, student_steps=275,
                         teacher_steps=400, planned_seeds=1, plot=False, errors=errors)
  assert doc["error_positions"] == errors
  md = (tmp_path / "distill.md").read_text()
  assert "| student (start) | 3 | 1 | 8 | 67% | 67% | n/a |" in md   # measured before `in_answer` existed
  assert f"| {ds.LABELS['esr']} | 4 | 1 | 27 | 25% | 25% | n/a |" in md
  errors["esr"] = ds.error_summary({0: 9, 3: 26, 4: 27, 5: 40}, 200, [12, 24], teacher_wrong={0},
                                   answer_start={0: 24, 3: 24, 4: 30, 5: 30})
  ds.write_outputs([_result("opd", 0, 0.8, 20000)], tmp_path, teacher_gap={}, student_steps=275,
                   teacher_steps=400, planned_seeds=1, plot=False, errors=errors)
  assert f"| {ds.LABELS['esr']} | 4 | 1 | 27 | 25% | 25% | 50% |" in (tmp_path / "distill.md").read_text()


def test_the_multiplication_variant_of_the_arms(monkeypatch):
  from rollouts_jax.training import config as config_lib
  arms = str(ds.REPO / ds.CONFIG)
  add = config_lib.load_config_file(arms, "esr16_full_lr3")
  mul = config_lib.load_config_file(arms, "esr16_full_lr3,mul")
  assert (add.data.ops, mul.data.ops, mul.data.difficulty) == ("+", "*", 2)
  assert (mul.rollout.distill, mul.rollout.generator, mul.rollout.generator_kwargs, mul.rl.learning_rate) == (
      "opd_full", "esr", "window=16", 3e-4)
  assert (add.rollout.teacher_sft_steps, mul.rollout.teacher_sft_steps) == (400, 600)
  assert (add.sft.steps, mul.sft.steps) == (275, 450)   # each task's student
  assert mul.rollout.max_new_tokens == 56 and mul.data.num_train == 8000
  assert config_lib.load_config_file(arms, "mul,smoke").data.ops == "*"   # the smoke form keeps the task
  monkeypatch.setattr(ds, "TASK", "mul")
  assert ds._config_arg("adwin_full_lr3", True) == "adwin_full_lr3,mul,smoke"
  assert ds._exp("opd", False).data.ops == "*"
  with pytest.raises(ValueError, match="mul"):
    config_lib.load_config_file(arms, "opd,esr")
  strong = config_lib.load_config_file(arms, "esr16_full_long,mul,strong")
  assert (strong.data.ops, strong.sft.steps, strong.rollout.teacher_sft_steps) == ("*", 800, 1200)
  assert (strong.rollout.generator_kwargs, strong.rl.learning_rate, strong.rl.steps) == ("window=16", 1.5e-4, 320)
  with pytest.raises(ValueError, match="variant of 'mul'"):
    config_lib.load_config_file(arms, "opd,strong")
  monkeypatch.setattr(ds, "TASK", "mul_strong")
  assert ds._config_arg("opd_full_long", False) == "opd_full_long,mul,strong"
  assert ds.REFERENCE["esr16_full_long"] == "opd_full_long"


def test_every_study_arm_is_an_arm_of_the_config_with_a_label_and_a_reference():
  """The study's arm lists (priority order, labels, families) and the config's arms stay one set."""
  from rollouts_jax.training import config as config_lib
  arms = str(ds.REPO / ds.CONFIG)
  for arm in ds.ARMS:
    config_lib.load_config_file(arms, arm + ",smoke")   # a word the config does not know raises
    assert arm in ds.LABELS
  assert set(ds.REFERENCE) | set(ds.FAMILIES) <= set(ds.ARMS)
