"""Evaluation metrics over N sampled answers per prompt: pass@k and maj@k.

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models
Trained on Code" (arXiv 2107.03374): draw n >= k samples, count the c correct ones, and
estimate the chance that k samples drawn without replacement hold at least one correct one,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i).

The product form never forms the huge binomials, so it is exact to float rounding for any n.

maj@k (self-consistency, Wang et al. 2022, arXiv 2203.11171) takes the most frequent answer
among the first k samples and scores whether it is correct.
"""

from __future__ import annotations

import numbers
from typing import Hashable, Sequence

import numpy as np

from rollouts_jax.rewards import label_free


def _as_int_array(x, name: str) -> np.ndarray:
  arr = np.asarray(x)
  if arr.dtype == bool:
    raise ValueError(f"{name} must hold integers, got booleans.")
  if not np.issubdtype(arr.dtype, np.integer):
    if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
      arr = arr.astype(np.int64)
    else:
      raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}.")
  return arr.astype(np.int64)


def pass_at_k(num_samples, num_correct, k: int):
  """Unbiased pass@k estimate from n samples of which c are correct.

  Args:
    num_samples: n, an int or an integer array (broadcast against `num_correct`).
    num_correct: c, an int or an integer array with 0 <= c <= n.
    k: the number of draws, 1 <= k <= n for every n.

  Returns:
    1 - C(n - c, k) / C(n, k): a Python float when both inputs are scalars, else a float64
    array of the broadcast shape.

  Raises:
    ValueError: if k < 1, k > n, c < 0, c > n, or an input is not integral.

  >>> round(pass_at_k(10, 3, 1), 6)   # pass@1 = c / n
  0.3
  >>> round(pass_at_k(4, 1, 2), 6)   # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
  0.5
  >>> pass_at_k([5, 5, 5], [0, 1, 5], 5).tolist()
  [0.0, 1.0, 1.0]

  Paper: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. (1).
  """
  if isinstance(k, bool) or not isinstance(k, numbers.Integral):
    raise ValueError(f"k must be an int, got {k!r}.")
  k = int(k)
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}.")
  scalar = np.ndim(num_samples) == 0 and np.ndim(num_correct) == 0
  n, c = np.broadcast_arrays(_as_int_array(num_samples, "num_samples"),
                             _as_int_array(num_correct, "num_correct"))
  if n.size and k > n.min():
    raise ValueError(f"pass@k needs k <= num_samples; got k={k} with num_samples={int(n.min())}.")
  if n.size and (c.min() < 0 or np.any(c > n)):
    raise ValueError("num_correct must lie in [0, num_samples] for every entry.")
  flat_n, flat_c = n.reshape(-1), c.reshape(-1)
  if flat_n.size == 0:
    out = np.zeros(n.shape, np.float64)
  else:
    # Terms (1 - k/i) for i in (n - c, n]; other i contribute a factor 1. When n - c < k the
    # range holds i = k, whose factor is exactly 0, so pass@k is exactly 1.
    i = np.arange(1, flat_n.max() + 1, dtype=np.float64)[None, :]
    inside = (i > (flat_n - flat_c)[:, None]) & (i <= flat_n[:, None])
    fail = np.prod(np.where(inside, 1.0 - k / i, 1.0), axis=1)
    fail = np.where(flat_n - flat_c < k, 0.0, fail)
    out = (1.0 - fail).reshape(n.shape)
  return float(out) if scalar else out


def mean_pass_at_k(correct_BxN, k: int) -> float:
  """pass@k averaged over prompts, from a [B, N] table of per-sample correctness.

  Args:
    correct_BxN: bool (or 0/1) array [B, N]; row b holds the N samples of prompt b.
    k: 1 <= k <= N.

  Returns:
    mean over b of pass_at_k(N, sum(correct_BxN[b]), k), a Python float.

  >>> mean_pass_at_k([[True, False, False, False], [False, False, False, False]], 1)
  0.125
  """
  correct = np.asarray(correct_BxN)
  if correct.ndim != 2:
    raise ValueError(f"correct_BxN must be 2-D [B, N], got shape {correct.shape}.")
  if correct.shape[0] == 0:
    raise ValueError("correct_BxN has no prompts (B = 0).")
  if correct.dtype != bool:
    if not np.all((correct == 0) | (correct == 1)):
      raise ValueError("correct_BxN must hold booleans or 0/1 values.")
    correct = correct.astype(bool)
  n = np.full(correct.shape[0], correct.shape[1])
  return float(np.mean(pass_at_k(n, correct.sum(axis=1), k)))


def majority_answer(answers: Sequence[Hashable | None]) -> int | None:
  """Index of the sample whose answer wins the vote, or None if no sample has an answer.

  The vote is the one majority vote, :func:`rollouts_jax.rewards.majority_vote`: None (and
  empty) answers take no part, the winner has the highest count and ties go to the answer
  that appears first. The returned index is that answer's first occurrence.

  >>> majority_answer(["4", None, "5", "5", "4"])   # "4" and "5" tie; "4" came first
  0
  >>> majority_answer(["1", "2", "2"])
  1
  >>> majority_answer([None, None]) is None
  True
  """
  answers = list(answers)
  label, _ = label_free.majority_vote(answers)
  return None if label is None else answers.index(label)


def maj_at_k(answers_per_prompt: Sequence[Sequence[Hashable | None]],
             correct_per_prompt: Sequence[Sequence[bool]], k: int) -> float:
  """Majority-vote accuracy over the first k samples of each prompt, averaged over prompts.

  Args:
    answers_per_prompt: for each prompt, the extracted answer of each sample (str or any
      hashable; None where nothing was extracted).
    correct_per_prompt: same lengths; whether each sample's answer is correct. The vote's
      correctness is the flag of the winning answer's first occurrence.
    k: use samples [0, k) of each prompt; every prompt needs at least k samples.

  Returns:
    The fraction of prompts whose majority answer is correct (a prompt whose first k answers
    are all None counts as wrong).

  >>> maj_at_k([["7", "8", "8"], ["1", None, None]], [[True, False, False], [False, False, False]], 3)
  0.0
  >>> maj_at_k([["7", "8", "8"], ["1", None, None]], [[True, False, False], [False, False, False]], 1)
  0.5

  Paper: Wang et al. 2022, "Self-Consistency Improves Chain of Thought Reasoning".
  """
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}.")
  if len(answers_per_prompt) != len(correct_per_prompt):
    raise ValueError(f"answers_per_prompt has {len(answers_per_prompt)} prompts but "
                     f"correct_per_prompt has {len(correct_per_prompt)}.")
  if not answers_per_prompt:
    raise ValueError("maj@k needs at least one prompt.")
  hits = 0
  for b, (answers, correct) in enumerate(zip(answers_per_prompt, correct_per_prompt)):
    if len(answers) != len(correct):
      raise ValueError(f"prompt {b}: {len(answers)} answers but {len(correct)} correctness flags.")
    if len(answers) < k:
      raise ValueError(f"maj@k needs k <= samples per prompt; prompt {b} has {len(answers)} < k={k}.")
    winner = majority_answer(list(answers[:k]))
    hits += winner is not None and bool(correct[winner])
  return hits / len(answers_per_prompt)
