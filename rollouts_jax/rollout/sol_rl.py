"""`sol_rl`: Sol-RL's FP4 exploration (arXiv 2604.06916): sample a pool with an FP4 copy, train on a subset.

`generate` quantizes the current policy (`models.quantize_params`, NVFP4 or MXFP4) and draws a
pool of `pool` completions per prompt from that copy; FILTER scores the whole pool; `finish`
keeps N of them per prompt (`control.select_subset`: the best half and the worst half by
reward, by default) and recomputes their log-probs under the full-precision policy
(`sampling.sol_rl.recompute_batch`), so the update's importance ratios refer to the policy it
trains, while `behaviour_logprobs` stay the FP4 explorer's (`rl.tis_cap` corrects the gap).

  rollout.generator = "sol_rl"; rollout.generator_kwargs = "fmt=nvfp4,pool=16,subset=contrastive"

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("sol_rl", {"fmt": "mxfp4", "pool": 16})
"""

from __future__ import annotations

import jax
import numpy as np

from rollouts_jax import control, models, sampling
from rollouts_jax.kernels.fp4 import FORMATS   # `models.quantize_params`'s formats
from rollouts_jax.rollout import generators
from rollouts_jax.sampling import sol_rl as sol_rl_lib


@generators.register("sol_rl")
def sol_rl(ctx: generators.GeneratorContext, *, fmt: str = "nvfp4", pool: int = 0,
           subset: str = "contrastive") -> generators.Generator:
  """Sol-RL over the run's sampler settings (N = `ctx.sampling.num_samples` kept per prompt).

  Args:
    ctx: the build context (model, sampler settings).
    fmt: the explorer's FP4 format, "nvfp4" or "mxfp4".
    pool: FP4 samples per prompt, >= N (0: N, every sample kept: the format's effect alone).
    subset: how N are chosen from the pool: one of `control.SUBSET_MODES`.

  Returns:
    A `Generator` with no state whose `finish` selects the subset and sets `old_logprobs`.
    Stats: `rollouts` (the pool), `generated_tokens`, `sol/pool_reward_mean`,
    `sol/subset_reward_mean`, `sol/pool_distinct_per_prompt`, `sol/fp4_logprob_gap` (mean
    |log p_fp4 - log p_full| per kept token).
  """
  name, N = "sol_rl", ctx.sampling.num_samples
  if fmt not in FORMATS:
    raise generators.setting_error(name, "fmt", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
  if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0 or 0 < pool < N:
    raise generators.setting_error(name, "pool", f"must be 0 or an integer >= rollout.num_samples={N}, got {pool!r}")
  if subset not in control.SUBSET_MODES:
    raise generators.setting_error(name, "subset", f"must be one of {', '.join(control.SUBSET_MODES)}, "
                                                   f"got {subset!r}")
  M = pool or N
  conf = ctx.sampling.replace(num_samples=M)

  def init():
    return None

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    explorer = models.quantize_params(ctx.cfg, params, fmt)
    out = jax.device_get(sampling.sample(ctx.cfg, explorer, prompts.ids, prompts.mask, key, conf))
    batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=version)
    stats = generators.decode_stats(batch)
    stats["rollouts"] = float(M * prompts.ids.shape[0])
    return batch, state, stats

  def finish(state, params, batch, key, *, version: int):
    del version
    r = np.asarray(batch.rewards)
    ids = np.asarray(batch.completion_ids)
    sel = control.select_subset(r, N, subset, key=jax.random.fold_in(key, 1), completion_ids=ids)
    kept, gap = sol_rl_lib.recompute_batch(ctx.cfg, params, batch.take_samples(sel),
                                           temperature=ctx.sampling.temperature)
    distinct = np.mean([np.unique(ids[b], axis=0).shape[0] for b in range(ids.shape[0])])
    stats = {"sol/pool_reward_mean": generators.Mean(r.mean()),
             "sol/subset_reward_mean": generators.Mean(np.asarray(kept.rewards).mean()),
             "sol/pool_distinct_per_prompt": generators.Mean(distinct),
             "sol/fp4_logprob_gap": generators.Mean(gap["fp4_logprob_gap"])}
    return kept, state, stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update, finish=finish, fields=("old_logprobs",))
