"""Entropy bonus and DAPO's overlong reward shaping."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rollouts_jax.losses.aggregation import aggregate

Array = jax.Array


def entropy_from_logits(logits: Array) -> Array:
  """Token entropy H = -sum_v p_v log p_v, p = softmax(logits), over the last axis.

  Args:
    logits: float[..., V].

  Returns:
    float[...] entropies in nats.

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(entropy_from_logits(jnp.zeros(4))), 4)
    1.3863
  """
  logits = jnp.asarray(logits)
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  # -sum p log p with log_softmax: logsumexp(z) - sum p z cancels badly at low entropy.
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def entropy_bonus(entropy: Array, mask: Array, agg: str = "token-mean",
                  max_len: Optional[int] = None) -> Array:
  """Aggregated token entropy; subtract `coef * entropy_bonus(...)` from the loss.

  The exploration bonus of PPO (Schulman et al., 2017, arXiv 1707.06347), aggregated like
  the policy loss so both share a scale.

  Args:
    entropy: float[S, T] per-token entropy (e.g. `entropy_from_logits`).
    mask: bool[S, T].
    agg: aggregation mode of `aggregate`.
    max_len: the constant of "seq-mean-token-sum-norm".

  Returns:
    A scalar (larger = more entropy).

  Example:
    >>> import jax.numpy as jnp
    >>> float(entropy_bonus(jnp.array([[1., 3.]]), jnp.array([[True, False]])))
    1.0
  """
  return aggregate(entropy, mask, agg, max_len)


def overlong_penalty(lengths: Array, max_len: int, cache_len: int) -> Array:
  """DAPO soft overlong punishment, added to the task reward.

  DAPO (Yu et al., 2025, arXiv 2503.14476), with L = max_len and C = cache_len:
  0 for |y| <= L - C; ((L - C) - |y|) / C for L - C < |y| <= L (linear from 0 to -1);
  -1 for |y| > L. The paper uses L = 20480, C = 4096.

  Args:
    lengths: int or float array of response lengths (any shape, e.g. [B, N]).
    max_len: L > 0 (static).
    cache_len: C with 0 < C <= L (static).

  Returns:
    float32 penalties of the shape of `lengths`, in [-1, 0].

  Example:
    >>> import jax.numpy as jnp
    >>> overlong_penalty(jnp.array([10, 16, 18, 20, 21]), max_len=20, cache_len=4).tolist()
    [0.0, 0.0, -0.5, -1.0, -1.0]
  """
  if not max_len > 0:
    raise ValueError(f"overlong_penalty: max_len must be > 0, got {max_len}.")
  if not 0 < cache_len <= max_len:
    raise ValueError(f"overlong_penalty: need 0 < cache_len <= max_len, got cache_len="
                     f"{cache_len}, max_len={max_len}.")
  lengths = jnp.asarray(lengths).astype(jnp.float32)
  soft_start = max_len - cache_len
  ramp = (soft_start - lengths) / cache_len
  return jnp.where(lengths <= soft_start, 0.0, jnp.where(lengths <= max_len, ramp, -1.0))
