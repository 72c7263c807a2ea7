"""Generalized advantage estimation over completion tokens, with a learned value function.

Schulman, Moritz, Levine, Jordan and Abbeel, 2016, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation" (arXiv 1506.02438):

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),    A_t = sum_l (gamma lam)^l delta_{t+l}.

Conventions follow verl's `compute_gae_advantage_return` (0.9.1): positions where the mask is
False (padding, a multi-turn row's observation tokens) are skipped, so the next value and the
running advantage jump over them; returns are `A + V` before whitening; the advantages are then
whitened over the valid tokens of the whole batch (mean 0, unbiased variance 1).

Used by `rl.advantage="gae"`: the update places each sample's outcome reward on its last loss
token (`outcome_token_rewards`) and takes the values from the critic (`models.value`) before
the update.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class GAESettings(NamedTuple):
  """`rl.advantage_kwargs` of `rl.advantage="gae"` (verl's defaults)."""
  gamma: float = 1.0
  lam: float = 0.95

  def check(self) -> "GAESettings":
    for name in ("gamma", "lam"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return GAESettings(float(self.gamma), float(self.lam))


def gae(token_rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Array, Array]:
  """Raw GAE advantages and returns per token, skipping masked positions (no whitening).

  Args:
    token_rewards: float[R, T], the reward of each token (an outcome reward on the last one).
    values: float[R, T], V(s_t): the value before token t.
    mask: bool[R, T], the tokens that take part (False: padding, observation tokens).
    gamma: discount.
    lam: GAE's lambda.

  Returns:
    (advantages, returns) float32 [R, T]; returns = advantages + values. At a masked position
    the advantage is that of the next valid token (0 after the last), as in verl.

  >>> a, r = gae(jnp.array([[0., 0., 1.]]), jnp.array([[0.5, 0.5, 0.5]]), jnp.ones((1, 3), bool), lam=1.0)
  >>> a.tolist(), r.tolist()
  ([[0.5, 0.5, 0.5]], [[1.0, 1.0, 1.0]])
  """
  rewards_TxR = jnp.asarray(token_rewards, jnp.float32).T
  values_TxR = jnp.asarray(values, jnp.float32).T
  mask_TxR = jnp.asarray(mask, bool).T

  def step(carry, xs):
    next_value, last_gae = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    candidate = delta + gamma * lam * last_gae
    next_value = jnp.where(m, v, next_value)
    last_gae = jnp.where(m, candidate, last_gae)
    return (next_value, last_gae), last_gae

  zeros = jnp.zeros(rewards_TxR.shape[1], jnp.float32)
  _, adv_TxR = jax.lax.scan(step, (zeros, zeros), (rewards_TxR, values_TxR, mask_TxR), reverse=True)
  adv = adv_TxR.T
  return adv, adv + jnp.asarray(values, jnp.float32)


def masked_whiten(x: Array, mask: Array, eps: float = 1e-8) -> Array:
  """`(x - mean) / sqrt(var + eps)` with the mean and unbiased variance over `mask` (verl's `masked_whiten`).

  With fewer than two valid entries the variance is taken as 0 (verl raises there).

  >>> [round(float(v), 4) for v in masked_whiten(jnp.array([1., 3., 100.]), jnp.array([True, True, False]))]
  [-0.7071, 0.7071, 69.2965]
  """
  x = jnp.asarray(x, jnp.float32)
  m = jnp.asarray(mask, jnp.float32)
  n = jnp.sum(m)
  mean = jnp.sum(jnp.where(m > 0, x, 0.0)) / (n + 1e-8)
  var = jnp.sum(jnp.where(m > 0, (x - mean) ** 2, 0.0)) / (n + 1e-8)
  var = jnp.where(n > 1, var * n / jnp.maximum(n - 1, 1), 0.0)
  return (x - mean) * jax.lax.rsqrt(var + eps)


def gae_advantages(token_rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0, lam: float = 0.95,
                   whiten: bool = True) -> tuple[Array, Array]:
  """verl's `compute_gae_advantage_return`: `gae`, then the advantages whitened over `mask`.

  Args:
    token_rewards, values, mask: float[R, T], float[R, T], bool[R, T] (see `gae`).
    gamma: discount.
    lam: GAE's lambda.
    whiten: whiten the advantages over the valid tokens of the whole batch.

  Returns:
    (advantages, returns) float32 [R, T]; returns are unwhitened advantages plus values.

  >>> a, r = gae_advantages(jnp.array([[0., 1.], [0., 0.]]), jnp.zeros((2, 2)), jnp.ones((2, 2), bool), lam=1.0)
  >>> [round(float(v), 4) for v in a.ravel()], r.tolist()
  ([0.866, 0.866, -0.866, -0.866], [[1.0, 1.0], [0.0, 0.0]])
  """
  adv, returns = gae(token_rewards, values, mask, gamma=gamma, lam=lam)
  if whiten:
    adv = masked_whiten(adv, mask)
  return adv, returns


def outcome_token_rewards(rewards_R: Array, mask_RxT: Array) -> Array:
  """Each row's reward on its last True position of `mask_RxT`, 0 elsewhere (and on all-False rows).

  >>> outcome_token_rewards(jnp.array([2., 3.]), jnp.array([[1, 0, 1, 0], [0, 0, 0, 0]], bool)).tolist()
  [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
  """
  mask = jnp.asarray(mask_RxT, bool)
  T = mask.shape[1]
  last = T - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  at_last = (jnp.arange(T)[None] == last[:, None]) & jnp.any(mask, axis=1, keepdims=True)
  return jnp.where(at_last, jnp.asarray(rewards_R, jnp.float32)[:, None], 0.0)
