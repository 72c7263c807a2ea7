"""Side steps of the rollout step: batch -> batch functions that run beside generation.

They read a scored batch and return it with a field the update reads set (no stage calls
back into another):

>>> from rollouts_jax.rollout import extras
>>> callable(extras.teacher_advantages)
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models, sampling
from rollouts_jax.advantages import clustering
from rollouts_jax.rollout.prompter import decode_completions
from rollouts_jax.rollout.stats import StepStats
from rollouts_jax.sampling import sol_rl as sol_rl_lib
from rollouts_jax.types import RolloutBatch

# The largest teacher vocabulary log-prob array (bytes) full-vocabulary distillation builds per step.
FULL_KL_MAX_BYTES = 2**30


def teacher_advantages(teacher, batch: RolloutBatch, temperature: float) -> np.ndarray:
  """float32 [B, N, T]: log p_teacher(y_t) - log p_behaviour(y_t) per completion token, 0 off the mask.

  On-policy distillation's per-token signal, the single-sample form of the reverse KL (GKD,
  Agarwal et al. 2024): maximizing it pulls the student toward the teacher on the student's own
  prefixes. `teacher` is (ModelConfig, params): any size with the student's vocabulary.
  """
  cfg, params = teacher
  scored, _ = sol_rl_lib.recompute_batch(cfg, params, batch, temperature=temperature)
  return reverse_kl_advantages(scored.old_logprobs, batch)


def reverse_kl_advantages(teacher_logprobs, batch: RolloutBatch) -> np.ndarray:
  """float32 [B, N, T]: the teacher's log-probs of the batch's tokens minus the behaviour's, 0 off the mask."""
  m = np.asarray(batch.completion_mask)
  return np.where(m, np.asarray(teacher_logprobs) - np.asarray(batch.behaviour_logprobs), 0.0).astype(np.float32)


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


def distill_signal(batch: RolloutBatch, teacher, distill: str, temperature: float, stats: StepStats) -> RolloutBatch:
  """On-policy distillation: the batch with the teacher's signal the update reads.

  "opd": per-token advantages log p_teacher - log p_student (`teacher_advantages`);
  "opd_full": the teacher's log-probs over the vocabulary at every completion position,
  float32 [B, N, T, V] (`RolloutBatch.teacher_logprobs`, the input of
  `losses.full_reverse_kl`), from one teacher forward; that array costs 4 B N T V bytes and
  above `FULL_KL_MAX_BYTES` it is refused. `teacher` is (ModelConfig, params).
  """
  cfg, params = teacher
  m = np.asarray(batch.completion_mask)
  if distill.endswith("_full"):
    check_full_kl_bytes(distill, math.prod(m.shape), cfg.vocab_size)
    vocab = np.asarray(models.batch_logprobs(
        params, jnp.asarray(batch.prompt_ids, jnp.int32), jnp.asarray(batch.prompt_mask),
        jnp.asarray(batch.completion_ids, jnp.int32), jnp.asarray(m), cfg=cfg, temperature=float(temperature),
        vocab=True), np.float32)
    adv = reverse_kl_advantages(np.take_along_axis(vocab, np.asarray(batch.completion_ids)[..., None], -1)[..., 0],
                                batch)
    batch = batch.replace(teacher_logprobs=vocab)
  else:
    adv = teacher_advantages(teacher, batch, temperature)
    batch = batch.replace(token_advantages=adv)
  stats.mean("distill/reverse_kl", float(-adv[m].mean()) if m.any() else 0.0)
  return batch


def external_rollouts(batch: RolloutBatch, prompts, examples, teacher, num: int, conf: sampling.SamplingConfig,
                      score, key: jax.Array, stats: StepStats) -> RolloutBatch:
  """ERILS: the external policy's rollouts of the same prompts join each group (`source_ids` 1).

  `prompts` is the step's `rollout.Prompts`, `teacher` (ModelConfig, params) and `score` the
  step's FILTER. Length control: only rollouts that ended with EOS within the budget are
  kept (a truncated external rollout is masked out, never trained on).
  """
  cfg, params = teacher
  out = jax.device_get(sampling.sample(cfg, params, prompts.ids, prompts.mask, key, conf.replace(num_samples=num)))
  ext = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=-1)
  lengths = np.asarray(out.lengths)
  ended = np.ones(lengths.shape, bool)   # without an EOS id nothing can be told apart
  if conf.eos_ids:
    last = np.take_along_axis(np.asarray(out.completion_ids), np.maximum(lengths - 1, 0)[..., None], axis=-1)[..., 0]
    ended = np.isin(last, conf.eos_ids) & (lengths > 0)
  ext = ext.replace(sample_mask=ended)
  r, _ = score(ext, examples, StepStats())
  ext = ext.replace(rewards=r)
  stats.add("erils/external_rollouts", float(num * len(examples)))
  stats.add("erils/rejected_overlong", float((~ended).sum()))
  stats.mean("erils/external_reward_mean", float(r[ended].mean()) if ended.any() else 0.0)
  stats.add("generated_tokens", float(lengths.sum()))
  B, N = batch.sample_mask.shape
  src = np.concatenate([np.zeros((B, N), np.int32), np.ones((B, num), np.int32)], 1)
  cat = lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)], 1)
  fields = {f: cat(getattr(batch, f), getattr(ext, f)) for f in (
      "completion_ids", "completion_mask", "behaviour_logprobs", "policy_version", "rewards", "sample_mask",
      "entropy")}
  return batch.replace(source_ids=src, **fields)


def recipe_extras(batch: RolloutBatch, *, seq_logprobs: bool, clusters: str | None, task, tokenizer,
                  stats: StepStats) -> RolloutBatch:
  """The inputs an advantage recipe reads beyond rewards.

  `seq_logprobs`: each sample's mean behaviour log-prob; `clusters` "strategy" / "answer":
  cluster ids of the samples' strategies / extracted answers within each group (uniqueness
  recipes).
  """
  extras = {}
  if seq_logprobs:
    m = np.asarray(batch.completion_mask)
    lp = np.asarray(batch.behaviour_logprobs)
    extras["seq_logprobs"] = ((lp * m).sum(-1) / np.maximum(m.sum(-1), 1)).astype(np.float32)
  if clusters:
    texts = decode_completions(tokenizer, np.asarray(batch.completion_ids), np.asarray(batch.completion_mask))
    key = task.strategy if clusters == "strategy" else task.extract
    ids = np.asarray(clustering.cluster_by_answer([[key(t) for t in row] for row in texts], normalize=lambda x: x),
                     np.int32)
    extras["cluster_ids"] = ids
    stats.add("clusters_per_group", float(np.mean([len(set(row)) for row in ids.tolist()])))
  return batch.replace(**extras) if extras else batch


def prompt_entropy(cfg, params, prompter, examples, tokens: int, conf: sampling.SamplingConfig,
                   stats: StepStats) -> np.ndarray:
  """float [P]: the policy's mean token entropy over a greedy `tokens`-token continuation of each prompt.

  HIVE's fresh prompt-entropy signal, asked for by the selector's `select` (`prompt_entropy_fn`).
  """
  ids, mask = prompter(examples)
  conf = conf.replace(num_samples=1, max_new_tokens=tokens, greedy=True)
  out = jax.device_get(sampling.sample(cfg, params, ids, mask, jax.random.key(0), conf))
  m = np.asarray(out.completion_mask)[:, 0]
  stats.add("hive/entropy_tokens", float(m.sum()))
  return (np.asarray(out.entropy)[:, 0] * m).sum(1) / np.maximum(m.sum(1), 1)
