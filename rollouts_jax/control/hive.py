"""`control.hive`: history-informed coarse selection, then pruning by prompt entropy.

Paper: HIVE, "History-Informed and online-VErified prompt selection" (arXiv 2603.25184). The
abstract: the strongest learning signal sits at the "learning edge", the intersection of
intermediate difficulty and high uncertainty, and the edge moves as training proceeds; HIVE
uses each prompt's historical reward trajectory for a coarse selection and prompt entropy as
a real-time proxy to prune prompts whose utility has gone stale.

Our reading of what the abstract leaves open (every constant below is a setting):

* History (stage 1). Each prompt keeps a decayed success count `succ` and sample count `n`
  (each observation first multiplies the old counts by `history_decay`, so the history follows
  the policy). Its historical success rate is `m = (succ + 1) / (n + 2)` and its learning-edge
  score is `4 m (1 - m)` (1 at m = 1/2, 0 at m = 0 or 1) plus an uncertainty bonus
  `explore / sqrt(1 + n)` (a rarely seen prompt's rate is uncertain, so it is revisited). The
  coarse pool is the `ceil(pool_factor * B)` prompts with the highest score.
* Online verification (stage 2). The paper computes prompt entropy with a fresh forward pass
  of the current policy before rollout. The selector contract has no policy in `select`, so
  the online signal here is the mean token entropy of the prompt's latest rollouts
  (`entropy_BxN`, given to `update`): the policy's uncertainty on the prompt the last time it
  was rolled out. From the pool, the B prompts with the highest entropy are kept (low
  entropy: the policy has become confident, the group is likely all-correct or all-wrong, the
  prompt's utility is stale); a prompt with no recorded entropy is never pruned (it has no
  evidence against it) and ties go to the higher stage-1 score. Without `entropy_BxN` (never
  given), stage 2 keeps the pool's top B by stage-1 score, i.e. HIVE reduces to stage 1.
  With `fresh_entropy=True` the signal is fresh, as in the paper: `select` takes the extra
  `prompt_entropy_fn(indices, num_tokens) -> float [P]`, which the loop gives it, and calls it
  on the pool; the loop answers with the current policy's mean token entropy over a short
  greedy continuation of each prompt (`entropy_tokens` tokens, one row per prompt: the
  entropy at the answer's first tokens, a few percent of the step's decoding). The
  abstract does not define prompt entropy; this is our reading.
"""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp

from rollouts_jax.control import base
from rollouts_jax.control.vade import prompt_counts


@flax.struct.dataclass
class HiveState:
  succ: jax.Array      # float32 [K]: decayed successes
  n: jax.Array         # float32 [K]: decayed samples
  entropy: jax.Array   # float32 [K]: mean token entropy of the latest rollouts
  has_entropy: jax.Array  # bool [K]: an entropy has been recorded
  step: jax.Array      # int32 scalar: updates so far


def hive(num_prompts: int, *, num_samples: int, seed: int = 0, pool_factor: float = 2.0, explore: float = 0.5,
         history_decay: float = 0.8, success_threshold: float = 0.5, fresh_entropy: bool = False,
         entropy_tokens: int = 8) -> base.PromptSelector:
  """HIVE: learning-edge pool from the reward history, pruned by prompt entropy.

  Args:
    num_prompts: K, size of the dataset.
    num_samples: N, rollouts per prompt (every selected prompt gets the full N).
    seed: unused (the key given to `select` drives the random tie-breaks).
    pool_factor: the stage-1 pool holds `ceil(pool_factor * B)` prompts (at most K); 1.0
      turns stage 2 off.
    explore: weight of the uncertainty bonus `1 / sqrt(1 + n)` in the stage-1 score.
    history_decay: per-observation decay of a prompt's counts.
    success_threshold: a reward above it is a success.
    fresh_entropy: stage 2 ranks the pool by `prompt_entropy_fn`'s fresh entropies when
      `select` is given one (else by the latest rollouts' entropies).
    entropy_tokens: the continuation length `prompt_entropy_fn` is asked for.

  Returns:
    A `PromptSelector`. `select(state, key, B, *, prompt_entropy_fn=None)`; `update` reads
    the optional extra `entropy_BxN` (float [B, N], mean token entropy of each sample) and
    ignores other extras.

  >>> import jax, jax.numpy as jnp
  >>> sel = hive(4, num_samples=2, pool_factor=2.0)
  >>> plan, state = sel.select(sel.init(), jax.random.key(0), 2)
  >>> state = sel.update(state, plan, jnp.array([[1., 0.], [1., 1.]]), jnp.ones((2, 2), bool),
  ...                    entropy_BxN=jnp.array([[0.9, 0.7], [0.1, 0.1]]))
  >>> [round(e, 3) for e in state.entropy[plan.indices].tolist()]   # mean entropy of each prompt's rollouts
  [0.8, 0.1]
  """
  del seed
  if pool_factor < 1.0:
    raise ValueError(f"hive: pool_factor must be >= 1; got {pool_factor}.")
  if not 0.0 <= history_decay <= 1.0:
    raise ValueError(f"hive: history_decay must be in [0, 1]; got {history_decay}.")
  if int(entropy_tokens) < 1:
    raise ValueError(f"hive: entropy_tokens must be >= 1; got {entropy_tokens}.")

  def init():
    z = jnp.zeros((num_prompts,), jnp.float32)
    return HiveState(succ=z, n=z, entropy=z, has_entropy=jnp.zeros((num_prompts,), bool),
                     step=jnp.zeros((), jnp.int32))

  def edge_score(state):
    m = (state.succ + 1.0) / (state.n + 2.0)
    return 4.0 * m * (1.0 - m) + explore / jnp.sqrt(1.0 + state.n)

  def select(state, key, batch_size: int, *, prompt_entropy_fn=None):
    base.check_batch_size(batch_size, num_prompts)
    pool_size = min(num_prompts, max(batch_size, int(math.ceil(pool_factor * batch_size))))
    hist = edge_score(state)
    order = jnp.lexsort((jax.random.uniform(key, (num_prompts,)), hist))[::-1]  # random tie-break
    pool = order[:pool_size]
    if fresh_entropy and prompt_entropy_fn is not None and pool_size > batch_size:
      ent = jnp.asarray(prompt_entropy_fn(pool, int(entropy_tokens)), jnp.float32)   # the current policy's
    else:
      ent = jnp.where(state.has_entropy[pool], state.entropy[pool], jnp.inf)
    stage2 = jnp.lexsort((hist[pool], ent))[::-1]    # by entropy, then by the history score
    idx = pool[stage2[:batch_size]].astype(jnp.int32)
    return base.full_budget(idx, num_samples), state

  def update(state, plan, rewards_BxN, mask_BxN=None, *, entropy_BxN=None, **extra):
    del extra
    succ, n = prompt_counts(plan, rewards_BxN, mask_BxN, num_prompts, success_threshold)
    seen = n > 0
    keep = jnp.where(seen, history_decay, 1.0)
    entropy, has_entropy = state.entropy, state.has_entropy
    if entropy_BxN is not None:
      m = plan.sample_mask(jnp.shape(rewards_BxN)[1])
      if mask_BxN is not None:
        m = m & jnp.asarray(mask_BxN, bool)
      e = jnp.asarray(entropy_BxN, jnp.float32)
      cnt_B = jnp.sum(m, axis=1)
      ent_B = jnp.sum(jnp.where(m, e, 0.0), axis=1) / jnp.maximum(cnt_B, 1)
      idx = jnp.asarray(plan.indices, jnp.int32)
      # Rows without a valid sample write back the old value (a prompt listed twice: last row wins).
      ent_B = jnp.where(cnt_B > 0, ent_B, entropy[idx])
      entropy = entropy.at[idx].set(ent_B)
      has_entropy = has_entropy.at[idx].set(has_entropy[idx] | (cnt_B > 0))
    return HiveState(succ=keep * state.succ + succ, n=keep * state.n + n, entropy=entropy,
                     has_entropy=has_entropy, step=state.step + 1)

  return base.PromptSelector(init, select, update)
