"""The bottom floor: `RolloutBatch`, the one typed batch that travels from every generator through every stage,
and the prompt-length buckets (`bucket_length`) that `data/` and `sampling/` both pad to.

B groups (one prompt each), N samples per group, prompt length P, T completion tokens. A
generator fills the prompt, completion, behaviour log-probs and policy version; FILTER
fills `rewards` (and extras such as `cluster_ids`, `ref_rewards`); CONTROL narrows
`sample_mask` and chooses groups; REPLAY stores and returns batches; the update reads it.

Optional fields are None when no stage produced them (a None field is an empty pytree node,
so jitted functions see a different, still static, structure).

This module imports nothing from the package, so every stage (generators, FILTER, CONTROL,
REPLAY, the update) can depend on it without depending on another stage;
`rollouts_jax.sampling` re-exports it.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class RolloutBatch:
  """Grouped rollouts `[B, N, T]` with everything the later stages need.

  Attributes:
    prompt_ids: int32 [B, P], left-padded.
    prompt_mask: bool [B, P].
    completion_ids: int32 [B, N, T], pad after EOS.
    completion_mask: bool [B, N, T], the loss positions: True at the policy's tokens, up to and
      including EOS. Multi-turn rows (`rollout.multiturn`) hold observation tokens between their
      turns with the mask False (context for the update, no loss): the mask may have holes, so
      a row's last loss position is not its count of them.
    behaviour_logprobs: float32 [B, N, T], log-prob of each token under the sampling
      distribution of the policy that produced it (temperature / top-k / top-p applied; an
      FP4 explorer's when it sampled). 0 where the mask is False.
    policy_version: int32 [B, N, T], the optimizer step of the policy that produced each token.
    rewards: float32 [B, N] (zeros until FILTER runs).
    sample_mask: bool [B, N], False for samples that carry no loss (padding groups, samples
      past a selector's budget, empty replay slots).
    prompt_index: int32 [B], the dataset index of each group's prompt (-1: none).
    old_logprobs: optional float32 [B, N, T], the log-probs the PPO ratio is taken against
      (None: the policy before this update; Sol-RL: the full-precision recomputation).
    entropy: optional float32 [B, N, T], the policy's entropy at each step.
    cluster_ids: optional int32 [B, N], strategy clusters (uniqueness recipes).
    seq_logprobs: optional float32 [B, N], mean token log-prob (XRPO novelty sharpening).
    ref_rewards: optional float32 [B, M], rewards of reference-policy rollouts (PVPO anchor).
    ref_mask: optional bool [B, M], valid entries of `ref_rewards`.
    token_advantages: optional float32 [B, N, T], per-token advantages that replace the
      advantage recipe's per-sample ones in the loss (tree rollouts' node values, on-policy
      distillation's per-token teacher signal). The recipe's sample mask still applies.
    confidence: optional float32 [B, N], each response's mean token confidence (DeepConf's C,
      recorded by tree rollouts), for ECHO's adaptive clip and hybrid shaping.
    source_ids: optional int32 [B, N], which policy produced each sample (0: the policy being
      trained; 1: an external policy, ERILS), for per-source advantages.
    teacher_logprobs: optional float32 [B, N, T, V], a teacher's log-probs over the vocabulary
      at every completion position (full-vocabulary on-policy distillation; 0 off the mask).
  """
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  completion_ids: jax.Array
  completion_mask: jax.Array
  behaviour_logprobs: jax.Array
  policy_version: jax.Array
  rewards: jax.Array
  sample_mask: jax.Array
  prompt_index: jax.Array
  old_logprobs: Any = None
  entropy: Any = None
  cluster_ids: Any = None
  seq_logprobs: Any = None
  ref_rewards: Any = None
  ref_mask: Any = None
  token_advantages: Any = None
  source_ids: Any = None
  confidence: Any = None
  teacher_logprobs: Any = None

  @property
  def shape(self) -> tuple[int, int, int]:
    """(B, N, T)."""
    return tuple(self.completion_ids.shape)

  @property
  def lengths(self):
    """int32 [B, N]: completion lengths (loss tokens: the policy's, without observations)."""
    return self.completion_mask.sum(-1).astype(jnp.int32)

  def take(self, group_idx) -> "RolloutBatch":
    """The groups `group_idx` (int [K]) in that order.

    >>> b = RolloutBatch.empty(3, 2, 4, 5)
    >>> b.take(np.array([2, 0])).completion_ids.shape
    (2, 2, 5)
    """
    xp = np if isinstance(self.completion_ids, np.ndarray) else jnp
    idx = xp.asarray(group_idx)
    return jax.tree_util.tree_map(lambda x: x[idx], self)

  def take_samples(self, sample_idx_BxK) -> "RolloutBatch":
    """Samples `sample_idx [B, K]` of each group; `[B, N, ...]` fields become `[B, K, ...]`.

    `ref_rewards` / `ref_mask` (reference rollouts, not samples of this batch) stay as they are.

    >>> b = RolloutBatch.empty(2, 4, 3, 5)
    >>> b.take_samples(np.array([[0, 3], [1, 2]])).completion_ids.shape
    (2, 2, 5)
    """
    xp = np if isinstance(self.completion_ids, np.ndarray) else jnp
    idx = xp.asarray(sample_idx_BxK)
    B, N = self.sample_mask.shape

    def take(x):
      if x is None or x.ndim < 2 or x.shape[:2] != (B, N):
        return x
      i = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
      return xp.take_along_axis(x, i, axis=1)

    return self.replace(**{f: take(getattr(self, f)) for f in _SAMPLE_FIELDS})

  def extend_groups(self, more: "RolloutBatch", start_B, count_B) -> "RolloutBatch":
    """Each group grown by samples of `more` (the same prompts): its first `count[b]` samples go to slots `start[b]...`.

    A selector's second phase (`PromptSelector.refine`) decodes more samples of prompts it
    already sampled; they join the first phase's groups. Fields that only one side carries
    come back None. Host arrays.

    >>> a, m = RolloutBatch.empty(2, 3, 1, 2), RolloutBatch.empty(2, 3, 1, 2)
    >>> m = m.replace(rewards=np.arange(6, dtype=np.float32).reshape(2, 3))
    >>> a.extend_groups(m, np.array([1, 0]), np.array([2, 1])).rewards.tolist()
    [[0.0, 0.0, 1.0], [3.0, 0.0, 0.0]]
    """
    start, count = np.asarray(start_B, np.int64), np.asarray(count_B, np.int64)
    B, N = self.sample_mask.shape
    if np.any(start + count > N) or np.any(count < 0):
      raise ValueError(f"extend_groups: start {start.tolist()} + count {count.tolist()} exceeds the group size {N}.")
    rows = np.repeat(np.arange(B), count)
    src = np.concatenate([np.arange(c) for c in count]) if B else np.zeros((0,), np.int64)
    dst = np.repeat(start, count) + src

    def put(a, b):
      if a is None or b is None:
        return None
      out = np.array(a)
      out[rows, dst] = np.asarray(b)[rows, src]
      return out

    return self.replace(**{f: put(getattr(self, f), getattr(more, f)) for f in _SAMPLE_FIELDS})

  def trim(self, width: int) -> "RolloutBatch":
    """Completions cut to `width` tokens (positions past every row's end carry no loss)."""
    return self.replace(**{f: (None if getattr(self, f) is None else getattr(self, f)[:, :, :width])
                           for f in _TOKEN_FIELDS})

  @classmethod
  def empty(cls, B: int, N: int, P: int, T: int) -> "RolloutBatch":
    """An all-masked batch of the given shape (numpy arrays)."""
    return cls(prompt_ids=np.zeros((B, P), np.int32), prompt_mask=np.zeros((B, P), bool),
               completion_ids=np.zeros((B, N, T), np.int32), completion_mask=np.zeros((B, N, T), bool),
               behaviour_logprobs=np.zeros((B, N, T), np.float32),
               policy_version=np.zeros((B, N, T), np.int32), rewards=np.zeros((B, N), np.float32),
               sample_mask=np.zeros((B, N), bool), prompt_index=np.full((B,), -1, np.int32))


# Fields [B, N, T, ...] (the token axis is axis 2).
_TOKEN_FIELDS = ("completion_ids", "completion_mask", "behaviour_logprobs", "policy_version", "old_logprobs",
                 "entropy", "token_advantages", "teacher_logprobs")
_SAMPLE_FIELDS = _TOKEN_FIELDS + ("rewards", "sample_mask", "cluster_ids", "seq_logprobs", "source_ids",
                                  "confidence")


def teacher_forced_rows(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxNxT):
  """The update's layout: R = B * N rows of prompt + completion, (tokens [R, P+T], attention [R, P+T]).

  The prompt's mask, then every completion slot visible (padding after EOS carries no loss).

  >>> t, a = teacher_forced_rows(jnp.array([[0, 5]]), jnp.array([[False, True]]), jnp.array([[[7], [8]]]))
  >>> t.tolist(), a.tolist()
  ([[0, 5, 7], [0, 5, 8]], [[False, True, True], [False, True, True]])
  """
  B, N, T = completion_ids_BxNxT.shape
  rep = lambda x: jnp.repeat(x, N, axis=0)
  tokens = jnp.concatenate([rep(prompt_ids_BxP), completion_ids_BxNxT.reshape(B * N, T)], axis=1)
  attn = jnp.concatenate([rep(prompt_mask_BxP), jnp.ones((B * N, T), bool)], axis=1)
  return tokens, attn


def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
  """Groups of several batches, in order (prompts are left-padded to the longest; host arrays).

  Optional fields must be present in all batches or in none.
  """
  batches = [jax.device_get(b) for b in batches]
  P = max(b.prompt_ids.shape[1] for b in batches)
  T = max(b.completion_ids.shape[2] for b in batches)

  def pad(b):
    p, t = P - b.prompt_ids.shape[1], T - b.completion_ids.shape[2]
    b = b.replace(prompt_ids=np.pad(b.prompt_ids, ((0, 0), (p, 0))),
                  prompt_mask=np.pad(b.prompt_mask, ((0, 0), (p, 0))))
    return b.replace(**{f: np.pad(getattr(b, f), ((0, 0), (0, 0), (0, t)) + ((0, 0),) * (getattr(b, f).ndim - 3))
                        for f in _TOKEN_FIELDS if getattr(b, f) is not None})

  padded = [pad(b) for b in batches]
  for f in ("old_logprobs", "entropy", "cluster_ids", "seq_logprobs", "ref_rewards", "ref_mask", "token_advantages",
            "confidence", "source_ids", "teacher_logprobs"):
    present = {getattr(b, f) is not None for b in padded}
    if len(present) > 1:
      raise ValueError(f"concat: field {f!r} is set in some batches and not in others.")
  return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, axis=0), *padded)


#: Prompt lengths are padded up to one of these, so a new prompt length rarely compiles anew.
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= length (length itself when there are no buckets)."""
  if not buckets:
    return length
  for b in buckets:
    if b >= length:
      return b
  raise ValueError(f"Prompt length {length} exceeds the largest prompt bucket {max(buckets)}; "
                   "add a larger bucket to the prompt buckets (SamplingConfig.prompt_buckets) or truncate the prompt.")


__all__ = ["DEFAULT_PROMPT_BUCKETS", "RolloutBatch", "bucket_length", "concat", "teacher_forced_rows"]
