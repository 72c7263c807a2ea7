"""Side steps of the rollout step: batch -> batch functions that run beside generation.

They read a scored batch and return it with a field the update reads set (no stage calls
back into another):

>>> from rollouts_jax.rollout import extras
>>> callable(extras.teacher_advantages)
True
"""

from __future__ import annotations

import numpy as np

from rollouts_jax.sampling import sol_rl as sol_rl_lib
from rollouts_jax.types import RolloutBatch


def teacher_advantages(teacher, batch: RolloutBatch, temperature: float) -> np.ndarray:
  """float32 [B, N, T]: log p_teacher(y_t) - log p_behaviour(y_t) per completion token, 0 off the mask.

  On-policy distillation's per-token signal, the single-sample form of the reverse KL (GKD,
  Agarwal et al. 2024): maximizing it pulls the student toward the teacher on the student's own
  prefixes. `teacher` is (ModelConfig, params): any size with the student's vocabulary.
  """
  cfg, params = teacher
  scored, _ = sol_rl_lib.recompute_batch(cfg, params, batch, temperature=temperature)
  return reverse_kl_advantages(scored.old_logprobs, batch)


def reverse_kl_advantages(teacher_logprobs, batch: RolloutBatch) -> np.ndarray:
  """float32 [B, N, T]: the teacher's log-probs of the batch's tokens minus the behaviour's, 0 off the mask."""
  m = np.asarray(batch.completion_mask)
  return np.where(m, np.asarray(teacher_logprobs) - np.asarray(batch.behaviour_logprobs), 0.0).astype(np.float32)
