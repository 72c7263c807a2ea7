"""Section matmul: the FP4 Pallas kernel against bf16 at every linear layer's [K, N] and decode M."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from experiments.benchmarks.gpu.common import Plan, Results, _error_record, alternate, first_call, sweep_max


def _pow2(v: int) -> bool:
  return v > 0 and v & (v - 1) == 0


def sweep_candidates(m: int, k_pad: int, n: int, fmt: str, limit: int) -> list[dict]:
  """Block settings for the compiled (Triton) kernel that need no weight padding.

  Powers of two, ``block_k`` a multiple of the format's block, ``block_k // 2 >= 16`` and
  ``block_n >= 16`` (``tl.dot``); the default blocks with 8 warps come first.
  """
  from rollouts_jax.kernels.fp4 import pallas as fp4_pallas
  from rollouts_jax.kernels.fp4 import reference as fp4_ref
  bm, dbn, dbk = fp4_pallas.default_block_sizes(m, k_pad, n, fmt, "gpu")
  out = [dict(block_m=bm, block_n=dbn, block_k=dbk, num_warps=8)]
  # (block_n, block_k), spread out first so that a short sweep still varies both
  for bn, bk in ((32, 128), (128, 128), (16, 128), (64, 256), (32, 256), (64, 64), (128, 256), (16, 64),
                 (32, 64), (128, 64), (16, 256), (64, 128)):
    ok = (_pow2(bn) and _pow2(bk) and n % bn == 0 and k_pad % bk == 0
          and bk % fp4_ref.BLOCK_SIZES[fmt] == 0 and bk // 2 >= 16)
    if ok and (bn, bk) != (dbn, dbk):
      out.append(dict(block_m=bm, block_n=bn, block_k=bk, num_warps=4))
  return out[:max(limit, 0)]


def _fp4_call(cfg_blocks: dict | None):
  from rollouts_jax.kernels import fp4
  kw = dict(cfg_blocks or {})
  return lambda x, q: fp4.matmul(x, q, "pallas", **kw)


def _scan_fn(mm, n: int):
  """jit(x, stack) -> the last weight's x @ W after a lax.scan over the whole stack."""
  import jax
  import jax.numpy as jnp

  def run(x, stack):
    def body(_, w):
      return mm(x, w), None
    y, _ = jax.lax.scan(body, jnp.zeros((x.shape[0], n), x.dtype), stack)
    return y
  return jax.jit(run)


def _bytes_entry(seconds: float, nbytes: float, bw: float, per: str) -> dict:
  bps = nbytes / seconds
  return {"time_s": seconds, "bytes": nbytes, "bytes_per_s": bps, "roofline_fraction": bps / bw, "per": per}


def _check_output(y, x, w_hat) -> dict:
  """Errors of y against x @ w_hat in float64, normalized by |x| @ |w_hat|."""
  y64 = np.asarray(y, np.float64)
  x64 = np.asarray(x.astype("float32"), np.float64)
  w64 = np.asarray(w_hat, np.float64)
  ref = x64 @ w64
  bound = np.abs(x64) @ np.abs(w64)
  diff = np.abs(y64 - ref)
  norm = np.where(bound > 0, diff / np.where(bound > 0, bound, 1.0), np.where(diff > 0, np.inf, 0.0))
  return {"max_abs_err": float(diff.max()), "max_err_normalized": float(norm.max()),
          "max_abs_ref": float(np.abs(ref).max())}


def prepare_matmul_shape(k: int, n: int, plan: Plan, args, key) -> dict:
  """The weights of one [K, N]: a bf16 stack of R, one wide [K, R * N], their FP4 forms and references."""
  import jax
  import jax.numpy as jnp
  from rollouts_jax import models
  from rollouts_jax.kernels import fp4

  bf16_bytes = k * n * 2
  r = int(min(max(math.ceil(plan.stack_bytes / bf16_bytes), 2), args.max_stack))
  kw, kx, kwide = jax.random.split(key, 3)
  w_stack = jax.random.normal(kw, (r, k, n), jnp.float32).astype(jnp.bfloat16)
  w_wide = jax.random.normal(kwide, (k, r * n), jnp.float32).astype(jnp.bfloat16)
  quant = {}
  for fmt in fp4.FORMATS:
    q_stack = jax.jit(jax.vmap(lambda w, fmt=fmt: fp4.quantize(w, fmt)))(w_stack)
    q_wide = jax.jit(lambda w, fmt=fmt: fp4.quantize(w, fmt))(w_wide)
    last = jax.tree_util.tree_map(lambda a: a[r - 1], q_stack)
    wide_first = jax.jit(lambda q, n=n: fp4.dequantize(q, jnp.float32)[:, :n])(q_wide)
    quant[fmt] = (q_stack, q_wide, np.asarray(fp4.dequantize(last, jnp.float32)), np.asarray(wide_first))
  return dict(k=k, n=n, r=r, kx=kx, w_stack=w_stack, w_wide=w_wide, quant=quant,
              w_last=np.asarray(w_stack[r - 1].astype(jnp.float32)),
              w_wide_first=np.asarray(w_wide[:, :n].astype(jnp.float32)),
              bf16_scan=_scan_fn(models.dense, n), bf16_wide=jax.jit(models.dense))


def bench_matmul_point(model: str, names: list[str], prep: dict, m: int, plan: Plan, args, bw: float,
                       sweep: bool, section: dict, results: Results, deadline: float) -> None:
  """Both formats at one [K, N] and M; appends a record per format to the section."""
  import jax
  import jax.numpy as jnp
  from rollouts_jax.kernels import fp4
  from rollouts_jax.kernels.fp4 import pallas as fp4_pallas

  k, n, r, kx = prep["k"], prep["n"], prep["r"], prep["kx"]
  w_stack, w_wide, quant = prep["w_stack"], prep["w_wide"], prep["quant"]
  w_last, w_wide_first = prep["w_last"], prep["w_wide_first"]
  bf16_scan, bf16_wide = prep["bf16_scan"], prep["bf16_wide"]
  bf16_bytes = k * n * 2
  l2 = args.l2_mb * 1e6
  tag = f"{model} [{k}x{n}] ({','.join(names)}) M={m}"
  if time.monotonic() > deadline:
    section["skipped"].append({"model": model, "k": k, "n": n, "m": m, "reason": "time budget"})
    return
  t_point = time.monotonic()
  x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.float32).astype(jnp.bfloat16)
  io_bytes = m * k * 2 + m * n * 2
  try:
    y_bf, c_bf = first_call(bf16_scan, x, w_stack)
    _, c_bfw = first_call(bf16_wide, x, w_wide)
    bf16_err = _check_output(y_bf, x, w_last)
  except Exception as e:  # pylint: disable=broad-except
    section["errors"].append({"model": model, "k": k, "n": n, "m": m, "what": "bf16", **_error_record(e)})
    results.save()
    return
  for fmt in fp4.FORMATS:
    q_stack, q_wide, w_hat_last, w_hat_wide = quant[fmt]
    fp4_bytes = q_stack.nbytes / r
    rec = {"model": model, "layers": names, "k": k, "n": n, "m": m, "fmt": fmt, "stack": r,
           "working_set_bytes": {"bf16": bf16_bytes * r, fmt: q_stack.nbytes},
           "weight_bytes": {"bf16": bf16_bytes, fmt: fp4_bytes}, "io_bytes": io_bytes,
           "tolerance": args.tol, "bf16_max_err_normalized": bf16_err["max_err_normalized"]}
    if q_stack.nbytes < 2 * l2:
      rec["note"] = "FP4 stack under 2x L2: the roofline fraction may count L2 hits"
    rec["default_blocks"] = list(fp4_pallas.default_block_sizes(
        m, q_stack.padded_k, n, fmt, "cpu" if plan.dry_run else jax.default_backend()))
    try:
      # Sweep: each setting compiled, checked and timed (median of 3) on the scan.
      fns = {"default": _scan_fn(_fp4_call(None), n)}
      sweep_rows, swept = [], {}
      compile_s = {}
      y_def, compile_s["default"] = first_call(fns["default"], x, q_stack)
      rec["check_default"] = _check_output(y_def, x, w_hat_last)
      if sweep and m in plan.sweep_ms:
        for blocks in sweep_candidates(m, q_stack.padded_k, n, fmt, sweep_max(args)):
          if time.monotonic() > deadline:
            sweep_rows.append({"blocks": blocks, "skipped": "time budget"})
            continue
          f = _scan_fn(_fp4_call(blocks), n)
          try:
            y_s, c_s = first_call(f, x, q_stack)
            t_s = statistics.median(alternate({"s": lambda f=f: f(x, q_stack)}, 3)["s"]) / r
            sweep_rows.append({"blocks": blocks, "time_s": t_s, "compile_s": c_s,
                               **_check_output(y_s, x, w_hat_last)})
            swept[len(sweep_rows) - 1] = f
          except Exception as e:  # pylint: disable=broad-except  (a setting the compiler rejects)
            sweep_rows.append({"blocks": blocks, **_error_record(e)})
        t_def = statistics.median(alternate({"d": lambda: fns["default"](x, q_stack)}, 3)["d"]) / r
        ok_rows = [s for s in sweep_rows if "time_s" in s and s["max_err_normalized"] <= args.tol]
        best = min(ok_rows, key=lambda s: s["time_s"], default=None)
        if best is not None and best["time_s"] < t_def:
          fns["best"] = swept[sweep_rows.index(best)]  # compiled and checked in the sweep
          compile_s["best"] = best["compile_s"]
          rec["best_blocks"] = best["blocks"]
          rec["check_best"] = {k2: best[k2] for k2 in ("max_abs_err", "max_err_normalized", "max_abs_ref")}
        else:
          rec["best_blocks"] = "default"
      else:
        rec["best_blocks"] = "not swept"
      rec["sweep"] = sweep_rows
      wide_fp4 = jax.jit(_fp4_call(None))
      y_wide, compile_s["wide"] = first_call(wide_fp4, x, q_wide)
      rec["check_wide"] = _check_output(y_wide[:, :n], x, w_hat_wide)  # the first weight of the stack's width
      rec["bf16_wide_max_err_normalized"] = _check_output(bf16_wide(x, w_wide)[:, :n], x,
                                                          w_wide_first)["max_err_normalized"]

      def wide(f, q):
        def go():
          outs = [f(x, q) for _ in range(plan.wide_calls)]
          return outs[-1]
        return go
      timed = {"bf16_scan": lambda: bf16_scan(x, w_stack)}
      timed.update({f"fp4_scan_{name}": (lambda g=g: g(x, q_stack)) for name, g in fns.items()})
      timed["bf16_wide"] = wide(bf16_wide, w_wide)
      timed["fp4_wide"] = wide(wide_fp4, q_wide)
      times = alternate(timed, plan.reps)
      med = {name: statistics.median(v) for name, v in times.items()}
      per_scan = lambda name: med[name] / r
      per_wide = lambda name: med[name] / plan.wide_calls / r
      rec["compile_s"] = {"bf16_scan": c_bf, "bf16_wide": c_bfw, **{f"fp4_{k2}": v for k2, v in compile_s.items()}}
      rec["in_scan"] = {"bf16": _bytes_entry(per_scan("bf16_scan"), bf16_bytes + io_bytes, bw, "matmul")}
      for name in fns:
        rec["in_scan"][f"fp4_{name}"] = _bytes_entry(per_scan(f"fp4_scan_{name}"), fp4_bytes + io_bytes, bw,
                                                     "matmul")
      best_name = "fp4_best" if "best" in fns else "fp4_default"
      rec["in_scan"]["speedup_default_vs_bf16"] = (rec["in_scan"]["bf16"]["time_s"]
                                                   / rec["in_scan"]["fp4_default"]["time_s"])
      rec["in_scan"]["speedup_vs_bf16"] = rec["in_scan"]["bf16"]["time_s"] / rec["in_scan"][best_name]["time_s"]
      rec["in_scan"]["fp4_kept"] = best_name
      # Per [K, N] of the wide weight: x is read once for all R of them, y written for each.
      rec["io_bytes_wide"] = m * k * 2 / r + m * n * 2
      rec["wide"] = {"bf16": _bytes_entry(per_wide("bf16_wide"), bf16_bytes + rec["io_bytes_wide"], bw,
                                          "[K, N] of the wide weight"),
                     "fp4_default": _bytes_entry(per_wide("fp4_wide"), fp4_bytes + rec["io_bytes_wide"], bw,
                                                 "[K, N] of the wide weight")}
      rec["wide"]["speedup_vs_bf16"] = rec["wide"]["bf16"]["time_s"] / rec["wide"]["fp4_default"]["time_s"]
      checks = [rec["check_default"]["max_err_normalized"], rec["check_wide"]["max_err_normalized"]]
      if "check_best" in rec:
        checks.append(rec["check_best"]["max_err_normalized"])
      rec["max_err_normalized"] = max(checks)
      rec["ok"] = rec["max_err_normalized"] <= args.tol
      rec["elapsed_s"] = time.monotonic() - t_point
      section["records"].append(rec)
      s = rec["in_scan"]
      print(f"  {tag:<48} {fmt:>5}  bf16 {s['bf16']['time_s'] * 1e6:8.2f} us "
            f"({s['bf16']['roofline_fraction']:6.1%})  fp4 {s[best_name]['time_s'] * 1e6:8.2f} us "
            f"({s[best_name]['roofline_fraction']:6.1%})  x{s['speedup_vs_bf16']:5.2f}  "
            f"wide x{rec['wide']['speedup_vs_bf16']:5.2f} ({rec['wide']['fp4_default']['roofline_fraction']:6.1%})"
            f"  err {rec['max_err_normalized']:.1e}{'' if rec['ok'] else ' FAIL'}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      section["errors"].append({"model": model, "k": k, "n": n, "m": m, "fmt": fmt, **_error_record(e)})
      print(f"  {tag} {fmt}: ERROR {section['errors'][-1]['error'][:300]}", flush=True)
    results.save()


def summarize_matmul(section: dict, models_info: dict) -> dict:
  """Per model, format and M: the layer-weighted time of one decode step's linear layers."""
  out = {}
  for rec in section["records"]:
    if "in_scan" not in rec:
      continue
    L = models_info[rec["model"]]["num_layers"]
    count = len(rec["layers"]) * L
    row = out.setdefault(rec["model"], {}).setdefault(rec["fmt"], {}).setdefault(
        str(rec["m"]), {"bf16_s": 0.0, "fp4_s": 0.0, "bf16_bytes": 0.0, "fp4_bytes": 0.0, "layers": []})
    s = rec["in_scan"]
    row["bf16_s"] += count * s["bf16"]["time_s"]
    row["fp4_s"] += count * s[s["fp4_kept"]]["time_s"]
    row["bf16_bytes"] += count * s["bf16"]["bytes"]
    row["fp4_bytes"] += count * s[s["fp4_kept"]]["bytes"]
    row["layers"] += rec["layers"]
  for per_fmt in out.values():
    for per_m in per_fmt.values():
      for row in per_m.values():
        row["speedup_vs_bf16"] = row["bf16_s"] / row["fp4_s"] if row["fp4_s"] else None
  return out
