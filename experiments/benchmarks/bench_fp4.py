"""Benchmark FP4 weights: bytes per parameter, quantization error, decode-shape matmul time.

Launch:
  python -m experiments.benchmarks.bench_fp4                       # K = N = 4096, M in 1,8,16,64
  python -m experiments.benchmarks.bench_fp4 --k=2048 --n=8192 --ms=1,16 --sweep

Prints, for one ``[K, N]`` weight:
  * weight bytes per parameter of NVFP4, MXFP4 and bf16, from the arrays' ``nbytes``
    (NVFP4 = 1/2 byte of codes + 1/16 byte of E4M3 scales, MXFP4 = 1/2 + 1/32);
  * the relative Frobenius error ``||W_hat - W|| / ||W||`` of each format on N(0, 1) weights;
  * on a GPU or TPU: the time of the compiled Pallas kernel (bf16 activations) against a
    bf16 ``jnp.dot`` for decode shapes (M <= 64) and their ratio (target >= 2x); with
    ``--sweep`` the best of a few block-size settings;
  * on CPU: that the kernel timing needs an accelerator, and, for information only, the
    XLA dequantize-then-dot path against an fp32 dot.

Paper: Sol-RL (arXiv 2604.06916) explores with NVFP4 rollouts to cut sampling cost.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.benchmarks import timing
from rollouts_jax.kernels import fp4


def bytes_per_parameter(k: int, n: int, seed: int = 0) -> dict[str, float]:
  """Stored bytes per weight of NVFP4, MXFP4 and bf16 for a ``[K, N]`` weight."""
  w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32)
  out = {"bf16": w.astype(jnp.bfloat16).nbytes / w.size}
  for fmt in fp4.FORMATS:
    out[fmt] = fp4.quantize(w, fmt).nbytes / w.size
  return out


def relative_errors(k: int, n: int, seed: int = 0) -> dict[str, float]:
  """``||dequantize(quantize(W)) - W||_F / ||W||_F`` on N(0, 1) weights, per format."""
  w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32)
  errs = {}
  for fmt in fp4.FORMATS:
    w_hat = fp4.dequantize(fp4.quantize(w, fmt))
    errs[fmt] = float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w))
  errs["mxfp4 (ceil scale)"] = float(
      jnp.linalg.norm(fp4.dequantize(fp4.quantize(w, "mxfp4", scale_rounding="ceil")) - w)
      / jnp.linalg.norm(w))
  return errs


def time_call(f, *args, reps: int = 50, warmup: int = 3) -> float:
  """Median wall time of ``f(*args)`` in seconds (after compiling and warming up)."""
  t = timing.alternate({"f": lambda: f(*args)}, reps, warmup=warmup, block=jax.block_until_ready)
  return t.median("f")


SWEEP = [dict(block_n=bn, block_k=bk, num_warps=nw)
         for bn in (32, 64, 128) for bk in (128, 256, 512) for nw in (4, 8)]


def time_accelerator(k: int, n: int, ms, reps: int, sweep: bool) -> None:
  """Compiled Pallas kernel vs bf16 jnp.dot for each M; prints one row per (M, format)."""
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32)
  w_bf16 = w.astype(jnp.bfloat16)
  dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
  print(f"\n[{jax.default_backend()}: {jax.devices()[0].device_kind}] K={k} N={n}, "
        f"bf16 activations, median of {reps}")
  print(f"{'M':>4} {'fmt':>6} {'bf16 dot us':>12} {'fp4 pallas us':>14} {'fp4 xla us':>11} "
        f"{'bf16/pallas':>12}  best blocks")
  for fmt in fp4.FORMATS:
    q = fp4.quantize(w, fmt)
    for m in ms:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
      t_ref = time_call(dot, x, w_bf16, reps=reps)
      t_xla = time_call(jax.jit(lambda x, q: fp4.matmul(x, q, "xla")), x, q, reps=reps)
      configs = SWEEP if sweep else [{}]
      best, best_cfg = float("inf"), None
      for cfg in configs:
        f = jax.jit(lambda x, q, cfg=cfg: fp4.matmul(x, q, "pallas", **cfg))
        try:
          t = time_call(f, x, q, reps=reps)
        except Exception as e:  # a block setting the compiler rejects: report and go on
          print(f"     {fmt} M={m} {cfg or 'default'} failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:120]}")
          continue
        if t < best:
          best, best_cfg = t, cfg or "default"
      print(f"{m:>4} {fmt:>6} {t_ref * 1e6:>12.1f} {best * 1e6:>14.1f} {t_xla * 1e6:>11.1f} "
            f"{t_ref / best:>11.2f}x  {best_cfg}")


def time_cpu_informational(k: int, n: int, ms, reps: int) -> None:
  """CPU only: the XLA dequantize-then-dot path vs an fp32 dot (not a kernel benchmark)."""
  print("\nKernel timing needs an accelerator (GPU or TPU); the Pallas kernel runs only in "
        "interpret mode on CPU.")
  print("INFORMATIONAL ONLY (CPU): XLA path fp4.matmul(..., 'xla') = dequantize + fp32 dot, "
        "vs an fp32 jnp.dot with the weight already in fp32:")
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  for fmt in fp4.FORMATS:
    q = fp4.quantize(w, fmt)
    xla = jax.jit(lambda x, q: fp4.matmul(x, q, "xla"))
    for m in ms:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
      t_ref = time_call(dot, x, w, reps=reps, warmup=1)
      t_xla = time_call(xla, x, q, reps=reps, warmup=1)
      print(f"  {fmt} M={m:>3}: fp32 dot {t_ref * 1e3:8.2f} ms, dequant+dot {t_xla * 1e3:8.2f} ms "
            f"(ratio {t_xla / t_ref:5.1f}x slower)")


def main(argv):
  del argv
  flags = _FLAGS
  k, n = flags.k, flags.n
  ms = [int(v) for v in flags.ms.split(",")]
  print(f"JAX {jax.__version__}, backend {jax.default_backend()}, weight [K={k}, N={n}]")
  print("\nweight bytes per parameter (from array nbytes):")
  for name, b in bytes_per_parameter(k, n).items():
    print(f"  {name:>6}: {b:.4f}")
  print("\nrelative Frobenius error on N(0,1) weights:")
  for name, e in relative_errors(k, n).items():
    print(f"  {name}: {e:.4f}")
  if jax.default_backend() == "cpu":
    time_cpu_informational(k, n, ms, reps=min(flags.reps, 3))
  else:
    time_accelerator(k, n, ms, reps=flags.reps, sweep=flags.sweep)


_FLAGS = None

if __name__ == "__main__":
  from absl import app, flags as absl_flags
  absl_flags.DEFINE_integer("k", 4096, "Contraction size K of the weight [K, N].")
  absl_flags.DEFINE_integer("n", 4096, "Output size N of the weight [K, N].")
  absl_flags.DEFINE_string("ms", "1,8,16,64", "Comma-separated activation rows M (decode shapes).")
  absl_flags.DEFINE_integer("reps", 50, "Timed repetitions (median reported).")
  absl_flags.DEFINE_bool("sweep", False, "On an accelerator, try a few block sizes per shape.")
  _FLAGS = absl_flags.FLAGS
  app.run(main)
