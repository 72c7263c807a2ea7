r"""Prompt selectors at equal rollout budget: a simulated bandit and the real arithmetic loop.

  python -m experiments.studies.control --mode=bandit            # seconds to minutes on a CPU
  python -m experiments.studies.control --mode=real --steps=40   # short real GRPO runs (minutes each)

Bandit (`--mode=bandit`). K prompts with known success probabilities: a share never solved
(p = 0), a share always solved (p = 1), the rest with logits of a Beta(0.5, 0.5) draw. A
"policy" learns: a trained group that is informative (its rewards differ) raises its
prompt's logit by `eta_local * b / N` and every prompt's logit by `eta_global * b / N` (b: the
group's rollouts; the GRPO signal is carried by the samples of informative groups). p = 0
prompts stay unsolvable, p = 1 prompts stay solved. Each method runs until it has spent the
same number of rollouts (the sum of its plans' budgets, plus generated-and-dropped groups
for dynamic sampling and the reference rollouts for PVPO). Reported, median over seeds:
  * the fraction of generated groups that are informative (reward variance > 0, >= 2 samples),
  * the fraction of spent rollouts that sit in informative groups,
  * the fraction of trained groups that are informative (dynamic sampling trains only kept ones),
  * the mean success probability over the dataset (the "learning") at equal rollouts.
HIVE's entropy signal is simulated as the binary entropy of the prompt's current p plus
noise (the idealized case: the policy is uncertain exactly where outcomes are mixed); a real
policy can be confidently wrong, which this does not model.

Real loop (`--mode=real`): `experiments.launch.train` on `configs/default.py` (or `--config`) for
`--steps` RL steps per method, reading `informative_groups`, `reward_mean` and `rollouts`
from each run's metrics.jsonl. Writes experiments/studies/results/control_*.{json,md,png}. The
default config has 20000 training prompts, so a 40-step run (1280 prompt draws) almost never
revisits a prompt and history-based selectors (VADE, HIVE) have nothing to go on; the
`pool256` runs keep the same warm start (loaded as a checkpoint, so SFT is unchanged) and
shrink only the RL prompt pool, so each prompt comes back about five times:

  python -m experiments.studies.control --mode=real --tag=pool256 --methods=uniform,vade,hive \
      --config.model.init=hf --config.model.path=WARM_START --config.tokenizer.path=WARM_START/tokenizer.json \
      --config.data.num_train=256

(WARM_START: the default config's cached warm-start folder.) "sampled reward" is the mean
reward of the groups a method chose, so a selector that picks p ~ 1/2 prompts changes it by
choice alone; held-out pass@1 is the comparable measure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import time

import numpy as np

from experiments.studies import harness
from rollouts_jax import tasks

RESULTS = harness.RESULTS

SELECTORS = ["vade", "hive", "pilot_commit", "xrpo", "pvpo"]
METHODS = ["uniform", "dynamic_sampling"] + SELECTORS
# Settings other than the defaults, shown next to them (name:setting=value:...).
VARIANTS = ["pilot_commit:pilot_samples=4", "pilot_commit:same_step=False", "xrpo:budget_fraction=0.75", "xrpo:phases=1",
            "vade:fast_decay=1.0:slow_decay=1.0"]


# ---------------------------------------------------------------------------------------------
# The simulated bandit.
# ---------------------------------------------------------------------------------------------
def parse_method(spec: str) -> tuple[str, dict]:
  """`"pilot_commit:pilot_samples=4:pilot_fraction=0.5"` -> (name, settings)."""
  import ast  # pylint: disable=g-import-not-at-top
  name, *parts = spec.split(":")
  kwargs = {}
  for part in parts:
    k, _, v = part.partition("=")
    kwargs[k] = ast.literal_eval(v)
  return name, kwargs


def make_prompts(rng: np.random.Generator, K: int, frac_zero: float, frac_one: float) -> tuple[np.ndarray, np.ndarray]:
  """(logit [K], fixed [K] int8: -1 never solved, +1 always solved, 0 learnable)."""
  kind = rng.choice(3, size=K, p=[frac_zero, frac_one, 1 - frac_zero - frac_one])
  p = np.clip(rng.beta(0.5, 0.5, size=K), 1e-3, 1 - 1e-3)
  logit = np.log(p) - np.log1p(-p)
  fixed = np.where(kind == 0, -1, np.where(kind == 1, 1, 0)).astype(np.int8)
  return logit.astype(np.float32), fixed


def run_bandit(method: str, seed: int, *, K: int, B: int, N: int, budget: int, frac_zero: float, frac_one: float,
               eta_local: float, eta_global: float, max_refills: int, ref_samples: int, curve_every: int):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rollouts_jax import control  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  logit0, fixed = make_prompts(rng, K, frac_zero, frac_one)
  fixed_j = jnp.asarray(fixed)

  def probs(logit, g):
    p = jax.nn.sigmoid(logit + g)
    return jnp.where(fixed_j < 0, 0.0, jnp.where(fixed_j > 0, 1.0, p))

  name, kwargs = parse_method(method)
  ds = name == "dynamic_sampling"
  if ds:
    name = "uniform"
  sel = control.build(name, num_prompts=K, num_samples=N, seed=seed, **kwargs)

  @jax.jit
  def generate(sel_state, logit, g, key):
    """select -> Bernoulli rollouts (+ simulated entropy) -> [second phase] -> selector update.

    A selector with a second phase (`refine`: XRPO's phases, Pilot-Commit's same-step commit)
    sees the first budgets' rewards and adds rollouts to the same groups, as in the loop.
    """
    k_sel, k_r, k_e = jax.random.split(key, 3)
    plan, sel_state = sel.select(sel_state, k_sel, B)
    p = probs(logit, g)[plan.indices]
    r = (jax.random.uniform(k_r, (B, N)) < p[:, None]).astype(jnp.float32)
    m = plan.sample_mask(N)
    if sel.refine is not None:
      plan, sel_state = sel.refine(sel_state, plan, jnp.where(m, r, 0.0), m)
      m = plan.sample_mask(N)
    h = -(p * jnp.log(jnp.maximum(p, 1e-6)) + (1 - p) * jnp.log(jnp.maximum(1 - p, 1e-6))) / jnp.log(2.0)
    ent = 0.2 + 0.8 * h[:, None] + 0.1 * jax.random.normal(k_e, (B, N))
    sel_state = sel.update(sel_state, plan, r, m, entropy_BxN=ent)
    return plan, r, m, sel_state

  @jax.jit
  def learn(logit, g, idx, r, m, keep):
    info = control.informative(r, m) & keep
    w = jnp.where(info, jnp.sum(m, axis=1) / N, 0.0)
    logit = logit.at[idx].add(eta_local * w)
    return logit, g + eta_global * jnp.sum(w)

  state = sel.init()
  spent = 0
  is_pvpo = name == "pvpo"
  if is_pvpo:   # pre-sampling: reference rollouts of the initial policy on every prompt
    p0 = np.asarray(probs(jnp.asarray(logit0), 0.0))
    ref = rng.random((K, ref_samples)) < p0[:, None]
    state = sel.init(ref_accuracy=jnp.asarray(ref.mean(axis=1), jnp.float32))
    spent += K * ref_samples
  logit, g = jnp.asarray(logit0), jnp.zeros((), jnp.float32)
  key = jax.random.key(seed)
  gen_groups = gen_info = info_rollouts = trained = trained_info = 0
  curve = [(spent, float(jnp.mean(probs(logit, g))))]
  next_mark = curve_every
  step = 0
  while spent < budget:
    parts = []
    for refill in range(1 + (max_refills if ds else 0)):
      plan, r, m, state = generate(state, logit, g, jax.random.fold_in(key, 1000 * step + refill))
      parts.append((np.asarray(plan.indices), np.asarray(r), np.asarray(m), np.asarray(plan.budget)))
      if not ds:
        break
      n_info = sum(int(np.asarray(control.informative(pr, pm)).sum()) for _, pr, pm, _ in parts)
      if n_info >= B:
        break
    idx = np.concatenate([p[0] for p in parts])
    r = np.concatenate([p[1] for p in parts])
    m = np.concatenate([p[2] for p in parts])
    bud = np.concatenate([p[3] for p in parts])
    info = np.asarray(control.informative(r, m))
    spent += int(bud.sum())
    gen_groups += len(idx)
    gen_info += int(info.sum())
    info_rollouts += int(bud[info].sum())
    if ds:
      keep_idx, ok = control.dynamic_sampling(r, B, m)
      keep = np.zeros(len(idx), bool)
      keep[np.asarray(keep_idx)[np.asarray(ok)]] = True
      trained += B
    else:
      keep = np.ones(len(idx), bool)
      trained += len(idx)
    trained_info += int((info & keep).sum())
    logit, g = learn(logit, g, jnp.asarray(idx), jnp.asarray(r), jnp.asarray(m), jnp.asarray(keep))
    step += 1
    if spent >= next_mark or spent >= budget:
      curve.append((spent, float(jnp.mean(probs(logit, g)))))
      while next_mark <= spent:
        next_mark += curve_every
  return {
      "steps": step, "rollouts": spent,
      "informative_generated": gen_info / gen_groups,
      "informative_rollouts": info_rollouts / max(spent - (K * ref_samples if is_pvpo else 0), 1),
      "informative_trained": trained_info / trained,
      "mean_p_start": curve[0][1], "mean_p_final": curve[-1][1],
      "curve": curve,
  }


def interp_curve(curve, grid):
  x, y = np.array([c[0] for c in curve], float), np.array([c[1] for c in curve], float)
  return np.interp(grid, x, y, left=np.nan)


def bandit_main(args):
  settings = dict(K=args.num_prompts, B=args.batch, N=args.num_samples, budget=args.budget,
                  frac_zero=args.frac_zero, frac_one=args.frac_one, eta_local=args.eta_local,
                  eta_global=args.eta_global, max_refills=args.max_refills, ref_samples=args.num_samples,
                  curve_every=args.batch * args.num_samples)
  load_before = os.getloadavg()
  t0 = time.time()
  runs = {}
  for method in args.methods:
    runs[method] = []
    for seed in range(args.seeds):
      runs[method].append(run_bandit(method, seed, **settings))
    print(f"{method:18s} done ({time.time() - t0:.0f} s)", flush=True)
  grid = np.linspace(0, args.budget, 41)
  summary = {}
  for method, rs in runs.items():
    with np.errstate(all="ignore"):
      curves = np.stack([interp_curve(r["curve"], grid) for r in rs])
    summary[method] = {
        k: float(np.median([r[k] for r in rs]))
        for k in ("informative_generated", "informative_rollouts", "informative_trained", "mean_p_start",
                  "mean_p_final", "steps", "rollouts")}
    summary[method]["mean_p_gain"] = float(np.median([r["mean_p_final"] - r["mean_p_start"] for r in rs]))
    summary[method]["per_seed_mean_p_final"] = [r["mean_p_final"] for r in rs]
    summary[method]["per_seed_informative_generated"] = [r["informative_generated"] for r in rs]
    summary[method]["curve_median"] = [float(np.median(c)) if np.isfinite(c).all() else None for c in curves.T]
  out = {"mode": "bandit", "settings": settings, "seeds": args.seeds, "grid_rollouts": grid.tolist(),
         "methods": summary, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
         "wall_s": time.time() - t0}
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "control_bandit.json").write_text(json.dumps(out, indent=1))
  bandit_report(out)


def rollouts_to_reach(grid, curve, target):
  """The first rollout count (linear between grid points) where `curve` reaches `target`; None if never."""
  y = np.array([np.nan if v is None else v for v in curve], float)
  for i in range(1, len(grid)):
    if np.isfinite(y[i]) and y[i] >= target:
      if not np.isfinite(y[i - 1]) or y[i - 1] >= target:
        return float(grid[i])
      return float(grid[i - 1] + (target - y[i - 1]) / (y[i] - y[i - 1]) * (grid[i] - grid[i - 1]))
  return None


def bandit_report(out):
  """The markdown table and the plot of a bandit run (`control_bandit.json`)."""
  st, summary, grid = out["settings"], out["methods"], np.asarray(out["grid_rollouts"])
  base = summary["uniform"]
  target = base["mean_p_start"] + 0.75 * (base["mean_p_final"] - base["mean_p_start"])
  reach_u = rollouts_to_reach(grid, base["curve_median"], target)
  lines = [f"Simulated bandit: K={st['K']} prompts ({st['frac_zero']:.0%} never solved, {st['frac_one']:.0%} "
           f"always solved, the rest Beta(0.5, 0.5)), B={st['B']} prompts x N={st['N']} per step, "
           f"{st['budget']} rollouts per method, median of {out['seeds']} seeds "
           f"(load average {out['loadavg_before'][0]:.1f} at the start; the numbers do not depend on it).", "",
           "| method | informative groups (generated) | rollouts in informative groups | informative groups (trained) "
           f"| mean p at equal rollouts (gain) | rollouts to mean p {target:.3f} (x uniform) | steps |",
           "|---|---|---|---|---|---|---|"]
  for method, s in summary.items():
    reach = rollouts_to_reach(grid, s["curve_median"], target)
    reach_txt = "not reached" if reach is None else f"{reach:.0f} ({reach / reach_u:.2f}x)"
    s["rollouts_to_target"] = reach
    lines.append(f"| {method} | {s['informative_generated']:.3f} | {s['informative_rollouts']:.3f} | "
                 f"{s['informative_trained']:.3f} | {s['mean_p_final']:.3f} ({s['mean_p_gain']:+.3f}) | {reach_txt} | "
                 f"{s['steps']:.0f} |")
  lines += ["", f"Mean p {base['mean_p_start']:.3f} at the start; the target is 3/4 of uniform's gain. PVPO's spent "
            f"rollouts include its reference pre-sampling ({st['K']} x {st['N']}).", ""]
  (RESULTS / "control_bandit.md").write_text("\n".join(lines))
  (RESULTS / "control_bandit.json").write_text(json.dumps(out, indent=1))
  print("\n".join(lines))
  plot_bandit(out)


def plot_bandit(out):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
  grid = np.asarray(out["grid_rollouts"])
  names = list(out["methods"])
  for name in names:
    y = np.array([np.nan if v is None else v for v in out["methods"][name]["curve_median"]], float)
    a1.plot(grid, y, label=name, lw=2 if name == "uniform" else 1.4)
  a1.set_xlabel("rollouts spent")
  a1.set_ylabel("mean success probability over the dataset")
  a1.set_title("Learning at equal rollouts (median over seeds)")
  a1.legend(fontsize=8)
  x = np.arange(len(names))
  gen = [out["methods"][n]["informative_generated"] for n in names]
  rol = [out["methods"][n]["informative_rollouts"] for n in names]
  a2.bar(x - 0.2, gen, 0.4, label="groups generated")
  a2.bar(x + 0.2, rol, 0.4, label="rollouts spent")
  a2.axhline(gen[0], color="gray", ls=":", lw=1)
  a2.set_xticks(x, names, rotation=30, fontsize=8)
  a2.set_ylabel("fraction informative")
  a2.set_title("Informative share (reward variance > 0)")
  a2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(RESULTS / "control_bandit.png", dpi=110)


# ---------------------------------------------------------------------------------------------
# The real loop.
# ---------------------------------------------------------------------------------------------
REAL_METHODS = {
    "uniform": [],
    "dynamic_sampling": ["--config.control.dynamic_sampling=True"],
    "vade": ["--config.control.name=vade"],
    "hive": ["--config.control.name=hive"],
    # Budgets that change what is decoded (two phases within a step).
    "xrpo": ["--config.control.name=xrpo", "--config.control.kwargs=budget_fraction=0.5"],
    "pilot_commit": ["--config.control.name=pilot_commit"],
    # PVPO as the paper runs it: every training prompt pre-sampled 8 times by the initial policy
    # (counted as the method's rollouts and tokens), its selector and its static-anchor advantage.
    "pvpo": ["--config.control.name=pvpo", "--config.rl.advantage=pvpo", "--config.reward.ref_samples=8"],
}
# Rollouts per step as a share of uniform's, for giving a method the steps that spend about
# uniform's tokens (`--equal_tokens`); Pilot-Commit's share varies, so this is its upper estimate
# (3/4 of the rows pilots of N/4, 1/4 committed to N) and the report reads the step where its
# generated tokens reach uniform's.
ROLLOUT_SHARE = {"xrpo": 0.5, "pilot_commit": 0.75 * 0.25 + 0.25}


def _portable(text: str) -> str:
  """A run's flag as results record it: the machine's cache folder written `<cache>`.

  >>> _portable(f"--config.model.path={tasks.cache_root()}/warmstart/x")
  '--config.model.path=<cache>/warmstart/x'
  """
  return text.replace(str(tasks.cache_root()), "<cache>")


def real_main(args):
  RESULTS.mkdir(parents=True, exist_ok=True)
  root = pathlib.Path(args.workdir_root).resolve()
  path = RESULTS / f"control_real{'_' + args.tag if args.tag else ''}.json"
  out = json.loads(path.read_text()) if path.exists() else {"mode": "real", "methods": {}}
  out.update({"config": os.path.relpath(args.config, harness.REPO), "steps": args.steps, "seed": args.seed,
              "tag": args.tag, "extra": [_portable(e) for e in args.extra], "equal_tokens": args.equal_tokens})
  for method in args.methods:
    if method not in REAL_METHODS:
      print(f"{method}: no real-loop recipe here (see REAL_METHODS).")
      continue
    workdir = root / f"control_{method}{'_' + args.tag if args.tag else ''}_s{args.seed}"
    steps = args.steps
    if args.equal_tokens:   # about uniform's tokens: more steps for a method that decodes less per step
      steps = int(math.ceil(args.steps / ROLLOUT_SHARE.get(method, 1.0)))
    cmd = harness.launch_command(
        "train", f"--config={os.path.abspath(args.config)}", f"--workdir={workdir}", f"--config.rl.steps={steps}",
        f"--config.seed={args.seed}", f"--config.eval.every={args.eval_every}",
        f"--config.eval.num_examples={args.eval_examples}", "--noprogress", *REAL_METHODS[method], *args.extra)
    t0 = time.time()
    load = os.getloadavg()
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=harness.REPO)
    if proc.returncode != 0:
      print(proc.stderr[-3000:])
      out["methods"][method] = {"error": proc.stderr[-800:]}
      continue
    recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "informative_groups" in r]
    summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
    summary.pop("plots", None)   # local paths
    pre = next((r for r in recs if "ref/presample_rollouts" in r), {})
    out["methods"][method] = {
        "presample_rollouts": pre.get("ref/presample_rollouts", 0.0),
        "presample_tokens": pre.get("ref/presample_generated_tokens", 0.0),
        "informative_groups": [r["informative_groups"] for r in steps],
        "reward_mean_sampled": [r.get("reward_mean_sampled", r["reward_mean"]) for r in steps],
        "rollouts": [r.get("rollouts_budget", r.get("rollouts", 0.0)) for r in steps],
        "generated_tokens": [r.get("generated_tokens", 0.0) for r in steps],
        # Held-out pass@1 at each periodic evaluation: (step, value), step 0 the start.
        "evals": [(r["step"], r["eval/pass@1"]) for r in recs if "eval/pass@1" in r],
        "summary": summary, "wall_s": time.time() - t0, "loadavg_before": load, "loadavg_after": os.getloadavg(),
    }
    path.write_text(json.dumps(out, indent=1, default=str))
    print(method, f"{time.time() - t0:.0f} s", flush=True)
  real_report(out)


def _find(d, *names):
  """The first value under one of `names` anywhere in a nested dict (summary layouts vary)."""
  if isinstance(d, dict):
    for n in names:
      if n in d and not isinstance(d[n], dict):
        return d[n]
    for v in d.values():
      got = _find(v, *names)
      if got is not None:
        return got
  return None


def real_report(out):
  stem = "control_real" + ("_" + out["tag"] if out.get("tag") else "")
  ok = {m: r for m, r in out["methods"].items() if "error" not in r}
  if not ok:
    return
  # A method's spend includes what it decodes before the first step (PVPO's pre-sampling).
  def spent(r, key, pre):
    return r.get(pre, 0.0) + np.cumsum(np.asarray(r[key], float))
  equal = min(float(spent(r, "rollouts", "presample_rollouts")[-1]) for r in ok.values())
  with_tokens = all(r.get("generated_tokens") for r in ok.values())
  equal_tok = (min(float(spent(r, "generated_tokens", "presample_tokens")[-1]) for r in ok.values())
               if with_tokens else 0.0)
  lines = [f"Real loop: `{out['config']}` {' '.join(out.get('extra') or [])}, {out['steps']} RL steps "
           f"({'scaled per method to spend about uniform' + chr(39) + 's tokens' if out.get('equal_tokens') else 'per method'}), "
           f"seed {out['seed']}. Equal rollouts = {equal:.0f} (the smallest total over the methods)"
           + (f"; equal generated tokens = {equal_tok:.0f}." if with_tokens else "."), "",
           "| method | informative groups (trained batch, mean) | sampled reward, last 10 steps within equal "
           "rollouts | total rollouts | decoded tokens / step | pass@1 at equal tokens (step, its tokens / equal) | "
           "pass@1 before -> after (all steps) |",
           "|---|---|---|---|---|---|---|"]
  for m, r in ok.items():
    cum = spent(r, "rollouts", "presample_rollouts")
    n = max(1, int(np.searchsorted(cum, equal, side="right")))
    rew = float(np.mean(r["reward_mean_sampled"][max(0, n - 10):n]))
    info = float(np.mean(r["informative_groups"][:n]))
    s = r.get("summary", {})
    before = _find(s.get("before", {}), "eval/pass@1", "pass@1")
    after = _find(s.get("after", {}), "eval/pass@1", "pass@1")
    ev = f"{before:.3f} -> {after:.3f}" if isinstance(before, float) and isinstance(after, float) else "n/a"
    tok = np.asarray(r.get("generated_tokens") or [np.nan], float)
    at_eq = "n/a"
    if with_tokens and r.get("evals"):
      # The evaluation whose step spent the tokens closest to the equal total (either side; evaluations
      # are every few steps), with that step and its tokens as a share of the total.
      spent_tok = np.concatenate([[r.get("presample_tokens", 0.0)], spent(r, "generated_tokens", "presample_tokens")])
      evals = {int(st): float(v) for st, v in r["evals"]}
      if after is not None:
        evals[len(tok)] = float(after)
      st = min(evals, key=lambda st: abs(spent_tok[min(st, len(tok))] - equal_tok))
      at_eq = f"{evals[st]:.3f} ({st}, {spent_tok[min(st, len(tok))] / equal_tok:.0%})"
    lines.append(f"| {m} | {info:.3f} | {rew:.3f} | {cum[-1]:.0f} | {np.nanmean(tok):.0f} | {at_eq} | {ev} |")
    r["at_equal_rollouts"] = {"steps": n, "informative_groups": info, "reward_mean_sampled_last10": rew}
  for m, r in ok.items():
    if r.get("presample_rollouts"):
      lines.append(f"\n{m}: its totals and equal-budget points include {r['presample_rollouts']:.0f} rollouts "
                   f"({r.get('presample_tokens', 0.0):.0f} tokens) pre-sampled before the first step.")
  (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
  (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
  print("\n".join(lines))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=["bandit", "bandit_report", "real", "real_report"], default="bandit")
  ap.add_argument("--methods", default=",".join(METHODS + VARIANTS))
  ap.add_argument("--seeds", type=int, default=5)
  ap.add_argument("--num_prompts", type=int, default=512)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--num_samples", type=int, default=8)
  ap.add_argument("--budget", type=int, default=32 * 8 * 150, help="rollouts per method (bandit)")
  ap.add_argument("--frac_zero", type=float, default=0.3)
  ap.add_argument("--frac_one", type=float, default=0.2)
  ap.add_argument("--eta_local", type=float, default=0.5)
  ap.add_argument("--eta_global", type=float, default=0.0001)
  ap.add_argument("--max_refills", type=int, default=2)
  ap.add_argument("--config", default=str(harness.REPO / "configs" / "default.py"))
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--equal_tokens", action="store_true",
                  help="real: scale each method's steps to spend about uniform's generated tokens (ROLLOUT_SHARE)")
  ap.add_argument("--eval_every", type=int, default=0, help="real: held-out evaluation every this many steps")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--eval_examples", type=int, default=200)
  ap.add_argument("--workdir_root", default=os.path.join(os.path.expanduser("~"), "rollouts_control_runs"))
  ap.add_argument("--tag", default="", help="names the real runs' workdirs and result files")
  ap.add_argument("--extra", nargs="*", default=[], help="more --config.* overrides for the real runs (bare --config.* flags work too)")
  args, unknown = ap.parse_known_args(argv)
  bad = [u for u in unknown if not u.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments: {' '.join(bad)}")
  args.extra = list(args.extra) + unknown     # `--extra --config.x=1 --config.y=2` or bare --config.* flags
  args.methods = [m for m in args.methods.split(",") if m]
  if args.mode == "bandit":
    bandit_main(args)
  elif args.mode == "bandit_report":
    bandit_report(json.loads((RESULTS / "control_bandit.json").read_text()))
  elif args.mode == "real":
    real_main(args)
  else:
    real_report(json.loads((RESULTS / f"control_real{'_' + args.tag if args.tag else ''}.json").read_text()))


if __name__ == "__main__":
  main()
