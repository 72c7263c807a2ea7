"""`sample`: plain sampling, N independent completions per prompt (the default generator).

>>> from rollouts_jax.rollout import generators
>>> "sample" in generators.names()
True
"""

from __future__ import annotations

import jax
import numpy as np

from rollouts_jax import sampling
from rollouts_jax.rollout import generators


@generators.register("sample")
def sample(ctx: generators.GeneratorContext) -> generators.Generator:
  """`sampling.sample` with the run's settings; keeps no state; decodes only the prompts' budgets.

  Args:
    ctx: the build context (model, sampler settings).

  Returns:
    A `Generator` whose batch is `sampling.sample`'s output on the same key.
  """

  def init():
    return None

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    out = jax.device_get(sampling.sample(ctx.cfg, params, prompts.ids, prompts.mask, key, ctx.sampling,
                                         budget=prompts.budget))
    batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=version)
    stats = generators.decode_stats(batch)
    if prompts.budget is not None:   # the rollouts started: the budgets (the rest was not decoded)
      stats["rollouts"] = float(np.asarray(prompts.budget).sum())
    return batch, state, stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update)
