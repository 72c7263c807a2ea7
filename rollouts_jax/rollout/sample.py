"""`sample`: plain sampling, N independent completions per prompt (the default generator).

>>> from rollouts_jax.rollout import generators
>>> "sample" in generators.names()
True
"""

from __future__ import annotations

import jax

from rollouts_jax import sampling
from rollouts_jax.rollout import generators


@generators.register("sample")
def sample(ctx: generators.GeneratorContext) -> generators.Generator:
  """`sampling.sample` with the run's settings; keeps no state.

  Args:
    ctx: the build context (model, sampler settings).

  Returns:
    A `Generator` whose batch is `sampling.sample`'s output on the same key.
  """

  def init():
    return None

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    out = jax.device_get(sampling.sample(ctx.cfg, params, prompts.ids, prompts.mask, key, ctx.sampling))
    batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=version)
    return batch, state, generators.decode_stats(batch)

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update)
