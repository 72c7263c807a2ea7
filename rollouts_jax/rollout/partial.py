"""APRIL's partial rollouts: one over-provisioned, early-stopped generation per step.

The step requests `requests` groups: the stored unfinished ones first (resumed under the
newer policy with `sampling.continue_from`), then fresh prompts from the selector. Decoding
stops once B groups have finished; those B are scored and trained on, and every other group,
finished or not, goes back to the store (`replay.partial_rollouts`). Each token keeps the
behaviour log-prob and the policy version that produced it.

Unlike a registered generator, this path chooses its own prompts (how many fresh ones
depends on the store), so the pipeline runs it in place of CONTROL's select -> GENERATE.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from rollouts_jax import control, sampling
from rollouts_jax.rollout.stats import StepStats, padding_frac
from rollouts_jax.types import RolloutBatch


def generate_partial(pipe, params, ctl, pstate, version: int, key: jax.Array, stats: StepStats):
  """(B finished, scored groups, the selector's state, the store's state) for one step of `pipe`.

  `pipe` is the step's `RolloutPipeline` (its selector, prompter, store and FILTER);
  `params` are the policy after `version` updates: the tag of the tokens generated now.
  """
  B, N = pipe.batch_size, pipe.num_samples
  conf = pipe.sampling_config
  T = conf.max_new_tokens
  got, pstate = pipe.partial.sample(pstate, None, pipe.partial_requests)
  got = jax.device_get(got)
  resumed = got.take(np.flatnonzero(np.asarray(got.prompt_index) >= 0))
  n_old = resumed.prompt_ids.shape[0]
  n_new = pipe.partial_requests - n_old
  ex = pipe.buffer_example()
  groups = [resumed] if n_old else []
  if n_new:
    plan, ctl = pipe.selector.select(ctl, jax.random.fold_in(key, 100), n_new)
    idx = np.asarray(plan.indices)
    ids, mask = pipe.prompter([pipe.examples[int(i)] for i in idx])
    ids, mask = sampling.left_pad_to(np.asarray(ids), np.asarray(mask), ex.prompt_ids.shape[1], conf.pad_id)
    fresh = RolloutBatch.empty(n_new, N, ids.shape[1], T).replace(
        prompt_ids=ids.astype(np.int32), prompt_mask=mask.astype(bool), prompt_index=idx.astype(np.int32),
        sample_mask=np.asarray(plan.sample_mask(N)), entropy=np.zeros((n_new, N, T), np.float32))
    groups.append(fresh)
    stats.add("rollouts_budget", float(np.asarray(plan.budget).sum()))
  req = jax.device_get(groups[0] if len(groups) == 1 else sampling.concat(groups))
  was = np.asarray(req.completion_mask)
  done_in = np.asarray(sampling.finished_rows(req.completion_ids, was, conf)) | ~np.asarray(req.sample_mask)
  # Prefix widths come in three buckets, so resumed steps compile at most three shapes.
  longest = int(was.sum(-1).max(initial=0))
  L = next(w for w in (max(T // 4, 1), max(T // 2, 1), T) if w >= longest)
  t0 = time.perf_counter()
  out = jax.device_get(sampling.continue_from(
      pipe.cfg, params, req.prompt_ids, req.prompt_mask, np.asarray(req.completion_ids)[..., :L], was[..., :L], key,
      conf, prefix_logprobs=np.asarray(req.behaviour_logprobs)[..., :L],
      prefix_entropy=np.asarray(req.entropy)[..., :L], finished=done_in, stop_after_groups=B))
  stats.add("time/sample", time.perf_counter() - t0)
  new = np.asarray(out.completion_mask) & ~was
  batch = req.replace(completion_ids=np.asarray(out.completion_ids), completion_mask=np.asarray(out.completion_mask),
                      behaviour_logprobs=np.asarray(out.logprobs, np.float32),
                      entropy=np.asarray(out.entropy, np.float32),
                      policy_version=np.where(new, version, np.asarray(req.policy_version)).astype(np.int32))
  done = np.asarray(sampling.finished_rows(batch.completion_ids, batch.completion_mask, conf)) | done_in
  finished = np.flatnonzero(done.all(axis=1))   # stored (older) groups come first
  use = finished[:B]
  rest = np.setdiff1d(np.arange(req.prompt_ids.shape[0]), use)
  if rest.size:
    pstate = pipe.partial.add(pstate, batch.take(rest))
  batch = batch.take(use)
  r, _ = pipe.filter(batch, [pipe.examples[int(i)] for i in np.asarray(batch.prompt_index)], stats)
  batch = batch.replace(rewards=r)
  live = np.asarray(batch.completion_mask) & np.asarray(batch.sample_mask)[..., None]
  stats.add("rollouts", float(n_new * N))
  stats.add("generated_tokens", float(new.sum()))
  stats.add("rollout/padding_frac", padding_frac(new.sum(-1)[~done_in]))
  stats.add("april/resumed_groups", float(n_old))
  stats.add("april/stored_groups", float(rest.size))
  stats.add("april/stored_unfinished_groups", float((~done[rest].all(axis=1)).sum()))
  stats.add("april/off_policy_token_frac",
            float((np.asarray(batch.policy_version) < version)[live].mean()) if live.any() else 0.0)
  plan = control.Plan(indices=batch.prompt_index, budget=batch.sample_mask.sum(1).astype(np.int32))
  return batch, plan, ctl, pstate
