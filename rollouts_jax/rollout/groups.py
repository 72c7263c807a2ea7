"""The step's group filter: DAPO's dynamic sampling keeps B groups, the surplus goes to REPLAY."""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from rollouts_jax import control, replay, sampling
from rollouts_jax.rollout.stats import StepStats
from rollouts_jax.types import RolloutBatch

log = logging.getLogger(__name__)
#: Generations in a row without an informative group after which dynamic sampling with
#: `max_refills=-1` stops refilling (every prompt it draws is solved, or none is).
STALL_REFILLS = 16


class Refills:
  """DAPO's dynamic sampling within one step: whether to generate again.

  Refills until B groups are informative; with `max_refills` >= 0 at most that many refills,
  with -1 until `STALL_REFILLS` generations in a row found none. Giving up is logged and
  reported (`dynamic_sampling_gave_up`, `dynamic_sampling/shortfall`); the step trains on
  what it has.
  """

  def __init__(self, B: int, max_refills: int):
    self.B, self.max_refills, self.informative, self.fruitless = B, max_refills, 0, 0

  def done(self, part: RolloutBatch, refill: int, step: int, stats: StepStats) -> bool:
    found = int(np.asarray(control.informative(part.rewards, part.sample_mask)).sum())
    self.informative, self.fruitless = self.informative + found, 0 if found else self.fruitless + 1
    if self.informative >= self.B:
      return True
    capped = 0 <= self.max_refills <= refill
    if capped or self.fruitless >= STALL_REFILLS:
      log.warning("Step %d: dynamic sampling stopped after %d refills with %d of %d informative groups (%s); "
                  "the step trains on the %d it has.", step + 1, refill, self.informative, self.B,
                  f"control.max_refills={self.max_refills}" if capped else
                  f"{self.fruitless} generations in a row found none", self.informative)
      stats.add("dynamic_sampling_gave_up", 1.0)
      stats.add("dynamic_sampling/shortfall", float(self.B - self.informative))
      return True
    return False


def keep(batch: RolloutBatch, B: int, dynamic_sampling: bool, buffer: replay.RolloutBuffer | None, buf,
         example: Callable[[], RolloutBatch], stats: StepStats) -> tuple[RolloutBatch, Any]:
  """(the B groups trained on, the buffer's state): informative groups first with dynamic sampling.

  With a buffer, the informative groups not kept are stored (padded to `example()`'s shape),
  and the kept groups' ratio is taken against their behaviour log-probs: replayed groups were
  sampled by older policies (for fresh ones they equal the current policy's).
  """
  if not (dynamic_sampling or buffer is not None):
    return batch, buf
  chosen, ok = (control.dynamic_sampling(batch.rewards, B, batch.sample_mask) if dynamic_sampling else
                (np.arange(B), np.ones((B,), bool)))
  chosen, ok = np.asarray(chosen), np.asarray(ok)
  if buffer is not None:
    surplus = np.setdiff1d(np.flatnonzero(np.asarray(control.informative(batch.rewards, batch.sample_mask))), chosen)
    if surplus.size:
      store = pad_for_buffer(batch.take(surplus), example())
      for i in range(0, surplus.size, B):
        buf = buffer.add(buf, store.take(np.arange(i, min(i + B, surplus.size))))
    stats.add("replay/stored", float(surplus.size))
  kept = batch.take(chosen)
  kept = kept.replace(sample_mask=kept.sample_mask & ok[:, None])
  if buffer is not None and kept.old_logprobs is None:
    kept = kept.replace(old_logprobs=kept.behaviour_logprobs)
  return kept, buf


def pad_for_buffer(batch: RolloutBatch, example: RolloutBatch) -> RolloutBatch:
  """`batch` padded (prompts on the left, completions on the right) to the buffer's group shape."""
  P, T = example.prompt_ids.shape[1], example.completion_ids.shape[2]
  p, t = P - batch.prompt_ids.shape[1], T - batch.completion_ids.shape[2]
  if p < 0 or t < 0:
    raise ValueError(f"A batch of prompt length {batch.prompt_ids.shape[1]} does not fit the buffer's {P}.")
  tok = lambda x: None if x is None else np.pad(np.asarray(x), ((0, 0), (0, 0), (0, t)))
  fields = {f: tok(getattr(batch, f)) for f in ("completion_ids", "completion_mask", "behaviour_logprobs",
                                                  "policy_version", "old_logprobs", "entropy")}
  if fields["old_logprobs"] is None and example.old_logprobs is not None:
    fields["old_logprobs"] = fields["behaviour_logprobs"]
  return batch.replace(prompt_ids=np.pad(np.asarray(batch.prompt_ids), ((0, 0), (p, 0))),
                       prompt_mask=np.pad(np.asarray(batch.prompt_mask), ((0, 0), (p, 0))),
                       cluster_ids=None, seq_logprobs=None, ref_rewards=None, ref_mask=None, token_advantages=None,
                       teacher_logprobs=None, **fields)


def buffer_example(prompt_len: int, conf: sampling.SamplingConfig, fields=()) -> RolloutBatch:
  """One group of the shape stored across steps (a replay buffer, APRIL's store): prompts padded to
  `prompt_len` (the pool's bucket), the generation budget, entropies, and old log-probs where the
  generator sets them (`fields`)."""
  ex = RolloutBatch.empty(1, conf.num_samples, prompt_len, conf.max_new_tokens)
  more = {"entropy": np.zeros(ex.completion_ids.shape, np.float32)}
  if "old_logprobs" in fields:
    more["old_logprobs"] = np.zeros(ex.completion_ids.shape, np.float32)
  return ex.replace(**more)
