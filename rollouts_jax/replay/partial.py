"""`replay.partial_rollouts`: unfinished rollout groups waiting to be resumed (APRIL).

APRIL (Active Partial Rollouts, `RLsys-Foundation/APRIL`): a step over-provisions rollout
requests and stops generating once enough groups have finished; the groups still running
are stored here whole (finished rows, and unfinished rows with their tokens so far, the
behaviour log-prob and the policy version of every token) and are the first requests of
the next step, resumed by `sampling.continue_from` under the newer policy. Nothing is
dropped: groups never expire and `add` refuses to overwrite a stored group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.replay import base
from rollouts_jax.types import RolloutBatch


def partial_rollouts(capacity: int, example: RolloutBatch, **unused) -> base.RolloutBuffer:
  """A FIFO store of unfinished groups that never drops one.

  Args:
    capacity: groups held. `add` raises (before writing) when the groups to add do not fit
      in the free slots: size it to the step's rollout requests.
    example: a RolloutBatch with the stored group shape (full `[N, T]` completions).
    **unused: accepted for the registry's common signature (`max_staleness` is ignored:
      partial groups are resumed, never expired).

  Returns:
    A `RolloutBuffer`; `sample(state, key, n)` returns the n oldest groups (empty slots
    masked, `prompt_index` -1) and frees their slots.

  >>> ex = RolloutBatch.empty(2, 2, 3, 4)
  >>> buf = partial_rollouts(2, ex)
  >>> s = buf.add(buf.init(), ex.replace(sample_mask=np.ones((2, 2), bool), prompt_index=np.array([4, 5])))
  >>> buf.add(s, ex.replace(sample_mask=np.ones((2, 2), bool)))
  Traceback (most recent call last):
  ...
  ValueError: replay.partial_rollouts: 2 groups do not fit in 0 free slots of 2; nothing was written.
  >>> out, s = buf.sample(s, None, 1)
  >>> out.prompt_index.tolist(), int(s.size)
  ([4], 1)
  """
  if capacity < 1:
    raise ValueError(f"replay.partial_rollouts needs capacity >= 1, got {capacity}.")

  def init():
    return base.empty_state(example, capacity)

  def add(state, batch, **extra):
    del extra
    state, batch = base.as_arrays(state), base.as_arrays(batch)
    keep = jnp.any(batch.sample_mask, axis=1)
    n, free = int(jnp.sum(keep)), int(capacity - jnp.sum(state.valid))
    if n > free:
      raise ValueError(f"replay.partial_rollouts: {n} groups do not fit in {free} free slots of {capacity}; "
                       "nothing was written.")
    return base.write(state, batch, keep, jnp.zeros(keep.shape, jnp.float32), state.order)

  def sample(state, key, n: int, **extra):
    del key, extra
    state = base.as_arrays(state)
    big = jnp.iinfo(jnp.int32).max
    slots = jnp.argsort(jnp.where(state.valid, state.order, big), stable=True)[:n]
    return base.read(state, slots)

  return base.RolloutBuffer(init, add, sample)
