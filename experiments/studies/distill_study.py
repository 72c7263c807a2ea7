r"""On-policy distillation in miniature: does the student approach the teacher, and at what token cost?

  python -m experiments.studies.distill_study --gap --gap_steps=275,400,600   # warm starts' held-out accuracy
  python -m experiments.studies.distill_study --seeds=3 --stop_at=13:15        # the sweep (resumable)
  python -m experiments.studies.distill_study --report_only                    # tables from finished runs

The arms are `configs/distill_arms.py:ARM` (the reproduction miniature: 8 prompts a step, here
160 RL steps, a 200-prompt held-out evaluation at 4 samples, temperature 1): full-rollout OPD,
ESR (only the first k tokens generated and trained), ADWIN (k re-sized from full-rollout
probes) and, for reference, GRPO on the task reward (METHODS 9.6; GKD, Agarwal et al. 2024).
The student is the SFT warm start (275 steps); the teacher the same recipe trained longer
(`rollout.teacher_sft_steps`). Every seed starts from seed 0's student and distils from seed
0's teacher (each passed as a fixed folder), so seeds differ only in the RL run.

Runs go one training process at a time, seed-major (seed 0 of every arm first), each in its
own workdir (`--runs_dir/ARM/seedS`); a run whose `result.json` exists is reused and a killed
one resumes from its last checkpoint. Writes `experiments/studies/results/distill.{json,md,png}`:
per arm, held-out pass@1 before/after (sampled and greedy), the fraction of the teacher gap
closed, generated and teacher-scored tokens, the tokens at which the held-out curve first
reaches half the gap, wall time, and a verdict under a stated rule; the plot is held-out
pass@1 against generated tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import tempfile
import time
from typing import Any, Callable, Collection, Sequence

from experiments.studies import harness

REPO = harness.REPO
RESULTS = harness.RESULTS
CONFIG = "configs/distill_arms.py"
# The task of the study (`--task`): "add" (the default arithmetic), "mul" (`distill_arms.py`'s `mul`
# variant) or "mul_strong" (its `mul,strong`: a student and a teacher trained further); set once by `main`.
TASK = "add"
TASK_TEXT = {"add": "Arithmetic (3-digit addition, worked carries, answers up to 40 tokens)",
             "mul": "Arithmetic (multiplication of 1-2 digit numbers, a worked partial product per digit of the "
                    "multiplier and then their sums, answers up to 56 tokens)"}
TASK_TEXT["mul_strong"] = TASK_TEXT["mul"]
TASK_ARG = {"add": "", "mul": ",mul", "mul_strong": ",mul,strong"}   # the task's words of `distill_arms.py`
# Priority order within a seed; "_full": the full-vocabulary reverse-KL loss on the same rollouts.
ARMS = ("opd", "esr", "adwin", "opd_lr3", "esr24", "grpo", "opd_full", "esr_full", "adwin_full", "esr24_full",
        "opd_full_lr6", "esr_full_lr6", "adwin_full_lr6", "opd_fwd", "esr_fwd", "adwin_fwd", "esr24_fwd",
        "opd_fwd_lr6", "esr_fwd_lr6", "adwin_fwd_lr6", "opd_full_lr3", "esr_full_lr3", "esr24_full_lr3",
        "adwin_full_lr3", "esr16_full_lr3", "opd_full_long", "opd_full_lr3_long", "opd_lr3_long",
        "esr_full_lr3_long", "esr16_full_lr3_long", "opd_full_lr10", "esr_full_lr10", "esr16_full_lr10",
        "esr16_full_long")
DISTILL_ARMS = tuple(a for a in ARMS if a != "grpo")
LABELS = {"opd": "OPD (full rollouts)", "opd_lr3": "OPD, lr 3e-4", "esr": "ESR k=12", "esr24": "ESR k=24", "adwin": "ADWIN (k0=12)",
          "grpo": "GRPO (task reward)", "opd_full": "OPD, full KL", "esr_full": "ESR k=12, full KL",
          "esr24_full": "ESR k=24, full KL", "adwin_full": "ADWIN (k0=12), full KL",
          "opd_full_lr6": "OPD, full KL, lr 6e-4", "esr_full_lr6": "ESR k=12, full KL, lr 6e-4",
          "adwin_full_lr6": "ADWIN (k0=12), full KL, lr 6e-4", "opd_fwd": "OPD, forward KL",
          "esr_fwd": "ESR k=12, forward KL", "esr24_fwd": "ESR k=24, forward KL",
          "adwin_fwd": "ADWIN (k0=12), forward KL",
          "opd_fwd_lr6": "OPD, forward KL, lr 6e-4", "esr_fwd_lr6": "ESR k=12, forward KL, lr 6e-4",
          "adwin_fwd_lr6": "ADWIN (k0=12), forward KL, lr 6e-4", "opd_full_lr3": "OPD, full KL, lr 3e-4",
          "esr_full_lr3": "ESR k=12, full KL, lr 3e-4", "esr24_full_lr3": "ESR k=24, full KL, lr 3e-4",
          "adwin_full_lr3": "ADWIN (k0=12), full KL, lr 3e-4", "esr16_full_lr3": "ESR k=16, full KL, lr 3e-4",
          "esr_full_lr3_long": "ESR k=12, full KL, lr 3e-4, 320 steps", "opd_full_lr10": "OPD, full KL, lr 1e-3",
          "esr_full_lr10": "ESR k=12, full KL, lr 1e-3", "esr16_full_lr10": "ESR k=16, full KL, lr 1e-3",
          "esr16_full_lr3_long": "ESR k=16, full KL, lr 3e-4, 320 steps", "opd_full_long": "OPD, full KL, 320 steps",
          "esr16_full_long": "ESR k=16, full KL, 320 steps",
          "opd_full_lr3_long": "OPD, full KL, lr 3e-4, 320 steps", "opd_lr3_long": "OPD, lr 3e-4, 320 steps"}

# Each full-rollout reference and the windowed arms trained with the same loss and step size,
# whose token-fraction verdict is taken against it.
FAMILIES = {"opd": ("esr", "esr24", "adwin"), "opd_full": ("esr_full", "esr24_full", "adwin_full"),
            "opd_full_lr6": ("esr_full_lr6", "adwin_full_lr6"), "opd_fwd": ("esr_fwd", "esr24_fwd", "adwin_fwd"),
            "opd_fwd_lr6": ("esr_fwd_lr6", "adwin_fwd_lr6"),
            "opd_full_lr3": ("esr_full_lr3", "esr16_full_lr3", "esr24_full_lr3", "adwin_full_lr3"),
            "opd_full_long": ("esr16_full_long",),
            "opd_full_lr3_long": ("esr_full_lr3_long", "esr16_full_lr3_long"), "opd_lr3_long": (),
            "opd_full_lr10": ("esr_full_lr10", "esr16_full_lr10")}
REFERENCE = {a: ref for ref, arms in FAMILIES.items() for a in arms}



# ---------------------------------------------------------------------------------------------
# Summaries (pure functions of run results; tested on hand-made results)
# ---------------------------------------------------------------------------------------------

def curve_from_rows(rows: Sequence[dict], before: float, after: float) -> list[tuple[int, float, float]]:
  """The held-out learning curve of a run: (RL step, cumulative generated tokens, pass@1) points.

  Args:
    rows: the run's `metrics.jsonl` rows; training rows carry "reward_mean" and
      "generated_tokens", and those of a mid-run evaluation also "eval/pass@1".
    before: held-out pass@1 before RL (the point at step 0, no tokens yet).
    after: held-out pass@1 after the last step.

  Returns:
    Points in step order, starting with (0, 0, before) and ending with the last step's
    cumulative tokens and `after`.

  >>> rows = [{"step": 1, "reward_mean": 0, "generated_tokens": 10},
  ...         {"step": 2, "reward_mean": 0, "generated_tokens": 20, "eval/pass@1": 0.5},
  ...         {"step": 3, "reward_mean": 0, "generated_tokens": 5}]
  >>> curve_from_rows(rows, 0.25, 0.75)
  [(0, 0, 0.25), (2, 30, 0.5), (3, 35, 0.75)]
  """
  steps: dict[int, dict] = {}
  for r in rows:
    if "reward_mean" in r:   # one row per step (a resumed run may have rewritten some)
      steps[int(r["step"])] = r
  points, total = [(0, 0, float(before))], 0
  last = max(steps, default=0)
  for s in sorted(steps):
    total += int(steps[s].get("generated_tokens", 0))
    if s == last:
      points.append((s, total, float(after)))
    elif "eval/pass@1" in steps[s]:
      points.append((s, total, float(steps[s]["eval/pass@1"])))
  return points


def tokens_to_reach(curve: Sequence[Sequence[float]], level: float) -> float | None:
  """Generated tokens at which a held-out curve first reaches `level` (linear between points).

  Args:
    curve: (step, cumulative tokens, pass@1) points in step order.
    level: the pass@1 to reach.

  Returns:
    Tokens (interpolated between the two evaluations around the first crossing), 0 if the
    start is already there, None if the curve never reaches it.

  >>> tokens_to_reach([(0, 0, 0.2), (10, 100, 0.4), (20, 200, 0.8)], 0.6)
  150.0
  >>> tokens_to_reach([(0, 0, 0.2), (10, 100, 0.4)], 0.6) is None
  True
  """
  prev = None
  for _, tok, p in curve:
    if p >= level:
      if prev is None:
        return 0.0
      (t0, p0), (t1, p1) = prev, (tok, p)
      return float(t0 + (t1 - t0) * (level - p0) / (p1 - p0)) if p1 > p0 else float(t1)
    prev = (tok, p)
  return None


def value_at_tokens(curve: Sequence[Sequence[float]], tokens: float) -> float | None:
  """A held-out curve's pass@1 at a token count (linear between evaluations; None past its end).

  >>> value_at_tokens([(0, 0, 0.2), (10, 100, 0.4), (20, 200, 0.8)], 150)
  0.6000000000000001
  """
  prev = None
  for _, tok, p in curve:
    if tok >= tokens:
      if prev is None or tok == prev[0]:
        return float(p)
      return float(prev[1] + (p - prev[1]) * (tokens - prev[0]) / (tok - prev[0]))
    prev = (tok, p)
  return None


def matched_budget(results: Sequence[dict], arm: str, reference: str = "opd") -> dict[str, Any] | None:
  """The reference arm's pass@1 when it had generated as many tokens as `arm` did in all, seed by seed.

  Returns:
    {"arm_after": mean final pass@1 of `arm`, "reference_at_budget": mean pass@1 of the
    reference at that budget (interpolated on its curve; its final value where `arm` used
    more tokens than the whole reference run), "seeds": the seeds both ran}, or None when
    they share no seed.
  """
  ref = {r["seed"]: r for r in results if r["arm"] == reference}
  pairs = [(r, ref[r["seed"]]) for r in results if r["arm"] == arm and r["seed"] in ref]
  vals = [(r["pass@1 after"], value_at_tokens(q["curve"], min(r["generated_tokens"], q["curve"][-1][1])))
          for r, q in pairs]
  vals = [(a, b) for a, b in vals if a is not None and b is not None]
  if not vals:
    return None
  return {"arm_after": sum(a for a, _ in vals) / len(vals), "reference_at_budget": sum(b for _, b in vals) / len(vals),
          "seeds": [r["seed"] for r, _ in pairs]}


def gap_closed(before: float, after: float, teacher: float) -> float | None:
  """(after - before) / (teacher - before): 0 = no progress, 1 = the teacher's accuracy.

  >>> gap_closed(0.5, 0.75, 1.0)
  0.5
  >>> gap_closed(0.9, 0.95, 0.9) is None
  True
  """
  if teacher is None or teacher - before <= 1e-9:
    return None
  return (after - before) / (teacher - before)


def run_summary(summary: dict, rows: Sequence[dict], *, teacher: dict, distill: bool) -> dict[str, Any]:
  """A finished run's numbers from its `summary.json` and `metrics.jsonl` rows.

  Args:
    summary: {"before": {...}, "after": {...}} held-out metrics ("eval/pass@1",
      "eval/greedy_accuracy", ...).
    rows: the metrics rows (see `curve_from_rows`); distillation rows may carry
      "distill/probe_tokens", "distill/window" and "distill/reverse_kl".
    teacher: the teacher's held-out metrics (same evaluation).
    distill: whether the teacher scored the run's rollouts (then every generated token,
      probes included, is teacher-scored).

  Returns:
    pass@1 / greedy before, after and gain, the fraction of the teacher gap closed (both),
    generated, probe, trained and teacher-scored tokens, the curve, the tokens to half the
    sampled pass@1 gap, mean window, mean train-time reverse KL of the first and last 10
    steps, and median sample/update seconds per step.
  """
  steps = {}
  for r in rows:
    if "reward_mean" in r:
      steps[int(r["step"])] = r
  steps = [steps[k] for k in sorted(steps)]
  out: dict[str, Any] = {}
  for name, key in (("pass@1", "eval/pass@1"), ("greedy", "eval/greedy_accuracy"), ("pass@4", "eval/pass@4")):
    b, a = summary.get("before", {}).get(key), summary.get("after", {}).get(key)
    out[f"{name} before"], out[f"{name} after"] = b, a
    out[f"{name} gain"] = None if a is None or b is None else a - b
    t = teacher.get(key)
    out[f"{name} teacher"] = t
    out[f"{name} gap closed"] = None if a is None or b is None else gap_closed(b, a, t)
  gen = sum(float(r.get("generated_tokens", 0.0)) for r in steps)
  probe = sum(float(r.get("distill/probe_tokens", 0.0)) for r in steps)
  out.update(generated_tokens=gen, probe_tokens=probe, trained_tokens=gen - probe,
             teacher_scored_tokens=gen if distill else 0.0, steps=len(steps))
  curve = curve_from_rows(rows, out["pass@1 before"] or 0.0, out["pass@1 after"] or 0.0)
  out["curve"] = [list(p) for p in curve]
  b, t = out["pass@1 before"], out["pass@1 teacher"]
  half = None if b is None or t is None or t <= b else b + 0.5 * (t - b)
  out["half_gap_level"] = half
  out["tokens_to_half_gap"] = None if half is None else tokens_to_reach(curve, half)

  def mean_of(key, part=slice(None)):
    vals = [float(r[key]) for r in steps[part] if key in r]
    return sum(vals) / len(vals) if vals else None

  def median_of(key):
    vals = sorted(float(r[key]) for r in steps if key in r)
    return vals[len(vals) // 2] if vals else None

  out["mean_window"] = mean_of("distill/window")
  out["reverse_kl_first10"] = mean_of("distill/reverse_kl", slice(0, 10))
  out["reverse_kl_last10"] = mean_of("distill/reverse_kl", slice(-10, None))
  out["sample_s_per_step"] = median_of("time/sample")
  out["update_s_per_step"] = median_of("time/update")
  return out


COLUMNS = {   # {column: run key}; the table's columns in order
    "pass@1 before": "pass@1 before", "pass@1 after": "pass@1 after", "gap closed (pass@1)": "pass@1 gap closed",
    "greedy after": "greedy after", "gap closed (greedy)": "greedy gap closed",
    "generated tokens": "generated_tokens", "probe tokens": "probe_tokens",
    "teacher-scored tokens": "teacher_scored_tokens", "tokens to half gap": "tokens_to_half_gap",
    "mean window": "mean_window", "wall s": "wall_s"}


def aggregate(results: Sequence[dict], arms: Sequence[str] = ARMS) -> dict[str, dict[str, Any]]:
  """{arm: {column: mean_spread(...) + per-seed values, "seeds", "reached half gap"}}.

  `tokens to half gap` is averaged over the seeds that reached it; "reached half gap"
  counts them (a seed that never reached it has no token count).
  """
  table = harness.aggregate(results, arms, COLUMNS)
  for arm, row in table.items():
    row["reached half gap"] = sum(r.get("tokens_to_half_gap") is not None for r in results if r["arm"] == arm)
  return table


_mean = harness.mean_se


def verdict(table: dict, *, token_fraction: float = 0.5) -> dict[str, Any]:
  """The two halves of the claim, each True / False / None (not enough runs) with its reason.

  approaches: full-rollout OPD closes at least half of the student-teacher gap in held-out
    pass@1 (mean over seeds), with a gain above two standard errors (above 0 with one seed).
  fraction[arm] for ESR / ADWIN arms: held when the arm ends within two standard errors
    (at least 0.02) of OPD's final pass@1 or above it, having generated at most
    `token_fraction` of OPD's tokens; None (not judged) when it would hold but OPD's own gain
    is not above two standard errors (matching a reference that did not learn shows nothing).
  approaches_by[ref]: the same rule for every full-rollout arm of `FAMILIES` that ran (the
    single-sample "opd" one is `approaches`); the fraction of a windowed arm of another loss
    is taken against its own family's full-rollout arm (`REFERENCE`).

  >>> t = {"opd": {"gap closed (pass@1)": {"mean": 0.6, "se": 0.05}, "pass@1 after": {"mean": 0.8, "se": 0.01},
  ...              "pass@1 before": {"mean": 0.45, "se": 0.0}, "generated tokens": {"mean": 1000, "se": 0}},
  ...      "esr": {"pass@1 after": {"mean": 0.79, "se": 0.01}, "generated tokens": {"mean": 300, "se": 0}}}
  >>> v = verdict(t)
  >>> v["approaches"][0], v["fraction"]["esr"][0]
  (True, True)
  """
  out: dict[str, Any] = {"fraction": {}, "approaches_by": {}}
  for ref, windowed in FAMILIES.items():
    name = "OPD" if ref == "opd" else LABELS[ref]
    closed, _ = _mean(table, ref, "gap closed (pass@1)")
    before, before_se = _mean(table, ref, "pass@1 before")
    after, after_se = _mean(table, ref, "pass@1 after")
    learned = False
    if after is None:
      approaches = (None, f"{name} has not run")
    elif closed is None:
      approaches = (None, "the teacher is not better than the student on held-out pass@1: no gap to close")
    else:
      gain, gain_se = after - before, math.sqrt(after_se ** 2 + before_se ** 2)
      learned = gain > 2 * gain_se and gain > 0
      ok = closed >= 0.5 and learned
      spread = f"se {gain_se:.3f}" if len(table[ref].get("seeds", ())) > 1 else "one seed: no standard error"
      approaches = (ok, f"{name} closes {closed:.0%} of the pass@1 gap to the teacher (gain {gain:+.3f}, "
                        f"{spread})")
    if ref == "opd":
      out["approaches"] = approaches
    elif after is not None:
      out["approaches_by"][ref] = approaches
    ref_tok, _ = _mean(table, ref, "generated tokens")
    for arm in windowed:
      a, a_se = _mean(table, arm, "pass@1 after")
      tok, _ = _mean(table, arm, "generated tokens")
      if a is None or after is None or not ref_tok:
        continue
      frac = tok / ref_tok
      tol = max(2 * math.sqrt(a_se ** 2 + after_se ** 2), 0.02)
      ok = a >= after - tol and frac <= token_fraction
      why = (f"{LABELS[arm]} ends at pass@1 {a:.3f} vs {name} {after:.3f} (tolerance {tol:.3f}) with {frac:.0%} "
             f"of {name}'s generated tokens")
      if not learned and ok:   # matching a reference that learned nothing shows nothing
        ok, why = None, why + f"; not judged: {name} itself gained nothing measurable"
      out["fraction"][arm] = (ok, why)
  return out


# ---------------------------------------------------------------------------------------------
# Tables and plot
# ---------------------------------------------------------------------------------------------

def _word(held):
  return {True: "held", False: "did not hold", None: "inconclusive"}[held]


def markdown(doc: dict) -> str:
  """The study's Markdown report from its JSON document (see `write_outputs`)."""
  table, v, gap = doc["arms"], doc["verdict"], doc.get("teacher_gap", {})
  lines = ["# On-policy distillation in miniature" + (" (smoke run: not a result)" if doc.get("smoke") else ""), "",
           doc["setup"], ""]
  if gap:
    lines += ["Held-out accuracy of the warm starts (200 prompts; pass@1 over 4 samples at temperature 1, and "
              "greedy):", "", "| SFT steps | role | pass@1 | greedy | pass@4 |", "|---|---|---|---|---|"]
    for steps, m in sorted(gap.items(), key=lambda kv: int(kv[0])):
      role = "student" if int(steps) == doc["student_sft_steps"] else (
          "teacher" if int(steps) == doc["teacher_sft_steps"] else "")
      lines.append(f"| {steps} | {role} | {m.get('eval/pass@1', float('nan')):.3f} | "
                   f"{m.get('eval/greedy_accuracy', float('nan')):.3f} | {m.get('eval/pass@4', float('nan')):.3f} |")
    lines.append("")
  kl = doc.get("kl_profile") or {}
  if kl:
    shares = ", ".join(f"first {k} tokens {kl[k]:.0%}" for k in kl if k.isdigit())
    lines += [f"Where the signal sits (student warm start, {kl['rollouts']} rollouts of training prompts, mean "
              f"length {kl['mean_length']:.1f} tokens): the summed reverse KL to the teacher is {kl['total']:.2f} "
              f"nats per rollout; its share in the {shares}; tokens whose estimate exceeds 2 nats are "
              f"{kl['big_token_frac']:.1%} of tokens and carry {kl['big_token_share']:.0%} of |log-ratio| mass.", ""]
  errors = doc.get("error_positions") or {}
  if errors:
    ks = [k for k in errors["start"] if k.isdigit()]
    lines += [f"Where the greedy answers go wrong ({errors['start']['prompts']} held-out prompts, seed 0's final "
              "policy of each arm): a wrong answer's position is where its completion first leaves the worked "
              "reference solution; `shared` counts the wrong answers on prompts the teacher also gets wrong; "
              "`in the answer` those that leave it at or after the start of its final <answer> (every worked "
              "line of the reference reproduced; on short problems that start is early).", "",
              "| policy | wrong | shared with the teacher | median position | "
              + " | ".join(f"within first {k}" for k in ks) + " | in the answer |",
              "|---|---|---|---|" + "---|" * (len(ks) + 1)]
    names = {"start": "student (start)", "teacher": "teacher"}
    for name, e in errors.items():
      cells = " | ".join("n/a" if x is None else f"{x:.0%}" for x in [e[k] for k in ks] + [e.get("in_answer")])
      lines.append(f"| {names.get(name, LABELS.get(name, name))} | {e['wrong']} | {e.get('shared', 'n/a')} | "
                   f"{e['median_position']} | {cells} |")
    lines.append("")
  ok, why = v["approaches"]
  if ok is not None or not v.get("approaches_by"):   # the sampled-OPD line, unless only other losses ran
    lines += [f"Student approaches the teacher: **{_word(ok)}**. {why}.", ""]
  for ref, (ok, why) in (v.get("approaches_by") or {}).items():
    lines += [f"Student approaches the teacher ({LABELS[ref]}): **{_word(ok)}**. {why}.", ""]
  for arm, (ok, why) in v["fraction"].items():
    ref = REFERENCE.get(arm, "opd")
    lines += [f"{LABELS[arm]} at a fraction of {'OPD' if ref == 'opd' else LABELS[ref]}'s tokens: **{_word(ok)}**. "
              f"{why}.", ""]
  matched = doc.get("matched_budget") or {}
  if matched:
    lines += ["At an equal token budget (the held-out curve of the arm's full-rollout reference, OPD of the same "
              "loss, interpolated at the arm's total generated tokens, same seeds): " + "; ".join(
                  f"{LABELS.get(a, a)} {m['arm_after']:.3f} vs "
                  f"{'OPD' if REFERENCE.get(a, 'opd') == 'opd' else LABELS[REFERENCE[a]]} "
                  f"{m['reference_at_budget']:.3f}"
                  for a, m in matched.items()) + ".", ""]
  lines += [f"Rules: {doc['rule']}", "",
            "Cells: mean +- sample standard deviation over seeds (ddof=1). Tokens are totals over the run; "
            "probe tokens are ADWIN's full-rollout probes (generated and teacher-scored, not trained on); "
            "`tokens to half gap` is where the held-out curve (evaluated every 20 steps) first reaches the "
            "student's pass@1 plus half the gap to the teacher, interpolated, over the seeds that reached it.", "",
            "| arm | " + " | ".join(COLUMNS) + " | reached half gap | seeds |",
            "|---|" + "---|" * (len(COLUMNS) + 2)]
  for arm, row in table.items():
    cells = [harness.cell(row[c], 0 if ("tokens" in c or c == "wall s") else (1 if c == "mean window" else 3))
             for c in COLUMNS]
    lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(cells) +
                 f" | {row['reached half gap']}/{len(row['seeds'])} | {len(row['seeds'])} |")
  if doc.get("not_run"):
    lines += ["", "Not run (not started before the stop time, or failed): " + ", ".join(doc["not_run"]) + "."]
  return "\n".join(lines) + "\n"


def _plot(doc: dict, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  kl = doc.get("kl_profile") or {}
  fig, axes = plt.subplots(1, 3 if kl else 2, figsize=(15 if kl else 10, 3.8))
  teacher = doc.get("teacher_pass@1")
  palette = plt.get_cmap("tab20").colors   # colour: the arm; line: the loss; marker: the step count
  for j, arm in enumerate(doc["arms"]):
    runs = [r for r in doc["runs"] if r["arm"] == arm]
    for i, r in enumerate(runs):
      c = r["curve"]
      style = ":" if "_fwd" in arm else "--" if "_full" in arm else "-"
      kw = dict(color=palette[j % len(palette)], marker="^" if "lr6" in arm else "s" if "long" in arm else "o", ms=3,
                lw=1.2, alpha=0.85, ls=style, label=LABELS.get(arm, arm) if i == 0 else None)
      axes[0].plot([p[1] / 1e3 for p in c], [p[2] for p in c], **kw)
      axes[1].plot([p[0] for p in c], [p[2] for p in c], **kw)
  if kl:
    pos = kl.get("mass_per_position") or kl["per_position"]
    axes[2].bar(range(len(pos)), pos, color="#8fb3d9", edgecolor="#35618f")
    for k in (12, 24):
      axes[2].axvline(k - 0.5, color="#d62728", ls=":", lw=1)
    axes[2].set_xlabel("completion position (dotted: ESR windows 12, 24)")
    axes[2].set_ylabel("reverse KL per rollout at the position")
    axes[2].set_title("reverse KL along the student's rollouts (warm start)", fontsize=8)
  for ax in axes[:2]:
    if teacher is not None:
      ax.axhline(teacher, color="k", ls="--", lw=0.8, label="teacher")
    ax.set_ylabel("held-out pass@1 (T=1)")
  axes[0].set_xlabel("generated tokens (thousands, probes included)")
  axes[1].set_xlabel("RL step")
  axes[0].legend(fontsize=5, loc="lower right", ncol=2)
  fig.suptitle("On-policy distillation, 8 prompts x 8 samples a step (one line per seed, one colour per arm)\n"
               "solid: single-sample advantage, dashed: full-vocabulary reverse KL, dotted: forward KL; "
               "triangles: lr 6e-4, squares: 320 steps", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


SETUP = ("{task}, a 0.6M-parameter character "
         "model. Student: the {student}-step SFT warm start; teacher: the same recipe trained {teacher} steps. "
         "160 RL steps of 8 prompts x 8 samples (lr 1.5e-4, one update per step); a token's advantage is "
         "log p_teacher - log p_student on the student's own sample (single-sample reverse KL, no baseline). "
         "ESR generates and trains only the first k tokens; ADWIN starts at k=12 and every 5 steps re-sizes it "
         "from a full-rollout probe of the same prompts (x1.25 when the prefix's per-sequence signal has cosine "
         "< 0.9 with the full rollout's, else x0.75, in [4, {max_new}]). GRPO on the task's reward is the "
         "reward-based reference. Every seed starts from seed 0's student and distils from seed 0's teacher. "
         "Arms marked full KL keep the same rollouts (and windows) but train with the exact reverse KL over the "
         "vocabulary at every completion position, sum_v p_s(v) (log p_s(v) - log p_t(v)), through the student's "
         "logits (GKD's on-policy loss; token-mean; no policy-gradient term); forward KL arms with "
         "sum_v p_t(v) (log p_t(v) - log p_s(v)).")
RULE = ("the student approaches the teacher when full-rollout OPD closes at least half of the held-out pass@1 "
        "gap with a gain above two standard errors; ESR / ADWIN reach it at a fraction of the tokens when they "
        "end within two standard errors (at least 0.02) of OPD's final pass@1, or above, having generated at "
        "most half of OPD's tokens (probes included), and not judged (inconclusive) when OPD's own gain is not "
        "above two standard errors; a windowed arm of another loss or step size is judged against the "
        "full-rollout OPD arm of that loss and step size.")


def write_outputs(results: Sequence[dict], out_dir: pathlib.Path, *, teacher_gap: dict, student_steps: int,
                  teacher_steps: int, planned_seeds: int, smoke: bool = False, missing: Sequence[str] = (),
                  plot: bool = True, stem: str = "distill", kl: dict | None = None,
                  errors: dict | None = None) -> dict[str, Any]:
  """Writes STEM.json and .md (and .png) from run results; returns the JSON document."""
  table = aggregate(results)
  v = verdict(table)
  teacher = teacher_gap.get(str(teacher_steps), {})
  max_new = _exp("opd", smoke).rollout.max_new_tokens
  doc = {"setup": SETUP.format(task=TASK_TEXT[TASK], student=student_steps, teacher=teacher_steps, max_new=max_new),
         "task": TASK, "rule": RULE, "smoke": smoke,
         "student_sft_steps": student_steps, "teacher_sft_steps": teacher_steps,
         "teacher_pass@1": teacher.get("eval/pass@1"), "teacher_greedy": teacher.get("eval/greedy_accuracy"),
         "teacher_gap": teacher_gap, "planned_seeds": planned_seeds, "verdict": v, "not_run": list(missing),
         "arms": table, "runs": sorted(results, key=lambda r: (ARMS.index(r["arm"]), r["seed"])),
         "kl_profile": kl or {}, "error_positions": errors or {},
         "matched_budget": {a: m for a in ARMS if a not in FAMILIES
                            for m in [matched_budget(results, a, REFERENCE.get(a, "opd"))] if m}}
  out_dir.mkdir(parents=True, exist_ok=True)
  base = out_dir / stem
  base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
  base.with_suffix(".md").write_text(markdown(doc))
  if plot and table:
    _plot(doc, base.with_suffix(".png"))
  return doc


# ---------------------------------------------------------------------------------------------
# Warm starts, the teacher gap and runs
# ---------------------------------------------------------------------------------------------

def _config_arg(arm: str, smoke: bool) -> str:
  """The argument of `distill_arms.py` for an arm of this study's task."""
  return arm + TASK_ARG[TASK] + (",smoke" if smoke else "")


def _exp(arm: str, smoke: bool, overrides: Sequence[str] = ()):
  return harness.load_experiment(f"{CONFIG}:{_config_arg(arm, smoke)}", overrides)


def _folder(exp, sft_steps: int) -> pathlib.Path:
  """Where the default cache keeps the warm start of `exp` trained `sft_steps` steps."""
  return harness.warm_start_folder(exp, sft_steps)


def measure_gap(steps_list: Sequence[int], *, smoke: bool = False, log: Callable[[str], None] = print) -> dict:
  """{sft steps: held-out metrics} of the seed-0 warm starts (built if absent), with the runs' evaluation.

  The evaluation is the one a training run does before and after RL (same prompts, same key).
  """
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  out = {}
  base = _exp("opd", smoke)
  train, test = loop.load_task(base)
  for steps in steps_list:
    exp = dataclasses.replace(base, sft=dataclasses.replace(base.sft, steps=int(steps)))
    t0 = time.time()
    cfg, params, tokenizer, folder = loop.warm_start(exp, train)
    built = time.time() - t0
    metrics = loop.evaluate(exp, cfg, params, tokenizer, list(test[:exp.eval.num_examples]))
    out[str(steps)] = dict({k: float(v) for k, v in metrics.items()}, folder=folder.name)
    log(f"SFT {steps} steps ({built:.0f} s to load/build): " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
  return out


def kl_share(kl: Sequence[Sequence[float]], mask: Sequence[Sequence[bool]], windows: Sequence[int]) -> dict:
  """The share of the summed per-token reverse KL that falls in each window's first k tokens.

  Args:
    kl: [R, T] per-token reverse KL estimates (log p_student - log p_teacher of the sampled token).
    mask: [R, T] which tokens exist.
    windows: the k's.

  Returns:
    {"k": share} (a share is in [0, 1] when every estimate is >= 0), plus "total" (the mean
    summed KL per rollout) and "mean_length".

  >>> kl_share([[1.0, 1.0, 2.0, 0.0]], [[True, True, True, False]], [1, 2])
  {'1': 0.25, '2': 0.5, 'total': 4.0, 'mean_length': 3.0}
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  kl, mask = np.asarray(kl, np.float64), np.asarray(mask, bool)
  per = np.where(mask, kl, 0.0)
  total = per.sum()
  out = {str(k): float(per[:, :k].sum() / total) if total else None for k in windows}
  out.update(total=float(per.sum(-1).mean()), mean_length=float(mask.sum(-1).mean()))
  return out


def kl_profile(teacher_steps: int, *, num_prompts: int = 64, windows: Sequence[int] = (12, 24), smoke: bool = False,
               seed: int = 0) -> dict:
  """Where the student's reverse KL to the teacher sits along its own rollouts (warm starts, train prompts).

  Samples `rollout.num_samples` rollouts of `num_prompts` training prompts from the student
  warm start, scores each token under both policies (the pipeline's own scoring), and
  returns the per-position mean reverse KL estimate (over the rollouts that reach the position),
  its mass per position (summed over rollouts, divided by their number), the share of the summed KL in the first
  k tokens (`kl_share`) and the share carried by tokens whose estimate exceeds 2 nats.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import sampling  # pylint: disable=g-import-not-at-top
  from rollouts_jax.sampling import sol_rl  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  exp = _exp("opd", smoke)
  train, _ = loop.load_task(exp)
  cfg, student, tokenizer, _ = loop.warm_start(exp, train)
  _, teacher, _, _ = loop.warm_start(dataclasses.replace(exp, sft=dataclasses.replace(exp.sft, steps=teacher_steps)),
                                     train)
  ids, mask = loop.prompter(exp, tokenizer)(list(train[:num_prompts]))
  out = jax.device_get(sampling.sample(cfg, student, ids, mask, jax.random.key(seed), loop.sampling_config(exp, tokenizer)))
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(len(ids)), policy_version=0)
  m = np.asarray(batch.completion_mask)
  scored, _ = sol_rl.recompute_batch(cfg, teacher, batch, temperature=exp.rollout.temperature)
  kl = (np.asarray(batch.behaviour_logprobs) - np.asarray(scored.old_logprobs)).reshape(-1, m.shape[-1])
  m = m.reshape(-1, m.shape[-1])
  live = np.where(m, kl, 0.0)
  per_pos = live.sum(0) / np.maximum(m.sum(0), 1)
  big = np.abs(live[m & (kl > 2)]).sum() / max(np.abs(live[m]).sum(), 1e-12)
  return dict(kl_share(kl, m, windows), per_position=[round(float(x), 4) for x in per_pos],
              mass_per_position=[round(float(x), 4) for x in live.sum(0) / m.shape[0]],
              tokens_per_position=[int(x) for x in m.sum(0)], big_token_share=float(big),
              big_token_frac=float((m & (kl > 2)).sum() / max(m.sum(), 1)), rollouts=int(m.shape[0]))


def first_divergence(text: str, reference: str) -> int:
  """The index of the first character where `text` leaves `reference` (their common prefix's length).

  With the character tokenizer of the arithmetic model this is also the token position.

  >>> first_divergence("7+9+0=15", "7+9+0=16")
  7
  >>> first_divergence("abc", "abc")
  3
  """
  n = min(len(text), len(reference))
  return next((i for i in range(n) if text[i] != reference[i]), n)


def error_summary(wrong: dict[int, int], total: int, windows: Sequence[int],
                  teacher_wrong: Collection[int] = (), answer_start: dict[int, int] | None = None) -> dict[str, Any]:
  """How many greedy answers were wrong, where they first left the reference, how many the teacher shares.

  Args:
    wrong: {prompt index: first-divergence position} of each wrong answer.
    total: how many prompts were decoded.
    windows: the k's: the share of wrong answers that left the reference inside the first k tokens.
    teacher_wrong: the prompts the teacher answers wrongly ("shared": how many of `wrong` it does).
    answer_start: {prompt index: where the reference's final answer (its `<answer>` tag) starts};
      given, "in_answer" is the share of wrong answers that first leave the reference at or after
      that point: every worked line of the reference reproduced, then a wrong final answer (or
      an extra line where the reference answers).

  >>> error_summary({0: 8, 3: 9, 5: 30}, 10, [12], teacher_wrong=[3, 4])
  {'prompts': 10, 'wrong': 3, 'median_position': 9, 'shared': 1, '12': 0.6666666666666666}
  >>> error_summary({0: 8, 5: 30}, 10, [12], answer_start={0: 25, 5: 25})["in_answer"]
  0.5
  """
  pos = sorted(int(p) for p in wrong.values())
  out: dict[str, Any] = {"prompts": int(total), "wrong": len(pos),
                         "median_position": pos[len(pos) // 2] if pos else None,
                         "shared": len(set(wrong) & set(teacher_wrong))}
  out.update({str(k): (sum(p < k for p in pos) / len(pos)) if pos else None for k in windows})
  if answer_start is not None:
    out["in_answer"] = (sum(p >= answer_start[i] for i, p in wrong.items()) / len(wrong)) if wrong else None
  return out


def error_positions(runs: Sequence[tuple[str, pathlib.Path]], teacher_steps: int, *, num_prompts: int = 200,
                    windows: Sequence[int] = (12, 24), smoke: bool = False) -> dict[str, dict[str, Any]]:
  """Where the greedy answers of the teacher, the warm start and each run's final policy go wrong.

  Each policy decodes the held-out prompts greedily; a wrong answer's (one the task's reward, the
  evaluation's rule, scores below 1) position is where its completion first leaves the worked
  reference solution.
  Tells whether a window of k tokens covers the student's mistakes, whether the teacher makes
  the same ones (then the window carries no correction for them), and whether training inside
  a window moved the mistakes later.

  Args:
    runs: (name, finished workdir) pairs.
    teacher_steps: the teacher's SFT steps (its warm start is built unless cached).

  Returns:
    {"teacher": summary, "start": summary, name: summary, ...} (see `error_summary`).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import sampling, tasks  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import evaluation, loop  # pylint: disable=g-import-not-at-top
  exp = _exp("opd", smoke)
  task = tasks.get(exp.data.task)
  train, test = loop.load_task(exp)
  cfg, start, tokenizer, _ = loop.warm_start(exp, train)
  _, teacher, _, _ = loop.warm_start(
      dataclasses.replace(exp, sft=dataclasses.replace(exp.sft, steps=teacher_steps)), train)
  examples = list(test[:num_prompts])
  conf = loop.sampling_config(exp, tokenizer).replace(temperature=0.0, num_samples=1)
  prompt = loop.prompter(exp, tokenizer)

  def mistakes(params) -> dict[int, int]:
    wrong = {}
    for lo in range(0, len(examples), exp.eval.batch_size):
      chunk = examples[lo:lo + exp.eval.batch_size]
      ids, mask = prompt(chunk)
      out = jax.device_get(sampling.sample(cfg, params, ids, mask, jax.random.key(0), conf))
      texts = evaluation.decode_completions(tokenizer, np.asarray(out.completion_ids),
                                            np.asarray(out.completion_mask))
      for i, (ex, (text,)) in enumerate(zip(chunk, texts)):
        if task.reward(text, task.reference(ex)) < 1.0:
          wrong[lo + i] = first_divergence(text, ex["solution"])
    return wrong

  by_teacher = mistakes(teacher)
  policies = [("teacher", by_teacher), ("start", mistakes(start))]
  policies += [(name, mistakes(loop.latest_params(exp, workdir, start))) for name, workdir in runs]
  answer_start = {}
  for i, ex in enumerate(examples):   # a reference without an answer tag: nothing counts as inside its answer
    at = ex["solution"].find("<answer>")
    answer_start[i] = at if at >= 0 else len(ex["solution"]) + 1
  return {name: error_summary(wrong, len(examples), windows, by_teacher, answer_start) for name, wrong in policies}


def warm_start_overrides(runs_dir: pathlib.Path, smoke: bool, teacher_steps: int) -> list[str]:
  """Overrides that load seed 0's student as a local checkpoint and its teacher from a private cache.

  The teacher is built by the pipeline through the warm-start cache, whose key includes the
  seed and the model section; this links seed 0's teacher under each run's key in a cache
  of this study (`runs_dir/teachers`), so every seed distils from the same teacher.
  """
  exp = _exp("opd", smoke)
  student = _folder(exp, exp.sft.steps)
  teacher = _folder(exp, teacher_steps if not smoke else exp.rollout.teacher_sft_steps)
  for folder in (student, teacher):
    if not (folder / "done.json").exists():
      raise RuntimeError(f"warm start {folder.name} is missing: run --gap first")
  return ["model.init=hf", f"model.path={student}", f"tokenizer.path={student / 'tokenizer.json'}",
          f"sft.cache_dir={runs_dir / 'teachers'}"] + (
      [f"rollout.teacher_sft_steps={teacher_steps}"] if not smoke else [])


def _link_teacher(arm: str, smoke: bool, overrides: Sequence[str], teacher: pathlib.Path) -> None:
  exp = _exp(arm, smoke, overrides)
  if not exp.rollout.distill:
    return
  link = _folder(exp, exp.rollout.teacher_sft_steps)
  link.parent.mkdir(parents=True, exist_ok=True)
  if not link.exists():
    link.symlink_to(teacher, target_is_directory=True)


def run_one(arm: str, seed: int, workdir: pathlib.Path, overrides: Sequence[str], *, teacher_folder: pathlib.Path,
            teacher_metrics: dict, smoke: bool, env: dict) -> dict[str, Any]:
  """Runs (or reuses, or resumes) one arm x seed in a training subprocess; returns its result."""
  overrides = list(overrides) + [f"seed={seed}"]
  if not (workdir / "result.json").exists():
    _link_teacher(arm, smoke, overrides, teacher_folder)

  def record(w):
    summary = json.loads((w / "summary.json").read_text())
    rows = [json.loads(line) for line in (w / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return dict(run_summary(summary, rows, teacher=teacher_metrics, distill=arm in DISTILL_ARMS), arm=arm, seed=seed)

  return harness.train_run(workdir, f"{CONFIG}:{_config_arg(arm, smoke)}", overrides, env=env, record=record,
                           label=f"{arm}/seed{seed}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gap", action="store_true", help="measure the warm starts' held-out accuracy and exit")
  parser.add_argument("--gap_steps", default="",
                      help="SFT steps measured by --gap (default: the task's student and teacher steps)")
  parser.add_argument("--task", choices=tuple(TASK_ARG), default="add",
                      help="add: the default arithmetic; mul: distill_arms.py's multiplication variant; "
                           "mul_strong: its student and teacher trained further (mul,strong)")
  parser.add_argument("--teacher_steps", type=int, default=0,
                      help="0: the task's (TEACHER_SFT_STEPS of configs/distill_arms.py)")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--arms", default=",".join(ARMS), help="arms to run (finished runs of the others are reported)")
  parser.add_argument("--runs_dir", default=None, help="default: TMP/rollouts_distill160[_TASK]")
  parser.add_argument("--results_dir", default=str(RESULTS))
  parser.add_argument("--threads", type=int, default=1, help="CPU threads per training process (0: default)")
  parser.add_argument("--stop_at", default=None, help="HH:MM UTC after which no new run starts")
  parser.add_argument("--report_only", action="store_true")
  parser.add_argument("--kl_profile", action="store_true", help="measure where the reverse KL sits and exit")
  parser.add_argument("--error_positions", action="store_true",
                      help="measure where seed 0's final greedy answers of each finished arm go wrong and exit")
  parser.add_argument("--smoke", action="store_true", help="the arms' smoke variants, one seed (not a result)")
  args = parser.parse_args(argv)
  global TASK
  TASK = args.task
  suffix = "" if TASK == "add" else "_" + TASK
  runs_dir = pathlib.Path(args.runs_dir or os.path.join(tempfile.gettempdir(), "rollouts_distill160" + suffix)) / (
      "smoke" if args.smoke else "")
  results_dir = pathlib.Path(args.results_dir)
  gap_file = runs_dir / "teacher_gap.json"
  gap = json.loads(gap_file.read_text()) if gap_file.exists() else {}
  student_steps = _exp("opd", args.smoke).sft.steps
  teacher_steps = (args.teacher_steps or _exp("opd", False).rollout.teacher_sft_steps) if not args.smoke else (
      _exp("opd", True).rollout.teacher_sft_steps)
  if args.gap or not gap:
    steps = ([int(s) for s in args.gap_steps.split(",")] if args.gap_steps and not args.smoke
             else [student_steps, teacher_steps])
    gap.update(measure_gap([s for s in steps if str(s) not in gap], smoke=args.smoke))
    runs_dir.mkdir(parents=True, exist_ok=True)
    gap_file.write_text(json.dumps(gap, indent=1))
    if args.gap:
      return
  kl_file = runs_dir / "kl_profile.json"
  if args.kl_profile:
    kl_file.write_text(json.dumps(kl_profile(teacher_steps, windows=(12, 16, 24), smoke=args.smoke), indent=1))
    return
  kl = json.loads(kl_file.read_text()) if kl_file.exists() else None
  errors_file = runs_dir / "error_positions.json"
  if args.error_positions:
    done = [(a, runs_dir / a / "seed0") for a in ARMS if a in args.arms.split(",")
            if (runs_dir / a / "seed0" / "result.json").exists()]
    errors_file.write_text(json.dumps(error_positions(done, teacher_steps, smoke=args.smoke), indent=1))
    return
  errors = json.loads(errors_file.read_text()) if errors_file.exists() else None
  if str(teacher_steps) not in gap:
    gap.update(measure_gap([teacher_steps], smoke=args.smoke))
    gap_file.write_text(json.dumps(gap, indent=1))
  env = harness.child_env(args.threads, runs_dir / "jax_cache")
  overrides = warm_start_overrides(runs_dir, args.smoke, teacher_steps)
  teacher_folder = _folder(_exp("opd", args.smoke), teacher_steps)
  arms = [a for a in ARMS if a in args.arms.split(",")]
  seeds = 1 if args.smoke else args.seeds
  kw = dict(teacher_gap=gap, student_steps=student_steps, teacher_steps=teacher_steps, planned_seeds=seeds,
            smoke=args.smoke, stem="distill" + suffix + ("_smoke" if args.smoke else ""), kl=kl,
            errors=errors)
  # Arms not chosen this time: reported if they ran before.
  others = [json.loads((runs_dir / a / f"seed{s}" / "result.json").read_text()) for s in range(seeds) for a in ARMS
            if a not in arms and (runs_dir / a / f"seed{s}" / "result.json").exists()]

  def run(arm, seed, workdir):
    t0, load = time.time(), os.getloadavg()[0]
    r = run_one(arm, seed, workdir, overrides, teacher_folder=teacher_folder,
                teacher_metrics=gap[str(teacher_steps)], smoke=args.smoke, env=env)
    print(f"{arm} seed {seed}: pass@1 {r['pass@1 before']:.3f} -> {r['pass@1 after']:.3f}, "
          f"{r['generated_tokens']:.0f} tokens, wall {r['wall_s']:.0f} s ({time.time() - t0:.0f} s now, "
          f"load {load:.2f})", flush=True)
    return r

  results, missing = harness.run_grid(
      arms, seeds, runs_dir, run, report_only=args.report_only, stop_at=args.stop_at,
      save=lambda results, missing: write_outputs(others + results, results_dir, missing=missing, plot=False, **kw))
  doc = write_outputs(others + results, results_dir, missing=missing, **kw)
  print(json.dumps(doc["verdict"], indent=1))


if __name__ == "__main__":
  main()
