"""`control.uniform`: the plain epoch stream (every prompt once per epoch, in a new order each epoch)."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.control import base


@flax.struct.dataclass
class UniformState:
  position: jax.Array   # int32 scalar: prompts handed out so far (over all epochs)


def epoch_order(seed: int, epoch: jax.Array, num_prompts: int) -> jax.Array:
  """The permutation of epoch `epoch`: a function of (seed, epoch) only."""
  return jax.random.permutation(jax.random.fold_in(jax.random.key(seed), epoch), num_prompts)


def stream_indices(seed: int, position: jax.Array, batch_size: int, num_prompts: int) -> jax.Array:
  """int32 [batch_size]: the prompts at stream positions `position, position + 1, ...`.

  A batch that crosses an epoch boundary takes the end of one permutation and the start of
  the next (batch_size <= num_prompts).
  """
  pos = position + jnp.arange(batch_size, dtype=jnp.int32)
  epoch0 = position // num_prompts
  first, second = epoch_order(seed, epoch0, num_prompts), epoch_order(seed, epoch0 + 1, num_prompts)
  idx = jnp.where(pos // num_prompts == epoch0, first[pos % num_prompts], second[pos % num_prompts])
  return idx.astype(jnp.int32)


def uniform(num_prompts: int, *, num_samples: int, seed: int = 0) -> base.PromptSelector:
  """Every prompt once per epoch, shuffled anew each epoch; full budget for each.

  The stream is a function of `(seed, position)` alone: the `key` given to `select` is not
  used, and the state is one counter, so a resumed run sees the same prompts. A batch that
  crosses an epoch boundary takes the end of one permutation and the start of the next.

  Args:
    num_prompts: size of the dataset.
    num_samples: N, rollouts per prompt.
    seed: the stream's seed.

  Returns:
    A `PromptSelector`.

  >>> import jax
  >>> sel = uniform(5, num_samples=4)
  >>> state = sel.init()
  >>> plan1, state = sel.select(state, jax.random.key(0), 3)
  >>> plan2, state = sel.select(state, jax.random.key(0), 2)
  >>> sorted(plan1.indices.tolist() + plan2.indices.tolist())  # one epoch: each prompt once
  [0, 1, 2, 3, 4]
  >>> plan1.budget.tolist()
  [4, 4, 4]
  """

  def init():
    return UniformState(position=jnp.zeros((), jnp.int32))

  def select(state, key, batch_size: int):
    del key
    base.check_batch_size(batch_size, num_prompts)
    idx = stream_indices(seed, state.position, batch_size, num_prompts)
    return base.full_budget(idx, num_samples), UniformState(position=state.position + batch_size)

  def update(state, plan, rewards_BxN, mask_BxN=None, **extra):
    del plan, rewards_BxN, mask_BxN, extra
    return state

  return base.PromptSelector(init, select, update)
