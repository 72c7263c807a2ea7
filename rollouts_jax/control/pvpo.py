"""`control.pvpo_presample`: PVPO's data pre-sampling as a selector.

Paper: PVPO (arXiv 2508.21104). A fixed reference model (the initial policy) rolls each prompt
out M times ahead of training; its mean reward is the prompt's difficulty and the advantage's
reference anchor (`A_i = r_i - mean(r_ref)`, an advantage transform, not part of this
selector). Pre-sampling keeps `0 < acc < 1`, drops prompts the reference always solves, and
for `acc = 0` the paper swaps one rollout for a cached ground-truth trajectory from a larger
model; without such trajectories this selector drops `acc = 0` prompts too (`drop_unsolved`).

The state holds each prompt's reference accuracy, filled either up front,
`sel.init(ref_accuracy=acc_K)`, or by `update` from reference rollouts given as the extra
`ref_rewards_BxM=` (optional `ref_mask_BxM=`); a later `ref_rewards_BxM` for the same prompt
replaces the old value (the paper refreshes the reference every fixed number of steps). The
on-policy rewards given to `update` do not change the reference accuracy. Prompts without a
reference accuracy are eligible (the loop rolls the reference out on them when they come up).

Selection: the least recently selected eligible prompts, random ties (an epoch over the
eligible prompts); dropped prompts are used only when fewer than B are eligible.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.control import base
from rollouts_jax.control.vade import top_b

_NEVER = 1 << 30


@flax.struct.dataclass
class PvpoState:
  ref_acc: jax.Array     # float32 [K]: reference-policy mean reward (success rate)
  ref_count: jax.Array   # float32 [K]: reference samples behind it (0: unknown)
  last_step: jax.Array   # int32 [K]: step the prompt was last selected (-1: never)
  step: jax.Array        # int32 scalar: selections so far


def pvpo_presample(num_prompts: int, *, num_samples: int, seed: int = 0, drop_solved: bool = True,
                   drop_unsolved: bool = True, success_threshold: float = 0.5) -> base.PromptSelector:
  """PVPO pre-sampling: skip prompts the reference policy always or never solves.

  Args:
    num_prompts: K, size of the dataset.
    num_samples: N, rollouts per prompt (every selected prompt gets the full N).
    seed: unused (the key given to `select` drives the random tie-breaks).
    drop_solved: drop prompts with reference accuracy 1.
    drop_unsolved: drop prompts with reference accuracy 0.
    success_threshold: a reference reward above it is a success.

  Returns:
    A `PromptSelector`; `init(ref_accuracy=None)` takes optional accuracies float [K] (NaN:
    unknown); `update` reads the extras `ref_rewards_BxM` and `ref_mask_BxM`.

  >>> import jax, jax.numpy as jnp
  >>> sel = pvpo_presample(4, num_samples=2)
  >>> state = sel.init(ref_accuracy=jnp.array([0.0, 0.5, 1.0, 0.25]))
  >>> plan, state = sel.select(state, jax.random.key(0), 2)
  >>> sorted(plan.indices.tolist())
  [1, 3]
  """
  del seed

  def init(ref_accuracy=None):
    if ref_accuracy is None:
      acc = jnp.zeros((num_prompts,), jnp.float32)
      count = jnp.zeros((num_prompts,), jnp.float32)
    else:
      a = jnp.asarray(ref_accuracy, jnp.float32)
      if a.shape != (num_prompts,):
        raise ValueError(f"pvpo_presample: ref_accuracy must have shape ({num_prompts},); got {a.shape}.")
      known = ~jnp.isnan(a)
      acc, count = jnp.where(known, a, 0.0), known.astype(jnp.float32)
    return PvpoState(ref_acc=acc, ref_count=count, last_step=jnp.full((num_prompts,), -1, jnp.int32),
                     step=jnp.zeros((), jnp.int32))

  def dropped(state):
    known = state.ref_count > 0
    out = jnp.zeros((num_prompts,), bool)
    if drop_solved:
      out = out | (known & (state.ref_acc >= 1.0))
    if drop_unsolved:
      out = out | (known & (state.ref_acc <= 0.0))
    return out

  def select(state, key, batch_size: int):
    base.check_batch_size(batch_size, num_prompts)
    age = jnp.where(state.last_step >= 0, state.step - state.last_step, _NEVER).astype(jnp.float32)
    score = jnp.where(dropped(state), age - 2.0 * _NEVER, age)
    idx = top_b(score, key, batch_size)
    state = state.replace(last_step=state.last_step.at[idx].set(state.step), step=state.step + 1)
    return base.full_budget(idx, num_samples), state

  def update(state, plan, rewards_BxN, mask_BxN=None, *, ref_rewards_BxM=None, ref_mask_BxM=None, **extra):
    del rewards_BxN, mask_BxN, extra
    if ref_rewards_BxM is None:
      return state
    r = jnp.asarray(ref_rewards_BxM, jnp.float32)
    m = jnp.ones(r.shape, bool) if ref_mask_BxM is None else jnp.asarray(ref_mask_BxM, bool)
    n_B = jnp.sum(m, axis=1).astype(jnp.float32)
    acc_B = jnp.sum((r > success_threshold) & m, axis=1) / jnp.maximum(n_B, 1.0)
    idx = jnp.asarray(plan.indices, jnp.int32)
    has = n_B > 0
    return state.replace(ref_acc=state.ref_acc.at[idx].set(jnp.where(has, acc_B, state.ref_acc[idx])),
                         ref_count=state.ref_count.at[idx].set(jnp.where(has, n_B, state.ref_count[idx])))

  return base.PromptSelector(init, select, update)
