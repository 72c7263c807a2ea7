"""`self_spec`: EfficientRollout's self-speculative decoding with an FP4 drafter (arXiv 2606.18967).

The policy's own FP4 copy (`models.quantize_params`, NVFP4 or MXFP4, re-quantized from the
current weights each step) drafts gamma tokens per row; the full-precision policy verifies
them in one forward and the exact rule (accept with min(1, p / q), a replacement from
max(0, p - q) at the first rejection, a bonus token when all are accepted) commits 1 to
gamma + 1 tokens (`sampling.self_speculative_sample`). The rollouts are distributed exactly
as plain sampling's, with the full-precision policy's log-probs; only the decode cost moves.
gamma is re-chosen every round from an EMA of the acceptance rate, which the generator keeps
in its state (so it checkpoints with the pipeline and the next step starts from it).

  rollout.generator = "self_spec"; rollout.generator_kwargs = "fmt=nvfp4,gamma_max=4"

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("self_spec", {"fmt": "mxfp4", "gamma_max": 2})
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollouts_jax import sampling
from rollouts_jax.kernels.fp4 import FORMATS   # `models.quantize_params`'s formats
from rollouts_jax.rollout import generators


@generators.register("self_spec")
def self_spec(ctx: generators.GeneratorContext, *, fmt: str = "nvfp4", gamma_max: int = 4, draft_cost: float = 0.5,
              acceptance_ema: float = 0.7, ema_decay: float = 0.8, max_spec_rows: int = -1,
              min_expected_speedup: float = 0.0) -> generators.Generator:
  """EfficientRollout over the run's sampler settings.

  Args:
    ctx: the build context (model, sampler settings).
    fmt: the drafter's FP4 format, "nvfp4" or "mxfp4".
    gamma_max: the most draft tokens per round (>= 1).
    draft_cost: one drafter step's cost over one verification forward's (>= 0; sets gamma).
    acceptance_ema: the acceptance-rate estimate of the first step, in [0, 1].
    ema_decay: the EMA's weight on its past value, per round, in [0, 1).
    max_spec_rows: speculate only when a call has at most this many rows (-1: always; 0:
      never, plain sampling, the right switch on a CPU, where a fake-quantized draft step costs
      a full one).
    min_expected_speedup: decode plainly when the expected speedup of the current estimate is
      below this (0: always speculate).

  Returns:
    A `Generator` whose state is the acceptance EMA (float32 scalar). Stats: `spec/speculated`,
    `spec/draft_tokens`, `spec/tested_tokens`, `spec/accepted_tokens`, `spec/acceptance_ema`,
    `rollout/decode_steps` (policy forwards over the batch) and `generated_tokens`.
  """
  name = "self_spec"
  if fmt not in FORMATS:
    raise generators.setting_error(name, "fmt", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
  if isinstance(gamma_max, bool) or not isinstance(gamma_max, int) or gamma_max < 1:
    raise generators.setting_error(name, "gamma_max", f"must be an integer >= 1, got {gamma_max!r}")
  for setting, value, ok in (("draft_cost", draft_cost, lambda v: v >= 0),
                             ("acceptance_ema", acceptance_ema, lambda v: 0 <= v <= 1),
                             ("ema_decay", ema_decay, lambda v: 0 <= v < 1),
                             ("min_expected_speedup", min_expected_speedup, lambda v: v >= 0)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
      raise generators.setting_error(name, setting, f"is out of range: {value!r}")
  if isinstance(max_spec_rows, bool) or not isinstance(max_spec_rows, int) or max_spec_rows < -1:
    raise generators.setting_error(name, "max_spec_rows", f"must be an integer >= -1, got {max_spec_rows!r}")

  def init():
    return jnp.asarray(acceptance_ema, jnp.float32)

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    out, s = sampling.self_speculative_sample(
        ctx.cfg, params, prompts.ids, prompts.mask, key, ctx.sampling, fmt=fmt, gamma_max=gamma_max,
        draft_cost=float(draft_cost), acceptance_ema=float(state), ema_decay=float(ema_decay),
        max_spec_rows=None if max_spec_rows < 0 else max_spec_rows, min_expected_speedup=float(min_expected_speedup))
    batch = sampling.from_samples(prompts.ids, prompts.mask, jax.device_get(out), prompt_index=prompts.index,
                                  policy_version=version)
    stats = dict(generators.decode_stats(batch), **{
        "rollout/decode_steps": float(s["decode_steps"]), "spec/speculated": float(s["speculated"]),
        "spec/draft_tokens": float(s["draft_tokens"]), "spec/tested_tokens": float(s["tested_tokens"]),
        "spec/accepted_tokens": float(s["accepted_tokens"]), "spec/acceptance_ema": float(s["acceptance_ema"])})
    return batch, jnp.asarray(s["acceptance_ema"], jnp.float32), stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update)
