"""The rollout pipeline: one step's GENERATE -> FILTER -> CONTROL -> REPLAY, composed from built stages.

`RolloutPipeline` is built once by `loop.train` from the config's sections (each stage from
its own) and holds no hidden state: everything that changes from step to step (the
selector's per-prompt statistics, the replay buffer, cached reference rewards) lives in a
`PipelineState` pytree that the loop checkpoints next to the train state, so a killed run
resumes bitwise.

One step (`collect`):
  1. CONTROL selects B prompts and their budgets (`selector.select`).
  2. GENERATE samples N completions each into a `RolloutBatch`: the configured generator
     (`rollout.generators`: plain sampling, Sol-RL's FP4 pool, ARRoL pruning, SPEC-RL, trees,
     a distillation window ...).
  3. FILTER scores them (verifiers in a grader pool and/or label-free group rewards); the
     generator finishes its groups (`generator.finish`: Sol-RL's subset, TreeRL's node
     advantages ...), the teacher scores them (distillation) and the generator learns from
     them (`generator.update`).
  4. Dynamic sampling (a CONTROL group filter) refills until B informative groups or the
     refill budget; surplus informative groups go to the REPLAY buffer, whose stored groups
     are offered first the next step.
  5. The selector learns from every generated group (`selector.update`); the batch gets the
     extras its advantage recipe reads (clusters, sequence log-probs, reference rewards).

With partial rollouts (APRIL), step 2 instead over-provisions requests (stored unfinished
groups first, then fresh prompts), stops decoding once B groups have finished, and stores
every other group, finished or not, in `replay.partial_rollouts` to be resumed next step
under the newer policy (`sampling.continue_from`); each token keeps the behaviour log-prob
and the policy version that produced it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Mapping, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import control, losses, models, replay, rewards, rollout, sampling, tasks
from rollouts_jax.advantages import clustering
from rollouts_jax.rollout import extras as rollout_extras
from rollouts_jax.sampling.batch import RolloutBatch
from rollouts_jax.training import rl_step as rl_step_lib
from rollouts_jax.training.evaluation import Prompter, decode_completions

log = logging.getLogger(__name__)

# The largest teacher vocabulary log-prob array (bytes) full-vocabulary distillation builds per step.
FULL_KL_MAX_BYTES = 2**30
#: Generations in a row without an informative group after which dynamic sampling with
#: `max_refills=-1` stops refilling (every prompt it draws is solved, or none is).
STALL_REFILLS = 16


def check_full_kl_bytes(distill: str, positions: int, vocab_size: int) -> None:
  """Refuses full-vocabulary distillation whose teacher array (4 * positions * vocab bytes) is too large.

  >>> check_full_kl_bytes("opd_full", 64 * 40, 108)   # the arithmetic miniature: about 1 MiB
  """
  need = 4 * int(positions) * int(vocab_size)
  if need > FULL_KL_MAX_BYTES:
    raise ValueError(f"rollout.distill={distill!r}: the teacher's log-probs over the vocabulary would take "
                     f"{need / 2**30:.2f} GiB ({positions} positions x {vocab_size} tokens), above the "
                     f"{FULL_KL_MAX_BYTES / 2**30:.2f} GiB limit; use the single-sample form "
                     f"(rollout.distill={distill.removesuffix('_full')!r}) or fewer samples / tokens.")


@flax.struct.dataclass
class RefRewards:
  """Cached reference-policy rewards per prompt (PVPO's static anchor)."""
  rewards: jax.Array     # float32 [num_prompts, M]
  step: jax.Array        # int32 [num_prompts]: the step they were computed at (-1: never)


@flax.struct.dataclass
class PipelineState:
  control: Any
  replay: Any = None
  ref: Any = None
  partial: Any = None
  generator: Any = None


@dataclasses.dataclass
class RolloutPipeline:
  """The built stages of one experiment (see the module docstring).

  Attributes:
    cfg: model configuration.
    prompter: formats and pads prompts of the task.
    examples: the training prompts' examples (label fields unread by label-free rewards).
    sampling_config: GENERATE's settings (N = num_samples).
    scorer: FILTER (a `rewards.GroupScorer`).
    selector: CONTROL's prompt selector.
    batch_size: B, groups per update.
    dynamic_sampling, max_refills: the DAPO group filter and its generation budget (-1: refill
      until B groups are informative, giving up only after `STALL_REFILLS` fruitless refills
      in a row).
    buffer: REPLAY's buffer (None: off).
    max_staleness: replayed groups older than this many updates are dropped.
    clusters: "strategy" or "answer" cluster ids for uniqueness recipes (None: not needed).
    ref_samples, ref_refresh: PVPO reference rollouts per prompt and their refresh period.
    overlong_buffer: DAPO soft overlong punishment (0: off).
    partial, partial_requests: APRIL's store of unfinished groups and the groups requested
      per step (None / 0: off).
    teacher_params, teacher_cfg: a stronger policy (ERILS's external policy, distillation's
      teacher) and its model config (None: the student's; any size with the same vocabulary).
    external_samples: ERILS's teacher rollouts per prompt (0: off); they join each group
      with `source_ids` 1, finished ones only.
    distill: on-policy distillation's teacher signal ("opd", "opd_full"; "": off): per-token
      advantages log p_teacher - log p_student on the student's rollouts; with "opd_full" the
      batch carries the teacher's log-probs over the vocabulary instead
      (`RolloutBatch.teacher_logprobs`) and the update minimizes the full-vocabulary KL
      (reverse, or forward with `rl.distill_kl`). The generators "esr" and "adwin" shorten
      the rollouts it scores.
    generator: GENERATE's `rollout.Generator` (None: plain sampling, "sample"); its state is
      `PipelineState.generator`.
    env: the multi-turn environment's settings (`envs.EnvSettings`; None: single-turn). Its
      generator ("multiturn") sets the rewards itself (`Generator.scores`): FILTER is skipped.
    seed: the run's seed.
  """
  cfg: models.ModelConfig
  prompter: Prompter
  examples: Sequence[dict]
  sampling_config: sampling.SamplingConfig
  scorer: rewards.GroupScorer
  selector: control.PromptSelector
  batch_size: int
  dynamic_sampling: bool = False
  max_refills: int = -1
  buffer: Optional[replay.RolloutBuffer] = None
  max_staleness: int = 4
  clusters: Optional[str] = None
  needs_seq_logprobs: bool = False
  ref_samples: int = 0
  ref_refresh: int = 0
  presample: bool = False
  overlong_buffer: int = 0
  max_failure_frac: float = 0.5
  partial: Optional[replay.RolloutBuffer] = None
  partial_requests: int = 0
  teacher_params: Any = None
  teacher_cfg: Optional[models.ModelConfig] = None
  external_samples: int = 0
  distill: str = ""
  generator: Optional[rollout.Generator] = None
  generator_name: str = "sample"
  generator_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  env: Any = None
  seed: int = 0

  def __post_init__(self):
    if self.generator is None:   # GENERATE's generator, built from this pipeline's context
      self.generator = rollout.build(self.generator_name, self.generator_context, **self.generator_kwargs)

  @property
  def task(self) -> tasks.Task:
    return self.prompter.task

  @property
  def num_samples(self) -> int:
    return self.sampling_config.num_samples

  @property
  def generator_context(self) -> rollout.GeneratorContext:
    """What GENERATE's generators are built from."""
    # The distillation teacher only: ERILS's external policy is not a teacher to the generators.
    teacher = (self.teacher_cfg or self.cfg, self.teacher_params) if self.distill else None
    return rollout.GeneratorContext(cfg=self.cfg, sampling=self.sampling_config, num_prompts=len(self.examples),
                                    seed=self.seed, batch_size=self.batch_size, teacher=teacher, env=self.env,
                                    tokenizer=self.prompter.tokenizer, examples=self.examples)

  # -- state -------------------------------------------------------------------------------------
  def init_state(self) -> PipelineState:
    buf = None
    if self.buffer is not None:
      buf = self.buffer.init()
    ref = None
    if self.ref_samples:
      n = len(self.examples)
      ref = RefRewards(rewards=jnp.zeros((n, self.ref_samples), jnp.float32), step=jnp.full((n,), -1, jnp.int32))
    partial = self.partial.init() if self.partial is not None else None
    return PipelineState(control=self.selector.init(), replay=buf, ref=ref, partial=partial,
                         generator=self.generator.init())

  @property
  def distill_full(self) -> bool:
    """Whether distillation uses the full-vocabulary reverse KL (else the single-sample advantage)."""
    return self.distill.endswith("_full")

  def buffer_example(self) -> RolloutBatch:
    """The group shape stored in the replay buffer (prompts padded to max_prompt_len's bucket)."""
    P = sampling.bucket_length(self.prompter.max_prompt_len, self.prompter.buckets)
    ex = RolloutBatch.empty(1, self.num_samples, P, self.sampling_config.max_new_tokens)
    extras = {"entropy": np.zeros(ex.completion_ids.shape, np.float32)}
    if "old_logprobs" in self.generator.fields:
      extras["old_logprobs"] = np.zeros(ex.completion_ids.shape, np.float32)
    return ex.replace(**extras)

  # -- one step ----------------------------------------------------------------------------------
  def collect(self, state: PipelineState, params, step: int, key: jax.Array, *, ref_params=None,
              version: int | None = None) -> tuple[RolloutBatch, PipelineState, dict[str, float]]:
    """One step's batch of B groups, the new pipeline state and the step's rollout metrics.

    `version` is the number of updates behind `params` (default `step`: the synchronous loop);
    it tags every generated token (`policy_version`) and ages replayed groups.
    """
    version = step if version is None else version
    B, N = self.batch_size, self.num_samples
    stats = _Stats()
    ctl = state.control
    parts: list[RolloutBatch] = []
    replayed = 0
    buf_state = state.replay
    if self.buffer is not None:
      got, buf_state = self.buffer.sample(buf_state, jax.random.fold_in(key, 7), B, version=version)
      got = jax.device_get(got)
      replayed = int(np.any(got.sample_mask, axis=1).sum())
      if replayed:
        parts.append(got.take(np.flatnonzero(np.any(got.sample_mask, axis=1))))
    refill = informative = fruitless = 0
    ref_state = state.ref
    partial_state = state.partial
    gstate = state.generator
    while self.partial is not None:  # APRIL: one over-provisioned, early-stopped generation
      part, ctl, partial_state = self._generate_partial(params, ctl, partial_state, version, key, stats)
      plan = control.Plan(indices=part.prompt_index, budget=part.sample_mask.sum(1).astype(np.int32))
      ctl = self.selector.update(ctl, plan, part.rewards, part.sample_mask, entropy_BxN=_mean_entropy(part),
                                 lengths_BxN=np.asarray(part.lengths))
      parts.append(part)
      break
    while self.partial is None:
      plan, ctl = self.selector.select(ctl, jax.random.fold_in(key, 100 + refill), B,
                                       **self._select_extras(params, stats))
      part, gstate, plan, ctl = self._generate(params, plan, step, jax.random.fold_in(key, refill), stats, gstate,
                                               ref_params, version, ctl)
      n = len(np.asarray(plan.indices))   # (a second view's groups follow the first n)
      extra = {}
      if self.ref_samples:  # reference rewards of the plan's prompts (cached), for the selector too
        with_ref, ref_state = self._reference(part, ref_state, ref_params, step, jax.random.fold_in(key, 200 + refill),
                                              stats)
        extra = dict(ref_rewards_BxM=with_ref.ref_rewards[:n], ref_mask_BxM=with_ref.ref_mask[:n])
      ctl = self.selector.update(ctl, plan, part.rewards[:n], part.sample_mask[:n],
                                 entropy_BxN=_mean_entropy(part)[:n], lengths_BxN=np.asarray(part.lengths)[:n],
                                 **extra)
      parts.append(part)
      if not self.dynamic_sampling:
        break
      found = int(np.asarray(control.informative(part.rewards, part.sample_mask)).sum())
      informative += found
      fruitless = 0 if found else fruitless + 1
      if informative >= B:
        break
      capped = 0 <= self.max_refills <= refill
      if capped or fruitless >= STALL_REFILLS:
        log.warning("Step %d: dynamic sampling stopped after %d refills with %d of %d informative groups "
                    "(%s); the step trains on the %d it has.", step + 1, refill, informative, B,
                    f"control.max_refills={self.max_refills}" if capped else
                    f"{fruitless} generations in a row found none", informative)
        stats.add("dynamic_sampling_gave_up", 1.0)
        stats.add("dynamic_sampling/shortfall", float(B - informative))
        break
      refill += 1
    batch = parts[0] if len(parts) == 1 else sampling.concat(parts)
    if self.dynamic_sampling or self.buffer is not None:
      keep, ok = control.dynamic_sampling(batch.rewards, B, batch.sample_mask) if self.dynamic_sampling else (
          np.arange(B), np.ones((B,), bool))
      keep, ok = np.asarray(keep), np.asarray(ok)
      if self.buffer is not None:
        surplus = np.setdiff1d(np.flatnonzero(np.asarray(control.informative(batch.rewards, batch.sample_mask))),
                               keep)
        if surplus.size:
          store = _pad_for_buffer(batch.take(surplus), self.buffer_example())
          for i in range(0, store.prompt_ids.shape[0], B):
            buf_state = self.buffer.add(buf_state, store.take(np.arange(i, min(i + B, store.prompt_ids.shape[0]))))
        stats.add("replay/stored", float(surplus.size))
      sampled = batch
      batch = batch.take(keep)
      batch = batch.replace(sample_mask=batch.sample_mask & ok[:, None])
    else:
      sampled = batch
    if self.buffer is not None and batch.old_logprobs is None:
      # Replayed groups were sampled by older policies: the ratio is taken against the
      # behaviour log-probs of every group (for fresh ones they equal the current policy's).
      batch = batch.replace(old_logprobs=batch.behaviour_logprobs)
    batch = self._extras(batch, stats)
    if self.ref_samples:
      batch, ref_state = self._reference(batch, ref_state, ref_params, step, key, stats)
    # The update runs on completions cut to the longest one kept (rounded up to a multiple of 8,
    # so few shapes compile): positions past every row's end carry no loss, only compute. A row's
    # end is its last loss position, not its count of them: multi-turn rows hold observation
    # tokens (mask False) between their turns.
    lengths = np.asarray(batch.lengths)
    width = min(batch.completion_ids.shape[-1], max(8, -(-loss_extent(batch.completion_mask) // 8) * 8))
    batch = batch.trim(width)
    info = stats.summary()
    r, live = np.asarray(batch.rewards), np.asarray(batch.sample_mask)
    if batch.source_ids is not None:   # step statistics of the policy's own rollouts (ERILS)
      live = live & (np.asarray(batch.source_ids) == 0)
    ent = np.asarray(batch.entropy) if batch.entropy is not None else np.zeros(batch.completion_ids.shape)
    m = np.asarray(batch.completion_mask) & live[..., None]
    info.update({
        "reward_mean": float(r[live].mean()) if live.any() else 0.0,
        "reward_std": float(r[live].std()) if live.any() else 0.0,
        # Over every group sampled this step, before any filter (equal to reward_mean without one).
        "reward_mean_sampled": float(np.asarray(sampled.rewards)[np.asarray(sampled.sample_mask)].mean()),
        "accuracy": float((r[live] >= 1.0).mean()) if live.any() else 0.0,
        "response_length": float(lengths[live].mean()) if live.any() else 0.0,
        "entropy": float((ent * m).sum() / max(m.sum(), 1)),
        "informative_groups": float(np.asarray(control.informative(batch.rewards, batch.sample_mask)).mean()),
        "refills": float(refill), "replay/used": float(replayed),
        "rollouts": float(stats.get("rollouts")),
    })
    return batch, PipelineState(control=ctl, replay=buf_state, ref=ref_state, partial=partial_state,
                                generator=gstate), info

  # -- stages ------------------------------------------------------------------------------------
  def _sample(self, params, ids, mask, key, conf, cfg=None):
    return jax.device_get(sampling.sample(cfg or self.cfg, params, ids, mask, key, conf))

  def _generate(self, params, plan: control.Plan, step: int, key: jax.Array, stats: "_Stats", gstate, anchor,
                version: int, ctl=None):
    """GENERATE + FILTER for the plan's prompts: (a scored RolloutBatch of B groups, the generator's
    state, the plan as refined, the selector's state).

    The fixed sequence: the generator generates the plan's budgets (a selector with a second
    phase, `PromptSelector.refine`, sees them scored and the generator decodes the rollouts it
    adds, merged into the groups), FILTER scores (a second view too, for Co-Reward), the
    generator finishes its groups (`Generator.finish`), the side steps add what the update
    reads (the teacher's signal, ERILS's external rollouts), the selector's budget masks the
    samples, and the generator learns from the result. `params` are the policy after
    `version` updates (the tag of every token it generates).
    """
    idx = np.asarray(plan.indices)
    examples = [self.examples[int(i)] for i in idx]
    ids, mask = self.prompter(examples)
    N = self.num_samples
    t0 = time.perf_counter()
    prompts = rollout.Prompts(ids=np.asarray(ids, np.int32), mask=np.asarray(mask, bool), index=idx.astype(np.int32),
                              budget=np.asarray(plan.budget, np.int32))
    batch, gstate, gstats = self.generator.generate(gstate, params, prompts, key, version=version)
    gstats = dict(gstats)
    decoded, started = gstats.pop("generated_tokens", None), gstats.pop("rollouts", None)
    if self.selector.refine is not None:   # the selector's second phase, from the first one's rewards
      first, _ = self._score(batch, examples, _Stats())
      refined, ctl = self.selector.refine(ctl, plan, first, plan.sample_mask(N))
      more = np.asarray(refined.budget) - np.asarray(plan.budget)
      if more.sum():
        added, gstate, astats = self.generator.generate(gstate, params, prompts.replace(budget=more.astype(np.int32)),
                                                        jax.random.fold_in(key, 3), version=version)
        astats = dict(astats)
        batch = batch.extend_groups(added, plan.budget, more)
        decoded = _sum_or_none(decoded, astats.pop("generated_tokens", None))
        started = _sum_or_none(started, astats.pop("rollouts", None))
        stats.add_all(astats)
        stats.add("control/phase2_rollouts", float(more.sum()))
      plan = refined
    stats.add_all(gstats)
    stats.add("time/sample", time.perf_counter() - t0)
    second = None
    if self.scorer.needs_second_view:
      views = [self.task.rewrite(ex, self.seed) for ex in examples]
      vids, vmask = self.prompter(views)
      vout = self._sample(params, vids, vmask, jax.random.fold_in(key, 2), self.sampling_config)
      second = sampling.from_samples(vids, vmask, vout, prompt_index=idx, policy_version=version)
    if self.generator.scores:   # the environment's rewards (multi-turn): no text reward overwrites them
      r, info = np.asarray(batch.rewards, np.float32), {}
    else:
      r, info = self._score(batch, examples, stats, second_view=second, anchor_params=anchor)
    batch = batch.replace(rewards=r)
    stats.add("rollouts", float(N * len(idx)) if started is None else started)
    stats.add("generated_tokens", float(np.asarray(batch.lengths).sum()) if decoded is None else decoded)
    stats.add("rollout/padding_frac", _padding_frac(np.asarray(batch.lengths).ravel()))
    if self.generator.finish is not None:
      batch, gstate, fstats = self.generator.finish(gstate, params, batch, key, version=version)
      stats.add_all(fstats)
    if self.distill_full:
      _, teacher = self._teacher_advantages(batch, stats, vocab=True)
      batch = batch.replace(teacher_logprobs=teacher)
    elif self.distill:
      batch = batch.replace(token_advantages=self._teacher_advantages(batch, stats))
    if self.external_samples:
      batch = self._external(batch, ids, mask, idx, examples, step, jax.random.fold_in(key, 5), stats)
    if second is not None:
      second = second.replace(rewards=info["second_view_rewards"])
      stats.add("rollouts", float(N * len(idx)))
      stats.add("generated_tokens", float(np.asarray(second.lengths).sum()))
      batch = sampling.concat([batch, second])
    stats.add("rollouts_budget", float(np.asarray(plan.budget).sum()))  # what the selector spent
    budget_mask = np.asarray(plan.sample_mask(N))
    if self.external_samples:   # external rollouts are outside the selector's budget
      budget_mask = np.concatenate([budget_mask, np.ones((budget_mask.shape[0], self.external_samples), bool)], 1)
    if batch.prompt_ids.shape[0] != budget_mask.shape[0]:   # two views: both follow the plan's budget
      budget_mask = np.concatenate([budget_mask] * (batch.prompt_ids.shape[0] // budget_mask.shape[0]))
    batch = batch.replace(sample_mask=batch.sample_mask & budget_mask)
    # The generator learns from its scored groups (the first view's).
    first = batch if batch.prompt_ids.shape[0] == len(idx) else batch.take(np.arange(len(idx)))
    gstate = self.generator.update(gstate, first, version=version)
    return batch, gstate, plan, ctl

  def _generate_partial(self, params, ctl, pstate, version: int, key: jax.Array, stats: "_Stats"):
    """APRIL: B finished, scored groups; unfinished and surplus groups go back to the store.

    `params` are the policy after `version` updates: the tag of the tokens generated now.
    """
    B, N = self.batch_size, self.num_samples
    conf = self.sampling_config
    T = conf.max_new_tokens
    got, pstate = self.partial.sample(pstate, None, self.partial_requests)
    got = jax.device_get(got)
    resumed = got.take(np.flatnonzero(np.asarray(got.prompt_index) >= 0))
    n_old = resumed.prompt_ids.shape[0]
    n_new = self.partial_requests - n_old
    ex = self.buffer_example()
    groups = [resumed] if n_old else []
    if n_new:
      plan, ctl = self.selector.select(ctl, jax.random.fold_in(key, 100), n_new)
      idx = np.asarray(plan.indices)
      ids, mask = self.prompter([self.examples[int(i)] for i in idx])
      ids, mask = sampling.left_pad_to(np.asarray(ids), np.asarray(mask), ex.prompt_ids.shape[1], conf.pad_id)
      fresh = RolloutBatch.empty(n_new, N, ids.shape[1], T).replace(
          prompt_ids=ids.astype(np.int32), prompt_mask=mask.astype(bool), prompt_index=idx.astype(np.int32),
          sample_mask=np.asarray(plan.sample_mask(N)), entropy=np.zeros((n_new, N, T), np.float32))
      groups.append(fresh)
      stats.add("rollouts_budget", float(np.asarray(plan.budget).sum()))
    req = jax.device_get(groups[0] if len(groups) == 1 else sampling.concat(groups))
    was = np.asarray(req.completion_mask)
    done_in = np.asarray(sampling.finished_rows(req.completion_ids, was, conf)) | ~np.asarray(req.sample_mask)
    # Prefix widths come in three buckets, so resumed steps compile at most three shapes.
    longest = int(was.sum(-1).max(initial=0))
    L = next(w for w in (max(T // 4, 1), max(T // 2, 1), T) if w >= longest)
    t0 = time.perf_counter()
    out = jax.device_get(sampling.continue_from(
        self.cfg, params, req.prompt_ids, req.prompt_mask, np.asarray(req.completion_ids)[..., :L], was[..., :L], key,
        conf, prefix_logprobs=np.asarray(req.behaviour_logprobs)[..., :L],
        prefix_entropy=np.asarray(req.entropy)[..., :L], finished=done_in, stop_after_groups=B))
    stats.add("time/sample", time.perf_counter() - t0)
    new = np.asarray(out.completion_mask) & ~was
    batch = req.replace(completion_ids=np.asarray(out.completion_ids), completion_mask=np.asarray(out.completion_mask),
                        behaviour_logprobs=np.asarray(out.logprobs, np.float32),
                        entropy=np.asarray(out.entropy, np.float32),
                        policy_version=np.where(new, version, np.asarray(req.policy_version)).astype(np.int32))
    done = np.asarray(sampling.finished_rows(batch.completion_ids, batch.completion_mask, conf)) | done_in
    finished = np.flatnonzero(done.all(axis=1))   # stored (older) groups come first
    use = finished[:B]
    rest = np.setdiff1d(np.arange(req.prompt_ids.shape[0]), use)
    if rest.size:
      pstate = self.partial.add(pstate, batch.take(rest))
    batch = batch.take(use)
    examples = [self.examples[int(i)] for i in np.asarray(batch.prompt_index)]
    r, _ = self._score(batch, examples, stats)
    batch = batch.replace(rewards=r)
    live = np.asarray(batch.completion_mask) & np.asarray(batch.sample_mask)[..., None]
    stats.add("rollouts", float(n_new * N))
    stats.add("generated_tokens", float(new.sum()))
    stats.add("rollout/padding_frac", _padding_frac(new.sum(-1)[~done_in]))
    stats.add("april/resumed_groups", float(n_old))
    stats.add("april/stored_groups", float(rest.size))
    stats.add("april/stored_unfinished_groups", float((~done[rest].all(axis=1)).sum()))
    stats.add("april/off_policy_token_frac",
              float((np.asarray(batch.policy_version) < version)[live].mean()) if live.any() else 0.0)
    return batch, ctl, pstate

  def _teacher_advantages(self, batch: RolloutBatch, stats: "_Stats", vocab: bool = False):
    """On-policy distillation: per-token log p_teacher(y_t) - log p_student(y_t), 0 off the mask.

    The single-sample form of the reverse KL (GKD, Agarwal et al. 2024): maximizing it pulls
    the student toward the teacher on the student's own prefixes.

    With `vocab`, returns (those advantages, the teacher's log-probs over the vocabulary
    float32 [B, N, T, V], 0 off the mask) from one teacher forward: the input of the
    full-vocabulary loss (`losses.full_reverse_kl`). That array costs 4 B N T V bytes; above
    `FULL_KL_MAX_BYTES` it is refused (use the single-sample form).
    """
    cfg = self.teacher_cfg or self.cfg
    m = np.asarray(batch.completion_mask)
    teacher = None
    if vocab:
      check_full_kl_bytes(self.distill, math.prod(m.shape), cfg.vocab_size)
      teacher = np.asarray(rl_step_lib.batch_logprobs(
          self.teacher_params, jnp.asarray(batch.prompt_ids, jnp.int32), jnp.asarray(batch.prompt_mask),
          jnp.asarray(batch.completion_ids, jnp.int32), jnp.asarray(m), cfg=cfg,
          temperature=float(self.sampling_config.temperature), vocab=True), np.float32)
      teacher_lp = np.take_along_axis(teacher, np.asarray(batch.completion_ids)[..., None], axis=-1)[..., 0]
      adv = rollout_extras.reverse_kl_advantages(teacher_lp, batch)
    else:
      adv = rollout_extras.teacher_advantages((cfg, self.teacher_params), batch, self.sampling_config.temperature)
    stats.mean("distill/reverse_kl", float(-adv[m].mean()) if m.any() else 0.0)
    return (adv, teacher) if vocab else adv

  def _external(self, batch: RolloutBatch, ids, mask, idx, examples, step: int, key, stats: "_Stats"):
    """ERILS: the external policy's rollouts of the same prompts join each group (source 1).

    Length control: only rollouts that ended with EOS within the budget are kept (a
    truncated external rollout is masked out, never trained on).
    """
    conf = self.sampling_config
    K = self.external_samples
    out = self._sample(self.teacher_params, ids, mask, key, conf.replace(num_samples=K), cfg=self.teacher_cfg)
    ext = sampling.from_samples(ids, mask, out, prompt_index=idx, policy_version=-1)
    lengths = np.asarray(out.lengths)
    ended = np.ones(lengths.shape, bool)   # without an EOS id nothing can be told apart
    if conf.eos_ids:
      last = np.take_along_axis(np.asarray(out.completion_ids), np.maximum(lengths - 1, 0)[..., None], axis=-1)[..., 0]
      ended = np.isin(last, conf.eos_ids) & (lengths > 0)
    ext = ext.replace(sample_mask=ended)
    r, _ = self._score(ext, examples, _Stats())
    ext = ext.replace(rewards=r)
    stats.add("erils/external_rollouts", float(K * len(idx)))
    stats.add("erils/rejected_overlong", float((~ended).sum()))
    stats.mean("erils/external_reward_mean", float(r[ended].mean()) if ended.any() else 0.0)
    stats.add("generated_tokens", float(np.asarray(out.lengths).sum()))
    B, N = batch.sample_mask.shape
    src = np.concatenate([np.zeros((B, N), np.int32), np.ones((B, K), np.int32)], 1)
    tok = lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)], 1)
    fields = {f: tok(getattr(batch, f), getattr(ext, f)) for f in (
        "completion_ids", "completion_mask", "behaviour_logprobs", "policy_version", "rewards", "sample_mask",
        "entropy")}
    return batch.replace(source_ids=src, **fields)

  def _anchor_syntheses(self, examples, texts, anchor_params) -> list[str]:
    """CaT: the frozen anchor reads each group's answers and writes one reference (greedy)."""
    if anchor_params is None:
      raise ValueError("reward term 'cat' needs the anchor policy (the run's initial policy).")
    from rollouts_jax import data as data_lib  # pylint: disable=g-import-not-at-top
    tok = self.prompter.tokenizer
    prompts = [rewards.cat_prompt(self.task.prompt(ex, tok, self.prompter.template,
                                                   instruction=self.prompter.instruction),
                                  [self.task.extract(t) for t in row]) for ex, row in zip(examples, texts)]
    ids, mask = data_lib.pad_left([tok.encode(p) for p in prompts], self.prompter.buckets, pad_id=tok.pad_id)
    conf = self.sampling_config.replace(num_samples=1, greedy=True)
    out = self._sample(anchor_params, np.asarray(ids, np.int32), np.asarray(mask, bool), jax.random.key(0), conf)
    return [row[0] for row in decode_completions(tok, np.asarray(out.completion_ids), np.asarray(out.completion_mask))]

  def _score(self, batch: RolloutBatch, examples, stats: "_Stats", second_view: RolloutBatch | None = None,
             anchor_params=None):
    """FILTER: rewards [B, N] of a batch (references read only when the reward needs labels)."""
    t0 = time.perf_counter()
    texts = decode_completions(self.prompter.tokenizer, np.asarray(batch.completion_ids),
                               np.asarray(batch.completion_mask))
    anchor = self._anchor_syntheses(examples, texts, anchor_params) if self.scorer.needs_anchor else None
    refs = [self.task.reference(ex) for ex in examples] if self.scorer.needs_labels else None
    second = None
    if second_view is not None:
      second = decode_completions(self.prompter.tokenizer, np.asarray(second_view.completion_ids),
                                  np.asarray(second_view.completion_mask))
    r, info = self.scorer(texts, refs, entropy_BxN=_mean_entropy(batch), second_view=second, anchor_texts=anchor)
    if anchor is not None:
      stats.add("cat/skipped_groups", float(info["cat_skipped_groups"]))
    if self.overlong_buffer:
      r = r + np.asarray(losses.overlong_penalty(np.asarray(batch.lengths), max_len=self.sampling_config.max_new_tokens,
                                                 cache_len=self.overlong_buffer))
      if "second_view_rewards" in info:
        info["second_view_rewards"] = info["second_view_rewards"] + np.asarray(losses.overlong_penalty(
            np.asarray(second_view.lengths), max_len=self.sampling_config.max_new_tokens,
            cache_len=self.overlong_buffer))
    stats.add("time/score", time.perf_counter() - t0)
    grader = info.get("grader")
    if grader is not None:
      if grader["failures"]:
        log.warning(rewards.summarize_stats(grader))
      rewards.check_grader_health(grader, self.max_failure_frac, min_samples=8)
      stats.add("grader_no_answer", float(grader.get("no_answer", 0)))
    stats.add("grader_failures", float(info["failures"]))
    for k, v in info.items():
      if k.startswith("reward/"):
        stats.mean(k, v)
    return np.asarray(r, np.float32), info

  def _extras(self, batch: RolloutBatch, stats: "_Stats") -> RolloutBatch:
    """The extra inputs the advantage recipe reads."""
    extras = {}
    if self.needs_seq_logprobs:
      m = np.asarray(batch.completion_mask)
      lp = np.asarray(batch.behaviour_logprobs)
      extras["seq_logprobs"] = ((lp * m).sum(-1) / np.maximum(m.sum(-1), 1)).astype(np.float32)
    if self.clusters:
      texts = decode_completions(self.prompter.tokenizer, np.asarray(batch.completion_ids),
                                 np.asarray(batch.completion_mask))
      if self.clusters == "strategy":
        keys = [[self.task.strategy(t) for t in row] for row in texts]
      else:
        keys = [[self.task.extract(t) for t in row] for row in texts]
      extras["cluster_ids"] = np.asarray(clustering.cluster_by_answer(keys, normalize=lambda x: x), np.int32)
      ids = extras["cluster_ids"]
      stats.add("clusters_per_group", float(np.mean([len(set(row)) for row in ids.tolist()])))
    return batch.replace(**extras) if extras else batch

  def _select_extras(self, params, stats) -> dict:
    """What a selector's `select` may ask for beyond (state, key, B): HIVE's fresh prompt entropy."""
    import inspect  # pylint: disable=g-import-not-at-top
    if "prompt_entropy_fn" not in inspect.signature(self.selector.select).parameters:
      return {}
    return {"prompt_entropy_fn": lambda idx, tokens: self._prompt_entropy(params, np.asarray(idx), tokens, stats)}

  def _prompt_entropy(self, params, idx: np.ndarray, tokens: int, stats) -> np.ndarray:
    """float [P]: the policy's mean token entropy over a greedy `tokens`-token continuation of each prompt."""
    ids, mask = self.prompter([self.examples[int(i)] for i in idx])
    conf = self.sampling_config.replace(num_samples=1, max_new_tokens=tokens, greedy=True)
    out = jax.device_get(self._sample(params, ids, mask, jax.random.key(0), conf))
    m = np.asarray(out.completion_mask)[:, 0]
    stats.add("hive/entropy_tokens", float(m.sum()))
    return (np.asarray(out.entropy)[:, 0] * m).sum(1) / np.maximum(m.sum(1), 1)

  def presample_state(self, state: PipelineState, ref_params, key) -> tuple[PipelineState, dict[str, float]]:
    """PVPO's data pre-sampling (arXiv 2508.21104), before the first step.

    The reference policy rolls out every training prompt `ref_samples` times, B prompts at a
    time; the rewards fill the reference table (the advantage's anchors) and go to the
    selector's `update` as `ref_rewards_BxM`, so the PVPO selector knows each prompt's
    reference accuracy, and drops the always- and never-solved ones, before it picks any.
    """
    if not (self.presample and self.ref_samples):
      return state, {}
    n, B, stats = len(self.examples), self.batch_size, _Stats()
    table, steps = np.asarray(state.ref.rewards).copy(), np.asarray(state.ref.step).copy()
    ctl = state.control
    for start in range(0, n, B):
      idx = np.arange(start, min(start + B, n))
      padded = np.concatenate([idx, np.full((B - idx.size,), idx[-1])])   # one program for every chunk
      r = self._reference_rewards(padded, ref_params, jax.random.fold_in(key, start), stats)[:idx.size]
      table[idx], steps[idx] = r, 0
      plan = control.Plan(indices=jnp.asarray(idx, jnp.int32),
                          budget=jnp.full((idx.size,), self.sampling_config.num_samples, jnp.int32))
      zeros = np.zeros((idx.size, self.sampling_config.num_samples), np.float32)
      ctl = self.selector.update(ctl, plan, zeros, zeros.astype(bool), ref_rewards_BxM=r.astype(np.float32),
                                 ref_mask_BxM=np.ones(r.shape, bool))
    acc = (table > 0.5).mean(axis=1)
    info = {"ref/presample_rollouts": stats.get("ref/rollouts"), "ref/presample_solved_frac": float((acc >= 1).mean()),
            "ref/presample_unsolved_frac": float((acc <= 0).mean()), "ref/presample_reward_mean": float(table.mean())}
    log.info("PVPO pre-sampling: %d reference rollouts; %.0f%% of the prompts always solved, %.0f%% never.",
             info["ref/presample_rollouts"], 100 * info["ref/presample_solved_frac"],
             100 * info["ref/presample_unsolved_frac"])
    return state.replace(control=ctl, ref=RefRewards(rewards=jnp.asarray(table), step=jnp.asarray(steps))), info

  def _reference_rewards(self, prompts: np.ndarray, ref_params, key, stats) -> np.ndarray:
    """float [len(prompts), ref_samples]: rewards of the reference policy's rollouts of these prompts."""
    examples = [self.examples[int(i)] for i in prompts]
    ids, mask = self.prompter(examples)
    conf = self.sampling_config.replace(num_samples=self.ref_samples)
    out = self._sample(ref_params, ids, mask, jax.random.fold_in(key, 3), conf)
    rb = sampling.from_samples(ids, mask, out, prompt_index=prompts, policy_version=0)
    r, _ = self._score(rb, examples, _Stats())
    stats.add("ref/rollouts", float(self.ref_samples * len(prompts)))
    return np.asarray(r)

  def _reference(self, batch: RolloutBatch, ref: RefRewards, ref_params, step: int, key, stats):
    """PVPO: reference-policy rewards of the batch's prompts, computed once per prompt (or per refresh)."""
    idx = np.asarray(batch.prompt_index)
    cached_step = np.asarray(ref.step)[np.maximum(idx, 0)]
    stale = (idx >= 0) & ((cached_step < 0) | (self.ref_refresh > 0) & (step - cached_step >= self.ref_refresh))
    todo = np.unique(idx[stale])
    table, steps = np.asarray(ref.rewards).copy(), np.asarray(ref.step).copy()
    if todo.size:
      table[todo], steps[todo] = self._reference_rewards(todo, ref_params, key, stats), step
    ref_rewards = table[np.maximum(idx, 0)]
    ref_mask = np.repeat((idx >= 0)[:, None], self.ref_samples, axis=1)
    stats.add("ref/reward_mean", float(ref_rewards[idx >= 0].mean()) if (idx >= 0).any() else 0.0)
    return (batch.replace(ref_rewards=ref_rewards.astype(np.float32), ref_mask=ref_mask),
            RefRewards(rewards=jnp.asarray(table), step=jnp.asarray(steps)))


class _Stats:
  """Sums (and means) of a step's rollout metrics."""

  def __init__(self):
    self.sums: dict[str, float] = {}
    self.means: dict[str, list[float]] = {}

  def add(self, key, value):
    self.sums[key] = self.sums.get(key, 0.0) + float(value)

  def mean(self, key, value):
    self.means.setdefault(key, []).append(float(value))

  def get(self, key):
    return self.sums.get(key, 0.0)

  def add_all(self, stats: dict):
    """A generator's stats: `rollout.Mean` values are averaged over the step's calls, others summed."""
    for k, v in stats.items():
      (self.mean if isinstance(v, rollout.Mean) else self.add)(k, v)

  def summary(self) -> dict[str, float]:
    out = dict(self.sums)
    out.update({k: float(np.mean(v)) for k, v in self.means.items()})
    for k in ("time/sample", "time/score", "grader_failures", "generated_tokens"):
      out.setdefault(k, 0.0)
    return out


def loss_extent(completion_mask) -> int:
  """The completion width that holds every loss position: 1 + the last True column (0 if none).

  Unlike the longest row's count of loss tokens, it keeps the later turns of multi-turn rows,
  whose observation tokens are holes in the mask.

  >>> loss_extent(np.array([[[True, False, False, True, False]]])), loss_extent(np.zeros((1, 1, 3), bool))
  (4, 0)
  """
  m = np.asarray(completion_mask, bool).reshape(-1, np.shape(completion_mask)[-1]).any(0)
  return int(np.flatnonzero(m)[-1] + 1) if m.any() else 0


def _sum_or_none(a, b):
  """A count from two calls; None (count it from the batch) unless both generator calls reported it."""
  return None if a is None or b is None else a + b


def _padding_frac(new_tokens_R: np.ndarray) -> float:
  """The share of a decode loop's row-steps that produced no token (an accelerator-idle proxy).

  The loop runs as many steps as its longest row; a row that ended earlier pads the rest.

  >>> round(_padding_frac(np.array([4, 2, 2])), 4)
  0.3333
  """
  steps = int(new_tokens_R.max(initial=0))
  return 1.0 - float(new_tokens_R.sum()) / (new_tokens_R.size * steps) if steps else 0.0


def _mean_entropy(batch: RolloutBatch) -> np.ndarray:
  """float32 [B, N]: each sample's mean token entropy (0 for empty samples)."""
  if batch.entropy is None:
    return np.zeros(np.asarray(batch.rewards).shape, np.float32)
  m = np.asarray(batch.completion_mask)
  return ((np.asarray(batch.entropy) * m).sum(-1) / np.maximum(m.sum(-1), 1)).astype(np.float32)


def _pad_for_buffer(batch: RolloutBatch, example: RolloutBatch) -> RolloutBatch:
  """`batch` padded (prompts on the left, completions on the right) to the buffer's group shape."""
  P, T = example.prompt_ids.shape[1], example.completion_ids.shape[2]
  p, t = P - batch.prompt_ids.shape[1], T - batch.completion_ids.shape[2]
  if p < 0 or t < 0:
    raise ValueError(f"A batch of prompt length {batch.prompt_ids.shape[1]} does not fit the buffer's {P}.")
  tok = lambda x: None if x is None else np.pad(np.asarray(x), ((0, 0), (0, 0), (0, t)))
  fields = {f: tok(getattr(batch, f)) for f in ("completion_ids", "completion_mask", "behaviour_logprobs",
                                                  "policy_version", "old_logprobs", "entropy")}
  if fields["old_logprobs"] is None and example.old_logprobs is not None:
    fields["old_logprobs"] = fields["behaviour_logprobs"]
  return batch.replace(prompt_ids=np.pad(np.asarray(batch.prompt_ids), ((0, 0), (p, 0))),
                       prompt_mask=np.pad(np.asarray(batch.prompt_mask), ((0, 0), (p, 0))),
                       cluster_ids=None, seq_logprobs=None, ref_rewards=None, ref_mask=None, token_advantages=None,
                       teacher_logprobs=None, **fields)

