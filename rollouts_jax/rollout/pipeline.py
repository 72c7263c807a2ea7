"""The rollout step: select -> generate -> score -> filter -> replay -> extras, from built stages.

`RolloutPipeline` is built once by `training.build` from the config's sections and holds no
hidden state: the selector's statistics, the replay buffer, PVPO's reference table and the
generator's state (APRIL's store, SPEC-RL's drafts ...) live in a `PipelineState` pytree the
loop checkpoints, so a killed run resumes bitwise. `collect` is one step: (1) REPLAY's stored
groups first; (2) CONTROL selects B prompts and budgets (or as many fresh prompts as a
generator that picks its own groups `wants`), GENERATE decodes them (`rollout.generators`; a
two-phase selector sees the first phase scored), FILTER scores them (`rollout.filter`), the
generator finishes and learns, the selector learns; dynamic sampling repeats this until B
groups are informative; (3) the group filter keeps B, the surplus goes to REPLAY
(`rollout.groups`); (4) side steps set what the update reads (`rollout.extras`,
`rollout.reference`).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, Mapping, Optional, Sequence

import flax
import jax
import numpy as np

from rollouts_jax import control, models, replay, rewards, sampling
from rollouts_jax.rollout import extras, generators, groups, reference
from rollouts_jax.rollout.filter import Filter
from rollouts_jax.rollout.prompter import Prompter
from rollouts_jax.rollout.stats import StepStats, batch_summary, mean_entropy, padding_frac, update_width
from rollouts_jax.types import RolloutBatch

from rollouts_jax.rollout.groups import STALL_REFILLS  # noqa: F401  (where dynamic sampling gives up)


@flax.struct.dataclass
class PipelineState:
  control: Any
  replay: Any = None
  ref: Any = None
  generator: Any = None


@dataclasses.dataclass(kw_only=True)
class RolloutPipeline:
  """The built stages of one experiment; each field is its config key's (`training.build.build_pipeline`).

  The fields that carry a config value have no default here: the config section is their one
  source (`training.config`), so a default cannot drift from it. `max_refills` -1 refills until
  B groups are informative (`rollout.groups.Refills`); `teacher_params` / `teacher_cfg` are
  distillation's teacher or ERILS's external policy (`teacher_cfg` None: the student's); `env` a
  multi-turn environment, whose generator sets the rewards itself (`Generator.scores`: FILTER
  skipped). `buffer` (REPLAY) is set by the builder once the generator's batch shape is known;
  None: not configured.
  """
  cfg: models.ModelConfig
  prompter: Prompter
  examples: Sequence[dict]
  sampling_config: sampling.SamplingConfig
  scorer: rewards.GroupScorer
  selector: control.PromptSelector
  batch_size: int
  dynamic_sampling: bool
  max_refills: int
  max_staleness: int
  clusters: Optional[str]
  needs_seq_logprobs: bool
  ref_samples: int
  ref_refresh: int
  presample: bool
  overlong_buffer: int
  max_failure_frac: float
  external_samples: int
  distill: str
  generator_name: str
  generator_kwargs: Mapping[str, Any]
  seed: int
  teacher_params: Any = None
  teacher_cfg: Optional[models.ModelConfig] = None
  env: Any = None
  generator: Optional[generators.Generator] = None
  buffer: Optional[replay.RolloutBuffer] = None

  def __post_init__(self):
    self.filter = Filter(self.cfg, self.prompter, self.scorer, self.sampling_config, self.overlong_buffer,
                         self.max_failure_frac, self.seed)
    self.reference = reference.Reference(self.cfg, self.prompter, self.examples, self.sampling_config, self.filter,
                                         self.ref_samples, self.ref_refresh) if self.ref_samples else None
    if self.generator is None:
      self.generator = generators.build(self.generator_name, self.generator_context, **self.generator_kwargs)

  task = property(lambda self: self.prompter.task, doc="The task of the prompts.")
  num_samples = property(lambda self: self.sampling_config.num_samples, doc="N, samples per prompt.")
  teacher = property(lambda self: (self.teacher_cfg or self.cfg, self.teacher_params), doc="(cfg, params).")
  prompt_len = property(lambda self: sampling.bucket_length(self.prompter.max_prompt_len, self.prompter.buckets),
                        doc="The width every prompt of the pool is padded to (its bucket).")

  @property
  def generator_context(self) -> generators.GeneratorContext:
    """What GENERATE's generators are built from (the distillation teacher only, not ERILS's policy)."""
    return generators.GeneratorContext(
        cfg=self.cfg, sampling=self.sampling_config, num_prompts=len(self.examples), seed=self.seed,
        batch_size=self.batch_size, teacher=self.teacher if self.distill else None, env=self.env,
        tokenizer=self.prompter.tokenizer, examples=self.examples, prompt_len=self.prompt_len)

  def init_state(self) -> PipelineState:
    return PipelineState(control=self.selector.init(), replay=self.buffer.init() if self.buffer else None,
                         ref=self.reference.init() if self.reference else None, generator=self.generator.init())

  def buffer_example(self) -> RolloutBatch:
    """The group shape stored in the replay buffer (`rollout.groups.buffer_example`)."""
    return groups.buffer_example(self.prompt_len, self.sampling_config, self.generator.fields)

  def presample_state(self, state: PipelineState, ref_params, key) -> tuple[PipelineState, dict[str, float]]:
    """PVPO's data pre-sampling before the first step (`rollout.reference.Reference.presample`)."""
    if not (self.presample and self.reference):
      return state, {}
    ref, ctl, info = self.reference.presample(state.ref, self.selector, state.control, ref_params, key, self.batch_size)
    return state.replace(control=ctl, ref=ref), info

  def collect(self, state: PipelineState, params, step: int, key: jax.Array, *, ref_params=None,
              version: int | None = None) -> tuple[RolloutBatch, PipelineState, dict[str, float]]:
    """One step's batch of B groups, the new pipeline state and the step's rollout metrics.

    `version` is the number of updates behind `params` (default `step`: the synchronous loop);
    it tags every generated token (`policy_version`) and ages replayed groups.
    """
    version = step if version is None else version
    stats, B = StepStats(), self.batch_size
    parts, buf = [], state.replay
    if self.buffer is not None:   # 1. REPLAY: stored groups first
      got, buf = self.buffer.sample(buf, jax.random.fold_in(key, 7), B, version=version)
      got = jax.device_get(got)
      live = np.flatnonzero(np.any(got.sample_mask, axis=1))
      parts += [got.take(live)] if live.size else []
      stats.add("replay/used", float(live.size))
    ctl, ref, gstate, refill = state.control, state.ref, state.generator, 0
    refills = groups.Refills(B, self.max_refills)
    while True:   # 2. select -> generate -> score, refilled by dynamic sampling
      plan, ctl = self._select(ctl, gstate, jax.random.fold_in(key, 100 + refill), params, stats)
      part, gstate, plan, ctl = self._generate(params, plan, jax.random.fold_in(key, refill), stats, gstate,
                                               ref_params, version, ctl)
      n, extra = len(np.asarray(plan.indices)), {}   # (a second view's groups follow the first n)
      if self.reference:   # the plan's reference rewards (cached), for the selector too
        got, ref = self.reference.attach(part, ref, ref_params, step, jax.random.fold_in(key, 200 + refill), stats)
        extra = dict(ref_rewards_BxM=got.ref_rewards[:n], ref_mask_BxM=got.ref_mask[:n])
      ctl = self._learn(ctl, plan, part.take(np.arange(n)) if n < part.prompt_ids.shape[0] else part, extra)
      parts.append(part)
      if not self.dynamic_sampling or refills.done(part, refill, step, stats):
        break
      refill += 1
    sampled = parts[0] if len(parts) == 1 else sampling.concat(parts)
    batch, buf = groups.keep(sampled, self.batch_size, self.dynamic_sampling, self.buffer, buf,   # 3. filter; REPLAY
                             self.buffer_example, stats)
    batch = extras.recipe_extras(batch, seq_logprobs=self.needs_seq_logprobs, clusters=self.clusters,   # 4. extras
                                 task=self.task, tokenizer=self.prompter.tokenizer, stats=stats)
    if self.reference:
      batch, ref = self.reference.attach(batch, ref, ref_params, step, key, stats)
    # The update runs on completions cut to the last loss position kept (`stats.update_width`).
    batch = batch.trim(update_width(batch))
    info = {**stats.summary(), **batch_summary(batch, sampled), "refills": float(refill),
            "replay/used": stats.get("replay/used"), "rollouts": stats.get("rollouts")}
    return batch, PipelineState(control=ctl, replay=buf, ref=ref, generator=gstate), info

  def _select(self, ctl, gstate, key: jax.Array, params, stats: StepStats):
    """CONTROL's plan: B prompts, or the fresh prompts a generator that picks its own groups wants."""
    wants = self.batch_size if self.generator.wants is None else self.generator.wants(gstate)
    return self.selector.select(ctl, key, wants, **self._select_extras(params, stats))

  def _learn(self, ctl, plan: control.Plan, part: RolloutBatch, extra: dict):
    """The selector learns from a plan's generated groups."""
    return self.selector.update(ctl, plan, part.rewards, part.sample_mask, entropy_BxN=mean_entropy(part),
                                lengths_BxN=np.asarray(part.lengths), **extra)

  def _generate(self, params, plan: control.Plan, key: jax.Array, stats: StepStats, gstate, anchor, version: int,
                ctl=None):
    """GENERATE + FILTER for the plan's prompts: (the scored batch, the generator's state, the plan as
    refined by a two-phase selector, the selector's state). Tokens are tagged with `version`."""
    idx = np.asarray(plan.indices)
    examples = [self.examples[int(i)] for i in idx]
    ids, mask = self.prompter(examples)
    N, t0 = self.num_samples, time.perf_counter()
    prompts = generators.Prompts(ids=np.asarray(ids, np.int32), mask=np.asarray(mask, bool),
                                 index=idx.astype(np.int32), budget=np.asarray(plan.budget, np.int32))
    batch, gstate, counts = self._decode(gstate, params, prompts, key, version, stats)
    budget = float(np.asarray(plan.budget).sum())   # the rollouts the selector asked for
    if self.selector.refine is not None:   # the selector's second phase, from the first one's rewards
      first, _ = self.filter(batch, examples, StepStats())
      refined, ctl = self.selector.refine(ctl, plan, first, plan.sample_mask(N))
      more = np.asarray(refined.budget) - np.asarray(plan.budget)
      if more.sum():
        added, gstate, c2 = self._decode(gstate, params, prompts.replace(budget=more.astype(np.int32)),
                                         jax.random.fold_in(key, 3), version, stats)
        batch = batch.extend_groups(added, plan.budget, more)
        counts = {k: None if v is None or c2[k] is None else v + c2[k] for k, v in counts.items()}
        stats.add("control/phase2_rollouts", float(more.sum()))
      plan, budget = refined, float(np.asarray(refined.budget).sum())
    elif self.generator.wants is not None:   # it chose its groups (stored or fresh): they are the plan
      idx = np.asarray(batch.prompt_index)
      examples = [self.examples[int(i)] for i in idx]
      plan = control.Plan(indices=idx, budget=np.asarray(batch.sample_mask).sum(1).astype(np.int32))
    stats.add("time/sample", time.perf_counter() - t0)
    second = None
    if self.scorer.needs_second_view:   # Co-Reward: the rewritten prompts, sampled
      second = self.filter.second_view(params, examples, idx, jax.random.fold_in(key, 2), version)
    r, info = ((np.asarray(batch.rewards, np.float32), {}) if self.generator.scores else
               self.filter(batch, examples, stats, second_view=second, anchor_params=anchor))
    batch = batch.replace(rewards=r)
    lengths = np.asarray(batch.lengths)
    stats.add("rollouts", float(N * len(idx)) if counts["rollouts"] is None else counts["rollouts"])
    stats.add("generated_tokens", float(lengths.sum()) if counts["generated_tokens"] is None
              else counts["generated_tokens"])
    stats.add("rollout/padding_frac", padding_frac(lengths.ravel()) if counts["rollout/padding_frac"] is None
              else counts["rollout/padding_frac"])
    if self.generator.finish is not None:
      batch, gstate, fstats = self.generator.finish(gstate, params, batch, key, version=version)
      stats.add_all(fstats)
    if self.distill:
      batch = extras.distill_signal(batch, self.teacher, self.distill, self.sampling_config.temperature, stats)
    mask = np.asarray(plan.sample_mask(N))   # the selector's budget; external rollouts are outside it
    if self.external_samples:
      batch = extras.external_rollouts(batch, prompts, examples, self.teacher, self.external_samples,
                                       self.sampling_config, self.filter, jax.random.fold_in(key, 5), stats)
      mask = np.concatenate([mask, np.ones((mask.shape[0], self.external_samples), bool)], 1)
    if second is not None:   # both views follow the plan's budget
      stats.add("rollouts", float(N * len(idx)))
      stats.add("generated_tokens", float(np.asarray(second.lengths).sum()))
      batch, mask = sampling.concat([batch, second.replace(rewards=info["second_view_rewards"])]), np.tile(mask, (2, 1))
    stats.add("rollouts_budget", budget)
    batch = batch.replace(sample_mask=batch.sample_mask & mask)
    first = batch if batch.prompt_ids.shape[0] == len(idx) else batch.take(np.arange(len(idx)))
    return batch, self.generator.update(gstate, first, version=version), plan, ctl

  def _decode(self, gstate, params, prompts, key, version, stats):
    """The generator's batch and state, and the counts it makes itself (decoded tokens, started rollouts, the
    decode loop's padding; None: the pipeline counts them from the batch)."""
    batch, gstate, gstats = self.generator.generate(gstate, params, prompts, key, version=version)
    gstats = dict(gstats)
    counts = {k: gstats.pop(k, None) for k in ("generated_tokens", "rollouts", "rollout/padding_frac")}
    stats.add_all(gstats)
    return batch, gstate, counts

  def _select_extras(self, params, stats) -> dict:
    """What a selector's `select` may ask for beyond (state, key, B): HIVE's fresh prompt entropy."""
    if "prompt_entropy_fn" not in inspect.signature(self.selector.select).parameters:
      return {}
    return {"prompt_entropy_fn": lambda idx, tokens: extras.prompt_entropy(
        self.cfg, params, self.prompter, [self.examples[int(i)] for i in np.asarray(idx)], tokens,
        self.sampling_config, stats)}
