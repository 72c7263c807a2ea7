"""Named advantage recipes: chains of the transforms in `transforms.py`."""
from __future__ import annotations

from rollouts_jax.advantages import base
from rollouts_jax.advantages import transforms as T
from rollouts_jax.advantages.token_gae import GAESettings


def grpo(eps: float = 1e-4, ddof: int = 1) -> base.AdvantageTransform:
  """GRPO: `A_i = (r_i - mean r) / (std r + eps)` per group.

  Shao et al., 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models" (arXiv 2402.03300). Defaults follow TRL/verl: unbiased std, eps = 1e-4.

  Args:
    eps: added to the group std.
    ddof: delta degrees of freedom of the std.

  Returns:
    `chain(group_mean_baseline(), scale_by_group_std(eps, ddof))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.grpo(eps=0., ddof=0), jnp.array([[1., 0.]]))
    >>> adv.tolist()
    [[1.0, -1.0]]
  """
  return base.chain(T.group_mean_baseline(), T.scale_by_group_std(eps=eps, ddof=ddof))


def dr_grpo() -> base.AdvantageTransform:
  """Dr. GRPO: `A_i = r_i - mean r`, no std division.

  Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (arXiv 2503.20783). Pair it with `losses.policy_loss(..., agg="seq-mean-token-sum-norm")`
  to also drop the per-sequence length normalization.

  Returns:
    `chain(group_mean_baseline())`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.dr_grpo(), jnp.array([[1., 0., 0., 0.]]))[0].tolist()
    [[0.75, -0.25, -0.25, -0.25]]
  """
  return base.chain(T.group_mean_baseline())


def rloo() -> base.AdvantageTransform:
  """RLOO: leave-one-out baseline, `A_i = r_i - mean_{j != i} r_j`.

  Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs" (arXiv 2402.14740); Kool et al., 2019.

  Returns:
    `chain(leave_one_out_baseline())`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.rloo(), jnp.array([[2., 0., 1.]]))[0].tolist()
    [[1.5, -1.5, 0.0]]
  """
  return base.chain(T.leave_one_out_baseline())


def mc_grpo(scale: str = "mad", eps: float = 1e-6, mad_fallback: bool = True,
            compensate: bool = False, exclude_pivot: bool = True) -> base.AdvantageTransform:
  """MC-GRPO: median baseline, MAD scaling, one pivot sample per group out of the loss.

  Median-Centered GRPO (arXiv 2601.22582): sample G+1 completions per prompt (odd N); see
  `group_median_baseline` for the scaling guard that keeps binary rewards from producing
  |A| = 1000 (`mad_fallback=False, eps=1e-3, compensate=True` reproduces the reference code).

  Args:
    scale: "mad" (paper), "std" or "none".
    eps: added to the scale.
    mad_fallback: scale a zero-MAD group by its std.
    compensate: the reference's zero-advantage compensation.
    exclude_pivot: drop the pivot from the loss (train mode).

  Returns:
    `chain(group_median_baseline(...))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, mask = advantages.apply(advantages.mc_grpo(), jnp.array([[1., 1., 0.]]))
    >>> mask.tolist()
    [[False, True, True]]
  """
  return base.chain(T.group_median_baseline(scale=scale, eps=eps, mad_fallback=mad_fallback,
                                            compensate=compensate, exclude_pivot=exclude_pivot))


def uniqueness_grpo(alpha: float = 0.5, eps: float = 1e-4, ddof: int = 1,
                    count: str = "correct", renormalize: bool = True
                    ) -> base.AdvantageTransform:
  """Uniqueness-aware GRPO: GRPO advantages, correct samples scaled by `|cluster|^-alpha`.

  "Rewarding the Rare" (Hu et al., arXiv 2601.08763). Needs `cluster_ids=` (int[B, N]) as an
  extra input, e.g. from `clustering.cluster_by_judge`.

  Args:
    alpha: rarity exponent (0 gives GRPO).
    eps, ddof: of the GRPO std.
    count, renormalize: see `uniqueness_reweight`.

  Returns:
    `chain(group_mean_baseline(), scale_by_group_std(eps, ddof), uniqueness_reweight(...))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> r = jnp.array([[1., 1., 1., 0.]])
    >>> adv, _ = advantages.apply(advantages.uniqueness_grpo(alpha=1.), r,
    ...                           cluster_ids=jnp.array([[0, 0, 1, 2]]))
    >>> bool(adv[0, 2] > adv[0, 0] > 0)
    True
  """
  return base.chain(T.group_mean_baseline(), T.scale_by_group_std(eps=eps, ddof=ddof),
                    T.uniqueness_reweight(alpha=alpha, count=count, renormalize=renormalize))


def xrpo(lam: float = 1.0, kappa: float = 0.5, eps: float = 1e-4, ddof: int = 1,
         correct_only: bool = True) -> base.AdvantageTransform:
  """XRPO's advantages: GRPO, then novelty sharpening of low-likelihood correct samples.

  XRPO (arXiv 2510.06672). Needs `seq_logprobs=` (float[B, N], mean token log-prob of each
  sample under the rollout policy); the training loop supplies it from the behaviour log-probs.

  Args:
    lam, kappa, correct_only: see `novelty_sharpen`.
    eps, ddof: of the GRPO std.

  Returns:
    `chain(group_mean_baseline(), scale_by_group_std(eps, ddof), novelty_sharpen(...))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> r = jnp.array([[1., 1., 0., 0.]])
    >>> s = jnp.array([[-3., -0.1, -1., -1.]])  # sample 0: correct but unlikely
    >>> adv, _ = advantages.apply(advantages.xrpo(), r, seq_logprobs=s)
    >>> bool(adv[0, 0] > adv[0, 1] > 0)
    True
  """
  return base.chain(T.group_mean_baseline(), T.scale_by_group_std(eps=eps, ddof=ddof),
                    T.novelty_sharpen(lam=lam, kappa=kappa, correct_only=correct_only))


def pvpo(scale: str = "none", eps: float = 1e-4) -> base.AdvantageTransform:
  """PVPO: the baseline is the mean reward of reference-policy rollouts of the prompt (static V).

  PVPO (arXiv 2508.21104). Needs `ref_rewards=` (float[B, M]) and optionally `ref_mask=`;
  the training loop supplies them from `reward.ref_samples` rollouts of the initial policy.

  Args:
    scale: "none" (the third-party port) or "batch_std" (divide by the batch std).
    eps: added to the batch std.

  Returns:
    `chain(reference_anchor())`, or with `scale_by_batch_std(eps)` after it.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.pvpo(), jnp.array([[1., 1.]]),
    ...                           ref_rewards=jnp.array([[0., 1., 0., 0.]]))
    >>> adv.tolist()   # an all-equal group still gets a gradient
    [[0.75, 0.75]]
  """
  if scale not in ("none", "batch_std"):
    raise ValueError(f"pvpo: scale must be 'none' or 'batch_std', got {scale!r}.")
  parts = [T.reference_anchor()]
  if scale == "batch_std":
    parts.append(T.scale_by_batch_std(eps=eps))
  return base.chain(*parts)


def erils(eps: float = 1e-4, ddof: int = 1) -> base.AdvantageTransform:
  """ERILS: GRPO normalized apart per rollout source (on-policy vs external rollouts).

  Groups mix the policy's rollouts with a stronger external policy's (METHODS 9.7, ERILS);
  each (prompt, source) is normalized on its own, since joint normalization collapses
  training. Reads `source_ids` [B, N] from the batch (0: on-policy, 1: external).

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.erils(eps=0., ddof=0), jnp.array([[0., 1., 1., 0.]]),
    ...                           source_ids=jnp.array([[0, 0, 1, 1]]))
    >>> adv.tolist()
    [[-1.0, 1.0, 1.0, -1.0]]
  """
  return T.per_source(grpo(eps=eps, ddof=ddof), num_sources=2)


def reinforce_pp(eps: float = 1e-8, weight: str = "tokens") -> base.AdvantageTransform:
  """REINFORCE++ for outcome rewards: the reward whitened over the whole batch, no group baseline.

  Hu, 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward
  Models" (arXiv 2501.03262): `A_i = (r_i - mean) / sqrt(var + eps)` with the mean and the
  (Bessel-corrected) variance over every token of every valid sample of the batch, as verl's
  `compute_reinforce_plus_plus_outcome_advantage` computes them for an outcome reward with
  discount 1. The per-token KL-in-reward returns of the paper are not part of this recipe (use
  `rl.kl_coef` for a KL loss). Needs `lengths=` (the training update passes them).

  Args:
    eps: added to the variance (verl: 1e-8).
    weight: "tokens" (verl) or "samples" (each valid sample counts once).

  Returns:
    `chain(whiten_batch(eps, ddof=1, weight))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.reinforce_pp(), jnp.array([[1., 0.], [0., 0.]]),
    ...                           lengths=jnp.array([[2, 2], [2, 2]]))
    >>> [round(x, 3) for x in adv[0].tolist()]   # mean 1/4, var (2 * 9/16 + 6 * 1/16) / 7
    [1.62, -0.54]
  """
  return base.chain(T.whiten_batch(eps=eps, ddof=1, weight=weight))


def reinforce_pp_baseline(eps: float = 1e-8, weight: str = "tokens", single_sample: str = "raw"
                          ) -> base.AdvantageTransform:
  """REINFORCE++-baseline: the group mean subtracted, then whitened over the whole batch.

  Hu, 2025 (arXiv 2501.03262), the variant with a per-prompt baseline, as verl's
  `compute_reinforce_plus_plus_baseline_outcome_advantage`: `A_i = whiten_batch(r_i - mean_g r)`,
  the local baseline decoupled from the global scale. Needs `lengths=`.

  Args:
    eps: added to the variance (verl: 1e-8).
    weight: "tokens" (verl) or "samples".
    single_sample: a group with one valid sample: "raw" (verl: its mean is taken as 0) or
      "zero" (its own baseline).

  Returns:
    `chain(group_mean_baseline(single_sample), whiten_batch(eps, ddof=1, weight))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.reinforce_pp_baseline(), jnp.array([[1., 0.], [5., 5.]]),
    ...                           lengths=jnp.array([[1, 1], [1, 1]]))
    >>> [[round(x, 3) for x in row] for row in adv.tolist()]   # centred (0.5, -0.5, 0, 0); var 1/6
    [[1.225, -1.225], [0.0, 0.0]]
  """
  return base.chain(T.group_mean_baseline(single_sample=single_sample),
                    T.whiten_batch(eps=eps, ddof=1, weight=weight))


def opo(single_sample: str = "raw") -> base.AdvantageTransform:
  """OPO: the length-weighted group baseline, `A_i = r_i - sum_j |o_j| r_j / sum_j |o_j|`.

  Hao et al., 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv 2505.23585), as verl's
  `compute_opo_outcome_advantage`. No std division. Needs `lengths=` (the training update
  passes them).

  Args:
    single_sample: a group with one valid sample: "raw" (verl: baseline 0) or "zero".

  Returns:
    `chain(length_weighted_baseline(single_sample))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.opo(), jnp.array([[1., 0., 0.]]), lengths=jnp.array([[2, 1, 1]]))
    >>> adv.tolist()   # b = 2 / 4
    [[0.5, -0.5, -0.5]]
  """
  return base.chain(T.length_weighted_baseline(single_sample=single_sample))


def gpg(count: str = "nonzero_reward", f_norm: float = 1.0, single_sample: str = "raw"
        ) -> base.AdvantageTransform:
  """GPG: `A_i = alpha (r_i - mean_g r) / f_norm`, alpha = B / M over the batch.

  Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
  Reasoning" (arXiv 2504.02546), as verl's `compute_gpg_outcome_advantage`: no std division;
  alpha corrects for the samples that carry no signal (see `gpg_scale` for the two ways to
  count M). verl pairs it with the plain policy-gradient loss; any `rl.loss_kind` works here.

  Args:
    count: "nonzero_reward" (verl) or "mixed_group" (the paper's M).
    f_norm: constant divisor (verl: 1).
    single_sample: a group with one valid sample: "raw" (verl: its mean is taken as 0) or "zero".

  Returns:
    `chain(group_mean_baseline(single_sample), gpg_scale(count, f_norm))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.gpg(), jnp.array([[1., 0.], [0., 0.]]))
    >>> adv.tolist()   # 4 samples, 1 non-zero reward: alpha = 4
    [[2.0, -2.0], [0.0, 0.0]]
  """
  return base.chain(T.group_mean_baseline(single_sample=single_sample),
                    T.gpg_scale(count=count, f_norm=f_norm))


def grpo_passk(eps: float = 1e-6, norm_by_std: bool = True) -> base.AdvantageTransform:
  """GRPO with pass@k credit: only each group's best sample gets `(r_max - r_2nd) / (std + eps)`.

  Tang et al., 2025 (arXiv 2503.19595), as verl's `compute_grpo_passk_outcome_advantage`
  (`norm_adv_by_std_in_grpo` is `norm_by_std`). See `best_of_group`.

  Returns:
    `chain(best_of_group(eps, norm_by_std))`.

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> adv, _ = advantages.apply(advantages.grpo_passk(norm_by_std=False), jnp.array([[0., 2., 0.5]]))
    >>> adv.tolist()
    [[0.0, 1.5, 0.0]]
  """
  return base.chain(T.best_of_group(eps=eps, norm_by_std=norm_by_std))


def gae(gamma: float = 1.0, lam: float = 0.95) -> base.AdvantageTransform:
  """PPO with a learned value function: GAE over the completion tokens (`advantages.token_gae`).

  Schulman et al., 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation" (arXiv 1506.02438); verl's `compute_gae_advantage_return` (defaults gamma = 1,
  lam = 0.95). This recipe is the per-sample part only: it passes each valid sample's outcome
  reward through. The update (`rl.advantage="gae"`) puts that reward on the sample's last loss
  token, takes V from the critic before the update and computes the token advantages and returns
  there (`gae_advantages`).

  Example:
    >>> import jax.numpy as jnp
    >>> from rollouts_jax import advantages
    >>> advantages.apply(advantages.gae(), jnp.array([[1., 0.]]), mask=jnp.array([[True, False]]))[0].tolist()
    [[1.0, 0.0]]
  """
  GAESettings(gamma, lam).check()

  def update(values, *, mask=None, group_mask=None, **extra):
    del extra
    values, mask, _ = base.prepare(values, mask, group_mask)
    return base.finish(values, mask), mask

  return base.stateless(update)
