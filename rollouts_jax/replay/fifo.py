"""`replay.fifo`: first in, first out."""

from __future__ import annotations

import jax.numpy as jnp

from rollouts_jax.replay import base
from rollouts_jax.types import RolloutBatch


def fifo(capacity: int, example: RolloutBatch, *, max_staleness: int | None = None) -> base.RolloutBuffer:
  """A FIFO buffer of rollout groups: `sample` returns the oldest stored groups.

  Args:
    capacity: groups the buffer holds; when full, `add` overwrites the oldest.
    example: a RolloutBatch whose group shape (`[N, T]`, prompt length P, optional fields)
      every added batch shares.
    max_staleness: with `sample(..., version=v)`, groups whose oldest token is more than this
      many policy versions older than v are dropped first (None: never).

  Returns:
    A `RolloutBuffer`.

  >>> import jax, numpy as np
  >>> from rollouts_jax.types import RolloutBatch
  >>> ex = RolloutBatch.empty(2, 2, 3, 4)
  >>> buf = fifo(4, ex)
  >>> s = buf.init()
  >>> b = ex.replace(sample_mask=np.ones((2, 2), bool), prompt_index=np.array([7, 8], np.int32))
  >>> s = buf.add(s, b)
  >>> out, s = buf.sample(s, jax.random.key(0), 3)
  >>> out.prompt_index.tolist(), int(s.size)
  ([7, 8, -1], 0)
  """
  if capacity < 1:
    raise ValueError(f"replay.fifo needs capacity >= 1, got {capacity}.")

  def init():
    return base.empty_state(example, capacity)

  def add(state, batch, **extra):
    del extra
    state, batch = base.as_arrays(state), base.as_arrays(batch)
    keep = jnp.any(batch.sample_mask, axis=1)
    return base.write(state, batch, keep, jnp.zeros(keep.shape, jnp.float32), state.order)

  def sample(state, key, n: int, *, version=None, **extra):
    del key, extra
    state = base.as_arrays(state)
    state = base.expire(state, version, max_staleness)
    big = jnp.iinfo(jnp.int32).max
    slots = jnp.argsort(jnp.where(state.valid, state.order, big), stable=True)[:n]
    return base.read(state, slots)

  return base.RolloutBuffer(init, add, sample)
