"""PVPO's reference rewards: a reference policy's rollouts of each prompt, cached per prompt.

The table (`RefRewards`, in the pipeline state, so it checkpoints) holds each prompt's M
reference rewards and the step they were computed at. `attach` fills the batch's
`ref_rewards` / `ref_mask` (the advantage's static anchor), computing only the prompts never
seen (or older than the refresh period); `presample` fills the whole table before the first
step, as the paper's data pre-sampling does (arXiv 2508.21104).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import control, sampling
from rollouts_jax.rollout.prompter import Prompter
from rollouts_jax.rollout.stats import StepStats
from rollouts_jax.types import RolloutBatch

log = logging.getLogger(__name__)


@flax.struct.dataclass
class RefRewards:
  """Cached reference-policy rewards per prompt (PVPO's static anchor)."""
  rewards: jax.Array     # float32 [num_prompts, M]
  step: jax.Array        # int32 [num_prompts]: the step they were computed at (-1: never)


@dataclasses.dataclass
class Reference:
  """M = `samples` reference rollouts per prompt, refreshed every `refresh` steps (0: never)."""
  cfg: Any
  prompter: Prompter
  examples: Sequence[dict]
  sampling_config: sampling.SamplingConfig
  score: Callable    # the step's FILTER: (batch, examples, stats) -> (rewards, info)
  samples: int
  refresh: int = 0

  def init(self) -> RefRewards:
    n = len(self.examples)
    return RefRewards(rewards=jnp.zeros((n, self.samples), jnp.float32), step=jnp.full((n,), -1, jnp.int32))

  def rewards(self, prompts: np.ndarray, ref_params, key, stats: StepStats) -> np.ndarray:
    """float [len(prompts), M]: rewards of the reference policy's rollouts of these prompts."""
    examples = [self.examples[int(i)] for i in prompts]
    ids, mask = self.prompter(examples)
    conf = self.sampling_config.replace(num_samples=self.samples)
    out = jax.device_get(sampling.sample(self.cfg, ref_params, ids, mask, jax.random.fold_in(key, 3), conf))
    rb = sampling.from_samples(ids, mask, out, prompt_index=prompts, policy_version=0)
    r, _ = self.score(rb, examples, StepStats())
    stats.add("ref/rollouts", float(self.samples * len(prompts)))
    stats.add("ref/generated_tokens", float(np.sum(jax.device_get(rb.lengths))))
    return np.asarray(r)

  def attach(self, batch: RolloutBatch, ref: RefRewards, ref_params, step: int, key,
             stats: StepStats) -> tuple[RolloutBatch, RefRewards]:
    """The batch with its prompts' reference rewards (computed once per prompt, or per refresh)."""
    idx = np.asarray(batch.prompt_index)
    cached_step = np.asarray(ref.step)[np.maximum(idx, 0)]
    stale = (idx >= 0) & ((cached_step < 0) | (self.refresh > 0) & (step - cached_step >= self.refresh))
    todo = np.unique(idx[stale])
    table, steps = np.asarray(ref.rewards).copy(), np.asarray(ref.step).copy()
    if todo.size:
      table[todo], steps[todo] = self.rewards(todo, ref_params, key, stats), step
    ref_rewards = table[np.maximum(idx, 0)]
    ref_mask = np.repeat((idx >= 0)[:, None], self.samples, axis=1)
    stats.add("ref/reward_mean", float(ref_rewards[idx >= 0].mean()) if (idx >= 0).any() else 0.0)
    return (batch.replace(ref_rewards=ref_rewards.astype(np.float32), ref_mask=ref_mask),
            RefRewards(rewards=jnp.asarray(table), step=jnp.asarray(steps)))

  def presample(self, ref: RefRewards, selector, ctl, ref_params, key,
                batch_size: int) -> tuple[RefRewards, Any, dict[str, float]]:
    """PVPO's data pre-sampling, before the first step: (the filled table, the selector's state, metrics).

    The reference policy rolls out every training prompt M times, `batch_size` prompts at a
    time; the rewards fill the table and go to the selector's `update` as `ref_rewards_BxM`,
    so the PVPO selector knows each prompt's reference accuracy, and drops the always- and
    never-solved ones, before it picks any.
    """
    n, B, stats = len(self.examples), batch_size, StepStats()
    table, steps = np.asarray(ref.rewards).copy(), np.asarray(ref.step).copy()
    N = self.sampling_config.num_samples
    for start in range(0, n, B):
      idx = np.arange(start, min(start + B, n))
      padded = np.concatenate([idx, np.full((B - idx.size,), idx[-1])])   # one program for every chunk
      r = self.rewards(padded, ref_params, jax.random.fold_in(key, start), stats)[:idx.size]
      table[idx], steps[idx] = r, 0
      plan = control.Plan(indices=jnp.asarray(idx, jnp.int32), budget=jnp.full((idx.size,), N, jnp.int32))
      zeros = np.zeros((idx.size, N), np.float32)
      ctl = selector.update(ctl, plan, zeros, zeros.astype(bool), ref_rewards_BxM=r.astype(np.float32),
                            ref_mask_BxM=np.ones(r.shape, bool))
    acc = (table > 0.5).mean(axis=1)
    info = {"ref/presample_rollouts": stats.get("ref/rollouts"),
            "ref/presample_generated_tokens": stats.get("ref/generated_tokens"),
            "ref/presample_solved_frac": float((acc >= 1).mean()),
            "ref/presample_unsolved_frac": float((acc <= 0).mean()), "ref/presample_reward_mean": float(table.mean())}
    log.info("PVPO pre-sampling: %d reference rollouts; %.0f%% of the prompts always solved, %.0f%% never.",
             info["ref/presample_rollouts"], 100 * info["ref/presample_solved_frac"],
             100 * info["ref/presample_unsolved_frac"])
    return RefRewards(rewards=jnp.asarray(table), step=jnp.asarray(steps)), ctl, info
