"""`arrol`: ARRoL online pruning (arXiv 2603.24840): over-sample, prune partial rollouts, continue the rest.

Each prompt starts ceil(N * (1 + oversample)) rows; after `at` tokens a quality head on the
policy's last hidden state (`control.arrol`) rates every prefix, N rows per prompt are kept
(a `target` share of likely successes) and only those are decoded to the end; the pruned rows
cost their prefix only. The head learns from the kept rows' verified outcomes in `finish`;
until it has seen `min_examples` of them the pruning is random. The head, and the kept rows'
prefix features that it learns from, are the generator's state (checkpointed with the run).

  rollout.generator = "arrol"; rollout.generator_kwargs = "oversample=0.5,at=8,target=0.5"

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("arrol", {"oversample": 1.0, "at": 4})
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import control, models, sampling
from rollouts_jax.rollout import generators
from rollouts_jax.sampling import sol_rl as sol_rl_lib
from rollouts_jax.sampling.batch import teacher_forced_rows


@flax.struct.dataclass
class ArrolState:
  """The quality head and the last call's kept rows (their prefix features and predictions).

  Attributes:
    head: `control.arrol.QualityHead`.
    hidden: float32 [B, N, H], the kept rows' prefix hidden states (what `finish` trains on).
    pred: float32 [B, N], the head's success probability for those rows when they were kept.
  """
  head: control.arrol.QualityHead
  hidden: jax.Array
  pred: jax.Array


@generators.register("arrol")
def arrol(ctx: generators.GeneratorContext, *, oversample: float = 0.5, at: int = 8, target: float = 0.5,
          min_examples: int = 64) -> generators.Generator:
  """ARRoL over the run's sampler settings.

  Args:
    ctx: the build context (model, sampler settings, `batch_size` B: prompts a call).
    oversample: extra rows per prompt, a share of N (> 0).
    at: prefix tokens decoded before pruning, in [1, rollout.max_new_tokens).
    target: the kept share of rows the head rates likely to succeed, in [0, 1].
    min_examples: outcomes the head sees before it prunes (random pruning until then), >= 0.

  Returns:
    A `Generator` whose state is an `ArrolState`. Stats: `rollouts` (every row started),
    `generated_tokens` (pruned prefixes included), `arrol/pruned_rows`, `arrol/head_ready`,
    `arrol/head_accuracy` (on the kept rows' outcomes).
  """
  name, conf = "arrol", ctx.sampling
  N, T = conf.num_samples, conf.max_new_tokens
  if isinstance(oversample, bool) or not isinstance(oversample, (int, float)) or not oversample > 0:
    raise generators.setting_error(name, "oversample", f"must be a number > 0, got {oversample!r}")
  if isinstance(at, bool) or not isinstance(at, int) or not 1 <= at < T:
    raise generators.setting_error(name, "at", f"must be an integer in [1, rollout.max_new_tokens={T}), got {at!r}")
  if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 <= target <= 1:
    raise generators.setting_error(name, "target", f"must be in [0, 1], got {target!r}")
  if isinstance(min_examples, bool) or not isinstance(min_examples, int) or min_examples < 0:
    raise generators.setting_error(name, "min_examples", f"must be an integer >= 0, got {min_examples!r}")
  if ctx.batch_size < 1:
    raise ValueError("The arrol generator needs GeneratorContext.batch_size (the prompts of one call).")
  M = control.arrol.oversampled(N, float(oversample))
  B = ctx.batch_size

  def init():
    H = ctx.cfg.hidden_size
    return ArrolState(head=control.arrol.head_init(H), hidden=jnp.zeros((B, N, H), jnp.float32),
                      pred=jnp.zeros((B, N), jnp.float32))

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    ids, mask = np.asarray(prompts.ids), np.asarray(prompts.mask)
    if ids.shape[0] != B:
      raise ValueError(f"The arrol generator was built for {B} prompts a call, got {ids.shape[0]}.")
    first = jax.device_get(sampling.sample(ctx.cfg, params, ids, mask, key, conf.replace(num_samples=M,
                                                                                          max_new_tokens=at)))
    P, H = ids.shape[1], ctx.cfg.hidden_size
    tokens, attn = teacher_forced_rows(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(first.completion_ids))
    hidden = models.forward(ctx.cfg, params, tokens, attn, return_hidden=True)
    last = P + np.maximum(np.asarray(first.lengths).reshape(-1), 1) - 1
    h = np.asarray(jnp.take_along_axis(hidden, jnp.asarray(last)[:, None, None], axis=1)[:, 0], np.float32)
    p = np.asarray(control.arrol.head_predict(state.head, h)).reshape(B, M)
    ready = int(state.head.examples) >= min_examples
    sel = np.asarray(control.arrol.prune(jnp.asarray(p), N, jax.random.fold_in(key, 3), target=float(target),
                                         ready=ready))
    pre = sol_rl_lib.gather_samples(first, sel)
    out = jax.device_get(sampling.continue_from(
        ctx.cfg, params, ids, mask, pre.completion_ids, pre.completion_mask, jax.random.fold_in(key, 4), conf,
        prefix_logprobs=pre.logprobs, prefix_policy_logprobs=pre.policy_logprobs, prefix_entropy=pre.entropy))
    batch = sampling.from_samples(ids, mask, out, prompt_index=prompts.index, policy_version=version)
    pruned = np.ones((B, M), bool)
    np.put_along_axis(pruned, sel, False, axis=1)
    stats = generators.decode_stats(batch)
    stats.update({"generated_tokens": stats["generated_tokens"] + float(np.asarray(first.lengths)[pruned].sum()),
                  "rollouts": float(B * M), "arrol/pruned_rows": float(pruned.sum()),
                  "arrol/head_ready": generators.Mean(ready)})
    kept = ArrolState(head=state.head, hidden=jnp.asarray(np.take_along_axis(h.reshape(B, M, H), sel[..., None], 1)),
                      pred=jnp.asarray(np.take_along_axis(p, sel, axis=1)))
    return batch, kept, stats

  def finish(state, params, batch, key, *, version: int):
    """The head learns from the kept rows' outcomes (before any budget mask: every kept row was decoded)."""
    del params, key, version
    success = np.asarray(batch.rewards) >= 1.0
    acc = float(((np.asarray(state.pred) > 0.5) == success).mean())
    head = control.arrol.head_update(state.head, state.hidden.reshape(-1, state.hidden.shape[-1]), jnp.asarray(success.reshape(-1)),
                                     jnp.asarray(np.asarray(batch.sample_mask).reshape(-1)))
    return batch, state.replace(head=head), {"arrol/head_accuracy": generators.Mean(acc)}

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update, finish=finish)
