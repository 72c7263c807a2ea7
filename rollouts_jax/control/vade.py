"""`control.vade`: variance-aware prompt selection from per-prompt Beta posteriors.

Paper: VADE, "Variance-Aware Dynamic sampling via online sample-level difficulty Estimation"
(arXiv 2511.18902). Three parts, as the abstract names them:

1. Online difficulty estimation: prompt i has a Beta(alpha_i, beta_i) posterior over its
   success probability p_i, updated from every observed group (alpha += successes,
   beta += failures). No extra rollouts: the training rollouts are the observations.
2. A Thompson sampler that maximizes information gain: draw p~_i ~ Beta(alpha_i, beta_i) for
   every prompt and take the batch with the largest p~(1 - p~), the Bernoulli variance (the
   proxy for the expected information gain of a group: it peaks at p = 1/2, where a group is
   most likely to hold both a success and a failure, and is 0 at p = 0 or 1).
3. Two-scale prior decay, so the posterior tracks the moving policy. Our reading (the abstract
   gives no formula; the constants are settings): the evidence, i.e. the posterior minus the
   prior, shrinks on two time scales,
     * `fast_decay` (per observation of the prompt): before a new group is added, the prompt's
       old evidence is multiplied by `fast_decay`, so a prompt's estimate follows its latest
       groups (memory of about `1 / (1 - fast_decay)` groups);
     * `slow_decay` (per training step, every prompt): all evidence is multiplied by
       `slow_decay`, so a prompt not seen for a long time drifts back to the prior and gets
       re-explored (its estimate is stale because the policy moved).
   With both decays at 1.0 the posterior is the exact Beta-Bernoulli posterior.

A sample counts as a success when its reward exceeds `success_threshold` (0.5: binary 0/1
rewards; use 0.0 for +-1 rewards).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.control import base


@flax.struct.dataclass
class VadeState:
  alpha: jax.Array   # float32 [K]: Beta posterior alpha (prior + decayed successes)
  beta: jax.Array    # float32 [K]: Beta posterior beta (prior + decayed failures)
  step: jax.Array    # int32 scalar: updates so far


def top_b(score_K: jax.Array, key: jax.Array, batch_size: int) -> jax.Array:
  """int32 [B]: indices of the `batch_size` largest scores, ties broken uniformly at random.

  >>> top_b(jnp.array([0., 2., 1., 2.]), jax.random.key(0), 2).sort().tolist()
  [1, 3]
  """
  tie = jax.random.uniform(key, score_K.shape)
  order = jnp.lexsort((tie, score_K))          # ascending by score, then by the random tie-breaker
  return order[::-1][:batch_size].astype(jnp.int32)


def group_counts(plan: base.Plan, rewards_BxN: jax.Array, mask_BxN: jax.Array | None,
                 success_threshold: float) -> tuple[jax.Array, jax.Array]:
  """(successes, counted samples), float32 [B] each, over the samples within each prompt's budget."""
  r = jnp.asarray(rewards_BxN, jnp.float32)
  m = plan.sample_mask(r.shape[1])
  if mask_BxN is not None:
    m = m & jnp.asarray(mask_BxN, bool)
  succ_B = jnp.sum((r > success_threshold) & m, axis=1).astype(jnp.float32)
  return succ_B, jnp.sum(m, axis=1).astype(jnp.float32)


def prompt_counts(plan: base.Plan, rewards_BxN: jax.Array, mask_BxN: jax.Array | None, num_prompts: int,
                  success_threshold: float) -> tuple[jax.Array, jax.Array]:
  """Per-prompt (successes, samples) float32 [K] of one step's rollouts.

  Only samples inside the plan's budget and `mask_BxN` count; a prompt listed twice in the
  plan adds both groups.

  >>> p = base.Plan(jnp.array([2, 0]), jnp.array([3, 2]))
  >>> s, n = prompt_counts(p, jnp.array([[1., 0., 1.], [1., 1., 1.]]), None, 3, 0.5)
  >>> s.tolist(), n.tolist()
  ([2.0, 0.0, 2.0], [2.0, 0.0, 3.0])
  """
  succ_B, n_B = group_counts(plan, rewards_BxN, mask_BxN, success_threshold)
  idx = jnp.asarray(plan.indices, jnp.int32)
  zeros = jnp.zeros((num_prompts,), jnp.float32)
  return zeros.at[idx].add(succ_B), zeros.at[idx].add(n_B)


def vade(num_prompts: int, *, num_samples: int, seed: int = 0, prior_alpha: float = 1.0, prior_beta: float = 1.0,
         fast_decay: float = 0.8, slow_decay: float = 0.995, success_threshold: float = 0.5) -> base.PromptSelector:
  """VADE: Thompson sampling over per-prompt Beta posteriors, maximizing p(1 - p).

  Args:
    num_prompts: K, size of the dataset.
    num_samples: N, rollouts per prompt (every selected prompt gets the full N).
    seed: unused (the stream is driven by the key given to `select`); kept for the contract.
    prior_alpha, prior_beta: the Beta prior (1, 1: uniform, so an unseen prompt's draw is
      uniform and it is explored).
    fast_decay: per-observation decay of a prompt's evidence (see the module docstring).
    slow_decay: per-step decay of every prompt's evidence.
    success_threshold: a reward above it is a success.

  Returns:
    A `PromptSelector`; state `VadeState(alpha [K], beta [K], step)`.

  >>> import jax, jax.numpy as jnp
  >>> sel = vade(4, num_samples=2, fast_decay=1.0, slow_decay=1.0)
  >>> state = sel.init()
  >>> plan, state = sel.select(state, jax.random.key(0), 2)
  >>> state = sel.update(state, plan, jnp.array([[1., 0.], [1., 1.]]), jnp.ones((2, 2), bool))
  >>> float(state.alpha.sum() - 4), float(state.beta.sum() - 4)   # 3 successes, 1 failure
  (3.0, 1.0)
  """
  del seed
  for name, v in (("fast_decay", fast_decay), ("slow_decay", slow_decay)):
    if not 0.0 <= v <= 1.0:
      raise ValueError(f"vade: {name} must be in [0, 1]; got {v}.")
  if prior_alpha <= 0 or prior_beta <= 0:
    raise ValueError(f"vade: the Beta prior must be positive; got ({prior_alpha}, {prior_beta}).")

  def init():
    return VadeState(alpha=jnp.full((num_prompts,), prior_alpha, jnp.float32),
                     beta=jnp.full((num_prompts,), prior_beta, jnp.float32),
                     step=jnp.zeros((), jnp.int32))

  def select(state, key, batch_size: int):
    base.check_batch_size(batch_size, num_prompts)
    k_draw, k_tie = jax.random.split(key)
    p = jax.random.beta(k_draw, state.alpha, state.beta)
    idx = top_b(p * (1.0 - p), k_tie, batch_size)
    return base.full_budget(idx, num_samples), state

  def update(state, plan, rewards_BxN, mask_BxN=None, **extra):
    del extra
    succ, n = prompt_counts(plan, rewards_BxN, mask_BxN, num_prompts, success_threshold)
    seen = n > 0
    keep = jnp.where(seen, fast_decay * slow_decay, slow_decay)
    alpha = prior_alpha + keep * (state.alpha - prior_alpha) + succ
    beta = prior_beta + keep * (state.beta - prior_beta) + (n - succ)
    return VadeState(alpha=alpha, beta=beta, step=state.step + 1)

  return base.PromptSelector(init, select, update)
