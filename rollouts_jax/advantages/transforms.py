"""Advantage transforms over per-sample values `[B, N]` (B prompts, N samples each).

Each factory returns an `AdvantageTransform` (see `base.py`). Group statistics are masked:
they use only the samples of a prompt where the statistics mask (`group_mask`, else `mask`)
is True, and every output is exactly zero where the returned loss mask is False.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rollouts_jax.advantages import base

Array = jax.Array

_SCALES = ("none", "mad", "std")


# ----------------------------------------------------------------------------- statistics

def _count(mask_BxN: Array, dtype) -> Array:
  return jnp.sum(mask_BxN, axis=-1, keepdims=True).astype(dtype)


def group_mean(values_BxN: Array, mask_BxN: Array) -> Array:
  """Masked mean per group, shape [B, 1]; 0 for a group with no valid sample.

  Computed as `shift + mean(v - shift)` with `shift` the group maximum, so the mean of a
  group of equal values is that value exactly and its deviations are exactly 0 (a plain
  sum / n can be off by an ulp, which std scaling would then blow up).
  """
  n = _count(mask_BxN, values_BxN.dtype)
  shift = jnp.max(jnp.where(mask_BxN, values_BxN, -jnp.inf), axis=-1, keepdims=True)
  shift = jnp.where(n > 0, shift, 0)
  total = jnp.sum(jnp.where(mask_BxN, values_BxN - shift, 0), axis=-1, keepdims=True)
  return shift + total / jnp.maximum(n, 1)


def group_weighted_mean(values_BxN: Array, mask_BxN: Array, weights_BxN: Array) -> Array:
  """Masked weighted mean per group, `sum w v / sum w`, shape [B, 1].

  Shifted by the group maximum as `group_mean` is, so a group of equal values has exactly
  that value as its mean. A group whose valid weights sum to 0 (or with no valid sample)
  gets the unweighted `group_mean`.
  """
  w = jnp.where(mask_BxN, weights_BxN, 0).astype(values_BxN.dtype)
  w_sum = jnp.sum(w, axis=-1, keepdims=True)
  n = _count(mask_BxN, values_BxN.dtype)
  shift = jnp.max(jnp.where(mask_BxN, values_BxN, -jnp.inf), axis=-1, keepdims=True)
  shift = jnp.where(n > 0, shift, 0)
  total = jnp.sum(jnp.where(mask_BxN, w * (values_BxN - shift), 0), axis=-1, keepdims=True)
  weighted = shift + total / jnp.where(w_sum > 0, w_sum, 1)
  return jnp.where(w_sum > 0, weighted, group_mean(values_BxN, mask_BxN))


def _lengths(lengths: Optional[Array], shape, who: str) -> Array:
  """The `lengths` extra as a float32 [B, N] array, or a ValueError naming `who`."""
  if lengths is None:
    raise ValueError(f"{who} needs `lengths=` (int[B, N] completion lengths in tokens); the training "
                     "update passes them from the batch's completion mask.")
  lengths = jnp.asarray(lengths)
  if lengths.shape != tuple(shape):
    raise ValueError(f"{who}: lengths must have shape {tuple(shape)}, got {lengths.shape}.")
  return lengths.astype(jnp.float32)


def _safe_sqrt(x: Array) -> Array:
  # sqrt(0) has an infinite derivative; keep gradients finite if anyone differentiates.
  positive = x > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), 0)


def group_std(values_BxN: Array, mask_BxN: Array, ddof: int = 0) -> Array:
  """Masked standard deviation per group, shape [B, 1]; 0 when a group has <= ddof samples."""
  n = _count(mask_BxN, values_BxN.dtype)
  dev = jnp.where(mask_BxN, values_BxN - group_mean(values_BxN, mask_BxN), 0)
  var = jnp.sum(dev * dev, axis=-1, keepdims=True) / jnp.maximum(n - ddof, 1)
  return jnp.where(n > ddof, _safe_sqrt(var), 0)


def _sorted_position(values_BxN: Array, mask_BxN: Array):
  """Stable order with invalid samples last; returns (order, sorted values, valid count)."""
  keyed = jnp.where(mask_BxN, values_BxN, jnp.inf)
  order = jnp.argsort(keyed, axis=-1, stable=True)
  sorted_vals = jnp.take_along_axis(keyed, order, axis=-1)
  n = jnp.sum(mask_BxN, axis=-1, keepdims=True)
  return order, sorted_vals, n


def group_median(values_BxN: Array, mask_BxN: Array):
  """Masked lower median per group (torch.median's convention for even counts).

  Returns:
    `(median_Bx1, pivot_Bx1)`: the median value (0 for an empty group) and the index of the
    one sample at rank (n-1)//2 of a stable sort of the n valid samples. Ties are ordered by
    index, so the choice is deterministic and exactly one sample is picked.
  """
  order, sorted_vals, n = _sorted_position(values_BxN, mask_BxN)
  k = jnp.maximum((n - 1) // 2, 0)
  med = jnp.take_along_axis(sorted_vals, k, axis=-1)
  med = jnp.where(n > 0, med, 0).astype(values_BxN.dtype)
  pivot = jnp.take_along_axis(order, k, axis=-1)
  return med, pivot


# ----------------------------------------------------------------------------- baselines

_SINGLE = ("zero", "raw")


def _check_single(single_sample: str, who: str) -> None:
  if single_sample not in _SINGLE:
    raise ValueError(f"{who}: single_sample must be one of {_SINGLE}, got {single_sample!r}.")


def _single_sample_baseline(baseline: Array, stats: Array, single_sample: str) -> Array:
  """`baseline` [B, 1], with 0 for groups of one valid sample when `single_sample == "raw"`."""
  if single_sample == "zero":
    return baseline
  return jnp.where(jnp.sum(stats, axis=-1, keepdims=True) == 1, 0, baseline)


def group_mean_baseline(single_sample: str = "zero") -> base.AdvantageTransform:
  """Subtracts the mean of each group: `A_i = r_i - mean_j r_j`.

  The baseline of GRPO (Shao et al., 2024, "DeepSeekMath", arXiv 2402.03300) and, alone,
  of Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).
  The mean is over the valid samples of the group (`group_mask`, else `mask`).

  Args:
    single_sample: a group with one valid sample. "zero": the sample is its own baseline, A = 0.
      "raw": it has no baseline, A = r (verl's convention: its group mean is taken as 0).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.group_mean_baseline(), jnp.array([[1., 0., 0., 0.]]))[0].tolist()
    [[0.75, -0.25, -0.25, -0.25]]
    >>> advantages.apply(advantages.group_mean_baseline("raw"), jnp.array([[3.], [0.]]))[0].tolist()
    [[3.0], [0.0]]
  """
  _check_single(single_sample, "group_mean_baseline")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    baseline = _single_sample_baseline(group_mean(values, stats), stats, single_sample)
    return base.finish(values - baseline, mask), mask

  return base.stateless(update)


def length_weighted_baseline(single_sample: str = "raw") -> base.AdvantageTransform:
  """OPO's baseline: the length-weighted group mean, `A_i = r_i - sum_j |o_j| r_j / sum_j |o_j|`.

  On-Policy RL with Optimal reward baseline (Hao et al., 2025, arXiv 2505.23585): for
  sequence-level rewards the variance-minimizing baseline weights each response by its
  gradient norm, which the paper approximates by its length |o_j| in tokens. With equal
  lengths it is the group mean (Dr. GRPO). The sums run over the valid samples of the group
  (`group_mask`, else `mask`); a group whose valid lengths sum to 0 falls back to the plain mean.

  Extra inputs (keyword):
    lengths: int[B, N] completion lengths in tokens (the training update passes them).

  Args:
    single_sample: a group with one valid sample. "raw" (default, as verl's
      `compute_opo_outcome_advantage`): no baseline, A = r. "zero": A = 0.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.length_weighted_baseline()
    >>> # b = (1 * 1 + 3 * 0) / 4 = 0.25
    >>> advantages.apply(t, jnp.array([[1., 0.]]), lengths=jnp.array([[1, 3]]))[0].tolist()
    [[0.75, -0.25]]
  """
  _check_single(single_sample, "length_weighted_baseline")

  def update(values, *, mask=None, group_mask=None, lengths=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    w = _lengths(lengths, values.shape, "length_weighted_baseline")
    baseline = _single_sample_baseline(group_weighted_mean(values, stats, w), stats, single_sample)
    return base.finish(values - baseline, mask), mask

  return base.stateless(update)


def leave_one_out_baseline() -> base.AdvantageTransform:
  """RLOO: subtracts the mean of the *other* samples, `A_i = r_i - mean_{j != i} r_j`.

  Kool et al., 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.,
  2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
  Feedback in LLMs" (arXiv 2402.14740). Equivalently `A_i = n/(n-1) * (r_i - mean r)` for a
  group with n valid samples; a group with a single sample gets A = 0.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.leave_one_out_baseline(), jnp.array([[2., 0., 1.]]))[0].tolist()
    [[1.5, -1.5, 0.0]]
  """

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    n = _count(stats, values.dtype)
    # r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean r); a sample outside the statistics mask
    # is not part of the mean, so its baseline is the plain mean.
    centered = values - group_mean(values, stats)
    factor = jnp.where(stats, n / jnp.maximum(n - 1, 1), 1)
    adv = jnp.where(stats & (n < 2), 0, centered * factor)
    return base.finish(adv, mask), mask

  return base.stateless(update)


def group_median_baseline(scale: str = "none", eps: float = 1e-6, exclude_pivot: bool = True,
                          mad_fallback: bool = True, ddof: int = 1,
                          compensate: bool = False, zero_atol: float = 1e-6
                          ) -> base.AdvantageTransform:
  """MC-GRPO: the group median is the baseline and the median sample is dropped from the loss.

  Median-Centered GRPO (arXiv 2601.22582): draw G+1 samples per prompt so the group size is
  odd; `A_i = (r_i - med) / s` with `med` the group median. Exactly one sample per group --
  the pivot, the one at rank (n-1)//2 of a stable sort (also under ties: one and only one;
  tied samples are ordered by index) -- has its mask set to False, so G samples carry gradient. For an even group the lower
  median is used (torch.median's convention); the pivot then still gets A = 0 and is still the
  only sample excluded, but other samples need not be symmetric around it.

  Scaling `s`:
    * "none": s = 1.
    * "std": s = group std (with `ddof`) + eps.
    * "mad": s = MAD + eps with MAD = median_j |r_j - med|. The reference code adds 1e-3 to the
      MAD; with binary rewards and an odd group more than half of the samples share the median
      value, so MAD = 0 and minority samples get |A| = 1000. Here, when `mad_fallback` is True
      (default), a group whose MAD is 0 (not above `eps`) is scaled by its std instead; for
      binary rewards with k minority samples out of n this gives |A| = n / sqrt(k (n-k)) <=
      n / sqrt(n-1) (about sqrt(n), the same order as GRPO), and an all-equal group stays at 0.
      `mad_fallback=False, eps=1e-3` reproduces the reference exactly.

  All statistics use the full group (`group_mask`, else `mask`) before the pivot is excluded.

  Args:
    scale: "none", "mad" or "std".
    eps: added to the scale; also the threshold under which a MAD counts as zero.
    exclude_pivot: set the pivot's mask to False (train mode); False for evaluation.
    mad_fallback: scale a zero-MAD group by its std (see above).
    ddof: delta degrees of freedom of the std (1: unbiased, as torch.std).
    compensate: the reference's zero-advantage compensation: multiply every advantage by
      n / max(1, #{|A| > zero_atol}) per group (n valid samples, pivot included).
    zero_atol: tolerance for "zero advantage" in the compensation.

  Returns:
    A stateless `AdvantageTransform`; its `update` returns the loss mask with the pivots off.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, mask = advantages.apply(advantages.group_median_baseline(), jnp.array([[0., 1., 3.]]))
    >>> adv.tolist(), mask.tolist()
    ([[-1.0, 0.0, 2.0]], [[True, False, True]])
  """
  if scale not in _SCALES:
    raise ValueError(f"group_median_baseline: scale must be one of {_SCALES}, got {scale!r}.")
  if eps < 0:
    raise ValueError(f"group_median_baseline: eps must be >= 0, got {eps}.")
  if ddof < 0:
    raise ValueError(f"group_median_baseline: ddof must be >= 0, got {ddof}.")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    med, pivot = group_median(values, stats)
    centered = jnp.where(stats, values - med, 0)
    if scale == "none":
      adv = centered
    elif scale == "std":
      adv = centered / (group_std(values, stats, ddof) + eps)
    else:
      mad, _ = group_median(jnp.abs(centered), stats)
      if mad_fallback:
        mad = jnp.where(mad > eps, mad, group_std(values, stats, ddof))
      adv = centered / (mad + eps)
    if compensate:
      n = _count(stats, values.dtype)
      nonzero = _count(stats & (jnp.abs(adv) > zero_atol), values.dtype)
      adv = adv * n / jnp.maximum(nonzero, 1)
    if exclude_pivot:
      n = jnp.sum(stats, axis=-1, keepdims=True)
      is_pivot = (jnp.arange(values.shape[-1]) == pivot) & (n > 0)
      mask = mask & ~is_pivot
    return base.finish(adv, mask), mask

  return base.stateless(update)


# ----------------------------------------------------------------------------- scaling

def scale_by_group_std(eps: float = 1e-4, ddof: int = 1) -> base.AdvantageTransform:
  """Divides by the group standard deviation: `A_i = v_i / (std_j v_j + eps)` (GRPO).

  Shao et al., 2024, "DeepSeekMath" (arXiv 2402.03300). The defaults follow TRL/verl
  (unbiased std, eps = 1e-4). A group with n <= ddof valid samples has std 0. Put a baseline
  in front: on centered values a zero-std group (all equal) stays exactly 0, never NaN.

  Args:
    eps: added to the std.
    ddof: delta degrees of freedom (1: unbiased, as torch.std; 0: population std).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.chain(advantages.group_mean_baseline(), advantages.scale_by_group_std(eps=0., ddof=0))
    >>> advantages.apply(t, jnp.array([[3., 1.]]))[0].tolist()
    [[1.0, -1.0]]
  """
  if eps < 0 or ddof < 0:
    raise ValueError(f"scale_by_group_std: eps and ddof must be >= 0, got eps={eps}, ddof={ddof}.")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    return base.finish(values / (group_std(values, stats, ddof) + eps), mask), mask

  return base.stateless(update)


def scale_by_batch_std(eps: float = 1e-4, ddof: int = 1) -> base.AdvantageTransform:
  """Divides by the standard deviation over all valid samples of the batch.

  Batch-level normalization as in REINFORCE++ (Hu, 2025, arXiv 2501.03262) and TRL's
  `scale_rewards="batch"`: after a group baseline the scale is shared by every prompt, so a
  prompt with a small spread is not amplified.

  Args:
    eps: added to the std.
    ddof: delta degrees of freedom.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.scale_by_batch_std(eps=0., ddof=0)
    >>> advantages.apply(t, jnp.array([[1., -1.], [1., -1.]]))[0].tolist()
    [[1.0, -1.0], [1.0, -1.0]]
  """
  if eps < 0 or ddof < 0:
    raise ValueError(f"scale_by_batch_std: eps and ddof must be >= 0, got eps={eps}, ddof={ddof}.")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    std = group_std(values.reshape(1, -1), stats.reshape(1, -1), ddof)
    return base.finish(values / (std + eps), mask), mask

  return base.stateless(update)


batch_std = scale_by_batch_std

_WEIGHTS = ("tokens", "samples")


def whiten_batch(eps: float = 1e-8, ddof: int = 1, weight: str = "tokens") -> base.AdvantageTransform:
  """Whitens over the whole batch: `A_i = (v_i - m) / sqrt(var + eps)` (REINFORCE++).

  REINFORCE++ (Hu, 2025, arXiv 2501.03262) normalizes advantages over the global batch
  instead of per prompt. With `weight="tokens"` every token of every valid sample counts once,
  as verl's `masked_whiten` over the response mask does for an outcome reward spread over a
  response's tokens (discount 1): sample i weighs its length L_i, the mean is
  `m = sum L_i v_i / sum L_i` and the variance `sum L_i (v_i - m)^2 / (sum L_i - ddof)`; with
  at most `ddof` tokens in the batch every A is 0 (verl raises). `weight="samples"` weighs every valid
  sample 1. The statistics use `group_mask` (else `mask`); a batch of equal values gives exactly 0.

  Extra inputs (keyword):
    lengths: int[B, N] completion lengths in tokens (needed with `weight="tokens"`).

  Args:
    eps: added to the variance under the square root (verl: 1e-8).
    ddof: delta degrees of freedom (1: Bessel's correction over the tokens, as verl).
    weight: "tokens" or "samples".

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.whiten_batch(eps=0., ddof=0, weight="samples")
    >>> advantages.apply(t, jnp.array([[3., 1.], [1., 3.]]))[0].tolist()
    [[1.0, -1.0], [-1.0, 1.0]]
  """
  if eps < 0 or ddof < 0:
    raise ValueError(f"whiten_batch: eps and ddof must be >= 0, got eps={eps}, ddof={ddof}.")
  if weight not in _WEIGHTS:
    raise ValueError(f"whiten_batch: weight must be one of {_WEIGHTS}, got {weight!r}.")

  def update(values, *, mask=None, group_mask=None, lengths=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    if weight == "tokens":
      w = _lengths(lengths, values.shape, "whiten_batch(weight='tokens')")
    else:
      w = jnp.ones(values.shape, jnp.float32)
    w = jnp.where(stats, w, 0).astype(values.dtype).reshape(1, -1)
    flat, flat_stats = values.reshape(1, -1), stats.reshape(1, -1)
    mean = group_weighted_mean(flat, flat_stats, w)
    dev = jnp.where(flat_stats, flat - mean, 0)
    total = jnp.sum(w)
    var = jnp.sum(w * dev * dev) / jnp.maximum(total - ddof, 1)
    # At most `ddof` tokens: no spread to measure (verl raises); the advantages are 0.
    adv = jnp.where(total > ddof, (values - mean) * jax.lax.rsqrt(var + eps), 0)
    return base.finish(adv, mask), mask

  return base.stateless(update)


_GPG_COUNTS = ("nonzero_reward", "mixed_group")


def gpg_scale(count: str = "nonzero_reward", f_norm: float = 1.0) -> base.AdvantageTransform:
  """GPG's gradient correction: multiplies by `alpha = B / M` and divides by `f_norm`.

  GPG (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
  Reasoning", arXiv 2504.02546): samples of a group whose rewards are all equal carry no
  gradient but still count in the batch mean, which shrinks the gradient; scaling by B over
  the number M of samples that carry signal undoes that. B is the number of valid samples of
  the batch (`group_mask`, else `mask`) and M (at least 1):

  * "nonzero_reward": the valid samples whose raw reward is not 0, as verl's
    `compute_gpg_outcome_advantage` counts them (`torch.count_nonzero(scores)`); with 0/1
    rewards, the correct samples.
  * "mixed_group": the valid samples of groups whose valid rewards are not all equal, as the
    paper defines M (its reference code counts groups of equal size, the same ratio).

  Extra inputs (keyword):
    rewards: the raw rewards (passed by `chain` / `apply`).

  Args:
    count: "nonzero_reward" or "mixed_group".
    f_norm: a constant divisor (verl's `f_norm`, 1 by default).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.gpg_scale()   # 4 samples, 2 with a non-zero reward: alpha = 2
    >>> advantages.apply(t, jnp.array([[0.5, -0.5], [0., 0.]]), rewards=jnp.array([[1., 0.], [1., 0.]]))[0].tolist()
    [[1.0, -1.0], [0.0, 0.0]]
  """
  if count not in _GPG_COUNTS:
    raise ValueError(f"gpg_scale: count must be one of {_GPG_COUNTS}, got {count!r}.")
  if not f_norm > 0:
    raise ValueError(f"gpg_scale: f_norm must be > 0, got {f_norm}.")

  def update(values, *, mask=None, group_mask=None, rewards=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    r = values if rewards is None else base.as_values(rewards, "rewards")
    if r.shape != values.shape:
      raise ValueError(f"gpg_scale: rewards shape {r.shape} != values shape {values.shape}.")
    total = jnp.sum(stats).astype(values.dtype)
    if count == "nonzero_reward":
      counted = stats & (r != 0)
    else:
      hi = jnp.max(jnp.where(stats, r, -jnp.inf), axis=-1, keepdims=True)
      lo = jnp.min(jnp.where(stats, r, jnp.inf), axis=-1, keepdims=True)
      counted = stats & (hi > lo)
    alpha = total / jnp.maximum(jnp.sum(counted), 1).astype(values.dtype)
    return base.finish(values * alpha / f_norm, mask), mask

  return base.stateless(update)


def best_of_group(eps: float = 1e-6, norm_by_std: bool = True) -> base.AdvantageTransform:
  """Pass@k credit: only the best sample of a group gets `(r_max - r_second) / (std + eps)`.

  The pass@k objective of Tang et al., 2025 ("Optimizing Language Models for Inference Time
  Objectives using Reinforcement Learning", arXiv 2503.19595), in the form of verl's
  `compute_grpo_passk_outcome_advantage`: the value of the group is its best reward, and the
  best sample's marginal contribution is its margin over the runner-up; every other sample
  gets 0. `std` is the unbiased std of the group's valid rewards (dropped with
  `norm_by_std=False`). Ties for the best give a margin of 0 (which of the tied samples holds
  it does not matter). A group with fewer than 2 valid samples gets 0 (verl raises).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.best_of_group(norm_by_std=False)
    >>> advantages.apply(t, jnp.array([[0.2, 1., 0.5], [1., 1., 0.]]))[0].tolist()
    [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
  """
  if eps < 0:
    raise ValueError(f"best_of_group: eps must be >= 0, got {eps}.")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    n = values.shape[-1]
    if n < 2:
      return jnp.zeros_like(values), mask
    keyed = jnp.where(stats, values, -jnp.inf)
    top, idx = jax.lax.top_k(keyed, 2)   # ties: the lower index first
    margin = top[:, :1] - top[:, 1:]
    if norm_by_std:
      margin = margin / (group_std(values, stats, ddof=1) + eps)
    enough = jnp.sum(stats, axis=-1, keepdims=True) >= 2
    margin = jnp.where(enough, margin, 0)
    is_best = jnp.arange(n) == idx[:, :1]
    return base.finish(jnp.where(is_best, margin, 0), mask), mask

  return base.stateless(update)


def clip(max_abs: float) -> base.AdvantageTransform:
  """Clips the values to `[-max_abs, max_abs]`.

  Bounds the advantage of rare outcomes (e.g. a single correct sample in a large group), as
  advantage clipping in PPO implementations (Schulman et al., 2017, arXiv 1707.06347).

  Args:
    max_abs: positive bound.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.clip(1.), jnp.array([[-3., 0.5, 2.]]))[0].tolist()
    [[-1.0, 0.5, 1.0]]
  """
  if not max_abs > 0:
    raise ValueError(f"clip: max_abs must be > 0, got {max_abs}.")

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, _ = base.prepare(values, mask, group_mask)
    return base.finish(jnp.clip(values, -max_abs, max_abs), mask), mask

  return base.stateless(update)


# ----------------------------------------------------------------------------- reweighting

def _correct(values: Array, rewards: Optional[Array], correct: Optional[Array],
             threshold: float, who: str) -> Array:
  if correct is not None:
    return base.as_mask(correct, values.shape, "correct")
  if rewards is None:
    raise ValueError(f"{who} needs `correct=` (bool[B, N]) or `rewards=` (float[B, N]); "
                     "chain and apply pass `rewards` automatically.")
  rewards = base.as_values(rewards, "rewards")
  if rewards.shape != values.shape:
    raise ValueError(f"{who}: rewards shape {rewards.shape} != values shape {values.shape}.")
  return rewards > threshold


def _cluster_sizes(ids_BxN: Array, counted_BxN: Array) -> Array:
  """For each sample, how many counted samples of its row share its id; O(N log N) per row."""

  def row(ids, counted):
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    cum = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counted[order].astype(jnp.int32))])
    left = jnp.searchsorted(sorted_ids, ids, side="left")
    right = jnp.searchsorted(sorted_ids, ids, side="right")
    return cum[right] - cum[left]

  return jax.vmap(row)(ids_BxN, counted_BxN)


def uniqueness_reweight(alpha: float = 0.5, count: str = "correct", renormalize: bool = True,
                        correct_threshold: float = 0.0) -> base.AdvantageTransform:
  """Rewards rare correct strategies: scales correct samples by `1 / |cluster|^alpha`.

  "Rewarding the Rare" (Hu et al., arXiv 2601.08763): samples of one prompt are clustered by
  high-level strategy (`cluster_ids`, e.g. from `clustering.cluster_by_judge`), and the
  advantage of a correct sample i is multiplied by `w_i = |C(i)|^-alpha`, so correct but rare
  strategies get more credit. Incorrect samples keep weight 1. With `renormalize` the weights
  of the correct samples of a group are divided by their mean, so their mean weight is 1 and
  the overall advantage scale of GRPO is kept. alpha = 0 recovers the input.

  The paper's alpha and whether clusters count all samples are not published; both are knobs.

  Extra inputs (keyword):
    cluster_ids: int[B, N]; samples of one prompt with the same id share a strategy. Ids are
      compared only within a prompt and may be any integers.
    correct: optional bool[B, N]; else `rewards > correct_threshold` (`rewards` is passed by
      `chain` / `apply`).

  Args:
    alpha: exponent >= 0 (0.5 and 1 are natural choices).
    count: "correct" -- |C(i)| counts the valid correct samples sharing i's id; "all" --
      every valid sample sharing it.
    renormalize: make the mean weight of the correct samples of each group 1.
    correct_threshold: a reward above it is correct.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.uniqueness_reweight(alpha=1.0, renormalize=False)
    >>> adv = jnp.array([[1., 1., 1., -1.]])
    >>> advantages.apply(t, adv, cluster_ids=jnp.array([[0, 0, 1, 2]]))[0].tolist()
    [[0.5, 0.5, 1.0, -1.0]]
  """
  if alpha < 0:
    raise ValueError(f"uniqueness_reweight: alpha must be >= 0, got {alpha}.")
  if count not in ("correct", "all"):
    raise ValueError(f"uniqueness_reweight: count must be 'correct' or 'all', got {count!r}.")

  def update(values, *, mask=None, group_mask=None, cluster_ids=None, rewards=None,
             correct=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    if cluster_ids is None:
      raise ValueError("uniqueness_reweight needs `cluster_ids=` (int[B, N]).")
    ids = jnp.asarray(cluster_ids)
    if ids.shape != values.shape:
      raise ValueError(f"cluster_ids must have shape {values.shape}, got {ids.shape}.")
    good = _correct(values, rewards, correct, correct_threshold, "uniqueness_reweight") & stats
    counted = good if count == "correct" else stats
    size = _cluster_sizes(ids, counted).astype(values.dtype)
    w = jnp.where(good, jnp.maximum(size, 1) ** (-alpha), 1)
    if renormalize:
      mean_w = group_mean(w, good)
      w = jnp.where(good, w / jnp.where(mean_w > 0, mean_w, 1), 1)
    return base.finish(values * w, mask), mask

  return base.stateless(update)


def novelty_sharpen(lam: float = 1.0, kappa: float = 0.5, correct_threshold: float = 0.0,
                    correct_only: bool = True) -> base.AdvantageTransform:
  """XRPO novelty sharpening: boosts correct samples that the policy found unlikely.

  XRPO (arXiv 2510.06672): with `s_i` the length-normalized log-likelihood of sample i
  (mean token log-prob) and `eta_i = exp(s_i - mean_j s_j)`,
  `A_i <- A_i + min(max(lam (1 - eta_i), 0), kappa |A_i|)`, applied to correct samples
  (`reward > correct_threshold`), as the paper describes; `correct_only=False` applies it to
  every sample as a third-party port does. The bonus is never negative and at most
  `kappa |A_i|`, so a zero advantage (an all-equal group) stays zero. lam and kappa are not
  given in what we could read of the paper; the defaults are our choice.

  Extra inputs (keyword):
    seq_logprobs: float[B, N] mean token log-prob of each sample under the rollout policy.
    correct / rewards: as in `uniqueness_reweight`.

  Args:
    lam: bonus strength.
    kappa: cap of the bonus relative to |A|.
    correct_threshold: a reward above it is correct.
    correct_only: gate the bonus on correctness.

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv = jnp.array([[1., 1., -2.]])
    >>> s = jnp.log(jnp.array([[0.5, 1., 1.]])) + 2.
    >>> t = advantages.novelty_sharpen(lam=1., kappa=1.)
    >>> out = advantages.apply(t, adv, seq_logprobs=s, rewards=jnp.array([[1., 1., 0.]]))[0]
    >>> bool(out[0, 0] > 1.) and bool(out[0, 1] == 1.)
    True
  """
  if lam < 0 or kappa < 0:
    raise ValueError(f"novelty_sharpen: lam and kappa must be >= 0, got {lam}, {kappa}.")

  def update(values, *, mask=None, group_mask=None, seq_logprobs=None, rewards=None,
             correct=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    if seq_logprobs is None:
      raise ValueError("novelty_sharpen needs `seq_logprobs=` (float[B, N]).")
    s = base.as_values(seq_logprobs, "seq_logprobs")
    if s.shape != values.shape:
      raise ValueError(f"seq_logprobs must have shape {values.shape}, got {s.shape}.")
    s = s.astype(values.dtype)
    # exp overflow would only make the bonus 0; cap the exponent to keep everything finite.
    eta = jnp.exp(jnp.minimum(s - group_mean(s, stats), 30.0))
    bonus = jnp.minimum(jnp.maximum(lam * (1 - eta), 0), kappa * jnp.abs(values))
    gate = stats
    if correct_only:
      gate = gate & _correct(values, rewards, correct, correct_threshold, "novelty_sharpen")
    return base.finish(values + jnp.where(gate, bonus, 0), mask), mask

  return base.stateless(update)


def reference_anchor() -> base.AdvantageTransform:
  """PVPO static-V anchor: `A_i = r_i - mean(r_ref)`, the baseline from reference rollouts.

  PVPO (arXiv 2508.21104): the baseline of a prompt is the mean reward of M rollouts of a
  fixed reference policy (computed ahead of time), not of the current group, so a group
  whose rewards are all equal still gets a gradient when it differs from the anchor. No std
  division (whether the paper divides is unverified); chain `scale_by_batch_std` if wanted
  (a per-group std would divide a uniform group's non-zero values by eps).

  Extra inputs (keyword):
    ref_rewards: float[B, M] reference rewards (M may differ from N) or float[B] means.
    ref_mask: optional bool[B, M]. A prompt with no valid reference reward falls back to the
      mean of its current group (GRPO's baseline).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.reference_anchor()
    >>> advantages.apply(t, jnp.array([[1., 1.]]), ref_rewards=jnp.array([[0., 1., 0., 0.]]))[0].tolist()
    [[0.75, 0.75]]
  """

  def update(values, *, mask=None, group_mask=None, ref_rewards=None, ref_mask=None, **extra):
    del extra
    values, mask, stats = base.prepare(values, mask, group_mask)
    if ref_rewards is None:
      raise ValueError("reference_anchor needs `ref_rewards=` (float[B, M] or float[B]).")
    ref = jnp.asarray(ref_rewards)
    if ref.ndim == 1:
      ref = ref[:, None]
    ref = base.as_values(ref, "ref_rewards").astype(values.dtype)
    if ref.shape[0] != values.shape[0]:
      raise ValueError(f"ref_rewards must have {values.shape[0]} rows, got shape {ref.shape}.")
    rmask = base.as_mask(ref_mask, ref.shape, "ref_mask")
    has_ref = jnp.any(rmask, axis=-1, keepdims=True)
    anchor = jnp.where(has_ref, group_mean(ref, rmask), group_mean(values, stats))
    return base.finish(values - anchor, mask), mask

  return base.stateless(update)


def per_source(inner: base.AdvantageTransform, num_sources: int = 2) -> base.AdvantageTransform:
  """Applies a stateless `inner` transform separately to each rollout source of a group.

  ERILS (external rollouts mixed into groups, METHODS 9.7): on-policy rollouts and a stronger
  policy's rollouts are normalized apart, `A_i = (r_i - mean_src) / (std_src + eps)` over the
  samples of the same (prompt, source); normalizing them jointly collapses training. A
  source with one sample or equal rewards gets 0. Needs `source_ids` (int [B, N], 0 =
  on-policy, 1.. = external sources).

  Args:
    inner: a stateless transform (e.g. `grpo()`); its `group_mask` is the source's samples.
    num_sources: how many source ids there may be (static).

  Returns:
    A stateless `AdvantageTransform`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> t = advantages.per_source(advantages.dr_grpo())
    >>> r, s = jnp.array([[1., 0., 1., 1.]]), jnp.array([[0, 0, 1, 1]])
    >>> advantages.apply(t, r, source_ids=s)[0].tolist()
    [[0.5, -0.5, 0.0, 0.0]]
  """

  def update(values, *, mask=None, group_mask=None, source_ids=None, **extra):
    if source_ids is None:
      raise ValueError("per_source needs source_ids [B, N] (which policy produced each sample).")
    values, mask, _ = base.prepare(values, mask, group_mask)
    source_ids = jnp.asarray(source_ids)
    out = jnp.zeros_like(values)
    out_mask = jnp.zeros_like(mask)
    for s in range(num_sources):
      sel = mask & (source_ids == s)
      adv, m, _ = inner.update(values, inner.init(), mask=sel, group_mask=sel, **extra)
      out = jnp.where(source_ids == s, adv, out)
      out_mask = jnp.where(source_ids == s, m, out_mask)
    return base.finish(out, out_mask), out_mask

  return base.stateless(update)
