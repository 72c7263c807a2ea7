"""Sol-RL's subset selection: which k of a pool of M samples per prompt are trained on.

A CONTROL group filter (host-side numpy: rewards come from a host verifier anyway, and exact
de-duplication of completions is a sort over rows). Modes follow Sol-RL's
`select_indices_by_mode` (NVlabs/Sana `train_scripts/sol_rl/train_utils.py`).

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

SUBSET_MODES = ("contrastive", "deviation", "random")
MODES = SUBSET_MODES


def _first_occurrence_M(ids_MxT: np.ndarray) -> np.ndarray:
  """True at the first of each set of identical rows (exact, by sorting rows)."""
  _, first = np.unique(ids_MxT, axis=0, return_index=True)
  out = np.zeros(ids_MxT.shape[0], bool)
  out[first] = True
  return out


def _order_desc(r_M: np.ndarray) -> np.ndarray:
  """Indices by descending reward, ties by ascending index."""
  return np.lexsort((np.arange(r_M.shape[0]), -r_M))


def _order_asc(r_M: np.ndarray) -> np.ndarray:
  """Indices by ascending reward, ties by ascending index."""
  return np.lexsort((np.arange(r_M.shape[0]), r_M))


def _contrastive(r_M: np.ndarray, cand: np.ndarray, k: int) -> list[int]:
  """Best k//2 then worst k - k//2 of the candidate indices `cand`, never picking one twice."""
  n_best = k // 2
  best = cand[_order_desc(r_M[cand])][:n_best]
  rest = np.setdiff1d(cand, best, assume_unique=True)
  worst = rest[_order_asc(r_M[rest])][:k - n_best]
  return best.tolist() + worst.tolist()


def _deviation(r_M: np.ndarray, cand: np.ndarray, k: int) -> list[int]:
  """The k candidates farthest from the group mean, ties by ascending index."""
  dev = np.abs(r_M[cand] - r_M.mean())
  return cand[_order_desc(dev)][:k].tolist()


def _random(cand: np.ndarray, k: int, rng_key: jax.Array) -> list[int]:
  perm = np.asarray(jax.random.permutation(rng_key, cand.shape[0]))
  return cand[perm][:k].tolist()


def select_subset(rewards_BxM: Any, k: int, mode: str = "contrastive", key: jax.Array | None = None,
                  completion_ids: Any = None) -> np.ndarray:
  """Indices of the k pool samples of each prompt to train on.

  Modes (Sol-RL `select_indices_by_mode`):
    * `"contrastive"` (the paper's `best_worst`): the `k // 2` highest rewards, then the
      `k - k // 2` lowest among the samples not already taken (odd k: one extra worst).
      Ties go to the lower index, and the worst half is drawn from what the best half left,
      so equal rewards never select one sample twice (an all-equal group gives `0..k-1`).
    * `"deviation"` (`mean_deviation`): the k largest `|r - mean(r)|` (group mean over the
      whole pool), ties to the lower index.
    * `"random"`: k distinct samples uniformly at random (needs `key`).

  With `completion_ids`, identical completions count once: a sample whose token row equals
  an earlier one of its group is taken only after every distinct completion has been, so
  the subset holds as many distinct completions as the pool allows.

  Args:
    rewards_BxM: float `[B, M]` pool rewards (host or device), finite.
    k: subset size per prompt, `1 <= k <= M`.
    mode: one of `MODES`.
    key: PRNG key, required by `"random"`; one permutation per prompt (`fold_in(key, b)`).
    completion_ids: optional int `[B, M, T]` pool tokens (pad after EOS), for de-duplication.

  Returns:
    int32 `[B, k]` numpy indices into the pool, distinct within each row. Contrastive rows
    list the best half (descending reward) then the worst half (ascending).

  Raises:
    ValueError: k outside `[1, M]`, an unknown mode, a missing key, non-finite rewards or
      mismatched shapes.

  >>> select_subset(np.array([[0.2, 1.0, 0.0, 0.5, 1.0]]), 3).tolist()
  [[1, 2, 0]]

  Paper: Sol-RL (arXiv 2604.06916), 24 trained of 96 explored per prompt.
  """
  r = np.asarray(rewards_BxM, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [B, M]; got shape {r.shape}.")
  B, M = r.shape
  if mode not in MODES:
    raise ValueError(f"Unknown selection mode {mode!r}; expected one of {MODES}.")
  if not 1 <= int(k) <= M:
    raise ValueError(f"Cannot select k={k} samples from a pool of M={M} per prompt (need 1 <= k <= M).")
  k = int(k)
  if not np.all(np.isfinite(r)):
    raise ValueError("rewards must be finite (score failures before selecting).")
  if mode == "random" and key is None:
    raise ValueError("mode='random' needs a PRNG key.")
  if completion_ids is not None:
    ids = np.asarray(completion_ids)
    if ids.ndim != 3 or ids.shape[:2] != (B, M):
      raise ValueError(f"completion_ids must be [B, M, T] = [{B}, {M}, T]; got shape {ids.shape}.")
  out = np.empty((B, k), np.int32)
  for b in range(B):
    distinct = _first_occurrence_M(ids[b]) if completion_ids is not None else np.ones(M, bool)
    tiers = [np.flatnonzero(distinct), np.flatnonzero(~distinct)]
    chosen: list[int] = []
    for t, cand in enumerate(tiers):
      need = k - len(chosen)
      if need == 0:
        break
      if cand.size == 0:
        continue
      take = min(need, cand.size)
      if mode == "contrastive":
        chosen += _contrastive(r[b], cand, take)
      elif mode == "deviation":
        chosen += _deviation(r[b], cand, take)
      else:
        chosen += _random(cand, take, jax.random.fold_in(jax.random.fold_in(key, b), t))
    out[b] = chosen
  return out
