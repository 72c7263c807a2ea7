"""Policy objectives (PPO-clip / DAPO, GSPO, CISPO, SAPO, Clip-Cov, KL-Cov), KL estimators and
controllers, distillation, shaping, aggregation, PPO's clipped value loss.

>>> import jax.numpy as jnp
>>> from rollouts_jax import losses
>>> lp = jnp.zeros((2, 3)); m = jnp.ones((2, 3), bool)
>>> loss, metrics = losses.policy_loss(lp, lp, jnp.array([1., -1.]), m, kind="ppo_clip",
...                                    clip_low=0.2, clip_high=0.28, agg="token-mean")
>>> kl = losses.kl_penalty(lp, lp, kind="k3")
"""
from rollouts_jax.losses.aggregation import AGG_MODES, aggregate, masked_mean
from rollouts_jax.losses.distill import full_forward_kl, full_reverse_kl
from rollouts_jax.losses.echo import confidence_clip_ranges, echo_policy_loss
from rollouts_jax.losses.kl import KL_KINDS, kl_penalty
from rollouts_jax.losses.kl_control import (KL_CONTROLLERS, KLController, KLControllerState,
                                            adaptive_kl_controller, build_kl_controller, fixed_kl_controller,
                                            kl_coef_state)
from rollouts_jax.losses.policy import KIND_KWARGS, KINDS, TIS_MODES, check_kind_kwargs, policy_loss
from rollouts_jax.losses.shaping import entropy_bonus, entropy_from_logits, overlong_penalty
from rollouts_jax.losses.value import value_loss

__all__ = [
    "AGG_MODES", "KINDS", "KL_KINDS", "TIS_MODES", "aggregate", "masked_mean", "kl_penalty", "policy_loss",
    "entropy_bonus", "entropy_from_logits", "overlong_penalty", "confidence_clip_ranges", "echo_policy_loss",
    "full_forward_kl", "full_reverse_kl", "KIND_KWARGS", "check_kind_kwargs", "KL_CONTROLLERS", "KLController",
    "KLControllerState", "adaptive_kl_controller", "fixed_kl_controller", "build_kl_controller", "kl_coef_state",
    "value_loss",
]
