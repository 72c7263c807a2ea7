"""Policy-gradient objectives: PPO-clip (DAPO), GSPO, CISPO, SAPO, Clip-Cov and KL-Cov."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rollouts_jax.losses.aggregation import aggregate, check_agg, masked_mean

Array = jax.Array

KINDS = ("ppo_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov")
TIS_MODES = ("truncate", "mask")

#: The settings of each kind beyond the clip range (`rl.loss_kwargs`), with their defaults
#: (verl's: `actor.tau_pos` / `tau_neg` and `actor.policy_loss.*`).
KIND_KWARGS = {
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "clip_cov": {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1},
}

# exp() of a log-ratio beyond this overflows float32 or says the sample is useless anyway.
_MAX_LOG_RATIO = 20.0


def _check_static(name: str, value, positive: bool = False) -> None:
  if isinstance(value, (int, float)) and (value < 0 or (positive and value <= 0)):
    raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}.")


def check_kind_kwargs(kind: str, kwargs: Dict[str, Any], key: str = "kind_kwargs") -> Dict[str, float]:
  """`kwargs` checked against `kind`'s settings (`KIND_KWARGS`), merged over the defaults.

  Raises a ValueError naming `key` for an unknown kind, a setting the kind does not have, or
  an out-of-range value, so a config fails before anything compiles.

  >>> check_kind_kwargs("sapo", {"tau_neg": 2.0})
  {'tau_pos': 1.0, 'tau_neg': 2.0}
  >>> check_kind_kwargs("ppo_clip", {"tau_pos": 1.0}, key="rl.loss_kwargs")
  Traceback (most recent call last):
  ...
  ValueError: Config key rl.loss_kwargs: loss kind 'ppo_clip' takes no settings tau_pos (its settings: none).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  known = KIND_KWARGS.get(kind, {})
  unknown = sorted(set(kwargs) - set(known))
  if unknown:
    raise ValueError(f"Config key {key}: loss kind {kind!r} takes no settings {', '.join(unknown)} (its settings: "
                     f"{', '.join(known) or 'none'}).")
  out = dict(known)
  for name, value in kwargs.items():
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"Config key {key}: {name} must be a number, got {value!r}.")
    out[name] = float(value)
  for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio"):
    if name in out and not out[name] > 0:
      raise ValueError(f"Config key {key}: {name} must be > 0, got {out[name]}.")
  for name in ("clip_cov_ratio", "kl_cov_ratio"):
    if name in out and out[name] > 1:
      raise ValueError(f"Config key {key}: {name} is a fraction of the tokens, in (0, 1]; got {out[name]}.")
  if "ppo_kl_coef" in out and out["ppo_kl_coef"] < 0:
    raise ValueError(f"Config key {key}: ppo_kl_coef must be >= 0, got {out['ppo_kl_coef']}.")
  if kind == "clip_cov" and not out["clip_cov_lb"] < out["clip_cov_ub"]:
    raise ValueError(f"Config key {key}: clip_cov_lb must be < clip_cov_ub, got {out['clip_cov_lb']} and "
                     f"{out['clip_cov_ub']}.")
  return out


def _masked_centered(x: Array, mask: Array) -> Array:
  return x - masked_mean(x, mask)


def _top_fraction(score: Array, eligible: Array, count: Array) -> Array:
  """The `count` eligible entries of highest `score` (ties: the lower flat index first)."""
  flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
  order = jnp.argsort(-flat, stable=True)
  rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
  return eligible & (rank.reshape(score.shape) < count)


def _token_count(ratio: float, n_valid: Array) -> Array:
  """max(floor(ratio * n_valid), 1), as verl's `max(int(ratio * n), 1)` (float32 nudged up by 1e-6
  relative so that an exact product such as 2e-4 * 10000 is not floored to 1)."""
  n = n_valid.astype(jnp.float32)
  return jnp.maximum(jnp.floor(ratio * n * (1 + 1e-6)), 1).astype(jnp.int32)


def policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array,
                kind: str = "ppo_clip", clip_low: float = 0.2, clip_high: Optional[float] = None,
                agg: str = "token-mean", *, dual_clip: Optional[float] = None,
                max_len: Optional[int] = None, rollout_logprobs: Optional[Array] = None,
                tis_cap: Optional[float] = None, tis_mode: str = "truncate",
                kind_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[Array, Dict[str, Array]]:
  """Clipped (or gated) surrogate policy loss (to minimize) and its metrics.

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
  * "sapo": SAPO's soft gate in place of a hard clip (Gao et al., 2025, "Soft Adaptive Policy
    Optimization", arXiv 2511.20347; verl's `compute_policy_loss_sapo`): the surrogate is
    f(r) A with f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos where A > 0 and tau_neg
    elsewhere. Its gradient weight f'(r) r = 4 s (1 - s) r, s = sigmoid(tau (r - 1)), is 1 at
    r = 1 and decays smoothly off policy. The token loss is -A (f(r) - 2 / tau + 1): the
    gradient is SAPO's exactly, and the constant shift makes the value -A on policy, as for every
    kind here (verl's value is -f(r) A, ours minus (1 - 2 / tau)(-A)). verl always aggregates
    SAPO by "seq-mean-token-mean"; here `agg` decides (set it to that for verl's loss). The clip
    metrics are 0.
  * "clip_cov": ppo_clip, and among the valid tokens it does not clip, the
    max(floor(clip_cov_ratio * n), 1) tokens (n: valid tokens) of largest covariance
    (A - mean A)(logprobs - mean logprobs) strictly inside (clip_cov_lb, clip_cov_ub) get no
    gradient (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617: their gradient is detached). verl's
    `compute_policy_loss_clip_cov` multiplies their loss by 0, so the gradient is the same; the
    value here keeps their (constant) surrogate, so it is ppo_clip's value. verl draws those
    tokens at random among the candidates; here the choice is deterministic (highest covariance
    first), the same set whenever there are at most that many candidates.
  * "kl_cov": the unclipped -r A on every token, plus ppo_kl_coef |logprobs - old_logprobs| on
    the max(floor(kl_cov_ratio * n), 1) valid tokens of largest covariance (same paper; verl's
    `compute_policy_loss_kl_cov`). Ties in the covariance: the lower flat index first.

  The covariance statistics of clip_cov / kl_cov are over the valid tokens of this call (a
  micro-batch in the training update, as in verl).

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
    kind: one of `KINDS` (static).
    clip_low: epsilon_low >= 0.
    clip_high: epsilon_high >= 0; default clip_low.
    agg: aggregation mode of `aggregate` (static).
    dual_clip: constant c > 1 of dual-clip PPO ("ppo_clip" and "gspo"), or None.
    max_len: the constant of "seq-mean-token-sum-norm"; default T.
    rollout_logprobs: optional float[S, T] log-probs from the sampler.
    tis_cap: cap of the truncated importance weight.
    tis_mode: "truncate" (min(w, cap)) or "mask" (0 where w > cap) (static).
    kind_kwargs: the kind's settings (`KIND_KWARGS`: tau_pos / tau_neg for sapo, clip_cov_ratio /
      clip_cov_lb / clip_cov_ub for clip_cov, kl_cov_ratio / ppo_kl_coef for kl_cov); missing
      ones take verl's defaults.

  Returns:
    `(loss, metrics)`: a float32 scalar and a dict of float32 scalars over valid tokens:
    clip_frac_low, clip_frac_high (fraction of tokens where the lower / upper clip changes the
    objective: r < 1 - clip_low with A < 0, r > 1 + clip_high with A > 0; for cispo the clip of
    the weight regardless of A), approx_kl (k3 estimate of KL(old || current)), ratio_mean,
    ratio_max, ratio_min (the ratio the objective uses: per sequence for gspo; 1 when there is
    no valid token), and dual_clip_frac, tis_weight_mean, tis_clip_frac when those are on;
    cov_frac (the fraction of valid tokens that clip_cov detaches / kl_cov penalizes) for those kinds.

  Example:
    >>> import jax.numpy as jnp
    >>> lp = jnp.log(jnp.array([[0.5, 0.5]]))
    >>> loss, m = policy_loss(lp, lp, jnp.array([1.]), jnp.array([[True, True]]),
    ...                       kind="ppo_clip", clip_low=0.2, clip_high=0.28, agg="token-mean")
    >>> float(loss), float(m["clip_frac_high"])
    (-1.0, 0.0)
  """
  settings = check_kind_kwargs(kind, dict(kind_kwargs or {}))
  check_agg(agg)
  if clip_high is None:
    clip_high = clip_low
  _check_static("clip_low", clip_low)
  _check_static("clip_high", clip_high)
  if dual_clip is not None:
    if kind not in ("ppo_clip", "gspo"):
      raise ValueError(f"dual_clip applies to 'ppo_clip' and 'gspo', not {kind!r}.")
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
  elif kind == "sapo":
    tau = jnp.where(adv > 0, settings["tau_pos"], settings["tau_neg"])
    # f(r) - f(1) + 1: SAPO's gate shifted by a constant, so the value is -A on policy.
    token_loss = -adv * (jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) - 2.0 / tau + 1.0)
    clipped_low = clipped_high = jnp.zeros(mask.shape, bool)
  elif kind == "kl_cov":
    lp_sg = jax.lax.stop_gradient(lp)
    cov = _masked_centered(adv, mask) * _masked_centered(lp_sg, mask)
    chosen = _top_fraction(cov, mask, _token_count(settings["kl_cov_ratio"], jnp.sum(mask)))
    token_loss = -adv * ratio + jnp.where(chosen, settings["ppo_kl_coef"] * jnp.abs(log_ratio), 0.0)
    clipped_low = clipped_high = jnp.zeros(mask.shape, bool)
    metrics["cov_frac"] = masked_mean(chosen, mask)
  else:
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, low, high)
    token_loss = jnp.maximum(unclipped, clipped)
    clipped_low = (ratio < low) & (adv < 0)
    clipped_high = (ratio > high) & (adv > 0)
    if kind == "clip_cov":
      lp_sg = jax.lax.stop_gradient(lp)
      cov = _masked_centered(adv, mask) * _masked_centered(lp_sg, mask)
      candidate = (mask & ~(clipped > unclipped) & (cov > settings["clip_cov_lb"])
                   & (cov < settings["clip_cov_ub"]))
      chosen = _top_fraction(cov, candidate, _token_count(settings["clip_cov_ratio"], jnp.sum(mask)))
      token_loss = jnp.where(chosen, jax.lax.stop_gradient(token_loss), token_loss)
      metrics["cov_frac"] = masked_mean(chosen, mask)
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
