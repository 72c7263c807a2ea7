"""A rollout step's metrics: the counters its stages add to, and the batch summary the loop logs.

>>> s = StepStats()
>>> s.add("rollouts", 8); s.add("rollouts", 8); s.mean("reward/x", 1.0); s.mean("reward/x", 0.0)
>>> s.summary()["rollouts"], s.summary()["reward/x"]
(16.0, 0.5)
"""

from __future__ import annotations

import numpy as np

from rollouts_jax import control
from rollouts_jax.rollout.generators import Mean
from rollouts_jax.types import RolloutBatch

#: Keys every step reports, 0 when no stage added to them.
ALWAYS = ("time/sample", "time/score", "grader_failures", "generated_tokens")


class StepStats:
  """Sums (and means) of a step's rollout metrics, added to by its stages."""

  def __init__(self):
    self.sums: dict[str, float] = {}
    self.means: dict[str, list[float]] = {}

  def add(self, key: str, value) -> None:
    self.sums[key] = self.sums.get(key, 0.0) + float(value)

  def mean(self, key: str, value) -> None:
    self.means.setdefault(key, []).append(float(value))

  def get(self, key: str) -> float:
    return self.sums.get(key, 0.0)

  def add_all(self, stats: dict) -> None:
    """A generator's stats: `rollout.Mean` values are averaged over the step's calls, others summed."""
    for k, v in stats.items():
      (self.mean if isinstance(v, Mean) else self.add)(k, v)

  def summary(self) -> dict[str, float]:
    out = dict(self.sums)
    out.update({k: float(np.mean(v)) for k, v in self.means.items()})
    for k in ALWAYS:
      out.setdefault(k, 0.0)
    return out


def batch_summary(batch: RolloutBatch, sampled: RolloutBatch) -> dict[str, float]:
  """The trained batch's reward, accuracy, length, entropy and informative-group share.

  Over the policy's own rollouts (ERILS's external ones, `source_ids` 1, left out);
  `reward_mean_sampled` is over every group sampled this step, before any group filter.
  """
  r, live = np.asarray(batch.rewards), np.asarray(batch.sample_mask)
  if batch.source_ids is not None:
    live = live & (np.asarray(batch.source_ids) == 0)
  lengths = np.asarray(batch.lengths)
  ent = np.asarray(batch.entropy) if batch.entropy is not None else np.zeros(batch.completion_ids.shape)
  m = np.asarray(batch.completion_mask) & live[..., None]
  some = bool(live.any())
  return {
      "reward_mean": float(r[live].mean()) if some else 0.0,
      "reward_std": float(r[live].std()) if some else 0.0,
      "reward_mean_sampled": float(np.asarray(sampled.rewards)[np.asarray(sampled.sample_mask)].mean()),
      "accuracy": float((r[live] >= 1.0).mean()) if some else 0.0,
      "response_length": float(lengths[live].mean()) if some else 0.0,
      "entropy": float((ent * m).sum() / max(m.sum(), 1)),
      "informative_groups": float(np.asarray(control.informative(batch.rewards, batch.sample_mask)).mean()),
  }


def loss_extent(completion_mask) -> int:
  """The completion width that holds every loss position: 1 + the last True column (0 if none).

  Unlike the longest row's count of loss tokens, it keeps the later turns of multi-turn rows,
  whose observation tokens are holes in the mask.

  >>> loss_extent(np.array([[[True, False, False, True, False]]])), loss_extent(np.zeros((1, 1, 3), bool))
  (4, 0)
  """
  m = np.asarray(completion_mask, bool).reshape(-1, np.shape(completion_mask)[-1]).any(0)
  return int(np.flatnonzero(m)[-1] + 1) if m.any() else 0


def update_width(batch: RolloutBatch) -> int:
  """The completion width the update runs on: the loss extent rounded up to a multiple of 8 (few shapes)."""
  return min(batch.completion_ids.shape[-1], max(8, -(-loss_extent(batch.completion_mask) // 8) * 8))


def padding_frac(new_tokens_R: np.ndarray) -> float:
  """The share of a decode loop's row-steps that produced no token (an accelerator-idle proxy).

  The loop runs as many steps as its longest row; a row that ended earlier pads the rest.

  >>> round(padding_frac(np.array([4, 2, 2])), 4)
  0.3333
  """
  steps = int(new_tokens_R.max(initial=0))
  return 1.0 - float(new_tokens_R.sum()) / (new_tokens_R.size * steps) if steps else 0.0


def mean_entropy(batch: RolloutBatch) -> np.ndarray:
  """float32 [B, N]: each sample's mean token entropy (0 for empty samples)."""
  if batch.entropy is None:
    return np.zeros(np.asarray(batch.rewards).shape, np.float32)
  m = np.asarray(batch.completion_mask)
  return ((np.asarray(batch.entropy) * m).sum(-1) / np.maximum(m.sum(-1), 1)).astype(np.float32)
