"""Per-token KL estimators between the policy and a reference policy."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rollouts_jax.losses.aggregation import aggregate

Array = jax.Array

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Array, ref_logprobs: Array, kind: str = "k3",
               mask: Optional[Array] = None, agg: Optional[str] = None,
               max_len: Optional[int] = None, clamp: Optional[float] = None) -> Array:
  """Estimates KL(pi || pi_ref) from tokens sampled from pi.

  With d = ref_logprobs - logprobs (Schulman, 2020, "Approximating KL Divergence"):
  "k1" = -d (unbiased, high variance, can be negative), "k2" = d^2 / 2 (biased, low
  variance), "k3" = exp(d) - d - 1 (unbiased, always >= 0; the GRPO penalty of DeepSeekMath,
  arXiv 2402.03300).

  Args:
    logprobs: float[S, T] log-probs of the sampled tokens under the policy.
    ref_logprobs: float[S, T] under the reference policy (treated as a constant).
    kind: "k1", "k2" or "k3".
    mask: optional bool[S, T]; masked tokens get 0 (and never reach exp).
    agg: None to return the per-token values, else an aggregation mode of `aggregate`.
    max_len: the constant of "seq-mean-token-sum-norm".
    clamp: optional bound on |d| before the estimator (verl clamps k3 for stability).

  Returns:
    float[S, T] per-token estimates, or a scalar when `agg` is given.

  Example:
    >>> import jax.numpy as jnp
    >>> lp = jnp.array([[0., -1.]])
    >>> kl_penalty(lp, lp, kind="k3").tolist()
    [[0.0, 0.0]]
  """
  if kind not in KL_KINDS:
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}.")
  logprobs = jnp.asarray(logprobs)
  ref_logprobs = jnp.asarray(ref_logprobs)
  if logprobs.shape != ref_logprobs.shape:
    raise ValueError(f"logprobs {logprobs.shape} and ref_logprobs {ref_logprobs.shape} differ.")
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
    if mask.shape != logprobs.shape:
      raise ValueError(f"mask {mask.shape} must have the shape of logprobs {logprobs.shape}.")
  dtype = jnp.promote_types(logprobs.dtype, jnp.float32)
  d = jax.lax.stop_gradient(ref_logprobs.astype(dtype)) - logprobs.astype(dtype)
  if mask is not None:
    d = jnp.where(mask, d, 0)
  if clamp is not None:
    d = jnp.clip(d, -clamp, clamp)
  if kind == "k1":
    kl = -d
  elif kind == "k2":
    kl = 0.5 * d * d
  else:
    kl = jnp.expm1(d) - d
  if agg is None:
    return kl
  if mask is None:
    mask = jnp.ones(kl.shape, bool)
  return aggregate(kl, mask, agg, max_len)
