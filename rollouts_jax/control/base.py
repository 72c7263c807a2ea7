"""The CONTROL contract: prompt selectors as `(init, select, update)` triples, optax-style.

A selector decides which prompts of the dataset the next step rolls out and how many
rollouts each gets. Its state is a pytree of per-prompt statistics (arrays over the
dataset), so it is jittable, checkpoints with orbax and a resumed run continues bitwise::

    sel = control.vade(num_prompts, num_samples=8)
    state = sel.init()
    plan, state = sel.select(state, key, batch_size)       # plan.indices [B], plan.budget [B]
    state = sel.update(state, plan, rewards_BxN, mask_BxN, **extra)

`select` returns a `Plan`: dataset indices `int32[B]` and a rollout budget `int32[B]` (at most
the selector's `num_samples`; shapes stay static, so a smaller budget is carried as a sample
mask: samples `j >= budget[b]` of prompt b do not count). `update` receives the rewards of
the plan's rollouts `[B, N]` and their mask (False: not generated, not kept, or padding) and
any extra statistics by keyword (`entropy_BxN`, `lengths_BxN` ...); every `update` accepts
and ignores extras it does not use.

Group filters (dynamic sampling, Sol-RL's subset) are plain functions of a batch's rewards.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Plan:
  """Which prompts a step rolls out and how many rollouts each gets.

  Attributes:
    indices: int32 [B], dataset indices.
    budget: int32 [B], rollouts per prompt (<= num_samples); samples past it are masked.
  """
  indices: jax.Array
  budget: jax.Array

  def sample_mask(self, num_samples: int) -> jax.Array:
    """bool [B, N]: True for the samples within each prompt's budget.

    >>> Plan(jnp.array([4, 2]), jnp.array([3, 1])).sample_mask(3).tolist()
    [[True, True, True], [True, False, False]]
    """
    return jnp.arange(num_samples)[None, :] < self.budget[:, None]


class PromptSelector(NamedTuple):
  """A prompt selector: three pure functions over a per-prompt state pytree.

  Attributes:
    init: `() -> state`.
    select: `(state, key, batch_size) -> (Plan, state)`; `batch_size` is static.
    update: `(state, plan, rewards_BxN, mask_BxN, **extra) -> state`.
    refine: None, or `(state, plan, rewards_BxN, mask_BxN) -> (plan, state)`: a second phase
      in the same step. It reads the scored samples of the first (`plan`'s budgets) and
      returns the same prompts with budgets at least as large; the loop decodes the difference
      and the new samples join their prompts' groups (XRPO's phased allocation, Pilot-Commit's
      commit after its pilot). `update` then sees the refined plan.
  """
  init: Callable[[], Any]
  select: Callable[..., tuple[Plan, Any]]
  update: Callable[..., Any]
  refine: Callable[..., tuple[Plan, Any]] | None = None


def full_budget(indices: jax.Array, num_samples: int) -> Plan:
  """A plan that gives every selected prompt `num_samples` rollouts."""
  indices = jnp.asarray(indices, jnp.int32)
  return Plan(indices=indices, budget=jnp.full(indices.shape, num_samples, jnp.int32))


def check_batch_size(batch_size: int, num_prompts: int) -> None:
  if not 1 <= int(batch_size) <= int(num_prompts):
    raise ValueError(f"Cannot select {batch_size} prompts from a dataset of {num_prompts} "
                     "(need 1 <= batch size <= number of prompts).")
