"""`from_samples`: a sampler's output as a `RolloutBatch` (the batch type lives in `rollouts_jax.types`)."""

from __future__ import annotations

import jax
import numpy as np

from rollouts_jax.types import (_SAMPLE_FIELDS, _TOKEN_FIELDS, RolloutBatch, concat,  # noqa: F401  (re-exported)
                                teacher_forced_rows)


def from_samples(prompt_ids, prompt_mask, out, *, prompt_index, policy_version: int) -> RolloutBatch:
  """A RolloutBatch from a `sampling.SampleOutput` of these prompts (host arrays)."""
  out = jax.device_get(out)
  B, N, T = out.completion_ids.shape
  return RolloutBatch(
      prompt_ids=np.asarray(prompt_ids, np.int32), prompt_mask=np.asarray(prompt_mask, bool),
      completion_ids=np.asarray(out.completion_ids, np.int32), completion_mask=np.asarray(out.completion_mask),
      behaviour_logprobs=np.asarray(out.logprobs, np.float32),
      policy_version=np.full((B, N, T), policy_version, np.int32), rewards=np.zeros((B, N), np.float32),
      sample_mask=np.ones((B, N), bool), prompt_index=np.asarray(prompt_index, np.int32),
      entropy=np.asarray(out.entropy, np.float32))
