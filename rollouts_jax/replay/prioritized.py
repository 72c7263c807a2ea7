"""`replay.prioritized`: reuse the past rollout groups that teach the most.

A simplified form of the neural rollout scheduler's global reuse (Contextual Rollout
Bandits, arXiv 2602.08499): each stored group carries a usefulness score, by default its
mean absolute group-normalized advantage (0 for a group whose rewards are all equal: it
teaches nothing), discounted by its staleness; `sample` draws groups in proportion to
score**alpha without replacement (Gumbel top-k), and a full buffer evicts the least useful
group. Reused groups keep their behaviour log-probs, so the update importance-corrects
them (the pipeline takes the PPO ratio against the behaviour policy for buffered batches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollouts_jax.replay import base
from rollouts_jax.types import RolloutBatch


def group_usefulness(batch: RolloutBatch, eps: float = 1e-6) -> jax.Array:
  """float32 [B]: mean |reward - group mean| / (group std + eps) over a group's live samples.

  >>> import numpy as np
  >>> b = RolloutBatch.empty(2, 4, 2, 3).replace(sample_mask=np.ones((2, 4), bool),
  ...     rewards=np.array([[1., 0., 1., 0.], [1., 1., 1., 1.]], np.float32))
  >>> group_usefulness(b).round(3).tolist()
  [1.0, 0.0]
  """
  m = batch.sample_mask.astype(jnp.float32)
  n = jnp.maximum(m.sum(1), 1.0)
  mean = (batch.rewards * m).sum(1) / n
  std = jnp.sqrt((((batch.rewards - mean[:, None]) ** 2) * m).sum(1) / n)
  adv = jnp.abs(batch.rewards - mean[:, None]) / (std[:, None] + eps)
  return jnp.where(std > 0, (adv * m).sum(1) / n, 0.0).astype(jnp.float32)


def prioritized(capacity: int, example: RolloutBatch, *, alpha: float = 1.0, staleness_decay: float = 0.5,
                max_staleness: int | None = None) -> base.RolloutBuffer:
  """A buffer that samples rollout groups by usefulness.

  Args:
    capacity: groups held; a full buffer evicts the lowest-priority groups.
    example: a RolloutBatch with the stored group shape.
    alpha: sampling probability is proportional to priority**alpha (0: uniform over stored
      groups, large: greedy by priority).
    staleness_decay: a group's priority is multiplied by this per policy version of age
      when `sample(..., version=v)` is given (1: no decay).
    max_staleness: groups older than this many versions are dropped first (None: never).

  Returns:
    A `RolloutBuffer`. `add(state, batch, priority_B=None)` scores groups with
    `group_usefulness` unless priorities are given; groups with no live sample or zero
    priority are not stored.

  >>> import numpy as np
  >>> ex = RolloutBatch.empty(3, 2, 2, 3)
  >>> b = ex.replace(sample_mask=np.ones((3, 2), bool), prompt_index=np.array([5, 6, 7]),
  ...                rewards=np.array([[1., 0.], [1., 1.], [0., 1.]], np.float32))
  >>> buf = prioritized(4, ex)
  >>> s = buf.add(buf.init(), b)
  >>> int(s.size)   # the all-equal group (prompt 6) teaches nothing and is not kept
  2
  >>> out, s = buf.sample(s, jax.random.key(0), 3)
  >>> sorted(out.prompt_index.tolist())
  [-1, 5, 7]
  """
  if capacity < 1:
    raise ValueError(f"replay.prioritized needs capacity >= 1, got {capacity}.")
  if alpha < 0:
    raise ValueError(f"replay.prioritized needs alpha >= 0, got {alpha}.")
  if not 0 < staleness_decay <= 1:
    raise ValueError(f"replay.prioritized needs staleness_decay in (0, 1], got {staleness_decay}.")

  def init():
    return base.empty_state(example, capacity)

  def add(state, batch, *, priority_B=None, **extra):
    del extra
    state, batch = base.as_arrays(state), base.as_arrays(batch)
    pr = group_usefulness(batch) if priority_B is None else jnp.asarray(priority_B, jnp.float32)
    keep = jnp.any(batch.sample_mask, axis=1) & (pr > 0)
    return base.write(state, batch, keep, pr, state.priority)

  def sample(state, key, n: int, *, version=None, **extra):
    del extra
    state = base.as_arrays(state)
    state = base.expire(state, version, max_staleness)
    pr = state.priority
    if version is not None:
      age = jnp.maximum(jnp.asarray(version) - base.group_versions(state.data), 0)
      pr = pr * staleness_decay ** age.astype(jnp.float32)
    logits = alpha * jnp.log(jnp.maximum(pr, 1e-30))
    gumbel = jax.random.gumbel(key, pr.shape) if key is not None else jnp.zeros(pr.shape)
    score = jnp.where(state.valid, logits + gumbel, -jnp.inf)
    slots = jnp.argsort(-score, stable=True)[:n]
    return base.read(state, slots)

  return base.RolloutBuffer(init, add, sample)
