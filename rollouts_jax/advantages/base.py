"""Core types of the advantage transforms: `(init, update)` pairs, `chain` and `apply`.

An advantage transform maps per-sample values `[B, N]` (B prompts, N samples each) to new
values of the same shape, together with a loss mask `[B, N]`. It is built like an optax
gradient transformation: a factory closes over the hyperparameters and returns a NamedTuple
of two pure functions,

    state = t.init()
    values_BxN, mask_BxN, state = t.update(values_BxN, state, *, mask=mask_BxN, **extra)

`update` receives the values produced by the previous transform in a chain (the first one
receives rewards), a boolean mask (True = the sample carries gradient; default all True) and
extra keyword inputs (cluster ids, sequence log-probs, reference rewards ...). Every `update`
accepts and ignores extras it does not use, so transforms compose with `chain`.

Two extras are set by `chain` and `apply` when the caller does not give them:

* `group_mask` -- the mask the chain started with. Group statistics (mean, std, median ...)
  are computed over `group_mask` rather than over the running loss mask, so a sample that an
  earlier transform excluded from the loss (the MC-GRPO median pivot) still counts in the
  statistics of later transforms: statistics are taken on the full group *before* filtering.
* `rewards` -- the raw rewards the chain started with, used to decide which samples are
  correct (`uniqueness_reweight`, `novelty_sharpen`).

Every transform returns exactly zero where its output mask is False.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


class EmptyState(NamedTuple):
  """State of a stateless transform."""


class AdvantageTransform(NamedTuple):
  """A pair of pure functions `(init, update)`, as in optax.

  Attributes:
    init: `() -> state`.
    update: `(values_BxN, state, *, mask=None, **extra) -> (values_BxN, mask_BxN, state)`.
  """
  init: Callable[[], Any]
  update: Callable[..., Tuple[Array, Array, Any]]


class ChainState(NamedTuple):
  """States of the inner transforms of a `chain`, in order."""
  inner: Tuple[Any, ...]


def as_values(values: Any, name: str = "values") -> Array:
  """Returns `values` as a floating array of rank 2, or raises ValueError."""
  values = jnp.asarray(values)
  if values.ndim != 2:
    raise ValueError(f"{name} must have shape [B, N] (rank 2), got shape {values.shape}.")
  if not jnp.issubdtype(values.dtype, jnp.floating):
    values = values.astype(jnp.float32)
  return values


def as_mask(mask: Any, shape: Tuple[int, ...], name: str = "mask") -> Array:
  """Returns `mask` as a bool array of `shape` (all True when None), or raises ValueError."""
  if mask is None:
    return jnp.ones(shape, dtype=bool)
  mask = jnp.asarray(mask)
  if mask.shape != tuple(shape):
    raise ValueError(f"{name} must have the shape of the values {tuple(shape)}, got {mask.shape}.")
  return mask.astype(bool)


def prepare(values: Any, mask: Any, group_mask: Any) -> Tuple[Array, Array, Array]:
  """Validates the common inputs of `update`; returns `(values, mask, stats_mask)`.

  `stats_mask` is `group_mask` when given (see the module docstring), else `mask`.
  """
  values = as_values(values)
  mask = as_mask(mask, values.shape)
  stats_mask = mask if group_mask is None else as_mask(group_mask, values.shape, "group_mask")
  return values, mask, stats_mask


def finish(values: Array, mask: Array) -> Array:
  """Zeroes the values of samples that carry no gradient."""
  return jnp.where(mask, values, jnp.zeros_like(values))


def stateless(update_fn: Callable[..., Tuple[Array, Array]]) -> AdvantageTransform:
  """Builds a stateless transform from `update_fn(values, *, mask, **extra) -> (values, mask)`."""

  def init():
    return EmptyState()

  def update(values, state, *, mask=None, **extra):
    new_values, new_mask = update_fn(values, mask=mask, **extra)
    return new_values, new_mask, state

  return AdvantageTransform(init, update)


def chain(*transforms: AdvantageTransform) -> AdvantageTransform:
  """Applies transforms one after the other, like `optax.chain`.

  Each transform receives the values and the mask that the previous one returned, and the
  same extra keyword inputs. `chain` adds two extras when the caller leaves them out:
  `group_mask` (the mask it received, so that statistics use the full group) and `rewards`
  (the values it received).

  Args:
    *transforms: `AdvantageTransform`s, applied left to right.

  Returns:
    An `AdvantageTransform` whose state is a `ChainState` of the inner states.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.chain(advantages.group_mean_baseline(), advantages.scale_by_group_std(ddof=0))
    >>> values, mask, state = t.update(jnp.array([[0., 1.]]), t.init())
    >>> values.round(3).tolist()
    [[-1.0, 1.0]]
  """
  for t in transforms:
    if not isinstance(t, AdvantageTransform):
      raise ValueError(f"chain expects AdvantageTransform arguments, got {type(t).__name__}.")

  def init():
    return ChainState(tuple(t.init() for t in transforms))

  def update(values, state, *, mask=None, **extra):
    values = as_values(values)
    mask = as_mask(mask, values.shape)
    if not isinstance(state, ChainState) or len(state.inner) != len(transforms):
      raise ValueError("chain.update received a state that chain.init did not make.")
    extra.setdefault("group_mask", mask)
    extra.setdefault("rewards", values)
    new_states = []
    for t, s in zip(transforms, state.inner):
      values, mask, s = t.update(values, s, mask=mask, **extra)
      new_states.append(s)
    return values, mask, ChainState(tuple(new_states))

  return AdvantageTransform(init, update)


def apply(transform: AdvantageTransform, rewards: Any, /, *, mask: Optional[Any] = None,
          **extra) -> Tuple[Array, Array]:
  """One-shot helper: `init`, one `update` on `rewards`, and drop the state.

  Args:
    transform: an `AdvantageTransform` (a recipe such as `grpo()` or a `chain`).
    rewards: float[B, N] rewards, B prompts with N samples each.
    mask: optional bool[B, N]; False marks samples that do not exist or carry no gradient.
    **extra: extra inputs by keyword (`cluster_ids`, `seq_logprobs`, `ref_rewards` ...).

  Returns:
    `(advantages, mask)`: float[B, N] advantages (zero where the mask is False) and the
    bool[B, N] loss mask (an MC-GRPO pivot turns its entry False).

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, mask = advantages.apply(advantages.dr_grpo(), jnp.array([[1., 0., 0., 1.]]))
    >>> adv.tolist(), mask.tolist()
    ([[0.5, -0.5, -0.5, 0.5]], [[True, True, True, True]])
  """
  if not isinstance(transform, AdvantageTransform):
    raise ValueError(f"apply expects an AdvantageTransform, got {type(transform).__name__}.")
  rewards = as_values(rewards, "rewards")
  mask = as_mask(mask, rewards.shape)
  extra.setdefault("group_mask", mask)
  extra.setdefault("rewards", rewards)
  values, mask, _ = transform.update(rewards, transform.init(), mask=mask, **extra)
  return values, mask
