"""experiments/studies/april_parity.py: a run's record from its files, APRIL's accounting, the parity verdict."""

import json

from conftest import load_script


ap = load_script("studies.april_parity")
B, N = 8, 8


def _april_rows(steps, rng_fresh, drop_at=None):
  """APRIL-like step rows: 12 requests a step (stored groups first), 8 used, the rest stored."""
  rows, stored = [], 0
  for t in range(1, steps + 1):
    fresh = 12 - stored
    now = stored + fresh - B
    if drop_at == t:   # one stored group lost: the store holds one fewer than the balance says
      now -= 1
    rows.append({"step": t, "reward_mean": 0.1 * rng_fresh[t - 1], "rollouts": float(fresh * N),
                 "groups": float(B), "april/stored_groups": float(now), "time/sample": 1.0 + t / 100,
                 "time/update": 0.5, "rollout/padding_frac": 0.2, "generated_tokens": 1500.0,
                 "april/off_policy_token_frac": 0.4})
    stored = now
  return rows


def _workdir(tmp_path, name, rows, before=0.40, after=0.45, extra_lines=()):
  d = tmp_path / name
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"rollout": {"num_samples": N}, "control": {"prompts_per_step": B}}))
  (d / "summary.json").write_text(json.dumps({"before": {"eval/pass@1": before}, "after": {"eval/pass@1": after}}))
  lines = [json.dumps({"step": 0, "eval/pass@1": before})] + [json.dumps(r) for r in rows] + list(extra_lines)
  (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  return d


def test_april_accounting_balances_and_a_dropped_group_is_caught(tmp_path):
  rows = _april_rows(10, list(range(10)))
  rec = ap.run_result(_workdir(tmp_path, "ok", rows))
  # 12 requested at step 1, then 8 fresh a step (4 resumed): 12 + 9 * 8 = 84 = 80 used + 4 stored.
  assert (rec["groups_started"], rec["groups_used"], rec["groups_stored_end"]) == (84, 80, 4)
  assert rec["groups_dropped"] == 0 and rec["balance_violations"] == 0
  bad = ap.run_result(_workdir(tmp_path, "bad", _april_rows(10, list(range(10)), drop_at=5)))
  assert bad["balance_violations"] == 1
  assert bad["groups_dropped"] == 1


def test_sync_runs_store_nothing_and_resumed_steps_count_once(tmp_path):
  rows = [{"step": t, "reward_mean": t / 10, "rollouts": 64.0, "groups": 8.0, "time/sample": 0.1,
           "rollout/padding_frac": 0.3, "generated_tokens": 1800.0} for t in range(1, 11)]
  # A resumed run rewrote steps 9 and 10 (the last row written wins).
  again = [json.dumps(dict(r, reward_mean=5.0)) for r in rows[8:]]
  rec = ap.run_result(_workdir(tmp_path, "sync", rows, extra_lines=again))
  assert rec["steps"] == 10 and len(rec["reward_curve"]) == 10
  assert rec["reward_curve"][:8] == [t / 10 for t in range(1, 9)] and rec["reward_curve"][8:] == [5.0, 5.0]
  assert rec["reward_last10"] == sum(rec["reward_curve"]) / 10
  assert (rec["groups_started"], rec["groups_used"], rec["groups_stored_end"], rec["groups_dropped"]) == (80, 80, 0, 0)
  assert abs(rec["pass@1 gain"] - (rec["pass@1 after"] - rec["pass@1 before"])) < 1e-12


def _run(arm, seed, after, reward, dropped=0, sample_s=1.0):
  return {"arm": arm, "seed": seed, "pass@1 before": 0.45, "pass@1 after": after, "pass@1 gain": after - 0.45,
          "reward_last10": reward, "reward_mean": reward, "sample_s_per_step": sample_s, "padding_frac": 0.2,
          "groups_dropped": dropped, "groups_started": 100, "groups_used": 96, "groups_stored_end": 4 - dropped,
          "reward_curve": [reward] * 5}


def test_verdict_parity_within_noise_held_clear_loss_not_held_one_seed_inconclusive():
  sync = [_run("sync", s, a, r, sample_s=0.5) for s, (a, r) in enumerate([(0.44, 0.40), (0.47, 0.42), (0.45, 0.38)])]
  close = [_run("april", s, a, r) for s, (a, r) in enumerate([(0.45, 0.39), (0.43, 0.41), (0.46, 0.40)])]
  held, text = ap.verdict(ap.aggregate(sync + close))
  assert held is True, text
  worse = [_run("april", s, a, r) for s, (a, r) in enumerate([(0.30, 0.20), (0.31, 0.22), (0.29, 0.21)])]
  held, text = ap.verdict(ap.aggregate(sync + worse))
  assert held is False and "pass@1" in text and "training reward" in text
  dropped = [dict(r, groups_dropped=1) if r["seed"] == 1 else r for r in close]
  assert ap.verdict(ap.aggregate(sync + dropped))[0] is False
  assert ap.verdict(ap.aggregate(sync[:1] + close[:1]))[0] is None
  assert ap.verdict(ap.aggregate(sync))[0] is None
  # The rollout-time ratio is sync / APRIL: 0.5 s vs 1.0 s a step.
  assert abs(ap.ratio(ap.aggregate(sync + close), "rollout s/step") - 0.5) < 1e-12


def test_outputs_name_every_run_and_agree_with_the_verdict(tmp_path):
  runs = [_run("sync", s, 0.45 + s / 100, 0.4) for s in range(3)] + [_run("april", s, 0.44 + s / 100, 0.4)
                                                                    for s in range(2)]
  doc = ap.write_outputs(runs, tmp_path, planned_seeds=3, missing=["april/seed2"], plot=False)
  saved = json.loads((tmp_path / "april_parity.json").read_text())
  assert saved["held"] == doc["held"] and saved["arms"]["april"]["pass@1 after"]["n"] == 2
  md = (tmp_path / "april_parity.md").read_text()
  assert {True: "parity held", False: "parity did not hold", None: "parity inconclusive"}[doc["held"]] in md
  for r in runs:
    assert f"| {r['arm']} | {r['seed']} |" in md
  assert "april/seed2" in md
