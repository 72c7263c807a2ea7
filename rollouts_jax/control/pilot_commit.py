"""`control.pilot_commit`: a small pilot group per candidate, the rest to high-variance prompts.

Paper: Pilot-Commit (arXiv 2605.26606; code `databricks/pilot-commit`, `recipe/pc`). A pilot
stage spends a fraction of the budget estimating each candidate's accuracy mu; candidates are
classified too easy (mu > 1 - p_upper), too hard (mu < p_lower) or kept; the remaining
rollouts are committed to kept prompts, preferring high reward variance; prompts that were
fully solved (mu >= 1) are evicted from later sampling. The paper's recipe `p32c96`: 32 pilot
rollouts per candidate, 96 more for each committed prompt, three candidates per trained prompt.

How the phases map onto the selector contract. In the default, `same_step=True`, as the paper
runs it: every row of a step is a pilot (budget `pilot_samples`, candidates least recently
observed first); the loop decodes the pilots, scores them and calls `refine`, which commits
the `round((1 - pilot_fraction) * B)` pilots in the keep band with the highest mu (1 - mu) to
the full N; the loop decodes only the committed rollouts and merges them into their pilot's
group, so a committed group is pilot + commit samples in one step (the paper's 32 + 96).
Uncommitted pilots keep their few samples (trained on like any group; a group whose rewards
agree carries no gradient anyway). With `same_step=False` the commit is a later step's:

* A step's B rows hold two kinds. Pilot rows (budget `pilot_samples`, by default N / 4 as in
  p32c96) go to candidates, least recently observed first (never observed first, random
  ties), so candidates sweep the dataset. Commit rows (budget N) go to prompts whose latest
  observation is a pilot from at most `max_pilot_age` steps ago (the paper's
  `buffer_max_off_steps`) and falls in the keep band, highest pilot variance mu (1 - mu)
  first. `round((1 - pilot_fraction) * B)` rows are reserved for commits; when fewer prompts
  qualify, the rest become pilots. Rollouts spent per step vary; they are the sum of budgets.
* Pilot samples are kept: they are trained on in their own step like any group (the loop
  decodes only the budget), and their statistics (successes, count, step) stay in the state
  and decide the commit. The commit group is a fresh group of N in a later step.
* Too-hard prompts (the paper defers them to a replay buffer) return to the candidate sweep.
  Eviction: a prompt is dropped from sampling after `exclude_after` consecutive solved
  samples over its observations (the paper evicts on mu >= 1 of a 32-sample pilot; on a
  2-sample pilot that would drop a p = 0.7 prompt half the time). 0 turns eviction off.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.control import base
from rollouts_jax.control.vade import group_counts, top_b

_NEVER = 1 << 30


@flax.struct.dataclass
class PilotCommitState:
  obs_succ: jax.Array    # float32 [K]: successes in the prompt's latest observation
  obs_n: jax.Array       # float32 [K]: samples in the prompt's latest observation
  obs_step: jax.Array    # int32 [K]: step of the latest observation (-1: never)
  obs_pilot: jax.Array   # bool [K]: the latest observation is a pilot not yet committed
  streak: jax.Array      # float32 [K]: consecutive solved samples
  evicted: jax.Array     # bool [K]: dropped from sampling
  step: jax.Array        # int32 scalar


def pilot_commit(num_prompts: int, *, num_samples: int, seed: int = 0, pilot_samples: int = 0,
                 pilot_fraction: float = 0.75, p_lower: float = 0.125, p_upper: float = 0.25,
                 max_pilot_age: int = 4, exclude_after: int = 16,
                 success_threshold: float = 0.5, same_step: bool = True) -> base.PromptSelector:
  """Pilot-Commit as a selector.

  Args:
    num_prompts: K, size of the dataset.
    num_samples: N, a commit row's budget.
    seed: unused (the key given to `select` drives the random tie-breaks).
    pilot_samples: a pilot row's budget, `< N`; 0 picks `max(2, N // 4)` (at most N - 1).
    pilot_fraction: share of the rows that are pilots when the commit queue is full (0.75:
      three candidates per committed prompt, the paper's gen batch = 3 x train batch).
    p_lower, p_upper: keep band `p_lower <= mu <= 1 - p_upper` (the README's 0.125, 0.25).
    max_pilot_age: steps a pilot stays eligible for a commit.
    exclude_after: consecutive solved samples that evict a prompt (0: never).
    success_threshold: a reward above it is a success.
    same_step: commit in the step of the pilot (`refine`; the paper's merged group), else in a
      later step.

  Returns:
    A `PromptSelector`.

  >>> import jax, jax.numpy as jnp
  >>> sel = pilot_commit(8, num_samples=8)
  >>> plan, state = sel.select(sel.init(), jax.random.key(0), 4)
  >>> plan.budget.tolist()                            # pilots of N / 4
  [2, 2, 2, 2]
  >>> r = jnp.array([[1., 1.], [1., 0.], [0., 0.], [0., 1.]])
  >>> plan, state = sel.refine(state, plan, jnp.pad(r, ((0, 0), (0, 6))), plan.sample_mask(8))
  >>> plan.budget.tolist()                            # one mixed pilot committed to N in the same step
  [2, 8, 2, 2]

  With `same_step=False`, the commit waits for a later step:

  >>> sel = pilot_commit(8, num_samples=8, same_step=False)
  >>> plan, state = sel.select(sel.init(), jax.random.key(0), 4)
  >>> plan.budget.tolist()          # nothing piloted yet: all rows are pilots of N / 4
  [2, 2, 2, 2]
  >>> state = sel.update(state, plan, jnp.tile(jnp.array([[1., 0.] + [0.] * 6]), (4, 1)), plan.sample_mask(8))
  >>> plan2, state = sel.select(state, jax.random.key(1), 4)
  >>> plan2.budget.tolist()         # one commit row (1 - 0.75 of 4) for a mixed pilot, 3 pilots
  [8, 2, 2, 2]
  """
  del seed
  if pilot_samples <= 0:
    pilot_samples = min(max(2, num_samples // 4), num_samples - 1)
  if not 1 <= pilot_samples < num_samples:
    raise ValueError(f"pilot_commit: pilot_samples must be in [1, num_samples); got {pilot_samples} "
                     f"with num_samples={num_samples}.")
  if not 0.0 <= pilot_fraction <= 1.0:
    raise ValueError(f"pilot_commit: pilot_fraction must be in [0, 1]; got {pilot_fraction}.")

  def init():
    z = jnp.zeros((num_prompts,), jnp.float32)
    f = jnp.zeros((num_prompts,), bool)
    return PilotCommitState(obs_succ=z, obs_n=z, obs_step=jnp.full((num_prompts,), -1, jnp.int32), obs_pilot=f,
                            streak=z, evicted=f, step=jnp.zeros((), jnp.int32))

  def select(state, key, batch_size: int):
    base.check_batch_size(batch_size, num_prompts)
    k_commit, k_pilot = jax.random.split(key)
    commit_slots = 0 if same_step else batch_size - int(round(pilot_fraction * batch_size))
    mu = state.obs_succ / jnp.maximum(state.obs_n, 1.0)
    age = jnp.where(state.obs_step >= 0, state.step - state.obs_step, _NEVER)
    keep_band = (mu >= p_lower) & (mu <= 1.0 - p_upper)
    cand = state.obs_pilot & (age <= max_pilot_age) & keep_band & ~state.evicted & (state.obs_n > 0)
    # Highest pilot variance first, then the freshest pilot; non-candidates rank last.
    commit_score = jnp.where(cand, mu * (1.0 - mu) - 1e-3 * age.astype(jnp.float32), -1.0)
    commit_idx = top_b(commit_score, k_commit, commit_slots)
    commit_ok = commit_score[commit_idx] >= 0.0
    n_commit = jnp.sum(commit_ok)
    chosen = jnp.zeros((num_prompts,), bool).at[commit_idx].max(commit_ok)
    # Pilots: least recently observed first; evicted prompts only when nothing else is left.
    pilot_score = jnp.where(chosen, -2.0 * _NEVER, jnp.where(state.evicted, -1.0 * _NEVER, 0.0) + age)
    pilot_idx = top_b(pilot_score, k_pilot, batch_size)
    rows = jnp.arange(batch_size)
    idx = jnp.where(rows < n_commit, jnp.pad(commit_idx, (0, batch_size - commit_slots))[rows],
                    pilot_idx[jnp.clip(rows - n_commit, 0, batch_size - 1)])
    budget = jnp.where(rows < n_commit, num_samples, pilot_samples).astype(jnp.int32)
    return base.Plan(indices=idx.astype(jnp.int32), budget=budget), state

  def update(state, plan, rewards_BxN, mask_BxN=None, **extra):
    del extra
    succ_B, n_B = group_counts(plan, rewards_BxN, mask_BxN, success_threshold)
    idx = jnp.asarray(plan.indices, jnp.int32)
    seen = n_B > 0
    pick = lambda new, old: jnp.where(seen, new, old[idx])  # noqa: E731  (rows without samples keep the old value)
    solved = seen & (succ_B == n_B)
    streak_B = jnp.where(solved, state.streak[idx] + n_B, jnp.where(seen, 0.0, state.streak[idx]))
    evict_B = state.evicted[idx] | ((exclude_after > 0) & (streak_B >= exclude_after))
    return PilotCommitState(
        obs_succ=state.obs_succ.at[idx].set(pick(succ_B, state.obs_succ)),
        obs_n=state.obs_n.at[idx].set(pick(n_B, state.obs_n)),
        obs_step=state.obs_step.at[idx].set(pick(jnp.broadcast_to(state.step, idx.shape), state.obs_step)),
        obs_pilot=state.obs_pilot.at[idx].set(pick(plan.budget < num_samples, state.obs_pilot)),
        streak=state.streak.at[idx].set(streak_B),
        evicted=state.evicted.at[idx].set(evict_B),
        step=state.step + 1)

  def refine(state, plan, rewards_BxN, mask_BxN=None):
    """The commit: pilots in the keep band, highest mu (1 - mu) first, get N in this step."""
    succ_B, n_B = group_counts(plan, rewards_BxN, mask_BxN, success_threshold)
    B = plan.indices.shape[0]
    mu = succ_B / jnp.maximum(n_B, 1.0)
    cand = (n_B > 0) & (mu >= p_lower) & (mu <= 1.0 - p_upper) & ~state.evicted[plan.indices]
    score = jnp.where(cand, mu * (1.0 - mu), -1.0)
    slots = B - int(round(pilot_fraction * B))
    # The `slots` best candidates (first row on ties).
    rank = jnp.argsort(jnp.argsort(-score, stable=True), stable=True)
    commit = cand & (rank < slots)
    return base.Plan(indices=plan.indices, budget=jnp.where(commit, num_samples, plan.budget).astype(jnp.int32)), state

  return base.PromptSelector(init, select, update, refine if same_step else None)
