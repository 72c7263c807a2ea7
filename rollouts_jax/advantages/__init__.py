"""Optax-style advantage transforms over rewards `[B, N]` and named recipes.

>>> import jax.numpy as jnp
>>> from rollouts_jax import advantages
>>> t = advantages.chain(advantages.group_median_baseline(), advantages.scale_by_group_std())
>>> values, mask, state = t.update(jnp.array([[0., 1., 1.]]), t.init())
>>> values, mask = advantages.apply(advantages.mc_grpo(), jnp.array([[0., 1., 1.]]))
"""
from rollouts_jax.advantages import clustering
from rollouts_jax.advantages.alias import (dr_grpo, erils, gae, gpg, grpo, grpo_passk, mc_grpo, opo, pvpo,
                                           reinforce_pp, reinforce_pp_baseline, rloo, uniqueness_grpo, xrpo)
from rollouts_jax.advantages.token_gae import GAESettings, gae_advantages, masked_whiten, outcome_token_rewards
from rollouts_jax.advantages.base import (AdvantageTransform, ChainState, EmptyState, apply,
                                          chain)
from rollouts_jax.advantages import tree
from rollouts_jax.advantages.tree import (echo_hybrid_advantages, mean_token_confidence, normalized_confidence,
                                          tree_node_advantages)
from rollouts_jax.advantages.clustering import (cluster_by_answer, cluster_by_judge, llm_judge,
                                                pairwise_judge)
from rollouts_jax.advantages.transforms import (batch_std, best_of_group, clip, gpg_scale, group_mean,
                                                group_mean_baseline, group_median, group_median_baseline,
                                                group_std, group_weighted_mean, leave_one_out_baseline,
                                                length_weighted_baseline, novelty_sharpen, per_source,
                                                reference_anchor, scale_by_batch_std,
                                                scale_by_group_std, uniqueness_reweight, whiten_batch)

#: The recipe names a config may use (`rl.advantage`).
RECIPES = ("grpo", "dr_grpo", "rloo", "mc_grpo", "uniqueness_grpo", "xrpo", "pvpo", "erils",
           "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "gae")

#: Recipes whose token advantages need the critic (`models.value`) in the train state.
CRITIC_RECIPES = ("gae",)


def build(name: str, **kwargs) -> AdvantageTransform:
  """The recipe `name` with its keyword arguments; errors name `rl.advantage` / `rl.advantage_kwargs`.

  >>> build("mc_grpo", mad_fallback=False) is not None
  True
  >>> build("ppo")
  Traceback (most recent call last):
  ...
  ValueError: Config key rl.advantage: unknown advantage recipe 'ppo'; known: grpo, dr_grpo, rloo, mc_grpo, uniqueness_grpo, xrpo, pvpo, erils, reinforce_pp, reinforce_pp_baseline, opo, gpg, grpo_passk, gae.
  """
  if name not in RECIPES:
    raise ValueError(f"Config key rl.advantage: unknown advantage recipe {name!r}; known: {', '.join(RECIPES)}.")
  try:
    return globals()[name](**kwargs)
  except (TypeError, ValueError) as e:   # an unknown keyword, or a value the recipe refuses
    settings = ",".join(f"{k}={v}" for k, v in kwargs.items())
    raise ValueError(f"Config key rl.advantage_kwargs={settings!r} does not fit recipe {name!r}: {e}") from None

__all__ = [
    "AdvantageTransform", "ChainState", "EmptyState", "apply", "chain",
    "group_mean_baseline", "leave_one_out_baseline", "group_median_baseline",
    "scale_by_group_std", "scale_by_batch_std", "batch_std", "clip", "uniqueness_reweight",
    "length_weighted_baseline", "whiten_batch", "gpg_scale", "best_of_group", "group_weighted_mean",
    "novelty_sharpen", "reference_anchor", "group_mean", "group_std", "group_median",
    "grpo", "dr_grpo", "rloo", "mc_grpo", "uniqueness_grpo", "xrpo", "pvpo", "erils", "per_source", "RECIPES", "build",
    "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "gae", "CRITIC_RECIPES",
    "GAESettings", "gae_advantages", "masked_whiten", "outcome_token_rewards",
    "clustering", "cluster_by_answer", "cluster_by_judge", "llm_judge", "pairwise_judge",
    "tree", "tree_node_advantages", "echo_hybrid_advantages", "normalized_confidence", "mean_token_confidence",
]
