"""`april`: APRIL's partial rollouts (Active Partial Rollouts, `RLsys-Foundation/APRIL`).

A step requests ceil(B * (1 + over_provision)) groups: the unfinished ones stored by earlier
steps first (resumed under the newer policy with `sampling.continue_from`), then fresh
prompts from CONTROL. Decoding stops once B groups have finished; those B are the step's
batch (scored by FILTER as any other), and every other group, finished or not, goes back to
the store (`replay.partial_rollouts`, in the generator's state, so it checkpoints with the
pipeline). Each token keeps the behaviour log-prob and the policy version that produced it.

It is the one generator that chooses its own groups: `wants` tells the pipeline how many
fresh prompts to select (the requests less the stored groups), and its batch's groups are
the first B to finish, stored or fresh, named by their `prompt_index`.

  rollout.generator = "april"; rollout.generator_kwargs = "over_provision=0.5"

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("april", {"over_provision": 0.5})
"""

from __future__ import annotations

import math

import jax
import numpy as np

from rollouts_jax import replay, sampling
from rollouts_jax.rollout import generators, groups
from rollouts_jax.rollout.stats import padding_frac
from rollouts_jax.types import RolloutBatch


@generators.register("april")
def april(ctx: generators.GeneratorContext, *, over_provision: float = 0.5) -> generators.Generator:
  """APRIL over steps of `ctx.batch_size` groups.

  Args:
    ctx: the build context (model, sampler settings, B, the stored prompt width `prompt_len`).
    over_provision: requests per step are ceil(B * (1 + over_provision)); > 0.

  Returns:
    A `Generator` whose state is the store's (`replay.partial_rollouts`, capacity = the
    requests) and whose `wants` is the fresh prompts a step needs. Stats: `rollouts` (fresh
    groups x N), `generated_tokens` (tokens decoded this step), `rollout/padding_frac` (over the
    rows decoded), `april/resumed_groups`, `april/stored_groups`,
    `april/stored_unfinished_groups`, `april/off_policy_token_frac` (of the batch's tokens, those
    of an older policy).
  """
  if isinstance(over_provision, bool) or not isinstance(over_provision, (int, float)) or not over_provision > 0:
    raise generators.setting_error("april", "over_provision", f"must be a number > 0, got {over_provision!r}")
  B, conf = ctx.batch_size, ctx.sampling
  N, T = conf.num_samples, conf.max_new_tokens
  requests = math.ceil(B * (1 + over_provision))
  store = replay.partial_rollouts(requests, groups.buffer_example(ctx.prompt_len, conf))

  def wants(state) -> int:
    return requests - int(np.asarray(jax.device_get(state.valid)).sum())

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    got, state = store.sample(state, None, requests)
    got = jax.device_get(got)
    resumed = got.take(np.flatnonzero(np.asarray(got.prompt_index) >= 0))
    n_old, n_new = resumed.prompt_ids.shape[0], prompts.ids.shape[0]
    parts = [resumed] if n_old else []
    if n_new:
      ids, mask = sampling.left_pad_to(np.asarray(prompts.ids), np.asarray(prompts.mask), ctx.prompt_len,
                                       conf.pad_id)
      budget = np.full(n_new, N) if prompts.budget is None else np.asarray(prompts.budget)
      parts.append(RolloutBatch.empty(n_new, N, ctx.prompt_len, T).replace(
          prompt_ids=ids.astype(np.int32), prompt_mask=mask.astype(bool),
          prompt_index=np.asarray(prompts.index, np.int32), sample_mask=np.arange(N) < budget[:, None],
          entropy=np.zeros((n_new, N, T), np.float32)))
    req = jax.device_get(parts[0] if len(parts) == 1 else sampling.concat(parts))
    was = np.asarray(req.completion_mask)
    done_in = np.asarray(sampling.finished_rows(req.completion_ids, was, conf)) | ~np.asarray(req.sample_mask)
    # Prefix widths come in three buckets, so resumed steps compile at most three shapes.
    longest = int(was.sum(-1).max(initial=0))
    L = next(w for w in (max(T // 4, 1), max(T // 2, 1), T) if w >= longest)
    out = jax.device_get(sampling.continue_from(
        ctx.cfg, params, req.prompt_ids, req.prompt_mask, np.asarray(req.completion_ids)[..., :L], was[..., :L],
        key, conf, prefix_logprobs=np.asarray(req.behaviour_logprobs)[..., :L],
        prefix_entropy=np.asarray(req.entropy)[..., :L], finished=done_in, stop_after_groups=B))
    new = np.asarray(out.completion_mask) & ~was
    batch = req.replace(completion_ids=np.asarray(out.completion_ids),
                        completion_mask=np.asarray(out.completion_mask),
                        behaviour_logprobs=np.asarray(out.logprobs, np.float32),
                        entropy=np.asarray(out.entropy, np.float32),
                        policy_version=np.where(new, version, np.asarray(req.policy_version)).astype(np.int32))
    done = np.asarray(sampling.finished_rows(batch.completion_ids, batch.completion_mask, conf)) | done_in
    use = np.flatnonzero(done.all(axis=1))[:B]   # stored (older) groups come first
    rest = np.setdiff1d(np.arange(req.prompt_ids.shape[0]), use)
    if rest.size:
      state = store.add(state, batch.take(rest))
    batch = batch.take(use)
    live = np.asarray(batch.completion_mask) & np.asarray(batch.sample_mask)[..., None]
    stats = {"rollouts": float(n_new * N), "generated_tokens": float(new.sum()),
             "rollout/padding_frac": padding_frac(new.sum(-1)[~done_in]),
             "april/resumed_groups": float(n_old), "april/stored_groups": float(rest.size),
             "april/stored_unfinished_groups": float((~done[rest].all(axis=1)).sum()),
             "april/off_policy_token_frac":
                 float((np.asarray(batch.policy_version) < version)[live].mean()) if live.any() else 0.0}
    return batch, state, stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(store.init, generate, update, wants=wants)
