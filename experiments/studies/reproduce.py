r"""Science in miniature: the seed papers' headline claims, rerun on small tasks through the real loop.

  python -m experiments.studies.reproduce --study=mc_grpo --seeds=3
  python -m experiments.studies.reproduce --study=mc_grpo,ttrl,uniqueness,brorl,sol_rl --stop_at=09:50
  python -m experiments.studies.reproduce --study=all --smoke          # every study's cheapest form
  python -m experiments.studies.reproduce --study=real --seeds=2 --runs_dir=/data/real_runs   # on SmolLM2

Each study is a set of arms (`configs/repro_STUDY.py:ARM`) run for every seed through
`experiments.launch.train` (`harness`), one training process at a time, each run in its own workdir
(`--runs_dir/STUDY/ARM/seedS`). Runs are resumable one by one: a run whose `result.json`
exists is reused, and a killed run is started again on its workdir, which resumes it from
its last checkpoint; a run recorded in the study's results JSON (committed from another
machine, with the config it ran) is not run again while today's config for it is the same
(`same_config`), so a study can span sessions. Every seed of a study starts from one warm
start (the config's SFT warm start for seed 0, passed as a local checkpoint), so seeds differ
only in the RL run; the `real_STUDY` studies (`REAL_STUDIES`) run a miniature's arms on
SmolLM2-135M-Instruct as shipped (`configs/repro_real_base.py`), with no warm start. Runs are
ordered seed-major (seed 0 of every arm first), so a study stopped early has balanced arms.

Writes `experiments/studies/results/repro_STUDY.{json,md,png}` (or `--results_dir`): per arm, the
study's metrics as mean +- spread over seeds (spread: the sample standard deviation,
ddof=1), the per-seed values, the run's compute (rollouts, generated tokens, sampling and
update seconds, wall time), a verdict on the paper's claim under a stated rule, and how the
miniature differs from the paper. `--smoke` runs every arm once with the config's `smoke`
variant (one RL step of a tiny model) in this process. The test suite's smoke form also
starts every study from one shared, randomly initialised policy (`random_warm_start`) and
keeps compiled programs in a persistent cache (`persistent_compile_cache`), so that arms
whose programs agree compile them once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import tempfile
import time
from typing import Any, Callable, Sequence

from experiments.studies import harness
from experiments.studies.harness import diff, hf_overrides, mean_se

REPO = harness.REPO
RESULTS = harness.RESULTS


@dataclasses.dataclass(frozen=True)
class Study:
  """A paper's claim, the arms that test it and the metrics that decide it.

  Attributes:
    name: the study's name (`--study`), also its config file `configs/repro_NAME.py`.
    paper: the paper (title and arXiv id).
    claim: the claim under test, in one sentence.
    arms: arm names, each a config argument of the study's config file.
    metrics: {column: key} of a run's result (see `run_result`); the first is the headline.
    verdict: a function of the aggregated table -> (held: True / False / None, reason).
    rule: the verdict's rule, in words.
    miniature: how the miniature differs from the paper.
    extra: extra config overrides of every run of the study ("key=value").
    teacher: an arm whose seed-0 run is exported (Hugging Face layout) to the folder the
      other arms' `rollout.teacher_path` names, before any of them runs; it is not a row of
      the table (its result is reported beside it).
  """
  name: str
  paper: str
  claim: str
  arms: tuple[str, ...]
  metrics: dict[str, str]
  verdict: Callable[[dict], tuple[bool | None, str]]
  rule: str
  miniature: str
  extra: tuple[str, ...] = ()
  teacher: str = ""


# ---------------------------------------------------------------------------------------------
# Aggregation and verdicts (pure functions of run results; tested on hand-made results).
# ---------------------------------------------------------------------------------------------

def aggregate(study: Study, results: Sequence[dict]) -> dict[str, dict[str, Any]]:
  """{arm: {"seeds", column: mean_spread + per-seed "values"}} over the runs of each of the study's arms."""
  return harness.aggregate(results, study.arms, study.metrics)


def _fmt(x, digits=3):
  return "n/a" if x is None else f"{x:+.{digits}f}"


def verdict_mc_grpo(t):
  gap, gap_se = diff(t, "g8_mean", "g2_mean", "pass@1 after")
  gain, gain_se = diff(t, "g2_median", "g2_mean", "pass@1 after")
  if gap is None or gain is None:
    return None, "not all of g2_mean, g2_median, g8_mean ran"
  text = (f"G=8 mean - G=2 mean = {_fmt(gap)} (se {gap_se:.3f}); G=2 median - G=2 mean = {_fmt(gain)} "
          f"(se {gain_se:.3f})")
  if gap <= gap_se:
    return None, text + ": G=8 does not beat G=2 by more than its standard error here, so there is no gap to close"
  return gain >= gap / 2 and gain > gain_se, text


def verdict_ttrl(t):
  gap, gap_se = diff(t, "ground_truth", "ttrl", "pass@1 after")
  g_gain, g_se = mean_se(t, "ground_truth", "pass@1 gain")
  l_gain, l_se = mean_se(t, "ttrl", "pass@1 gain")
  if gap is None:
    return None, "not both arms ran"
  text = (f"pass@1 after: ground truth - TTRL = {_fmt(gap)} (se {gap_se:.3f}); pass@1 gain: ground truth "
          f"{_fmt(g_gain)} (se {g_se:.3f}), TTRL {_fmt(l_gain)} (se {l_se:.3f})")
  if gap <= 2 * gap_se:
    return True, text
  recovers = g_gain > g_se and l_gain > l_se and l_gain >= g_gain / 2
  if not recovers and l_gain < -2 * max(l_se, 1e-9):
    text += "; TTRL lost held-out accuracy (label-free collapse)"
  return recovers, text


def verdict_uniqueness(t):
  dk, dk_se = diff(t, "uniqueness", "grpo", "pass@16 after")
  d1, d1_se = diff(t, "uniqueness", "grpo", "pass@1 after")
  if dk is None:
    return None, "not both arms ran"
  text = (f"uniqueness - GRPO: pass@16 {_fmt(dk)} (se {dk_se:.3f}), pass@1 {_fmt(d1)} (se {d1_se:.3f})")
  return dk > dk_se and abs(d1) <= 2 * max(d1_se, 1e-9), text


def verdict_brorl(t):
  vals = {a: mean_se(t, a, "pass@1 gain")[0] for a in ("n8", "n32", "n128", "n8_steps4")}
  if any(vals[a] is None for a in ("n8", "n32", "n128")):
    return None, "not all of n8, n32, n128 ran"
  text = "pass@1 gain: " + ", ".join(f"{a} {_fmt(v)}" for a, v in vals.items() if v is not None)
  d, d_se = diff(t, "n128", "n8", "pass@1 gain")
  monotone = vals["n8"] <= vals["n32"] <= vals["n128"]
  beats_steps = vals["n8_steps4"] is None or vals["n128"] >= vals["n8_steps4"]
  return monotone and d > d_se and beats_steps, text


def verdict_sol_rl(t):
  d, d_se = diff(t, "fp4_subset", "full", "pass@1 gain")
  if d is None:
    return None, "not both of full and fp4_subset ran"
  ts, _ = mean_se(t, "fp4_subset", "sample s/step")
  tf, _ = mean_se(t, "full", "sample s/step")
  text = (f"fp4_subset - full pass@1 gain {_fmt(d)} (se {d_se:.3f}); rollout seconds per step "
          f"{ts:.2f} (FP4 pool of 16) vs {tf:.2f} (full precision, 8): FP4 is simulated on this CPU")
  return d >= -2 * d_se, text


def verdict_real_sol_rl(t):
  parts, held = [], True
  for arm in ("fp4_naive", "mxfp4_naive"):
    d, d_se = diff(t, arm, "full", "pass@1 gain")
    if d is None:
      return None, f"not both of full and {arm} ran"
    gap, _ = mean_se(t, arm, "FP4 log-prob gap")
    parts.append(f"{arm} - full pass@1 gain {_fmt(d)} (se {d_se:.3f}), behaviour/trainer log-prob gap "
                 f"{gap if gap is None else round(gap, 4)}")
    held = held and d >= -2 * d_se
  return held, "; ".join(parts) + " (FP4 is simulated on this CPU: the cost half is not tested)"


def verdict_real_opd(t):
  """ESR (early-stopped rollouts) and ADWIN (its adaptive window) against full-rollout OPD: as accurate,
  with fewer generated tokens (ADWIN's probes counted)."""
  parts, held = [], True
  to, _ = mean_se(t, "opd", "generated tokens")
  for arm in ("esr", "adwin"):
    d, d_se = diff(t, arm, "opd", "pass@1 after")
    if d is None:
      if arm == "esr":
        return None, "not both of opd and esr ran"
      continue
    te, _ = mean_se(t, arm, "generated tokens")
    frac = te / to if te is not None and to else None
    held = held and d >= -max(0.05, 2 * d_se) and frac is not None and frac < 0.9
    parts.append(f"{arm} - opd held-out pass@1 {_fmt(d)} (se {d_se:.3f}); {arm.upper()} generated "
                 f"{'n/a' if frac is None else f'{100 * frac:.0f}%'} of OPD's tokens")
  return held, "; ".join(parts)


_COMMON = {"pass@1 before": "eval/pass@1 before", "pass@1 after": "eval/pass@1 after",
           "pass@1 gain": "eval/pass@1 gain"}
_COMPUTE = {"rollouts": "rollouts", "sample s/step": "sample_s_per_step", "update s/step": "update_s_per_step",
            "wall s": "wall_s"}

STUDIES = {s.name: s for s in [
    Study(
        name="mc_grpo", paper="MC-GRPO (arXiv 2601.22582)",
        claim="With small groups, a median baseline over G+1 samples (pivot left out) keeps accuracy close to "
              "large groups.",
        arms=("g2_mean", "g2_median", "g8_mean", "g8_median"),
        metrics={**_COMMON, "pass@4 after": "eval/pass@4 after", "train reward, last 10": "reward_last10",
                 **_COMPUTE},
        verdict=verdict_mc_grpo,
        rule="held if G=8 (mean) beats G=2 (mean) by more than a standard error and the G=2 median arm "
             "(3 samples, pivot excluded) closes at least half of that gap (and beats G=2 mean by more than "
             "its standard error)",
        miniature="3-digit addition with a 0.6M-parameter character model (paper: Qwen3-1.7B / Qwen2.5-Math on "
                  "GSM8K and MATH); 80 RL steps of 8 prompts; binary reward; MAD scaling falls back to the "
                  "std on zero-MAD groups instead of MAD + 1e-3 (|A| = 1000 in the reference code); 200 held-out "
                  "prompts x 4 samples"),
    Study(
        name="ttrl", paper="TTRL (arXiv 2504.16084)",
        claim="Majority-vote pseudo-labels, with no ground truth, approach the ground-truth reward run on the "
              "same prompts.",
        arms=("ground_truth", "ttrl"),
        metrics={**_COMMON, "maj@4 after": "eval/maj@4 after",
                 "train reward (agreement for TTRL), last 10": "reward_last10", **_COMPUTE},
        verdict=verdict_ttrl,
        rule="held if TTRL's held-out pass@1 after RL is within two standard errors of the ground-truth "
             "run's, or (where the ground-truth run gains) TTRL keeps at least half of that gain; collapse "
             "shows as a rising training reward (the group agrees with itself) while held-out pass@1 falls",
        miniature="votes over 8 samples (paper: 64, training on 32); RL on the training split's prompts, "
                  "not the test set; arithmetic instead of AIME/MATH; 80 steps of 8 prompts"),
    Study(
        name="uniqueness", paper="Rewarding the Rare (arXiv 2601.08763)",
        claim="Reweighting correct samples by strategy rarity raises pass@k at large k versus GRPO at equal "
              "pass@1.",
        arms=("grpo", "uniqueness"),
        metrics={**_COMMON, "pass@16 before": "eval/pass@16 before", "pass@16 after": "eval/pass@16 after",
                 "pass@16 gain": "eval/pass@16 gain", "strategies per group": "clusters_per_group",
                 **_COMPUTE},
        verdict=verdict_uniqueness,
        rule="held if uniqueness beats GRPO on held-out pass@16 by more than a standard error while pass@1 "
             "stays within two standard errors",
        miniature="countdown with 3 numbers and a character model; strategies are canonical expression "
                  "structures, not an LLM judge's clusters; alpha = 0.5; pass@16 on 100 prompts (paper: "
                  "AUC of pass@k up to k = 256 on math benchmarks); 80 steps of 8 prompts x 8 samples"),
    Study(
        name="brorl", paper="BroRL (arXiv 2510.01180)",
        claim="More rollouts per prompt (N = 8, 32, 128) keep improving at a fixed number of update steps, "
              "where more steps at small N plateau.",
        arms=("n8", "n32", "n128", "n8_steps4"),
        metrics={**_COMMON, "train reward, last 10": "reward_last10", "informative groups": "informative_groups",
                 **_COMPUTE},
        verdict=verdict_brorl,
        rule="held if held-out pass@1 gain rises with N at 60 steps (n8 <= n32 <= n128, n128 - n8 above its "
             "standard error) and n128 is at least n8 run for 4x the steps",
        miniature="2 prompts a step (paper: hundreds of prompts x N = 512 from a ProRL checkpoint); 60 steps; "
                  "arithmetic; the compute columns are this CPU's"),
    Study(
        name="sol_rl", paper="Sol-RL (arXiv 2604.06916)",
        claim="An FP4 rollout pool with a contrastive subset matches full-precision rollouts in reward per "
              "update, at lower rollout cost where the hardware favours FP4.",
        arms=("full", "fp4_subset", "fp4_naive"),
        metrics={**_COMMON, "FP4 pool reward": "sol/pool_reward_mean", "FP4 log-prob gap": "sol/fp4_logprob_gap",
                 **_COMPUTE},
        verdict=verdict_sol_rl,
        rule="held (quality half) if the FP4 contrastive subset's held-out pass@1 gain is within two standard "
             "errors of the full-precision run's or above; the cost half cannot be tested here: a CPU has no "
             "FP4 units and the FP4 matmul is simulated, so FP4 rollouts are slower",
        miniature="a language model on arithmetic (paper: diffusion image models, 24-in-96 with fewer ODE "
                  "steps in the draft); 8-in-16; NVFP4 weights with fake-quantized matmuls; 80 steps of 8 "
                  "prompts"),
]}

_REAL = ("SmolLM2-135M-Instruct as shipped (Q4_1 GGUF dequantized to float32, no SFT) on 1-2 digit addition "
         "in its chat template, temperature 0.7; 24 RL steps of 8 prompts, lr 2e-5, no dynamic sampling; "
         "held-out pass@1 / pass@8 / maj@8 on 100 test problems (8 samples each); 2 CPU cores")
_REAL_EVAL = {**_COMMON, "maj@8 before": "eval/maj@8 before", "maj@8 after": "eval/maj@8 after",
              "greedy after": "eval/greedy_accuracy after"}

#: The same claims on a real pretrained model (`configs/repro_real_STUDY.py`: the miniature's
#: arms on `configs/repro_real_base.py`). Their runs start from the GGUF file, not an SFT warm start.
REAL_STUDIES = {s.name: s for s in [
    dataclasses.replace(
        STUDIES["mc_grpo"], name="real_mc_grpo", arms=("g2_mean", "g2_median", "g8_mean"),
        metrics={**_REAL_EVAL, "train reward, last 10": "reward_last10", **_COMPUTE},
        miniature=_REAL + " (paper: Qwen3-1.7B / Qwen2.5-Math on GSM8K and MATH, hundreds of steps)"),
    dataclasses.replace(
        STUDIES["ttrl"], name="real_ttrl",
        metrics={**_REAL_EVAL, "train reward (agreement for TTRL), last 10": "reward_last10", **_COMPUTE},
        miniature=_REAL + "; the base model's maj@8 (0.26) exceeds its pass@1 (0.155) on this task at this "
                          "temperature; votes over 8 samples on the training split (paper: 64 votes, 32 trained "
                          "on, on the test set: AIME / MATH-500)"),
    dataclasses.replace(
        STUDIES["brorl"], name="real_brorl",
        metrics={**_REAL_EVAL, "train reward, last 10": "reward_last10", "informative groups": "informative_groups",
                 **_COMPUTE},
        rule="held if held-out pass@1 gain rises with N at 24 steps (n8 <= n32 <= n128, n128 - n8 above its "
             "standard error) and n128 is at least n8 run for 4x the steps (96)",
        miniature=_REAL.replace("24 RL steps of 8 prompts", "24 RL steps of 2 prompts (96 for n8_steps4)")
        + " (paper: hundreds of prompts x N = 512 from a ProRL checkpoint, thousands of steps)"),
    Study(
        name="real_sol_rl", paper="Sol-RL (arXiv 2604.06916)",
        claim="Rollouts from an FP4 (NVFP4 or MXFP4) copy of the policy, with the full-precision update, reach "
              "the reward of full-precision rollouts.",
        arms=("full", "fp4_naive", "mxfp4_naive"),
        metrics={**_REAL_EVAL, "train reward, last 10": "reward_last10",
                 "FP4 log-prob gap": "sol/fp4_logprob_gap", "sampler/trainer mismatch": "mismatch_mean",
                 **_COMPUTE},
        verdict=verdict_real_sol_rl,
        rule="held if both FP4 arms' held-out pass@1 gain is within two standard errors of the full-precision "
             "run's or above; the FP4 log-prob gap is the mean |log p_fp4 - log p_full| of the sampled tokens; "
             "the cost half cannot be tested here (a CPU has no FP4 units)",
        miniature=_REAL + "; 8 FP4 samples a prompt, all trained on (no pool or subset selection: the format's "
                          "own effect); weights fake-quantized (paper: diffusion image models)"),
    Study(
        name="real_opd", paper="On-policy distillation (GKD, arXiv 2306.13649) with early-stopped rollouts (ESR)",
        claim="A student trained on a teacher's per-token log-ratios over its own rollouts gains accuracy with no "
              "reward; rollouts stopped after a prefix (ESR) keep that gain with fewer generated tokens.",
        arms=("opd", "esr", "adwin"),
        metrics={**_REAL_EVAL, "generated tokens": "generated_tokens", "reverse KL, last 10": "reverse_kl_last10",
                 "window, mean over steps": "distill_window_mean", "window, last": "distill_window_last",
                 "probe tokens": "probe_tokens", **_COMPUTE},
        verdict=verdict_real_opd,
        rule="held if ESR's (and ADWIN's) held-out pass@1 after training is within max(0.05, 2 se) of "
             "full-rollout OPD's while it generates under 90% of OPD's tokens (ADWIN's full-length probes "
             "counted); OPD's own gain is the pass@1 gain column",
        miniature=_REAL + "; the teacher is the same model after 24 GRPO steps on the task's reward (the `teacher` "
                          "arm, seed 0); ESR keeps the first 12 of 24 tokens; ADWIN starts at 12 and probes every 5 steps "
                          "(window in [4, 24], multiples of 4); single-sample reverse-KL advantage "
                          "(paper settings: larger teachers, long reasoning traces)",
        teacher="teacher"),
]}
ALL_STUDIES = {**STUDIES, **REAL_STUDIES}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def config_arg(study: str, arm: str, smoke: bool) -> str:
  return f"configs/repro_{study}.py:{arm}" + (",smoke" if smoke else "")


def _load_exp(study: str, arm: str, smoke: bool, overrides: Sequence[str] = ()):
  return harness.load_config(config_arg(study, arm, smoke), overrides)


def warm_start_overrides(study: Study, smoke: bool, env: dict, *, in_process: bool) -> list[str]:
  """Overrides that load the study's seed-0 SFT warm start as a local checkpoint (built if absent)."""
  return harness.ensure_warm_start(config_arg(study.name, study.arms[0], smoke), study.extra, env=env,
                                   in_process=in_process, check=not study.teacher,   # (no teacher folder yet)
                                   log=lambda line: print(f"[{study.name}] {line}", flush=True))


def random_warm_start(folder: pathlib.Path, study: str = "mc_grpo", *, smoke: bool = True,
                      seed: int = 0) -> pathlib.Path:
  """Writes a randomly initialised policy (no SFT) as a warm-start folder; returns `folder`.

  The model is the one `study`'s first arm configures (the `smoke` variant by default) and the
  tokenizer the synthetic tasks' fixed character vocabulary, which every study uses, so one such
  folder can start every study (`run_studies(..., warm_start=folder)`): the test suite's smoke
  form, where what the policy knows does not matter and an SFT per study would only compile.

  Args:
    folder: where to write the weights (`config.json`, safetensors) and `tokenizer.json`.
    study: the study whose model configuration is used.
    smoke: use the config's smoke variant.
    seed: the initialisation's seed.

  Returns:
    `folder`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from rollouts_jax import data as data_lib, models  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib, policy  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(_load_exp(study, STUDIES[study].arms[0], smoke))
  if exp.tokenizer.kind != "char":
    raise ValueError(f"random_warm_start writes the character tokenizer; {study} uses {exp.tokenizer.kind!r}.")
  tokenizer = data_lib.CharTokenizer.default()
  cfg = policy.model_config(exp.model, tokenizer)
  folder.mkdir(parents=True, exist_ok=True)
  models.save_hf_checkpoint(folder, cfg, models.init_params(cfg, jax.random.key(seed)))
  tokenizer.save(folder / "tokenizer.json")
  return folder


@contextlib.contextmanager
def persistent_compile_cache(path: pathlib.Path, *, optimize: bool = True):
  """Within the block, compiled XLA programs are kept in (and read from) the folder `path`.

  JAX's in-memory caches belong to each jitted function object, and a training run builds its
  own, so in one process the second run of a study recompiles what the first compiled; with a
  persistent cache every program after the first identical one is read back, and a later
  process reads them all back. The earlier settings are restored on exit.

  Args:
    path: the cache folder (created if absent).
    optimize: False skips most of XLA's optimisations (`jax_disable_most_optimizations`):
      programs compile faster and run slower, the right trade for smoke runs of one step.
      The programs compiled so are cached under their own keys.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  settings = {"jax_persistent_cache_min_compile_time_secs": 0.0}
  if not optimize and "jax_disable_most_optimizations" in jax.config.values:
    settings["jax_disable_most_optimizations"] = True
  before = {k: jax.config.values[k] for k in list(settings) + ["jax_compilation_cache_dir"]}
  pathlib.Path(path).mkdir(parents=True, exist_ok=True)
  for k, v in settings.items():
    jax.config.update(k, v)
  compilation_cache.set_cache_dir(str(path))
  compilation_cache.reset_cache()   # the cache object is built once per setting: build it for this folder
  try:
    yield pathlib.Path(path)
  finally:
    for k, v in before.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def run_result(workdir: pathlib.Path) -> dict[str, Any]:
  """A finished run's numbers from its `summary.json` and `metrics.jsonl`.

  Returns:
    {"eval/<metric> before|after|gain", "reward_last10" (mean training reward of the last 10
    steps), "rollouts" (total), "generated_tokens", "sample_s_per_step", "update_s_per_step"
    (medians), and the mean of every `sol/*`, `clusters_per_group` and `informative_groups`
    metric logged}.
  """
  summary = json.loads((workdir / "summary.json").read_text())
  steps = harness.read_steps(workdir)
  out: dict[str, Any] = {}
  for phase in ("before", "after"):
    for k, v in summary.get(phase, {}).items():
      out[f"{k} {phase}"] = v
  for k in summary.get("after", {}):
    if k in summary.get("before", {}):
      out[f"{k} gain"] = summary["after"][k] - summary["before"][k]

  def med(key):
    vals = sorted(r[key] for r in steps if key in r)
    return vals[len(vals) // 2] if vals else None

  out["reward_last10"] = sum(r["reward_mean"] for r in steps[-10:]) / max(len(steps[-10:]), 1)
  out["rollouts"] = sum(r.get("rollouts", 0.0) for r in steps)
  out["generated_tokens"] = sum(r.get("generated_tokens", 0.0) for r in steps)
  out["sample_s_per_step"] = med("time/sample")
  out["update_s_per_step"] = med("time/update")
  out["steps"] = len(steps)
  for key in {k for r in steps for k in r if k.startswith("sol/") or k in (
      "clusters_per_group", "informative_groups", "mismatch_mean")}:
    vals = [r[key] for r in steps if key in r]
    out[key] = sum(vals) / len(vals)
  kl = [r["distill/reverse_kl"] for r in steps if "distill/reverse_kl" in r]
  if kl:   # on-policy distillation: the sampled reverse KL to the teacher over the last 10 steps
    out["reverse_kl_last10"] = sum(kl[-10:]) / len(kl[-10:])
  windows = [r["distill/window"] for r in steps if "distill/window" in r]
  if windows:   # ESR / ADWIN: the generation window, mean over steps and last
    out["distill_window_mean"], out["distill_window_last"] = sum(windows) / len(windows), windows[-1]
  probe = [r["distill/probe_tokens"] for r in steps if "distill/probe_tokens" in r]
  if probe:   # ADWIN: the full-length probes' tokens (included in generated_tokens)
    out["probe_tokens"] = sum(probe)
  return out


def run_one(study: Study, arm: str, seed: int, workdir: pathlib.Path, overrides: Sequence[str], *, smoke: bool,
            env: dict, in_process: bool) -> dict[str, Any]:
  """Runs (or reuses, or resumes) one arm x seed; returns its result (also written to result.json)."""
  overrides = list(study.extra) + list(overrides) + [f"seed={seed}"]

  def train_here():
    from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top
    loop.train(config_lib.from_config_dict(_load_exp(study.name, arm, smoke, overrides)), workdir, progress=False)

  return harness.train_run(workdir, config_arg(study.name, arm, smoke), overrides, env=env,
                           record=lambda w: dict(run_result(w), arm=arm, seed=seed),
                           label=f"{study.name}/{arm}/seed{seed}", in_process=train_here if in_process else None)


def committed_runs(path: pathlib.Path) -> tuple[dict[tuple[str, int], dict], dict]:
  """({(arm, seed): run result}, its teacher record) of a results JSON written by `write_outputs`.

  ({}, {}) if there is none.
  """
  if not path.exists():
    return {}, {}
  recorded = json.loads(path.read_text())
  return {(r["arm"], int(r["seed"])): r for r in recorded.get("runs", [])}, recorded.get("teacher") or {}


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def flat_config(exp) -> dict:
  """An `ExperimentConfig` (or its `asdict` / `config.json`) as flat {"section.key": JSON value}."""
  tree = exp if isinstance(exp, dict) else dataclasses.asdict(exp)
  return _flat(json.loads(json.dumps(tree, default=str)))


def run_config(study: str, arm: str, seed: int, extra: Sequence[str] = ()) -> dict:
  """One run's full config, flat, as training sees it (before any warm-start override).

  A study with a teacher is read without the file checks: its teacher folder may not exist yet here.
  """
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  return flat_config(config_lib.from_config_dict(_load_exp(study, arm, False, list(extra) + [f"seed={seed}"]),
                                                 check=not ALL_STUDIES[study].teacher))


def same_config(recorded: dict | None, today: dict, ignore: Sequence[str] = ()) -> bool:
  """Whether a run recorded with flat config `recorded` is the run `today`'s config would make.

  Every key must agree, except keys in `ignore` (a machine's warm-start paths) and keys added
  to the config since the run whose value today is their default (a new option that leaves
  the old behaviour alone, the project's rule for new keys). A changed default is a mismatch.
  """
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  if not recorded:
    return False
  recorded = config_lib.upgrade_flat(recorded)   # recorded by an earlier version: today's keys
  defaults = flat_config(config_lib.ExperimentConfig())
  for key, value in today.items():
    if key in ignore:
      continue
    if key in recorded:
      if recorded[key] != value:
        return False
    elif key not in defaults or value != defaults[key]:
      return False
  return all(key in today or key in ignore for key in recorded)


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------

def write_outputs(study: Study, results: Sequence[dict], out_dir: pathlib.Path, *, planned_seeds: int,
                  smoke: bool, missing: Sequence[str] = (), plot: bool = True) -> dict[str, Any]:
  """Writes repro_STUDY.json and .md (and .png); returns the JSON document."""
  table = aggregate(study, results)
  held, reason = study.verdict(table)
  doc = {"study": study.name, "paper": study.paper, "claim": study.claim, "rule": study.rule,
         "miniature": study.miniature, "smoke": smoke, "planned_seeds": planned_seeds,
         "held": held, "verdict": reason, "not_run": list(missing), "arms": table,
         "runs": sorted(results, key=lambda r: (r["arm"], r["seed"]))}
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = out_dir / f"repro_{study.name}"
  (stem.with_suffix(".json")).write_text(json.dumps(doc, indent=1))
  word = {True: "held", False: "did not hold", None: "inconclusive"}[held]
  lines = [f"# Reproduction `{study.name}`: {study.paper}" + (" (smoke run: not a result)" if smoke else ""), "",
           f"Claim: {study.claim}", "",
           f"Verdict: **{word}**. {reason}.", "", f"Rule: {study.rule}.", "",
           f"Miniature: {study.miniature}.", "",
           "Cells: mean +- sample standard deviation over seeds (n seeds in the last column).", ""]
  lines += harness.markdown_table(
      table, list(study.metrics), lambda c: 0 if c in ("rollouts", "wall s") else (2 if c.endswith("s/step") else 3))
  reused = [f"{r['arm']}/seed{r['seed']} = {r['reused_from']}" for r in doc["runs"] if r.get("reused_from")]
  if reused:
    lines += ["", "Runs taken from another study's run with the same config and seed: " + "; ".join(reused) + "."]
  if missing:
    lines += ["", "Not run (not in --arms, not started before the deadline, or failed): " + ", ".join(missing) + "."]
  (stem.with_suffix(".md")).write_text("\n".join(lines) + "\n")
  if plot and table:
    _plot(study, table, stem.with_suffix(".png"))
  return doc


def _plot(study: Study, table: dict, path: pathlib.Path) -> None:
  plt = harness.pyplot()
  columns = [c for c in study.metrics if c.startswith("pass@") and ("after" in c or "gain" in c)][:3]
  fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 3.4), squeeze=False)
  for ax, column in zip(axes[0], columns):
    harness.bar_panel(ax, table, column)
    ax.axhline(0, color="#999", lw=0.6)
  fig.suptitle(f"{study.name}: {study.paper} (mean +- sd over seeds, dots: seeds)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def run_studies(names: Sequence[str], *, seeds: int, runs_dir: pathlib.Path, results_dir: pathlib.Path,
                smoke: bool = False, in_process: bool | None = None, threads: int = 1,
                stop_at: str | None = None, arms: Sequence[str] = (), plot: bool = True,
                report_only: bool = False, warm_start: pathlib.Path | None = None,
                log: Callable[[str], None] = print) -> dict[str, dict]:
  """Runs the studies one after another (each seed-major) and writes their tables.

  Args:
    names: study names, in order of priority.
    seeds: seeds per arm (0 .. seeds-1).
    runs_dir: parent of every run's workdir (`runs_dir/STUDY/ARM/seedS`).
    results_dir: where `repro_STUDY.{json,md,png}` go.
    smoke: the configs' `smoke` variants, one seed.
    in_process: run `loop.train` in this process (default: only for smoke) instead of
      `experiments.launch.train` subprocesses.
    threads: CPU threads of each training subprocess (0: JAX's default).
    stop_at: "HH:MM" (UTC; its next occurrence, fixed when this is called): start no run after this
      time; the rest is reported as not run.
    arms: if given, only these arms (of any study).
    plot: write the PNG.
    report_only: train nothing: tables from the runs that have finished.
    warm_start: a warm-start folder (weights and `tokenizer.json`, e.g. `random_warm_start`)
      that every study starts from, instead of each study's SFT warm start.
    log: progress lines.

  Returns:
    {study: the JSON document written}.
  """
  in_process = smoke if in_process is None else in_process
  seeds = 1 if smoke else seeds
  env = harness.child_env(threads, runs_dir / "jax_cache")
  docs, stop_at = {}, harness.deadline(stop_at)   # one deadline for every study
  for name in names:
    study = ALL_STUDIES[name]
    # Runs recorded in the study's results JSON (a commit of an earlier machine's) count as done
    # when their config is today's: a study spread over machines repeats nothing.
    committed, recorded_teacher = ({}, {}) if smoke else committed_runs(results_dir / f"repro_{name}.json")
    study_dir = runs_dir / ("smoke" if smoke else "") / name
    # Keys the warm start sets (paths on the machine that built it), and a teacher's folder, do
    # not tell runs apart.
    ignored = (["rollout.teacher_path"] if name in REAL_STUDIES
               else [o.partition("=")[0] for o in hf_overrides(runs_dir)])
    setup = {}

    def save(results, missing, plot=False, study=study, study_dir=study_dir, recorded_teacher=recorded_teacher):
      """The study's JSON and MD as they stand (the teacher's record kept in them after every run)."""
      doc = write_outputs(study, results, results_dir, planned_seeds=seeds, smoke=smoke, missing=missing, plot=plot)
      return add_teacher(study, results_dir, study_dir, doc, recorded_teacher) if study.teacher else doc

    def recorded(arm, seed, workdir, name=name, study=study, committed=committed, ignored=ignored):
      earlier = committed.get((arm, seed))
      if earlier is None or not same_config(earlier.get("config"), run_config(name, arm, seed, study.extra),
                                            ignore=ignored):
        return None
      log(f"[{name}] {arm} seed {seed}: recorded in {results_dir.name}/repro_{name}.json")
      return earlier

    def run(arm, seed, workdir, name=name, study=study, study_dir=study_dir, setup=setup):
      if "overrides" not in setup:   # the warm start (and a teacher) once, before the study's first run
        setup["overrides"] = (hf_overrides(warm_start) if warm_start is not None and name not in REAL_STUDIES
                              else warm_start_overrides(study, smoke, env, in_process=in_process))
        if study.teacher:
          ensure_teacher(study, study_dir, setup["overrides"], smoke=smoke, env=env, in_process=in_process, log=log)
      t0 = time.time()
      result = run_one(study, arm, seed, workdir, setup["overrides"], smoke=smoke, env=env, in_process=in_process)
      if not smoke and "config" not in result and (workdir / "config.json").exists():
        # What ran, for a later machine to decide whether its runs are this one's.
        result["config"] = flat_config(json.loads((workdir / "config.json").read_text()))
        (workdir / "result.json").write_text(json.dumps(result, indent=1))
      log(f"[{name}] {arm} seed {seed}: pass@1 {result.get('eval/pass@1 before', float('nan')):.3f} -> "
          f"{result.get('eval/pass@1 after', float('nan')):.3f}, wall {result['wall_s']:.0f} s "
          f"({time.time() - t0:.0f} s now)")
      return result

    # Arms not chosen keep their recorded runs in the table; only the chosen ones start runs.
    results, missing = harness.run_grid(study.arms, seeds, study_dir, run, report_only=report_only, stop_at=stop_at,
                                        only=[a for a in study.arms if a in arms] if arms else None,
                                        recorded=recorded, save=save, log=log)
    docs[name] = save(results, missing, plot)
  return docs


def teacher_folder(study: Study, smoke: bool) -> pathlib.Path:
  """Where the study's configs read the teacher (`rollout.teacher_path` of its distilling arms)."""
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  student = next(a for a in study.arms if a != study.teacher)
  exp = config_lib.from_config_dict(_load_exp(study.name, student, smoke), check=False)
  if not exp.rollout.teacher_path:
    raise ValueError(f"Study {study.name}: arm {student!r} sets no rollout.teacher_path for the teacher to go to.")
  return pathlib.Path(exp.rollout.teacher_path)


def ensure_teacher(study: Study, study_dir: pathlib.Path, overrides: Sequence[str], *, smoke: bool, env: dict,
                   in_process: bool, log: Callable[[str], None] = print) -> dict:
  """Trains the study's teacher arm (seed 0) unless done, exports it where the arms read it; its result.

  A run that stopped part-way resumes (`run_one`); the export is redone whenever the folder
  lacks a finished export (`done.json`) or the run is newer than it.
  """
  workdir = study_dir / "teacher" / "seed0"
  result = run_one(study, study.teacher, 0, workdir, overrides, smoke=smoke, env=env, in_process=in_process)
  folder = teacher_folder(study, smoke)
  done = folder / "done.json"
  if done.exists() and json.loads(done.read_text()).get("workdir") == str(workdir):
    return result
  log(f"[{study.name}] exporting the teacher ({study.teacher} seed 0: pass@1 "
      f"{result.get('eval/pass@1 after', float('nan')):.3f}) to {folder}")
  cmd = harness.launch_command("evaluate", f"--workdir={workdir}", f"--export_hf={folder}")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"[{study.name}] exporting the teacher failed:\n{proc.stderr[-2000:]}")
  done.write_text(json.dumps({"workdir": str(workdir), "pass@1": result.get("eval/pass@1 after")}))
  return result


def add_teacher(study: Study, results_dir: pathlib.Path, study_dir: pathlib.Path, doc: dict,
                recorded: dict | None = None) -> dict:
  """The teacher's own run (when it ran here, else as `recorded`) beside the study's table, in the JSON and the MD."""
  result_file = study_dir / "teacher" / "seed0" / "result.json"
  teacher = json.loads(result_file.read_text()) if result_file.exists() else recorded
  if not teacher:
    return doc
  doc["teacher"] = teacher
  (results_dir / f"repro_{study.name}.json").write_text(json.dumps(doc, indent=1))
  md = results_dir / f"repro_{study.name}.md"
  line = (f"\nTeacher: the `{study.teacher}` arm, seed 0 (the student after 24 GRPO steps): held-out pass@1 "
          f"{teacher.get('eval/pass@1 before', float('nan')):.3f} -> {teacher.get('eval/pass@1 after', float('nan')):.3f}, "
          f"maj@8 {teacher.get('eval/maj@8 after', float('nan')):.3f}.\n")
  if md.exists() and "Teacher: " not in md.read_text():
    md.write_text(md.read_text() + line)
  return doc


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--study", required=True,
                      help="a study, a comma-separated list, 'all' (the miniatures) or 'real' (on SmolLM2)")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="every arm's smoke variant, one seed, in-process")
  parser.add_argument("--arms", default="", help="comma-separated arms to run (default: all)")
  parser.add_argument("--runs_dir", default=os.path.join(tempfile.gettempdir(), "rollouts_repro"))
  parser.add_argument("--results_dir", default=str(RESULTS))
  parser.add_argument("--threads", type=int, default=1, help="CPU threads per training process (0: default)")
  parser.add_argument("--stop_at", default=None, help="HH:MM UTC after which no new run starts")
  parser.add_argument("--no_plot", action="store_true")
  parser.add_argument("--report_only", action="store_true", help="no training: tables from finished runs")
  args = parser.parse_args(argv)
  groups = {"all": list(STUDIES), "real": list(REAL_STUDIES)}
  names = [n for part in args.study.split(",") for n in groups.get(part, [part])]
  for n in names:
    if n not in ALL_STUDIES:
      parser.error(f"unknown study {n!r}; studies: {', '.join(ALL_STUDIES)} (or all, real)")
  known = [a for n in names for a in ALL_STUDIES[n].arms]
  for a in filter(None, args.arms.split(",")):
    if a not in known:
      parser.error(f"--arms: unknown arm {a!r}; the arms of {', '.join(names)}: {', '.join(dict.fromkeys(known))}")
  runs_dir = pathlib.Path(args.runs_dir)
  # The smoke runs train in this process: its compiled programs (quickly compiled, for one step)
  # go to the runs' cache, as the training subprocesses' do.
  cache = contextlib.nullcontext()
  if args.smoke:
    cache = persistent_compile_cache(runs_dir / "jax_cache", optimize=False)
  with cache:
    docs = run_studies(names, seeds=args.seeds, runs_dir=runs_dir, results_dir=pathlib.Path(args.results_dir),
                       smoke=args.smoke, threads=args.threads, stop_at=args.stop_at,
                       arms=[a for a in args.arms.split(",") if a], plot=not args.no_plot,
                       report_only=args.report_only)
  for name, doc in docs.items():
    print(f"{name}: {doc['verdict']} -> held={doc['held']}")


if __name__ == "__main__":
  main()
