"""The REPLAY contract: fixed-capacity rollout buffers as `(init, add, sample)` triples.

A buffer holds up to `capacity` rollout groups (one prompt and its N samples each) in a
pytree of arrays with a leading capacity axis, so it is jittable and checkpoints with orbax::

    buf = replay.fifo(capacity, example_batch)
    bstate = buf.init()
    bstate = buf.add(bstate, batch)                  # stores the groups with any live sample
    batch, bstate = buf.sample(bstate, key, n)       # n groups; empty slots come back masked

Every group keeps its behaviour log-probs and the policy version of each token, so a later
update can importance-correct for staleness. `sample` removes what it returns (a group is
used once); `add` overwrites the oldest groups when the buffer is full.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.types import RolloutBatch


@flax.struct.dataclass
class BufferState:
  """Stored groups and their bookkeeping (C = capacity).

  Attributes:
    data: a RolloutBatch whose leading axis has C slots.
    valid: bool [C], slot holds a group.
    order: int32 [C], insertion counter of each slot's group (FIFO order).
    priority: float32 [C], the group's usefulness score (prioritized buffers).
    next_order: int32 scalar.
  """
  data: RolloutBatch
  valid: jax.Array
  order: jax.Array
  priority: jax.Array
  next_order: jax.Array

  @property
  def size(self) -> jax.Array:
    return jnp.sum(self.valid).astype(jnp.int32)


class RolloutBuffer(NamedTuple):
  """A rollout buffer: three pure functions over a `BufferState`.

  Attributes:
    init: `() -> state`.
    add: `(state, batch, **extra) -> state`.
    sample: `(state, key, n, **extra) -> (batch, state)`; `n` is static.
  """
  init: Callable[[], BufferState]
  add: Callable[..., BufferState]
  sample: Callable[..., tuple[RolloutBatch, BufferState]]


def as_arrays(tree):
  """`tree` with jax arrays for leaves (a state restored from a checkpoint may hold numpy arrays)."""
  return jax.tree_util.tree_map(jnp.asarray, tree)


def empty_state(example: RolloutBatch, capacity: int) -> BufferState:
  """A buffer of `capacity` empty slots shaped like one group of `example`."""
  data = jax.tree_util.tree_map(lambda x: jnp.zeros((capacity,) + tuple(x.shape[1:]), x.dtype), example)
  return BufferState(data=data, valid=jnp.zeros((capacity,), bool), order=jnp.zeros((capacity,), jnp.int32),
                     priority=jnp.zeros((capacity,), jnp.float32), next_order=jnp.zeros((), jnp.int32))


def group_versions(batch: RolloutBatch) -> jax.Array:
  """int32 [B]: the oldest policy version among a group's live tokens (its staleness anchor)."""
  live = batch.completion_mask & batch.sample_mask[..., None]
  big = jnp.iinfo(jnp.int32).max
  v = jnp.min(jnp.where(live, batch.policy_version, big), axis=(1, 2))
  return jnp.where(v == big, 0, v)


def write(state: BufferState, batch: RolloutBatch, keep_B: jax.Array, priority_B: jax.Array,
          evict_key_C: jax.Array) -> BufferState:
  """Writes the groups with `keep_B` into the slots with the smallest `evict_key_C` (free slots first)."""
  B = keep_B.shape[0]
  C = state.valid.shape[0]
  if B > C:
    raise ValueError(f"Cannot add {B} groups to a buffer of capacity {C}.")
  src = jnp.argsort(~keep_B, stable=True)            # kept groups first, in order
  ok = keep_B[src]
  slots = jnp.argsort(jnp.where(state.valid, evict_key_C, -jnp.inf), stable=True)[:B]
  order = state.next_order + jnp.cumsum(ok.astype(jnp.int32)) - 1

  def put(store, new):
    new = new[src]
    cur = store[slots]
    cond = ok.reshape((B,) + (1,) * (new.ndim - 1))
    return store.at[slots].set(jnp.where(cond, new, cur))

  data = jax.tree_util.tree_map(put, state.data, batch)
  return BufferState(data=data, valid=state.valid.at[slots].set(state.valid[slots] | ok),
                     order=state.order.at[slots].set(jnp.where(ok, order, state.order[slots])),
                     priority=state.priority.at[slots].set(jnp.where(ok, priority_B[src], state.priority[slots])),
                     next_order=state.next_order + jnp.sum(ok).astype(jnp.int32))


def read(state: BufferState, slots_n: jax.Array) -> tuple[RolloutBatch, BufferState]:
  """The groups in `slots_n`, empty slots masked out, and the state with those slots freed."""
  got = state.valid[slots_n]
  batch = jax.tree_util.tree_map(lambda x: x[slots_n], state.data)
  batch = batch.replace(sample_mask=batch.sample_mask & got[:, None],
                        prompt_index=jnp.where(got, batch.prompt_index, -1))
  return batch, state.replace(valid=state.valid.at[slots_n].set(False))


def expire(state: BufferState, version, max_staleness: int | None) -> BufferState:
  """Frees the slots whose groups are more than `max_staleness` versions older than `version`."""
  if max_staleness is None or version is None:
    return state
  stale = jnp.asarray(version) - group_versions(state.data) > max_staleness
  return state.replace(valid=state.valid & ~stale)
