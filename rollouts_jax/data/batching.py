"""Tokenized batches with fixed, bucketed shapes.

Prompts are left-padded (the sampler appends to the right end) and completions / SFT targets
right-padded, each to the smallest bucket that holds the longest sequence, so a jitted step
sees only a handful of shapes and never recompiles for a new length.

>>> ids, mask = pad_left([[5, 6, 7], [8]], buckets=(4, 8), pad_id=0)
>>> ids.tolist(), mask.tolist()
([[0, 5, 6, 7], [0, 0, 0, 8]], [[False, True, True, True], [False, False, False, True]])
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from rollouts_jax.data import formatting
# The one bucketing rule and bucket tuple: the sampler's, so a batch padded here has the shape
# the sampler would pad it to.
from rollouts_jax.types import DEFAULT_PROMPT_BUCKETS, bucket_length

__all__ = ["DEFAULT_PROMPT_BUCKETS", "bucket_length", "pad_left", "pad_right", "PromptBatch",
           "make_prompt_batch"]


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
  """The buckets as ints; an error unless they are strictly increasing and positive."""
  buckets = tuple(int(b) for b in buckets)
  if not buckets or any(b <= 0 for b in buckets) or any(
      x >= y for x, y in zip(buckets, buckets[1:])):
    raise ValueError(f"buckets must be strictly increasing positive ints, got {buckets}")
  return buckets


def _pad(seqs: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int, left: bool):
  seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
  if not seqs:
    raise ValueError("cannot pad an empty batch")
  length = bucket_length(max(len(s) for s in seqs), _check_buckets(buckets))
  ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
  mask = np.zeros((len(seqs), length), dtype=bool)
  for i, s in enumerate(seqs):
    if len(s) == 0:
      continue
    if s.min() < np.iinfo(np.int32).min or s.max() > np.iinfo(np.int32).max:
      raise ValueError(f"sequence {i} has ids outside int32")
    if left:
      ids[i, length - len(s):], mask[i, length - len(s):] = s, True
    else:
      ids[i, :len(s)], mask[i, :len(s)] = s, True
  return ids, mask


def pad_left(seqs: Sequence[Sequence[int]], buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, *,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads id lists to the smallest bucket that fits the longest.

  Args:
    seqs: B lists (or 1-D arrays) of ids.
    buckets: strictly increasing candidate lengths.
    pad_id: the padding id.

  Returns:
    ``(ids int32[B, P], mask bool[B, P])``; ``mask`` is True on real tokens, which sit at the
    right end of each row.

  >>> pad_left([[1, 2]], buckets=(3,), pad_id=9)[0].tolist()
  [[9, 1, 2]]
  """
  return _pad(seqs, buckets, pad_id, left=True)


def pad_right(seqs: Sequence[Sequence[int]], buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, *,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads id lists to the smallest bucket that fits the longest (see :func:`pad_left`).

  >>> pad_right([[1, 2]], buckets=(3,), pad_id=9)[0].tolist()
  [[1, 2, 9]]
  """
  return _pad(seqs, buckets, pad_id, left=False)


class PromptBatch(NamedTuple):
  """A batch of prompts ready for the sampler.

  Attributes:
    prompt_ids: int32[B, P], left-padded.
    prompt_mask: bool[B, P].
    prompts: the B prompt strings.
    examples: the B source examples (their reference answers feed the rewards).
  """
  prompt_ids: np.ndarray
  prompt_mask: np.ndarray
  prompts: list[str]
  examples: list[Mapping[str, Any]]


def make_prompt_batch(examples: Sequence[Mapping[str, Any]], task: str, tokenizer, *,
                      buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, template: str = "plain",
                      add_bos: bool = False, **format_kwargs: Any) -> PromptBatch:
  """Formats, tokenizes and left-pads a batch of examples.

  Args:
    examples: dataset records.
    task: one of ``formatting.TASKS``.
    tokenizer: a :class:`rollouts_jax.data.tokenizers.Tokenizer`.
    buckets: prompt length buckets.
    template: ``"plain"`` or ``"chat"``.
    add_bos: prepend BOS (leave False for chat templates, which write their own).
    **format_kwargs: passed to :func:`formatting.format_prompt`.

  Returns:
    A :class:`PromptBatch`.

  >>> from rollouts_jax.data.tokenizers import CharTokenizer
  >>> b = make_prompt_batch([{"question": "What is 1 + 2?"}], "arithmetic",
  ...                       CharTokenizer.default(), buckets=(16, 32), instruction=False)
  >>> b.prompt_ids.shape, int(b.prompt_mask.sum())
  ((1, 16), 15)
  """
  examples = list(examples)
  prompts = [formatting.format_prompt(ex, task, template, tokenizer, **format_kwargs)
             for ex in examples]
  ids, mask = pad_left([tokenizer.encode(p, add_bos=add_bos) for p in prompts], buckets,
                       pad_id=tokenizer.pad_id)
  return PromptBatch(ids, mask, prompts, examples)
