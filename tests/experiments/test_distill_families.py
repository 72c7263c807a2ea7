"""experiments/studies/distill_study.py: each loss's windowed arms are judged against that loss's full-rollout OPD."""

from conftest import load_script

ds = load_script("studies.distill_study")


def _result(arm, seed, after, tokens, before=0.45, teacher=0.95):
  return {"arm": arm, "seed": seed, "pass@1 before": before, "pass@1 after": after,
          "pass@1 gap closed": ds.gap_closed(before, after, teacher), "generated_tokens": tokens,
          "curve": [[0, 0, before], [160, tokens, after]]}


def test_full_kl_arms_are_judged_against_full_kl_opd_and_sampled_ones_against_opd():
  results = [_result("opd", s, a, 20000) for s, a in enumerate((0.50, 0.52, 0.51))]          # 12 % of the gap
  results += [_result("opd_full", s, a, 20000) for s, a in enumerate((0.80, 0.82, 0.84))]    # 74 %
  results += [_result("esr_full", s, a, 6000) for s, a in enumerate((0.81, 0.82, 0.83))]     # as good as opd_full
  results += [_result("esr", s, a, 6000) for s, a in enumerate((0.50, 0.51, 0.52))]          # as good as opd
  results += [_result("adwin_fwd", s, a, 6000) for s, a in enumerate((0.81, 0.82, 0.83))]    # no opd_fwd ran
  v = ds.verdict(ds.aggregate(results))
  assert v["approaches"][0] is False and v["approaches_by"]["opd_full"][0] is True
  assert "opd_fwd" not in v["approaches_by"] and "adwin_fwd" not in v["fraction"]
  assert v["fraction"]["esr_full"][0] is True and "OPD, full KL 0.820" in v["fraction"]["esr_full"][1]
  assert v["fraction"]["esr"][0] is True and "vs OPD 0.510" in v["fraction"]["esr"][1]
  # At an equal budget each windowed arm reads its own family's reference curve.
  m = ds.matched_budget(results, "esr_full", ds.REFERENCE["esr_full"])
  assert abs(m["reference_at_budget"] - (0.45 + (0.82 - 0.45) * 6000 / 20000)) < 1e-9


def test_the_report_states_each_familys_verdicts(tmp_path):
  results = [_result("opd", s, a, 20000) for s, a in enumerate((0.50, 0.52, 0.51))]
  results += [_result("opd_full", s, a, 20000) for s, a in enumerate((0.80, 0.82, 0.84))]
  results += [_result("adwin_full", s, a, 19000) for s, a in enumerate((0.81, 0.82, 0.83))]   # 95 % of the tokens
  for r in results:
    r.update({"greedy after": 0.9, "greedy gap closed": 0.5, "probe_tokens": 0.0, "teacher_scored_tokens": 1.0,
              "tokens_to_half_gap": None, "mean_window": None, "wall_s": 1.0})
  doc = ds.write_outputs(results, tmp_path, teacher_gap={}, student_steps=275, teacher_steps=400, planned_seeds=3,
                         plot=False)
  text = (tmp_path / "distill.md").read_text()
  assert "Student approaches the teacher: **did not hold**" in text
  assert "Student approaches the teacher (OPD, full KL): **held**" in text
  assert "ADWIN (k0=12), full KL at a fraction of OPD, full KL's tokens: **did not hold**" in text
  assert "adwin_full" in doc["matched_budget"] and "opd_full" not in doc["matched_budget"]
