"""ECHO's confidence-adaptive clipping: a per-response PPO clip range from its confidence.

eps_i = eps_lo + (eps_hi - eps_lo) c_i, with c_i the response's confidence min-max normalised
within its group, so low-confidence responses get a tighter trust region (ECHO, arXiv
2602.02150; the paper names the idea, the exact form is ours). With eps_lo == eps_hi it is the
plain symmetric PPO clip.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rollouts_jax.losses.policy import policy_loss

Array = jax.Array


def confidence_clip_ranges(normalized_confidence_S: Array, eps_lo: float = 0.1, eps_hi: float = 0.28) -> Array:
  """eps_i = eps_lo + (eps_hi - eps_lo) c_i for c_i in [0, 1].

  >>> confidence_clip_ranges(jnp.array([0., 0.5, 1.])).tolist()
  [0.10000000149011612, 0.1899999976158142, 0.2800000011920929]
  """
  c = jnp.clip(jnp.asarray(normalized_confidence_S, jnp.float32), 0.0, 1.0)
  return eps_lo + (eps_hi - eps_lo) * c


def echo_policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array,
                     normalized_confidence: Array, eps_lo: float = 0.1, eps_hi: float = 0.28,
                     agg: str = "token-mean", **kwargs) -> Tuple[Array, Dict[str, Array]]:
  """PPO-clip with a per-response symmetric clip range eps_i (ECHO's adaptive clipping).

  Args:
    logprobs, old_logprobs: float [S, T] (S = B*N responses).
    advantages: float [S] or [S, T].
    mask: bool [S, T].
    normalized_confidence: float [S] in [0, 1], e.g. `advantages.tree.normalized_confidence`
      of the responses' mean token confidence, flattened.
    eps_lo, eps_hi: the clip range of the least and of the most confident response.
    agg: aggregation mode of `losses.aggregate`.
    **kwargs: passed to `losses.policy_loss` (dual_clip, rollout_logprobs, tis_cap ...).

  Returns:
    `(loss, metrics)` as `losses.policy_loss`, plus `clip_eps_mean`.

  Example:
    >>> lp = jnp.zeros((2, 3)); m = jnp.ones((2, 3), bool)
    >>> loss, _ = echo_policy_loss(lp + 0.5, lp, jnp.array([1., 1.]), m, jnp.array([0., 1.]))
    >>> round(float(loss), 4)  # ratios e^0.5 clipped at 1.1 and 1.28
    -1.19
  """
  eps = confidence_clip_ranges(normalized_confidence, eps_lo, eps_hi)[:, None]
  loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, kind="ppo_clip", clip_low=eps,
                              clip_high=eps, agg=agg, **kwargs)
  metrics = dict(metrics, clip_eps_mean=jnp.mean(eps))
  return loss, metrics
