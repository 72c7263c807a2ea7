"""FILTER in the rollout step: a batch's rewards from its decoded texts.

`Filter` holds what scoring reads (the task's prompter, the group scorer, DAPO's overlong
buffer, the grader's failure limit) and scores a batch's groups: verifiers in the grader
pool and/or label-free group rewards, with the inputs a reward asks for: references only
when it needs labels, Co-Reward's second view (`second_view`: the same prompts rewritten and
sampled), CaT's anchor syntheses (`anchor_syntheses`: the frozen anchor policy reads each
group's answers and writes one reference).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from rollouts_jax import losses, models, rewards, sampling, tasks
from rollouts_jax.rollout.prompter import Prompter, decode_completions
from rollouts_jax.rollout.stats import StepStats, mean_entropy
from rollouts_jax.types import RolloutBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Filter:
  """A batch's rewards [B, N] (see the module docstring); `cfg` is the policy's (CaT's anchor shares it)."""
  cfg: models.ModelConfig
  prompter: Prompter
  scorer: rewards.GroupScorer
  sampling_config: sampling.SamplingConfig
  overlong_buffer: int = 0
  max_failure_frac: float = 0.5
  seed: int = 0

  @property
  def task(self) -> tasks.Task:
    return self.prompter.task

  def __call__(self, batch: RolloutBatch, examples, stats: StepStats, second_view: RolloutBatch | None = None,
               anchor_params=None) -> tuple[np.ndarray, dict[str, Any]]:
    """(float32 rewards [B, N], the scorer's info) of a batch of these examples' groups."""
    t0 = time.perf_counter()
    tok = self.prompter.tokenizer
    texts = decode_completions(tok, np.asarray(batch.completion_ids), np.asarray(batch.completion_mask))
    anchor = self.anchor_syntheses(examples, texts, anchor_params) if self.scorer.needs_anchor else None
    refs = [self.task.reference(ex) for ex in examples] if self.scorer.needs_labels else None
    second = None
    if second_view is not None:
      second = decode_completions(tok, np.asarray(second_view.completion_ids), np.asarray(second_view.completion_mask))
    r, info = self.scorer(texts, refs, entropy_BxN=mean_entropy(batch), second_view=second, anchor_texts=anchor)
    if anchor is not None:
      stats.add("cat/skipped_groups", float(info["cat_skipped_groups"]))
    if self.overlong_buffer:
      r = r + self._overlong(batch)
      if "second_view_rewards" in info:
        info["second_view_rewards"] = info["second_view_rewards"] + self._overlong(second_view)
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

  def _overlong(self, batch: RolloutBatch) -> np.ndarray:
    """DAPO's soft overlong punishment of each sample."""
    return np.asarray(losses.overlong_penalty(np.asarray(batch.lengths), max_len=self.sampling_config.max_new_tokens,
                                              cache_len=self.overlong_buffer))

  def second_view(self, params, examples, idx: np.ndarray, key: jax.Array, version: int) -> RolloutBatch:
    """Co-Reward: the task's rewrite of each prompt, sampled N times by the policy (unscored)."""
    views = [self.task.rewrite(ex, self.seed) for ex in examples]
    vids, vmask = self.prompter(views)
    out = jax.device_get(sampling.sample(self.cfg, params, vids, vmask, key, self.sampling_config))
    return sampling.from_samples(vids, vmask, out, prompt_index=idx, policy_version=version)

  def anchor_syntheses(self, examples, texts, anchor_params) -> list[str]:
    """CaT: the frozen anchor reads each group's answers and writes one reference (greedy)."""
    if anchor_params is None:
      raise ValueError("reward term 'cat' needs the anchor policy (the run's initial policy).")
    from rollouts_jax import data as data_lib  # pylint: disable=g-import-not-at-top
    p, tok = self.prompter, self.prompter.tokenizer
    prompts = [rewards.cat_prompt(self.task.prompt(ex, tok, p.template, instruction=p.instruction),
                                  [self.task.extract(t) for t in row]) for ex, row in zip(examples, texts)]
    ids, mask = data_lib.pad_left([tok.encode(q) for q in prompts], p.buckets, pad_id=tok.pad_id)
    conf = self.sampling_config.replace(num_samples=1, greedy=True)
    out = jax.device_get(sampling.sample(self.cfg, anchor_params, np.asarray(ids, np.int32),
                                         np.asarray(mask, bool), jax.random.key(0), conf))
    return [row[0] for row in decode_completions(tok, np.asarray(out.completion_ids), np.asarray(out.completion_mask))]
