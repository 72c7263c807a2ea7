"""Section rl_step: one RL step (the training package is being refactored: fail loudly on API changes)."""
from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
import time

import numpy as np

from experiments.benchmarks.gpu.common import Plan, Results, _block
from experiments.benchmarks.gpu.sampler import sampling_config


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
        f"{name}{sig} ({e}). Update experiments/benchmarks/gpu/rl_step.py, section rl_step.") from e
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
        f"(gone: {unknown or 'none'}, new required: {missing or 'none'}). Update "
        "experiments/benchmarks/gpu/rl_step.py, section rl_step.")
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
                             "experiments/benchmarks/gpu/rl_step.py, section rl_step.")
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
