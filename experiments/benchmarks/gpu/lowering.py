"""Section lowering: the kernel and the FP4 sampler lowered for CUDA (runs the Triton lowering rules on any machine)."""
from __future__ import annotations

import time
from unittest import mock

import numpy as np

from experiments.benchmarks.gpu.common import (FULL_MS, FULL_SWEEP_MS, Plan, Results, SamplerShape, _error_record,
                                               layer_shapes)
from experiments.benchmarks.gpu.matmul import sweep_candidates
from experiments.benchmarks.gpu.sampler import sampling_config


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
