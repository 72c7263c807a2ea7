r"""The FP4 kernel, the sampler and one RL step on an accelerator, timed against HBM bandwidth.

One script for one short GPU run (issue 20). On a random model of Qwen2.5-0.5B's
architecture (bf16; hidden 896, 24 layers, 14/2 heads, vocabulary 151936, tied embeddings,
QKV bias) and on the project's default small model, it measures:

* ``matmul``: every linear layer's ``[K, N]`` at decode shapes (M = 1, 8, 32, 128, 256 rows):
  the FP4 Pallas kernel (NVFP4 and MXFP4, compiled; ``fp4.matmul(..., "pallas")``) against a
  bf16 ``jnp.dot`` (``models.dense``). Two settings:

  - ``in_scan``: ``lax.scan`` over a stack of R distinct weights, the way the model's layer
    scan reads them; R is chosen so that the bf16 stack is ``--stack_mb`` (far past the L2
    cache), and the time per matmul is the call's time / R (launches and slicing included);
  - ``wide``: the same bytes as one ``[K, R * N]`` weight in a single call (the kernel
    streaming from HBM without per-layer launches).

  Each time comes with the bytes the matmul must move (weight in its format + x + y) and
  ``roofline_fraction = bytes / time / hbm_bandwidth``. The FP4 output of the last weight of
  the stack is checked against ``x @ dequantize(W)`` in float64: ``max_err_normalized`` is
  ``max |y - y_ref| / (|x| @ |W_hat|)`` (bf16 rounding of y alone gives <= 2^-9). A small
  block-size sweep (``block_n``, ``block_k``, ``num_warps``) runs at ``--sweep_ms``; the best
  setting is kept and timed again alternately with bf16 and the default blocks.
* ``sampler``: ``sampling.sample`` decode tokens/s at batch 64 x 8 samples (32-token prompt)
  and at 256 samples of one 256-token prompt, 128 new tokens, bf16 and NVFP4 weights
  (``models.quantize_params(..., implementation="pallas")``), compile time apart (first call
  minus the median of the timed ones), and the fraction of the HBM roofline:
  ``(weight bytes + KV bytes a decode step must read) / step time / bandwidth``, the KV term
  being each prompt's keys and values once plus each row's generated ones so far (averaged
  over the steps), and the step time the whole call / new tokens (prefill included, so the
  fraction is a lower bound). All samples of a prompt decode at once (``sample_chunk = N``).
* ``rl_step``: one RL step of the 0.5B-sized model: a rollout (the sampler, batch 64 x 8)
  plus one update (``rollouts_jax.training.rl_step.rl_step``), compile apart.

The sections live in ``experiments/benchmarks/gpu/`` (``matmul.py``, ``sampler.py``, ``rl_step.py``,
``lowering.py``; what they share in ``common.py``); this script parses the arguments and runs them.

Every section prints its elapsed time and is skipped, recorded as such, when the time
budget (``--time_budget_s``) runs out; the JSON (``--out``) is rewritten after every
measurement, so a run stopped from outside still leaves what finished.

``--dry_run`` runs the same code on CPU at tiny shapes (the Pallas kernel in interpret
mode, a tiny model of the same architecture, a few tokens); it also lowers the kernel and
the FP4 sampler for CUDA at the real shapes, which runs the Triton lowering rules here.
Its numbers are not GPU claims: the JSON says ``"dry_run": true``.

  python -m experiments.benchmarks.bench_gpu --out=gpu_bench.json            # on the GPU, 5-6 min
  python -m experiments.benchmarks.bench_gpu --dry_run --out=gpu_dryrun.json  # CPU, ~1 min of 1 core
  bash experiments/benchmarks/gpu_check.sh RESULTS_DIR             # the tests, then this

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916) samples its rollouts with NVFP4
weights, a memory-bound win in decode.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import statistics
import time

from experiments.benchmarks.gpu.common import (MODEL_NAMES, REPO, SCHEMA_VERSION, SECTIONS, Budget, Plan, Results,
                                               _error_record, build_models, layer_shapes, make_plan, qwen05b_config)
from experiments.benchmarks.gpu.lowering import lowering_check
from experiments.benchmarks.gpu.matmul import bench_matmul_point, prepare_matmul_shape, summarize_matmul
from experiments.benchmarks.gpu.rl_step import bench_rl_step
from experiments.benchmarks.gpu.sampler import bench_sampler_model


# ----------------------------------------------------------------------------------------------
# Arguments (the plan they give, full run or tiny dry run: gpu/common.py make_plan)
# ----------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dry_run", action="store_true",
                 help="CPU, tiny shapes, Pallas interpreted; numbers are not GPU claims.")
  p.add_argument("--out", default=None, help="JSON path (default experiments/benchmarks/results/gpu_bench.json, "
                 "or gpu_dryrun.json with --dry_run).")
  p.add_argument("--hbm_tbps", type=float, default=4.8, help="HBM bandwidth in TB/s (H200: 4.8).")
  p.add_argument("--l2_mb", type=float, default=60.0, help="L2 cache size in MB (H200: 60).")
  p.add_argument("--time_budget_s", type=float, default=None,
                 help="Seconds for all sections (default 300; a measurement under way when it ends "
                 "still finishes).")
  p.add_argument("--sections", default=",".join(SECTIONS),
                 help=f"Comma-separated subset of {SECTIONS} (lowering runs only with --dry_run "
                 "unless named alone or --lowering).")
  p.add_argument("--lowering", action="store_true", help="Also run the CUDA lowering check off dry run.")
  p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"Subset of {MODEL_NAMES}.")
  p.add_argument("--ms", default=None, help="Decode rows M (default 1,8,32,128,256; dry 1).")
  p.add_argument("--sweep_ms", default=None, help="M values with a block-size sweep (default 1,128; "
                 "dry 1; empty: no sweep).")
  p.add_argument("--sweep_max", type=int, default=None,
                 help="Block settings tried per sweep point (default 6, dry 2).")
  p.add_argument("--sweep_models", default="qwen2.5-0.5b", help="Models whose layers are swept.")
  p.add_argument("--max_layer_shapes", type=int, default=0,
                 help="Benchmark only the first this many [K, N] of each model (0: all; dry: 2, then 1).")
  p.add_argument("--stack_mb", type=float, default=None,
                 help="bf16 MB of the weight stack per timed matmul (default 512; dry: tiny).")
  p.add_argument("--max_stack", type=int, default=4096, help="Most weights in a stack.")
  p.add_argument("--reps", type=int, default=None, help="Timed repetitions (median; default 7, dry 2).")
  p.add_argument("--new_tokens", type=int, default=None, help="Sampler new tokens (default 128, dry 3).")
  p.add_argument("--tol", type=float, default=2.0 ** -7,
                 help="Bound on max |y - y_ref| / (|x| @ |W_hat|) for the kernel output.")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def print_summary(data: dict) -> None:
  """The tables of the run: decode linear layers per step, the sampler, the RL step."""
  summary = data.get("summary", {})
  print("\n== summary" + (" (DRY RUN: CPU, tiny shapes, not GPU numbers)" if data.get("dry_run") else ""))
  print(f"{'model':<14} {'fmt':>5} {'M':>4} {'bf16 ms':>9} {'fp4 ms':>9} {'fp4/bf16':>9}  "
        "(all linear layers of one decode step, in-scan)")
  for model, per_fmt in summary.get("matmul_decode_linear_layers", {}).items():
    for fmt, per_m in per_fmt.items():
      for m, row in per_m.items():
        print(f"{model:<14} {fmt:>5} {m:>4} {row['bf16_s'] * 1e3:9.3f} {row['fp4_s'] * 1e3:9.3f} "
              f"{row['speedup_vs_bf16']:8.2f}x")
  samp = data["sections"].get("sampler", {}).get("records", [])
  if samp:
    print(f"\n{'model':<14} {'shape':<15} {'weights':>7} {'tokens/s':>12} {'step ms':>9} {'roofline':>9} "
          f"{'compile s':>9}")
    for r in samp:
      print(f"{r['model']:<14} {r['shape']:<15} {r['weights']:>7} {r['tokens_per_s']:12,.0f} "
            f"{r['step_s'] * 1e3:9.3f} {r['roofline_fraction']:9.1%} {r['compile_s']:9.1f}")
  for r in data["sections"].get("rl_step", {}).get("records", []):
    if "step_s" in r:
      print(f"\nRL step ({r['model']}, {r['batch']} x {r['num_samples']}, {r['new_tokens']} new tokens): "
            f"{r['step_s']:.2f} s = rollout {r['rollout_s']:.2f} s + update {r['update_s']:.2f} s "
            f"(first step {r['first_step_s']:.1f} s)")
  for key in ("kernel_matches_reference", "fp4_vs_bf16_small_m_min", "fp4_vs_bf16_small_m_median",
              "decode_roofline_fraction_max", "issue_targets"):
    if key in summary:
      print(f"{key}: {summary[key]}")
  for name, sec in data["sections"].items():
    print(f"section {name}: {sec['status']} ({len(sec['records'])} records, {len(sec['skipped'])} skipped, "
          f"{len(sec['errors'])} errors)")


def environment(args, plan: Plan) -> dict:
  import jax
  dev = jax.devices()[0]
  env = {"jax_version": jax.__version__, "python": platform.python_version(), "backend": jax.default_backend(),
         "device_kind": dev.device_kind, "device_count": jax.device_count(), "platform": dev.platform,
         "host_cpus": os.cpu_count()}
  try:
    import jaxlib
    env["jaxlib_version"] = jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    env["loadavg"] = list(os.getloadavg())
  except OSError:
    pass
  try:
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      env["device_memory_bytes"] = stats["bytes_limit"]
  except Exception:  # pylint: disable=broad-except
    pass
  return env


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  from rollouts_jax import models

  plan = make_plan(args)
  out = pathlib.Path(args.out or REPO / "experiments" / "benchmarks" / "results" /
                     ("gpu_dryrun.json" if args.dry_run else "gpu_bench.json"))
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    raise SystemExit(f"Unknown sections {unknown}; expected a subset of {SECTIONS}.")
  if "lowering" in sections and not (args.dry_run or args.lowering or sections == ["lowering"]):
    sections.remove("lowering")
  if jax.default_backend() == "cpu" and not args.dry_run:
    print("WARNING: no accelerator; the Pallas kernel would run interpreted. Use --dry_run on CPU.", flush=True)
  bw = args.hbm_tbps * 1e12
  env = environment(args, plan)
  header = {
      "schema": SCHEMA_VERSION, "dry_run": args.dry_run,
      "claims": ("none: CPU dry run at tiny shapes, the Pallas kernel interpreted; the numbers exercise the "
                 "code path and are not GPU measurements") if args.dry_run else "accelerator run",
      "env": env, "args": vars(args), "plan": dataclasses.asdict(plan), "hbm_bandwidth_bytes_per_s": bw,
      "sections_requested": sections, "models": {}}
  results = Results(out, header)
  budget = Budget(plan.budget_s)
  t_start = time.monotonic()
  print(f"JAX {env['jax_version']} on {env['backend']} ({env['device_kind']}); HBM {args.hbm_tbps} TB/s; "
        f"budget {plan.budget_s:.0f} s; dry_run={args.dry_run}; out={out}", flush=True)

  model_names = [s.strip() for s in args.models.split(",") if s.strip()]
  models_cfg = build_models(model_names, args.dry_run)
  params = {}
  for name, (cfg, info) in models_cfg.items():
    results.data["models"][name] = {**info, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                                    "num_params": cfg.num_params(), "dtype": "bfloat16"}
  results.save()

  def get_params(name):
    if name not in params:
      cfg = models_cfg[name][0]
      params[name] = models.init_params(cfg, jax.random.key(args.seed), jnp.bfloat16)
    return params[name]

  # (section, model, weight): the most important measurements first; weights share the time.
  units = []
  if "lowering" in sections:
    units.append(("lowering", None, 1.5 if args.dry_run else 0.5))
  for name in model_names:
    first = name == model_names[0]
    if "matmul" in sections:
      units.append(("matmul", name, 3.5 if first else 0.8))
    if "sampler" in sections:
      units.append(("sampler", name, 2.5 if first else 0.8))
    if "rl_step" in sections and name == "qwen2.5-0.5b":
      units.append(("rl_step", name, 1.8))
  if "rl_step" in sections and "qwen2.5-0.5b" not in model_names:
    results.section("rl_step").update(status="skipped", reason="rl_step runs on the qwen2.5-0.5b model only")

  for i, (sec, name, weight) in enumerate(units):
    section = results.section(sec)
    remaining = sum(w for _, _, w in units[i:])
    deadline = budget.section_deadline(weight, remaining)
    t0 = time.monotonic()
    print(f"\n== {sec}{' / ' + name if name else ''}: up to {deadline - t0:.0f} s "
          f"(elapsed {t0 - t_start:.0f} s)", flush=True)
    if budget.left() <= 0:
      section["skipped"].append({"model": name, "reason": "time budget spent before the section"})
      continue
    try:
      if sec == "lowering":
        # The first model at its full size (the accelerator's shapes): Qwen2.5-0.5B's by default.
        first_name = model_names[0]
        full = {first_name: qwen05b_config(False) if first_name == "qwen2.5-0.5b" else models_cfg[first_name][0]}
        lowering_check(full, plan, args, section, results, deadline)
      elif sec == "matmul":
        cfg = models_cfg[name][0]
        sweep = name in [s.strip() for s in args.sweep_models.split(",")] and bool(plan.sweep_ms)
        limit = plan.max_shapes[0 if name == model_names[0] else 1]
        # Every shape at one M before the next M: when time runs out, it is the largest M that are
        # left out, not whole layers.
        preps = []
        for j, ((k, n), names) in enumerate(list(layer_shapes(cfg).items())[:limit]):
          try:
            preps.append((names, prepare_matmul_shape(k, n, plan, args, jax.random.key(args.seed + 1000 + j))))
          except Exception as e:  # pylint: disable=broad-except
            section["errors"].append({"model": name, "k": k, "n": n, "what": "weights", **_error_record(e)})
        for m in plan.ms:
          for names, prep in preps:
            bench_matmul_point(name, names, prep, m, plan, args, bw, sweep, section, results, deadline)
        del preps
      elif sec == "sampler":
        first = name == model_names[0]
        shapes = plan.sampler_shapes[:plan.max_sampler_shapes[0 if first else 1]]
        if not shapes:
          section.setdefault("notes", []).append(f"{name}: not run (dry run: the first model's sampler only)")
        else:
          bench_sampler_model(name, models_cfg[name][0], get_params(name), plan, shapes, bw, section, results,
                              deadline, args.seed)
      elif sec == "rl_step":
        bench_rl_step(name, models_cfg[name][0], get_params(name), plan, section, results, deadline, args.seed)
    except Exception as e:  # pylint: disable=broad-except
      section["errors"].append({"model": name, **_error_record(e)})
      print(f"  {sec} / {name}: ERROR {section['errors'][-1]['error'][:500]}", flush=True)
    el = time.monotonic() - t0
    section.setdefault("elapsed_s", {})[name or "all"] = el
    print(f"== {sec}{' / ' + name if name else ''}: {el:.1f} s", flush=True)
    results.save()

  for sec in sections:
    s = results.section(sec)
    if s["status"] == "running":
      s["status"] = ("error" if s["errors"] and not s["records"] else
                     "failed" if any(r.get("ok") is False for r in s["records"]) else
                     "partial" if s["errors"] or s["skipped"] else "done")
  summary = {}
  if "matmul" in results.data["sections"]:
    summary["matmul_decode_linear_layers"] = summarize_matmul(
        results.data["sections"]["matmul"],
        {n: {"num_layers": c.num_layers} for n, (c, _) in models_cfg.items()})
  records = [r for s in results.data["sections"].values() for r in s["records"]]
  mm = [r for r in results.data["sections"].get("matmul", {}).get("records", []) if "in_scan" in r]
  summary["kernel_matches_reference"] = all(r["ok"] for r in mm) if mm else None
  small_m = [r for r in mm if r["m"] <= 8 and r["model"] == model_names[0]]
  if small_m:
    summary["fp4_vs_bf16_small_m_min"] = min(r["in_scan"]["speedup_vs_bf16"] for r in small_m)
    summary["fp4_vs_bf16_small_m_median"] = statistics.median(r["in_scan"]["speedup_vs_bf16"] for r in small_m)
  samp = [r for r in results.data["sections"].get("sampler", {}).get("records", [])]
  if samp:
    summary["decode_roofline_fraction_max"] = max(r["roofline_fraction"] for r in samp)
  # The targets, from the numbers above (not evaluated on a dry run's CPU numbers).
  steps = summary.get("matmul_decode_linear_layers", {}).get(model_names[0], {}).get("nvfp4", {})
  small = [row["speedup_vs_bf16"] for m, row in steps.items() if int(m) <= 8 and row["speedup_vs_bf16"]]
  targets = {"nvfp4_decode_linear_layers_speedup_small_m": min(small) if small else None,
             "decode_roofline_fraction_max": summary.get("decode_roofline_fraction_max")}
  if args.dry_run:
    targets["met"] = "not evaluated: dry run"
  else:
    targets["met"] = {
        "fp4_decode_matmul_ge_2x_bf16_small_m": None if not small else min(small) >= 2.0,
        "decode_ge_50pct_hbm_roofline": (None if targets["decode_roofline_fraction_max"] is None
                                         else targets["decode_roofline_fraction_max"] >= 0.5),
        "kernel_matches_reference": summary["kernel_matches_reference"]}
  summary["issue_targets"] = targets
  summary["records"] = len(records)
  results.data["summary"] = summary
  results.data["elapsed_s"] = time.monotonic() - t_start
  results.save()
  print_summary(results.data)
  print(f"wrote {out} ({results.data['elapsed_s']:.1f} s)", flush=True)
  return results.data


if __name__ == "__main__":
  main()
