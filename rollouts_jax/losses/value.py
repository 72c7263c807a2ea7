"""PPO's clipped value loss (the critic's objective with `rl.advantage="gae"`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def value_loss(vpreds: jax.Array, returns: jax.Array, old_values: jax.Array, mask: jax.Array,
               cliprange_value: float = 0.5) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`0.5 * token-mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))` over `mask`.

  The clipped value loss of PPO's reference implementation (as verl's `compute_value_loss` with
  loss_agg_mode="token-mean" and TRL's): a prediction moved more than `cliprange_value` from the
  value it had before the update is held by the pessimistic (larger) of the two errors.

  Args:
    vpreds: float[S, T], the critic's current values.
    returns: float[S, T], the targets (GAE returns, computed before the update; no gradient).
    old_values: float[S, T], the values before the update (no gradient).
    mask: bool[S, T], the tokens in the loss.
    cliprange_value: c.

  Returns:
    (loss, {"vf_clipfrac": the share of tokens where the clipped error is the larger}); 0 without tokens.

  >>> loss, m = value_loss(jnp.array([[2.0, 0.0]]), jnp.array([[0.0, 1.0]]), jnp.array([[0.0, 0.0]]),
  ...                      jnp.array([[True, True]]))
  >>> float(loss), float(m["vf_clipfrac"])   # token 0: max(4, 0.25); token 1: max(1, 1)
  (1.25, 0.0)
  """
  vpreds = vpreds.astype(jnp.float32)
  returns = jax.lax.stop_gradient(returns.astype(jnp.float32))
  old_values = jax.lax.stop_gradient(old_values.astype(jnp.float32))
  clipped = jnp.clip(vpreds, old_values - cliprange_value, old_values + cliprange_value)
  loss1 = (vpreds - returns) ** 2
  loss2 = (clipped - returns) ** 2
  count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  loss = 0.5 * jnp.sum(jnp.where(mask, jnp.maximum(loss1, loss2), 0.0)) / count
  clipfrac = jnp.sum(mask & (loss2 > loss1)).astype(jnp.float32) / count
  return loss, {"vf_clipfrac": clipfrac}
