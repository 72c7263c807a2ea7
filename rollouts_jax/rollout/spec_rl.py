"""`spec_rl`: SPEC-RL speculative rollouts (Liu et al. 2025, arXiv 2509.23232).

A prompt's rollouts from its previous visit are drafts: the current policy verifies them in
one forward pass, accepting each token with probability min(1, lenience * p_new / p_old)
(`sampling.speculative_sample`, SPEC-RL's free replacement draw at the first rejection), keeps
the accepted prefix and decodes only the rest. A prompt seen for the first time is sampled
afresh. The drafts live in the generator's state (`replay.draft_store`, `[num_prompts, N, T]`),
so they checkpoint with the pipeline; `update` stores each scored group's rollouts, with the
behaviour log-probs they were sampled with, as that prompt's next drafts.

  rollout.generator = "spec_rl"; rollout.generator_kwargs = "lenience=1.6487"   # e^0.5, the paper's GRPO default

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("spec_rl", {"lenience": 1.0})
"""

from __future__ import annotations

import math

import jax
import numpy as np

from rollouts_jax import replay, sampling
from rollouts_jax.rollout import generators

DEFAULT_LENIENCE = math.exp(0.5)


@generators.register("spec_rl")
def spec_rl(ctx: generators.GeneratorContext, *, lenience: float = DEFAULT_LENIENCE) -> generators.Generator:
  """SPEC-RL over a pool of `ctx.num_prompts` prompts.

  Args:
    ctx: the build context (model, sampler settings, pool size).
    lenience: SPEC-RL's l > 0 (1: exact acceptance; larger accepts more, off-policy).

  Returns:
    A `Generator` whose state is a `replay.DraftState`. Stats: `spec/draft_tokens`,
    `spec/accepted_tokens`, `spec/fully_accepted_rows` (on visits with drafts),
    `rollout/decode_steps`, and `generated_tokens` (a rejected row's replacement counts as one).
  """
  if isinstance(lenience, bool) or not isinstance(lenience, (int, float)) or not lenience > 0:
    raise generators.setting_error("spec_rl", "lenience", f"must be a number > 0, got {lenience!r}")
  lenience = float(lenience)
  conf = ctx.sampling
  store = replay.draft_store(ctx.num_prompts, conf.num_samples, conf.max_new_tokens)

  def init():
    return store.init()

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    d_ids, d_mask, d_lp, valid = store.get(state, prompts.index)
    if not valid.any():   # nothing seen before: plain sampling
      out = jax.device_get(sampling.sample(ctx.cfg, params, prompts.ids, prompts.mask, key, conf))
      batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index,
                                    policy_version=version)
      return batch, state, generators.decode_stats(batch)
    out, s = sampling.speculative_sample(ctx.cfg, params, prompts.ids, prompts.mask, key, conf,
                                         drafts=sampling.Drafts(d_ids, d_mask, d_lp), lenience=lenience,
                                         residual=False)
    batch = sampling.from_samples(prompts.ids, prompts.mask, jax.device_get(out), prompt_index=prompts.index,
                                  policy_version=version)
    stats = {"generated_tokens": float(s["generated_tokens"] + s["rejected_rows"]),
             "spec/draft_tokens": float(s["draft_tokens"]), "spec/accepted_tokens": float(s["accepted_tokens"]),
             "spec/fully_accepted_rows": float(s["fully_accepted_rows"]),
             "rollout/decode_steps": float(s["decode_steps"])}
    return batch, state, stats

  def update(state, batch, *, version: int, **extra):
    del extra
    return store.put(state, np.asarray(batch.prompt_index), batch.completion_ids, batch.completion_mask,
                     batch.behaviour_logprobs, version)

  return generators.Generator(init, generate, update)
