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
import functools
import importlib.util
import itertools
import inspect
import json
import math
import os
import pathlib
import platform
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable
from unittest import mock

import numpy as np

from experiments.benchmarks import timing

REPO = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("lowering", "matmul", "sampler", "rl_step")
MODEL_NAMES = ("qwen2.5-0.5b", "default-small")
SCHEMA_VERSION = 1
FULL_MS = [1, 8, 32, 128, 256]       # decode rows of the accelerator run
FULL_SWEEP_MS = [1, 128]             # rows at which it sweeps block sizes


# ----------------------------------------------------------------------------------------------
# Arguments and the plan (full run on the accelerator, or tiny dry run on CPU)
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


@dataclasses.dataclass
class SamplerShape:
  name: str
  batch: int
  num_samples: int
  prompt_len: int
  new_tokens: int


@dataclasses.dataclass
class Plan:
  dry_run: bool
  ms: list[int]
  sweep_ms: list[int]
  reps: int
  stack_bytes: float
  sampler_shapes: list[SamplerShape]
  sampler_reps: int
  rl_shape: SamplerShape
  rl_micro_batch: int
  rl_reps: int
  budget_s: float
  wide_calls: int
  max_shapes: tuple[int | None, int | None] = (None, None)  # layer shapes of (first, other) models
  max_sampler_shapes: tuple[int | None, int | None] = (None, None)  # sampler shapes (first, other)


def sweep_max(args) -> int:
  return args.sweep_max if args.sweep_max is not None else (2 if args.dry_run else 6)


def make_plan(args) -> Plan:
  ints = lambda s: [int(v) for v in s.split(",") if v.strip()]
  dry = args.dry_run
  t = args.new_tokens or (3 if dry else 128)
  if dry:
    shapes = [SamplerShape("batch64_n8", 2, 2, 8, t), SamplerShape("n256_prompt256", 1, 4, 16, t)]
    rl = SamplerShape("rl_batch64_n8", 2, 2, 8, t)
  else:
    shapes = [SamplerShape("batch64_n8", 64, 8, 32, t), SamplerShape("n256_prompt256", 1, 256, 256, t)]
    rl = SamplerShape("rl_batch64_n8", 64, 8, 32, t)  # the sampler's first shape: its compile is reused
  return Plan(
      dry_run=dry, ms=ints(args.ms) if args.ms is not None else ([1] if dry else list(FULL_MS)),
      sweep_ms=ints(args.sweep_ms) if args.sweep_ms is not None else ([1] if dry else list(FULL_SWEEP_MS)),
      reps=args.reps or (2 if dry else 7),
      stack_bytes=(args.stack_mb if args.stack_mb is not None else (0.01 if dry else 512)) * 1e6,
      sampler_shapes=shapes, sampler_reps=1 if dry else 3, rl_shape=rl,
      rl_micro_batch=2 if dry else 32, rl_reps=1 if dry else 2,
      budget_s=args.time_budget_s or 300.0, wide_calls=2 if dry else 5,
      max_shapes=((args.max_layer_shapes,) * 2 if args.max_layer_shapes else (2, 1) if dry else (None, None)),
      max_sampler_shapes=(1, 0) if dry else (None, None))


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def qwen05b_config(tiny: bool):
  """Qwen2.5-0.5B's architecture (random weights), or a tiny model of the same kind."""
  from rollouts_jax import models
  if tiny:
    return models.ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=1e6,
                              tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=4096)
  return models.ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_layers=24, num_heads=14, num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)


def _char_vocab_size() -> tuple[int, str]:
  """The default character tokenizer's vocabulary size (the small model's vocabulary).

  `rollouts_jax.data` imports dataset builders that need tensorflow_datasets; where that is
  missing (the GPU image) the tokenizer module is loaded from its file alone.
  """
  try:
    from rollouts_jax.data import CharTokenizer
    return CharTokenizer.default().vocab_size, "rollouts_jax.data.CharTokenizer.default()"
  except ImportError:
    path = REPO / "rollouts_jax" / "data" / "tokenizers.py"
    spec = importlib.util.spec_from_file_location("_bench_gpu_tokenizers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod.CharTokenizer.default().vocab_size, "tokenizers.py CharTokenizer.default() (file)"


def default_small_config():
  """The default config's policy (configs/default.py model section, char-tokenizer vocabulary)."""
  from rollouts_jax import models
  from rollouts_jax.training import config as config_lib
  try:
    exp = config_lib.from_config_dict(config_lib.load_config_file(REPO / "configs" / "default.py"))
    source = "configs/default.py"
  except Exception as e:  # pylint: disable=broad-except  (no ml_collections on the GPU image, or a
    # config file mid-refactor): the model section's dataclass defaults, with the reason recorded
    exp = config_lib.ExperimentConfig()
    source = f"training.config.ExperimentConfig() defaults ({type(e).__name__}: {e})"
  m = exp.model
  vocab, vocab_source = _char_vocab_size()
  cfg = models.ModelConfig(
      model_type=m.model_type, vocab_size=vocab, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
      qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3", max_position_embeddings=1024)
  return cfg, {"config_source": source, "vocab_source": vocab_source}


def build_models(names, dry: bool):
  out = {}
  for name in names:
    if name == "qwen2.5-0.5b":
      out[name] = (qwen05b_config(dry), {"architecture": "Qwen2.5-0.5B" + (" (tiny, dry run)" if dry else "")})
    elif name == "default-small":
      out[name] = default_small_config()
    else:
      raise ValueError(f"Unknown model {name!r}; expected one of {MODEL_NAMES}.")
  return out


def layer_shapes(cfg) -> dict[tuple[int, int], list[str]]:
  """Distinct per-layer linear weight shapes (K, N) -> the weight names that have them."""
  from rollouts_jax import models
  shapes = models.param_shapes(cfg)["layers"]
  out: dict[tuple[int, int], list[str]] = {}
  for name in models.LINEAR_WEIGHTS:
    out.setdefault(tuple(shapes[name][1:]), []).append(name)
  return out


# ----------------------------------------------------------------------------------------------
# Results: one JSON, rewritten after every measurement
# ----------------------------------------------------------------------------------------------

def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, float)):
    v = float(x)
    return v if math.isfinite(v) else str(v)
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


class Results:
  def __init__(self, path: pathlib.Path, header: dict):
    self.path = path
    self.data = dict(header)
    self.data["sections"] = {}

  def section(self, name: str) -> dict:
    return self.data["sections"].setdefault(name, {"status": "running", "records": [], "skipped": [],
                                                   "errors": []})

  def save(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(self.path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(self.data), indent=1) + "\n")
    os.replace(tmp, self.path)


class Budget:
  """A global deadline, shared out over the remaining sections by weight."""

  def __init__(self, total_s: float):
    self.start = time.monotonic()
    self.deadline = self.start + total_s

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def section_deadline(self, weight: float, remaining_weight: float) -> float:
    return time.monotonic() + max(self.left(), 0.0) * weight / max(remaining_weight, 1e-9)


def _scrub(text: str) -> str:
  """Error text without this machine's paths (the repository's become relative)."""
  text = text.replace(str(REPO) + os.sep, "")
  return re.sub(r"(/[^\s'\"]+)+/(site|dist)-packages/", "", text)


def _error_record(e: BaseException) -> dict:
  lines = traceback.format_exception_only(type(e), e)
  return {"error": _scrub(f"{type(e).__name__}: {''.join(lines).strip()[-1500:]}")}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def _block(x):
  import jax
  return jax.block_until_ready(x)


def first_call(fn, *args):
  """(output, seconds) of the first call: compile + one run."""
  return timing.first_call(fn, *args, block=_block)


def alternate(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
  """Times each zero-argument callable once per round, round after round (sides alternate)."""
  return timing.alternate(fns, reps, block=_block).times


# ----------------------------------------------------------------------------------------------
# Section: matmul
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Section: sampler
# ----------------------------------------------------------------------------------------------

def sampling_config(num_samples: int, new_tokens: int):
  """Temperature-1 sampling of exactly `new_tokens` (no EOS), every sample of a prompt decoded at once.

  `sample_chunk=num_samples` keeps all B * N rows in one decode (the sampler's automatic chunk
  follows a memory budget sized for a CPU, which would split the batch on the accelerator).
  """
  from rollouts_jax import sampling
  return sampling.SamplingConfig(num_samples=num_samples, max_new_tokens=new_tokens, temperature=1.0, top_k=0,
                                 top_p=1.0, eos_id=None, prompt_buckets=(), sample_chunk=num_samples)


def kv_cache_bytes(cfg, rows: int, cache_len: int, itemsize: int) -> int:
  """Bytes of keys and values of `cache_len` tokens for `rows` rows, all layers."""
  return 2 * cfg.num_layers * rows * cache_len * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_read_bytes_per_step(cfg, batch: int, num_samples: int, prompt_len: int, new_tokens: int,
                           itemsize: int) -> float:
  """The KV bytes a decode step must read, averaged over the steps (the roofline's KV term).

  Each prompt's keys and values once (its samples share them) and each row's generated
  tokens so far: at step t (0-based) a row has t of them, (T - 1) / 2 on average.
  """
  per_token = kv_cache_bytes(cfg, 1, 1, itemsize)
  return per_token * (batch * prompt_len + batch * num_samples * (new_tokens - 1) / 2)


def _sample_once(cfg, params, prompt, mask, conf, seeds):
  """One sampler call with a fresh key (so repeated calls are not the same computation)."""
  import jax
  from rollouts_jax import sampling
  return sampling.sample(cfg, params, prompt, mask, jax.random.key(next(seeds)), conf)


def bench_sampler_model(model: str, cfg, params, plan: Plan, shapes: list[SamplerShape], bw: float,
                        section: dict, results: Results, deadline: float, seed: int) -> None:
  import jax
  import jax.numpy as jnp
  from rollouts_jax import models, sampling

  weights = {"bf16": params}
  try:
    weights["nvfp4"] = models.quantize_params(cfg, params, "nvfp4", implementation="pallas")
  except Exception as e:  # pylint: disable=broad-except
    section["errors"].append({"model": model, "what": "quantize_params", **_error_record(e)})
  rng = np.random.default_rng(seed)
  for shape in shapes:
    if time.monotonic() > deadline:
      section["skipped"].append({"model": model, "shape": shape.name, "reason": "time budget"})
      continue
    B, N, P, T = shape.batch, shape.num_samples, shape.prompt_len, shape.new_tokens
    prompt = rng.integers(1, cfg.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.ones((B, P), bool)
    conf = sampling_config(N, T)
    calls, first = {}, {}
    for wname, p in weights.items():
      if time.monotonic() > deadline:
        section["skipped"].append({"model": model, "shape": shape.name, "weights": wname, "reason": "time budget"})
        continue
      call = functools.partial(_sample_once, cfg, p, prompt, mask, conf, itertools.count(seed))
      try:
        out, first[wname] = first_call(call)
        n_tok = int(np.asarray(out.lengths).sum())
        if n_tok != B * N * T:
          raise AssertionError(f"sampled {n_tok} tokens, expected {B * N * T} (no EOS stop)")
        calls[wname] = call
        print(f"  {model} {shape.name} {wname}: compiled + first run {first[wname]:.1f} s", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        section["errors"].append({"model": model, "shape": shape.name, "weights": wname, **_error_record(e)})
        print(f"  {model} {shape.name} {wname}: ERROR {section['errors'][-1]['error'][:300]}", flush=True)
    if not calls:
      results.save()
      continue
    times = alternate(calls, plan.sampler_reps)
    itemsize = jnp.dtype(params["embed"].dtype).itemsize  # the sampler's cache dtype: the params'
    kv = kv_read_bytes_per_step(cfg, B, N, P, T, itemsize)
    kv_full = kv_cache_bytes(cfg, B * N, P + T, itemsize)  # a full [rows, P + T] cache read every step
    for wname in calls:
      t = statistics.median(times[wname])
      wbytes = models.param_bytes(weights[wname])
      step_s = t / T
      step_bytes = wbytes + kv
      logits_bytes = B * N * cfg.vocab_size * 4
      rec = {"model": model, "shape": shape.name, "batch": B, "num_samples": N, "prompt_len": P,
             "new_tokens": T, "weights": wname, "sample_chunk": conf.sample_chunk, "time_s": t,
             "times_s": times[wname], "first_call_s": first[wname], "compile_s": max(first[wname] - t, 0.0),
             "tokens": B * N * T, "tokens_per_s": B * N * T / t, "step_s": step_s,
             "weight_bytes": wbytes, "kv_read_bytes": kv, "step_bytes": step_bytes,
             "bytes_per_s": step_bytes / step_s, "roofline_fraction": step_bytes / step_s / bw,
             "kv_full_cache_bytes": kv_full,
             "roofline_fraction_full_cache": (wbytes + kv_full) / step_s / bw,
             "logits_bytes_per_step": logits_bytes}
      section["records"].append(rec)
      print(f"  {model:<14} {shape.name:<15} {wname:>5}: {rec['tokens_per_s']:12,.0f} tok/s  step "
            f"{step_s * 1e3:8.3f} ms  roofline {rec['roofline_fraction']:6.1%}  compile {rec['compile_s']:.1f} s",
            flush=True)
    results.save()


# ----------------------------------------------------------------------------------------------
# Section: rl_step (the training package is being refactored: fail loudly on API changes)
# ----------------------------------------------------------------------------------------------

class TrainingAPIChanged(RuntimeError):
  """The training package's public pieces no longer match what this benchmark calls."""


def checked_call(fn, name: str, expected: str, *args, **kwargs):
  """Calls fn after checking that its signature accepts these arguments.

  Raises:
    TrainingAPIChanged: naming the function, the signature expected and the one found.

  >>> checked_call(lambda a, *, b: a + b, "f", "(a, *, b)", 1, b=2)
  3
  """
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return fn(*args, **kwargs)
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise TrainingAPIChanged(
        f"{name} changed: this benchmark calls it as {name}{expected}, but its signature is now "
        f"{name}{sig} ({e}). Update experiments/benchmarks/bench_gpu.py, section rl_step.") from e
  return fn(*args, **kwargs)


# Each field of the update's batch this benchmark can fill: the names it has had (the batch
# type moved from `Rollouts` to `sampling.batch.RolloutBatch` in the refactor) -> a builder.
_BATCH_FIELDS = {
    ("prompt_ids",): lambda d: d["prompt_ids"],
    ("prompt_mask",): lambda d: d["prompt_mask"],
    ("completion_ids",): lambda d: d["completion_ids"],
    ("completion_mask",): lambda d: d["completion_mask"],
    ("behaviour_logprobs", "rollout_logprobs"): lambda d: d["logprobs"],
    ("rewards",): lambda d: d["rewards"],
    ("sample_mask", "group_mask"): lambda d: d["ones_BxN"],
    ("cluster_ids",): lambda d: d["zeros_BxN"],
    ("policy_version",): lambda d: d["zeros_BxNxT"],
    ("prompt_index",): lambda d: d["prompt_index"],
    ("entropy",): lambda d: d["entropy"],
}


def _required_fields(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
          and f.default_factory is dataclasses.MISSING]


def build_dataclass(cls, name: str, **values):
  """cls(**values) after checking the field names (a flax/dataclasses dataclass).

  Raises:
    TrainingAPIChanged: if a field this benchmark fills is gone or a required one is new.
  """
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  missing = sorted(n for n in _required_fields(cls) if n not in values)
  if unknown or missing:
    raise TrainingAPIChanged(
        f"{name} changed: fields now {sorted(fields)}; this benchmark sets {sorted(values)} "
        f"(gone: {unknown or 'none'}, new required: {missing or 'none'}). Update experiments/benchmarks/bench_gpu.py, "
        "section rl_step.")
  return cls(**values)


def build_batch(cls, data: dict):
  """The update's batch from sampler output: every field this benchmark knows, under its current name.

  Raises:
    TrainingAPIChanged: a required field that no known name covers.
  """
  fields = {f.name for f in dataclasses.fields(cls)}
  values = {}
  for names, make in _BATCH_FIELDS.items():
    present = [n for n in names if n in fields]
    if present:
      values[present[0]] = make(data)
  return build_dataclass(cls, f"{cls.__module__}.{cls.__name__}", **values)


def training_api():
  """The public pieces of rollouts_jax.training this benchmark uses, or a clear error."""
  try:
    import importlib
    mod = importlib.import_module("rollouts_jax.training.rl_step")
    from rollouts_jax.training.config import RLConfig
  except ImportError as e:
    raise TrainingAPIChanged(f"cannot import rollouts_jax.training.rl_step / training.config.RLConfig: "
                             f"{type(e).__name__}: {e}") from e
  need = ("rl_step", "init_train_state", "Rollouts", "rl_optimizer")
  gone = [n for n in need if not hasattr(mod, n)]
  if gone:
    raise TrainingAPIChanged(f"rollouts_jax.training.rl_step no longer defines {gone}; it has "
                             f"{sorted(n for n in vars(mod) if not n.startswith('_'))}. Update "
                             "experiments/bench_gpu.py, section rl_step.")
  return mod, RLConfig


def bench_rl_step(model: str, cfg, params, plan: Plan, section: dict, results: Results, deadline: float,
                  seed: int) -> None:
  import jax
  import jax.numpy as jnp
  from rollouts_jax import sampling

  mod, RLConfig = training_api()
  sh = plan.rl_shape
  B, N, P, T = sh.batch, sh.num_samples, sh.prompt_len, sh.new_tokens
  # Fields the update needs here; the batch sizes only where RLConfig still holds them (they
  # moved to the rollout/control sections in the refactor).
  needed = dict(micro_batch_size=min(plan.rl_micro_batch, B * N), learning_rate=1e-6, kl_coef=0.0)
  optional = dict(steps=100, warmup_steps=0, prompts_per_step=B, num_samples=N, max_new_tokens=T)
  have = {f.name for f in dataclasses.fields(RLConfig)}
  values = {**needed, **{k: v for k, v in optional.items() if k in have}}
  rl = build_dataclass(RLConfig, "RLConfig", **{**{f.name: getattr(RLConfig(), f.name)
                                                   for f in dataclasses.fields(RLConfig)}, **values})
  tx = checked_call(mod.rl_optimizer, "rl_optimizer", "(rl)", rl)
  state = checked_call(mod.init_train_state, "init_train_state", "(params, tx)", params, tx)
  rng = np.random.default_rng(seed)
  prompt = rng.integers(1, cfg.vocab_size, size=(B, P)).astype(np.int32)
  pmask = np.ones((B, P), bool)
  conf = sampling_config(N, T)  # the sampler section's first shape: its compiled sampler is reused
  # Static settings that newer versions of rl_step take (the sampling temperature, the budget).
  step_params = inspect.signature(mod.rl_step).parameters
  step_kwargs = {k: v for k, v in dict(temperature=1.0, max_len=T).items() if k in step_params}
  rows = []
  for it in range(1 + plan.rl_reps):
    if time.monotonic() > deadline and it > 0:
      section["skipped"].append({"model": model, "iteration": it, "reason": "time budget"})
      break
    t0 = time.perf_counter()
    out = _block(sampling.sample(cfg, state.params, prompt, pmask, jax.random.key(seed + it), conf))
    t1 = time.perf_counter()
    rollouts = build_batch(mod.Rollouts, dict(
        prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(pmask), completion_ids=out.completion_ids,
        completion_mask=out.completion_mask, logprobs=out.logprobs, entropy=out.entropy,
        rewards=jnp.asarray(rng.normal(size=(B, N)), jnp.float32), ones_BxN=jnp.ones((B, N), bool),
        zeros_BxN=jnp.zeros((B, N), jnp.int32), zeros_BxNxT=jnp.zeros((B, N, T), jnp.int32),
        prompt_index=jnp.arange(B, dtype=jnp.int32)))
    state, metrics = checked_call(mod.rl_step, "rl_step", "(state, rollouts, ref_params, *, cfg, rl, ...)",
                                  state, rollouts, None, cfg=cfg, rl=rl, **step_kwargs)
    metrics = _block(metrics)
    t2 = time.perf_counter()
    rows.append({"rollout_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0,
                 "loss": float(metrics.get("loss", np.nan)), "grad_norm": float(metrics.get("grad_norm", np.nan))})
    print(f"  {model} RL step {it}{' (compile)' if it == 0 else ''}: rollout {t1 - t0:7.2f} s  update "
          f"{t2 - t1:7.2f} s  grad_norm {rows[-1]['grad_norm']:.3g}", flush=True)
  timed = rows[1:]
  rec = {"model": model, "batch": B, "num_samples": N, "prompt_len": P, "new_tokens": T,
         "micro_batch_size": rl.micro_batch_size, "iterations": rows,
         "first_step_s": rows[0]["step_s"]}
  if timed:
    med = lambda k: statistics.median(r[k] for r in timed)
    rec.update(rollout_s=med("rollout_s"), update_s=med("update_s"), step_s=med("step_s"),
               compile_s=max(rows[0]["step_s"] - med("step_s"), 0.0),
               rollout_tokens_per_s=B * N * T / med("rollout_s"),
               update_tokens_per_s=B * N * (P + T) / med("update_s"))
    rec["grad_norm_finite"] = all(math.isfinite(r["grad_norm"]) for r in rows)
  section["records"].append(rec)
  results.save()


# ----------------------------------------------------------------------------------------------
# Section: lowering for CUDA (runs the Triton lowering rules on any machine)
# ----------------------------------------------------------------------------------------------

def lowering_check(models_full: dict, plan: Plan, args, section: dict, results: Results, deadline: float):
  """Lowers the compiled kernel (default and sweep blocks) and the FP4 sampler for CUDA at full size."""
  import jax
  import jax.numpy as jnp
  from rollouts_jax import models, sampling
  from rollouts_jax.kernels import fp4
  from rollouts_jax.kernels.fp4 import pallas as fp4_pallas

  def lower(fn, *abstract):
    text = jax.jit(fn).trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")

  # Default blocks at every M of the accelerator run; the sweep's settings at its first sweep M
  # (all of them off the dry run).
  ms = FULL_MS if plan.dry_run else plan.ms
  sweep_ms = FULL_SWEEP_MS[:1] if plan.dry_run else plan.sweep_ms
  for model, cfg in models_full.items():
    for (k, n), names in layer_shapes(cfg).items():
      for fmt in fp4.FORMATS:
        q_abs = jax.eval_shape(lambda w, fmt=fmt: fp4.quantize(w, fmt), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
        seen = set()
        for m in ms:
          x_abs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
          blocks = [dict(zip(("block_m", "block_n", "block_k"),
                             fp4_pallas.default_block_sizes(m, q_abs.padded_k, n, fmt, "gpu")))]
          if m in sweep_ms:
            blocks += sweep_candidates(m, q_abs.padded_k, n, fmt, 8)
          for b in blocks:
            sig = (tuple(sorted(b.items())), k, n, fmt)
            if sig in seen:
              continue
            seen.add(sig)
            if time.monotonic() > deadline:
              section["skipped"].append({"model": model, "k": k, "n": n, "fmt": fmt, "m": m, "blocks": b,
                                         "reason": "time budget"})
              continue
            rec = {"what": "kernel", "model": model, "k": k, "n": n, "fmt": fmt, "m": m, "blocks": b}
            try:
              rec["triton_calls"] = lower(
                  lambda x, q, b=b: fp4.matmul(x, q, "pallas", interpret=False, backend="gpu", **b), x_abs, q_abs)
              rec["ok"] = rec["triton_calls"] == 1
            except Exception as e:  # pylint: disable=broad-except
              rec.update(ok=False, **_error_record(e))
            section["records"].append(rec)
    # The whole FP4 sampler at the first sampler shape, lowered for CUDA.
    sh = plan.sampler_shapes[0]
    if plan.dry_run:
      sh = SamplerShape(sh.name, 64, 8, 32, 128)
    rec = {"what": "sampler_nvfp4", "model": model, "batch": sh.batch, "num_samples": sh.num_samples,
           "prompt_len": sh.prompt_len, "new_tokens": sh.new_tokens}
    if time.monotonic() > deadline:
      section["skipped"].append({**rec, "reason": "time budget"})
      continue
    try:
      p_abs = jax.eval_shape(lambda key: models.init_params(cfg, key, jnp.bfloat16), jax.random.key(0))
      q_abs = jax.eval_shape(lambda p: models.quantize_params(cfg, p, "nvfp4", implementation="pallas"), p_abs)
      conf = sampling_config(sh.num_samples, sh.new_tokens)
      # Concrete prompts (the sampler checks them on the host), abstract weights.
      ids = np.ones((sh.batch, sh.prompt_len), np.int32)
      msk = np.ones((sh.batch, sh.prompt_len), bool)
      # models.dense lets the kernel pick its backend from jax.default_backend(); on a CPU host
      # that is the interpreter, so the trace is made as on a GPU (caches are cleared after).
      run = jax.jit(lambda p: sampling.sample(cfg, p, ids, msk, jax.random.key(0), conf))
      with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        text = run.trace(q_abs).lower(lowering_platforms=("cuda",)).as_text()
      jax.clear_caches()
      rec["triton_calls"] = text.count("__gpu$xla.gpu.triton")
      # The kernel lowered through Triton, not the interpreter. (Calls of one shape share one
      # lowered function, so the text holds one call per distinct [M, K, N].)
      rec["ok"] = rec["triton_calls"] >= 1
    except Exception as e:  # pylint: disable=broad-except
      rec.update(ok=False, **_error_record(e))
    section["records"].append(rec)
    results.save()
  bad = [r for r in section["records"] if not r.get("ok")]
  print(f"  lowered {len(section['records'])} kernels/samplers for CUDA: {len(bad)} failed", flush=True)
  for r in bad[:10]:
    print(f"    FAILED {r}", flush=True)


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
