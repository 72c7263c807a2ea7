"""`control.xrpo_allocation`: XRPO's rollout allocator (per-prompt group sizes under a fixed budget).

Paper: XRPO, "eXplore - eXploit GRPO" (arXiv 2510.06672). Its allocator gives more rollouts
to prompts "with higher potential for uncertainty reduction". For prompt q with n rollouts
and reward standard deviation s_q, the uncertainty of its mean reward is the Student-t
half-width `h_q(n) = t_{1 - a/2, n - 1} * s_q / sqrt(n)`; rollouts go, one at a time, to the
prompt with the largest reduction `h_q(n_q) - h_q(n_q + 1)` (plus an exploration bonus),
until the step's total budget is spent. (The paper allocates in phases within a step; the
formulas come from a review of the paper, the code was not available.)

Mapping onto the selector contract:

* Prompts are chosen as in `control.uniform` (an epoch stream: XRPO changes how many
  rollouts each prompt gets, not which prompts), and the allocation is the plan's `budget`:
  every prompt gets at least `min_samples` (2: a t half-width needs n >= 2), at most N (the
  static group size), and the budgets sum to `round(budget_fraction * B * N)`. Shapes stay
  [B, N]; samples past a prompt's budget are masked.
* Phases (`phases=2`, the default, as the paper allocates): the step first decodes
  `min_samples` rollouts of every prompt; `refine` reads their rewards and allocates the rest
  of the step's budget, and only those rollouts are decoded next (the loop merges them into
  the prompts' groups). s_q is a Bernoulli estimate over the prompt's decayed history and this
  step's first phase, `p = (succ + prior_count / 2) / (n + prior_count)`, `s = sqrt(p (1 - p))`
  (an unseen prompt has s = 1/2, the largest; two agreeing samples do not make s = 0). With
  `phases=1` the whole allocation is made up front from the history alone. The exploration
  bonus is optimism on s: `s + explore * sqrt(log(t + 2) / (1 + visits))`, UCB-style.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.control import base
from rollouts_jax.control.uniform import stream_indices
from rollouts_jax.control.vade import prompt_counts


@flax.struct.dataclass
class XrpoState:
  position: jax.Array   # int32 scalar: prompts handed out so far (the uniform stream)
  succ: jax.Array       # float32 [K]: decayed successes
  n: jax.Array          # float32 [K]: decayed samples
  visits: jax.Array     # float32 [K]: groups observed
  step: jax.Array       # int32 scalar


def t_quantiles(num_samples: int, confidence: float) -> np.ndarray:
  """`q[n] = t_{(1 + confidence) / 2, n - 1}` for n = 0..N (q[0] = q[1] = inf: no half-width).

  >>> round(float(t_quantiles(4, 0.95)[2]), 3)     # t_{0.975, 1}
  12.706
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  q = np.full(num_samples + 2, np.inf)
  for n in range(2, num_samples + 2):
    q[n] = stats.t.ppf(0.5 + confidence / 2.0, n - 1)
  return q


def allocate(s_B: jax.Array, total: int, min_samples: int, num_samples: int, tq: jax.Array) -> jax.Array:
  """int32 [B] group sizes: greedy largest half-width reduction, `min_samples..N`, summing to `total`.

  >>> tq = jnp.asarray(t_quantiles(8, 0.95), jnp.float32)
  >>> allocate(jnp.array([0.5, 0.0, 0.3]), 12, 2, 8, tq).tolist()   # s = 0 gets only the minimum
  [5, 2, 5]
  """
  B = s_B.shape[0]
  n0 = jnp.full((B,), min_samples, jnp.int32)
  ns = jnp.arange(num_samples + 2)
  width = tq[ns] / jnp.sqrt(jnp.maximum(ns, 1).astype(jnp.float32))      # h(n) / s

  def body(_, n):
    gain = s_B * (width[n] - width[n + 1])
    gain = jnp.where(n < num_samples, gain, -jnp.inf)
    b = jnp.argmax(gain)                                                  # first index on ties
    return n.at[b].add(jnp.where(gain[b] > -jnp.inf, 1, 0))

  return jax.lax.fori_loop(0, total - B * min_samples, body, n0)


def xrpo_allocation(num_prompts: int, *, num_samples: int, seed: int = 0, budget_fraction: float = 0.5,
                    min_samples: int = 2, confidence: float = 0.95, explore: float = 0.1,
                    prior_count: float = 1.0, history_decay: float = 0.8,
                    success_threshold: float = 0.5, phases: int = 2) -> base.PromptSelector:
  """XRPO's allocator over an epoch stream of prompts.

  Args:
    num_prompts: K, size of the dataset.
    num_samples: N, the static group size (the largest budget).
    seed: the prompt stream's seed (as in `control.uniform`).
    budget_fraction: the step's rollouts are `round(budget_fraction * B * N)` (1.0 gives every
      prompt N, i.e. uniform).
    min_samples: the smallest group (>= 2 for a t half-width).
    confidence: the t interval's level (0.95: t_{0.975, n-1}).
    explore: weight of the optimism bonus on s.
    prior_count: pseudo-samples at p = 1/2 in the estimate of s.
    history_decay: per-observation decay of a prompt's counts.
    success_threshold: a reward above it is a success.
    phases: 2: `min_samples` each, then the rest by `refine` from their rewards (the paper's
      phases within a step); 1: the whole allocation in `select`, from the history.

  Returns:
    A `PromptSelector`; `plan.budget` holds the group sizes.

  >>> import jax, jax.numpy as jnp
  >>> sel = xrpo_allocation(16, num_samples=8, prior_count=0.1, explore=0.0)
  >>> plan, state = sel.select(sel.init(), jax.random.key(0), 4)
  >>> plan.budget.tolist()                                   # phase 1: min_samples each
  [2, 2, 2, 2]
  >>> r = jnp.array([[1., 0.], [0., 0.], [1., 1.], [0., 1.]])
  >>> plan, state = sel.refine(state, plan, jnp.pad(r, ((0, 0), (0, 6))), plan.sample_mask(8))
  >>> int(plan.budget.sum()), plan.budget.tolist()          # half of 4 x 8, mixed groups first
  (16, [5, 3, 3, 5])

  (With the default prior of one pseudo-sample the t quantile's fall from n = 2 to 4 outweighs
  a 2-sample spread, and these four prompts would get 4 each.)
  >>> plan, _ = xrpo_allocation(16, num_samples=8, phases=1).select(state, jax.random.key(0), 4)
  >>> int(plan.budget.sum())                                 # one phase: all up front
  16
  """
  if not 1 <= min_samples <= num_samples:
    raise ValueError(f"xrpo_allocation: min_samples must be in [1, num_samples]; got {min_samples}.")
  if phases not in (1, 2):
    raise ValueError(f"xrpo_allocation: phases must be 1 or 2; got {phases}.")
  if not 0.0 < budget_fraction <= 1.0:
    raise ValueError(f"xrpo_allocation: budget_fraction must be in (0, 1]; got {budget_fraction}.")
  tq = jnp.asarray(t_quantiles(num_samples, confidence), jnp.float32)

  def init():
    z = jnp.zeros((num_prompts,), jnp.float32)
    return XrpoState(position=jnp.zeros((), jnp.int32), succ=z, n=z, visits=z, step=jnp.zeros((), jnp.int32))

  def spread(state, idx, succ_now=0.0, n_now=0.0):
    p = (state.succ[idx] + succ_now + 0.5 * prior_count) / (state.n[idx] + n_now + prior_count)
    s = jnp.sqrt(p * (1.0 - p))
    return s + explore * jnp.sqrt(jnp.log(state.step.astype(jnp.float32) + 2.0) / (1.0 + state.visits[idx]))

  def total_rollouts(batch_size: int) -> int:
    total = int(round(budget_fraction * batch_size * num_samples))
    return min(max(total, batch_size * min_samples), batch_size * num_samples)

  def select(state, key, batch_size: int):
    del key
    base.check_batch_size(batch_size, num_prompts)
    idx = stream_indices(seed, state.position, batch_size, num_prompts)
    if phases == 2:
      budget = jnp.full((batch_size,), min_samples, jnp.int32)
    else:
      budget = allocate(spread(state, idx), total_rollouts(batch_size), min_samples, num_samples, tq)
    return base.Plan(indices=idx, budget=budget), state.replace(position=state.position + batch_size)

  def refine(state, plan, rewards_BxN, mask_BxN=None):
    """Phase 2: the rest of the step's rollouts, by this step's first-phase rewards."""
    if phases == 1:
      return plan, state
    live = plan.sample_mask(rewards_BxN.shape[1]) if mask_BxN is None else jnp.asarray(mask_BxN, bool)
    succ = jnp.sum((jnp.asarray(rewards_BxN) > success_threshold) & live, axis=1).astype(jnp.float32)
    s = spread(state, plan.indices, succ, jnp.sum(live, axis=1).astype(jnp.float32))
    budget = allocate(s, total_rollouts(plan.indices.shape[0]), min_samples, num_samples, tq)
    return base.Plan(indices=plan.indices, budget=jnp.maximum(budget, plan.budget)), state

  def update(state, plan, rewards_BxN, mask_BxN=None, **extra):
    del extra
    succ, n = prompt_counts(plan, rewards_BxN, mask_BxN, num_prompts, success_threshold)
    keep = jnp.where(n > 0, history_decay, 1.0)
    return state.replace(succ=keep * state.succ + succ, n=keep * state.n + n,
                         visits=state.visits + (n > 0), step=state.step + 1)

  return base.PromptSelector(init, select, update, refine if phases == 2 else None)
