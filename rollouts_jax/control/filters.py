"""Group filters: pure functions that decide which rollout groups of a batch are trained on."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def informative(rewards_BxN: jax.Array, mask_BxN: jax.Array | None = None) -> jax.Array:
  """bool [B]: groups whose (unmasked) rewards are not all equal, i.e. carry a GRPO signal.

  >>> informative(jnp.array([[1., 1.], [0., 1.]])).tolist()
  [False, True]
  """
  r = jnp.asarray(rewards_BxN, jnp.float32)
  m = jnp.ones(r.shape, bool) if mask_BxN is None else jnp.asarray(mask_BxN, bool)
  hi = jnp.max(jnp.where(m, r, -jnp.inf), axis=1)
  lo = jnp.min(jnp.where(m, r, jnp.inf), axis=1)
  return (hi > lo) & (jnp.sum(m, axis=1) > 1)


def dynamic_sampling(rewards_BxN: jax.Array, target: int, mask_BxN: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """DAPO's dynamic sampling as a group filter: keep `target` groups, informative ones first.

  Groups whose rewards are all equal give zero GRPO advantage and no gradient. This keeps
  the informative groups in their original order and, when fewer than `target` exist, pads
  with uninformative ones whose group mask is False (static shapes; they carry no loss). The
  caller decides whether to refill (generate more groups) before calling it.

  Args:
    rewards_BxN: float [B, N] rewards of B >= target groups.
    target: groups to keep.
    mask_BxN: optional bool [B, N] of valid samples.

  Returns:
    (keep int32 [target] indices into the B groups, group_mask bool [target]).

  Paper: DAPO (Yu et al., 2025, arXiv 2503.14476), "dynamic sampling".

  >>> keep, ok = dynamic_sampling(jnp.array([[1., 1.], [0., 1.], [1., 0.]]), 2)
  >>> keep.tolist(), ok.tolist()
  ([1, 2], [True, True])
  >>> keep, ok = dynamic_sampling(jnp.array([[1., 1.], [0., 1.], [0., 0.]]), 2)
  >>> keep.tolist(), ok.tolist()
  ([1, 0], [True, False])
  """
  B = rewards_BxN.shape[0]
  if not 1 <= target <= B:
    raise ValueError(f"dynamic_sampling needs 1 <= target <= B; got target={target}, B={B}.")
  info = informative(rewards_BxN, mask_BxN)
  order = jnp.argsort(~info, stable=True)[:target]
  return order.astype(jnp.int32), info[order]
