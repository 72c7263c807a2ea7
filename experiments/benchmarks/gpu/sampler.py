"""Section sampler: decode tokens/s of `sampling.sample`, bf16 and NVFP4 weights, against the HBM roofline."""
from __future__ import annotations

import functools
import itertools
import statistics
import time

import numpy as np

from experiments.benchmarks.gpu.common import Plan, Results, SamplerShape, _error_record, alternate, first_call


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
