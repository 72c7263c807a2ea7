"""Clipped policy-gradient objectives: PPO-clip (DAPO), GSPO and CISPO."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rollouts_jax.losses.aggregation import aggregate, check_agg, masked_mean

Array = jax.Array

KINDS = ("ppo_clip", "gspo", "cispo")
TIS_MODES = ("truncate", "mask")

# exp() of a log-ratio beyond this overflows float32 or says the sample is useless anyway.
_MAX_LOG_RATIO = 20.0


def _check_static(name: str, value, positive: bool = False) -> None:
  if isinstance(value, (int, float)) and (value < 0 or (positive and value <= 0)):
    raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}.")


def policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array,
                kind: str = "ppo_clip", clip_low: float = 0.2, clip_high: Optional[float] = None,
                agg: str = "token-mean", *, dual_clip: Optional[float] = None,
                max_len: Optional[int] = None, rollout_logprobs: Optional[Array] = None,
                tis_cap: Optional[float] = None, tis_mode: str = "truncate") -> Tuple[Array, Dict[str, Array]]:
  """Clipped surrogate policy loss (to minimize) and its metrics.

  With ratio r_t = exp(logprobs_t - old_logprobs_t) and advantage A:

  * "ppo_clip": -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per token (Schulman et al.,
    2017, arXiv 1707.06347). `dual_clip=c` (c > 1) also bounds the loss of a negative
    advantage by -c A (Ye et al., 2020, arXiv 1912.09729). DAPO (Yu et al., 2025,
    arXiv 2503.14476) is this with clip_low=0.2, clip_high=0.28, agg="token-mean".
  * "gspo": the same clipped form on the sequence ratio s_i = exp(mean_t log r_it) over the
    valid tokens of sequence i (GSPO, Zheng et al., 2025, arXiv 2507.18071). It is written
    as GSPO-token, s_it = sg[s_i] r_it / sg[r_it]: the value is s_i on every token, per-token
    advantages are allowed, and with per-sequence advantages the gradient equals GSPO's for
    every aggregation mode. The paper uses "seq-mean-token-mean" and tiny clip ranges
    (3e-4, 4e-4).
  * "cispo": -sg[clip(r, 1 - clip_low, 1 + clip_high)] A log pi_t (MiniMax-M1, arXiv
    2506.13585): the importance weight is clipped, never the gradient. It is written as
    -sg[w] A (1 + logprobs - sg[logprobs]) so the value is the clipped surrogate -w A and the
    gradient is the paper's.

  Truncated importance sampling (Yao et al., 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"): when `rollout_logprobs` (the sampler's log-probs) are
  given, every token loss is multiplied by the stop-gradient weight
  min(exp(old_logprobs - rollout_logprobs), tis_cap) (no cap when tis_cap is None). With
  `tis_mode="mask"` a token whose weight exceeds the cap gets weight 0 instead, and stays in
  the denominator (AReaL's decoupled PPO, `behav_imp_weight_cap`, arXiv 2505.24298: there
  `old_logprobs` is the proximal policy and `rollout_logprobs` the behaviour policy).

  Log-ratios are clamped to [-20, 20] before exp; masked tokens never reach exp, so junk in
  padding cannot turn into NaN gradients.

  Args:
    logprobs: float[S, T] log-probs of the sampled tokens under the current policy (S = B*N
      sequences, T tokens).
    old_logprobs: float[S, T] under the policy that the advantages refer to (no gradient).
    advantages: float[S] per sequence or float[S, T] per token.
    mask: bool[S, T]; False for padding, prompt and excluded sequences.
    kind: "ppo_clip", "gspo" or "cispo" (static).
    clip_low: epsilon_low >= 0.
    clip_high: epsilon_high >= 0; default clip_low.
    agg: aggregation mode of `aggregate` (static).
    dual_clip: constant c > 1 of dual-clip PPO ("ppo_clip" and "gspo"), or None.
    max_len: the constant of "seq-mean-token-sum-norm"; default T.
    rollout_logprobs: optional float[S, T] log-probs from the sampler.
    tis_cap: cap of the truncated importance weight.
    tis_mode: "truncate" (min(w, cap)) or "mask" (0 where w > cap) (static).

  Returns:
    `(loss, metrics)`: a float32 scalar and a dict of float32 scalars over valid tokens:
    clip_frac_low, clip_frac_high (fraction of tokens where the lower / upper clip changes the
    objective: r < 1 - clip_low with A < 0, r > 1 + clip_high with A > 0; for cispo the clip of
    the weight regardless of A), approx_kl (k3 estimate of KL(old || current)), ratio_mean,
    ratio_max, ratio_min (the ratio the objective uses: per sequence for gspo; 1 when there is
    no valid token), and dual_clip_frac, tis_weight_mean, tis_clip_frac when those are on.

  Example:
    >>> import jax.numpy as jnp
    >>> lp = jnp.log(jnp.array([[0.5, 0.5]]))
    >>> loss, m = policy_loss(lp, lp, jnp.array([1.]), jnp.array([[True, True]]),
    ...                       kind="ppo_clip", clip_low=0.2, clip_high=0.28, agg="token-mean")
    >>> float(loss), float(m["clip_frac_high"])
    (-1.0, 0.0)
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  check_agg(agg)
  if clip_high is None:
    clip_high = clip_low
  _check_static("clip_low", clip_low)
  _check_static("clip_high", clip_high)
  if dual_clip is not None:
    if kind == "cispo":
      raise ValueError("dual_clip applies to 'ppo_clip' and 'gspo', not 'cispo'.")
    if isinstance(dual_clip, (int, float)) and dual_clip <= 1:
      raise ValueError(f"dual_clip must be > 1, got {dual_clip}.")
  if tis_cap is not None:
    _check_static("tis_cap", tis_cap, positive=True)
  if tis_mode not in TIS_MODES:
    raise ValueError(f"tis_mode must be one of {TIS_MODES}, got {tis_mode!r}.")

  logprobs = jnp.asarray(logprobs)
  old_logprobs = jnp.asarray(old_logprobs)
  mask = jnp.asarray(mask)
  if logprobs.ndim != 2:
    raise ValueError(f"logprobs must have shape [S, T], got {logprobs.shape}.")
  if old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
    raise ValueError(f"logprobs {logprobs.shape}, old_logprobs {old_logprobs.shape} and mask "
                     f"{mask.shape} must have the same shape [S, T].")
  adv = jnp.asarray(advantages, jnp.float32)
  if adv.shape == logprobs.shape[:1]:
    adv = adv[:, None]
  elif adv.shape != logprobs.shape:
    raise ValueError(f"advantages must have shape [S]={logprobs.shape[:1]} or [S, T]="
                     f"{logprobs.shape}, got {adv.shape}.")
  adv = jnp.broadcast_to(jax.lax.stop_gradient(adv), logprobs.shape)
  mask = mask.astype(bool)

  lp = logprobs.astype(jnp.float32)
  old = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
  token_log_ratio = jnp.clip(jnp.where(mask, lp - old, 0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  metrics: Dict[str, Array] = {}

  if kind == "gspo":
    lengths = jnp.sum(mask, axis=-1, keepdims=True)
    seq_log_ratio = jnp.sum(token_log_ratio, axis=-1, keepdims=True) / jnp.maximum(lengths, 1)
    lp_safe = jnp.where(mask, lp, 0)
    log_ratio = (jax.lax.stop_gradient(seq_log_ratio) + lp_safe
                 - jax.lax.stop_gradient(lp_safe))
  else:
    log_ratio = token_log_ratio
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - clip_low, 1.0 + clip_high

  if kind == "cispo":
    weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))
    lp_safe = jnp.where(mask, lp, 0)
    token_loss = -adv * weight * (1.0 + lp_safe - jax.lax.stop_gradient(lp_safe))
    clipped_low = ratio < low
    clipped_high = ratio > high
  else:
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, low, high)
    token_loss = jnp.maximum(unclipped, clipped)
    clipped_low = (ratio < low) & (adv < 0)
    clipped_high = (ratio > high) & (adv > 0)
    if dual_clip is not None:
      bound = -adv * dual_clip
      dual_active = (adv < 0) & (bound < token_loss)
      token_loss = jnp.where(adv < 0, jnp.minimum(token_loss, bound), token_loss)
      metrics["dual_clip_frac"] = masked_mean(dual_active, mask)

  if rollout_logprobs is not None:
    rollout = jnp.asarray(rollout_logprobs)
    if rollout.shape != logprobs.shape:
      raise ValueError(f"rollout_logprobs must have shape {logprobs.shape}, got {rollout.shape}.")
    tis_log = jnp.clip(jnp.where(mask, old - rollout.astype(jnp.float32), 0),
                       -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    tis_w = jnp.exp(tis_log)
    if tis_cap is not None:
      metrics["tis_clip_frac"] = masked_mean(tis_w > tis_cap, mask)
      tis_w = jnp.minimum(tis_w, tis_cap) if tis_mode == "truncate" else jnp.where(tis_w > tis_cap, 0.0, tis_w)
    tis_w = jax.lax.stop_gradient(tis_w)
    metrics["tis_weight_mean"] = masked_mean(tis_w, mask)
    token_loss = token_loss * tis_w

  loss = aggregate(token_loss, mask, agg, max_len)

  any_valid = jnp.any(mask)
  r = jax.lax.stop_gradient(ratio)
  tr = jax.lax.stop_gradient(token_log_ratio)
  metrics.update(
      clip_frac_low=masked_mean(clipped_low, mask),
      clip_frac_high=masked_mean(clipped_high, mask),
      approx_kl=masked_mean(jnp.expm1(tr) - tr, mask),
      ratio_mean=jnp.where(any_valid, masked_mean(r, mask), 1.0),
      ratio_max=jnp.where(any_valid, jnp.max(jnp.where(mask, r, -jnp.inf)), 1.0),
      ratio_min=jnp.where(any_valid, jnp.min(jnp.where(mask, r, jnp.inf)), 1.0),
  )
  metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
  return loss, metrics
