"""Credit over the turns of multi-turn trajectories, selectable by name (`rollout.turn_credit`).

* `trajectory`: one reward per trajectory (the sum of its turn rewards); the configured
  `rl.advantage` recipe (GRPO ...) normalizes it within the group, and every policy token of
  the trajectory gets that advantage.
* `turn`: per-turn credit as turn-level GRPO / TRACE do it. Turn k's return is its reward plus
  the discounted later ones, G_k = sum_{j >= k} gamma^(j - k) r_j; returns are normalized
  within the group among the samples that reached turn k (mean, and std when it is positive),
  and every policy token of turn k gets A_k (`token_advantages`, which replace the recipe's).

Observation tokens belong to no turn (`turn_ids` -1) and carry no loss whatever they get.

>>> import numpy as np
>>> r = np.array([[[0.0, 1.0], [1.0, 0.0]]])          # [B=1, N=2, K=2]
>>> m = np.array([[[True, True], [True, False]]])
>>> trajectory_rewards(r, m).tolist()
[[1.0, 1.0]]
>>> turn_advantages(r, m, gamma=1.0).tolist()         # turn 0: returns 1 and 1; turn 1: one sample
[[[0.0, 0.0], [0.0, 0.0]]]
"""

from __future__ import annotations

import numpy as np


def discounted_returns(turn_rewards_BxNxK: np.ndarray, turn_mask_BxNxK: np.ndarray, gamma: float) -> np.ndarray:
  """G_k = sum_{j >= k} gamma^(j - k) r_j over each trajectory's turns (0 where the mask is False).

  >>> discounted_returns(np.array([[[0.0, 0.0, 1.0]]]), np.ones((1, 1, 3), bool), 0.5).tolist()
  [[[0.25, 0.5, 1.0]]]
  """
  r = np.where(turn_mask_BxNxK, np.asarray(turn_rewards_BxNxK, np.float64), 0.0)
  out = np.zeros_like(r)
  acc = np.zeros(r.shape[:-1])
  for k in range(r.shape[-1] - 1, -1, -1):
    acc = r[..., k] + gamma * acc
    out[..., k] = acc
  return np.where(turn_mask_BxNxK, out, 0.0).astype(np.float32)


def trajectory_rewards(turn_rewards_BxNxK: np.ndarray, turn_mask_BxNxK: np.ndarray) -> np.ndarray:
  """float32 [B, N]: each trajectory's reward, the sum of its turns' rewards."""
  return np.where(turn_mask_BxNxK, turn_rewards_BxNxK, 0.0).sum(-1).astype(np.float32)


def turn_advantages(turn_rewards_BxNxK: np.ndarray, turn_mask_BxNxK: np.ndarray, gamma: float = 1.0,
                    eps: float = 1e-4, sample_mask_BxN: np.ndarray | None = None) -> np.ndarray:
  """float32 [B, N, K]: turn-level GRPO advantages (returns normalized per group and turn index).

  Within group b and turn k the valid samples' returns are centred on their mean and divided
  by their std (ddof 1; not divided when the std is below `eps` or fewer than two samples
  reached the turn). Invalid entries are 0.
  """
  G = discounted_returns(turn_rewards_BxNxK, turn_mask_BxNxK, gamma).astype(np.float64)
  m = np.asarray(turn_mask_BxNxK, bool)
  if sample_mask_BxN is not None:
    m = m & np.asarray(sample_mask_BxN, bool)[..., None]
  n = m.sum(1, keepdims=True)                                  # [B, 1, K]
  mean = np.where(m, G, 0.0).sum(1, keepdims=True) / np.maximum(n, 1)
  var = np.where(m, (G - mean) ** 2, 0.0).sum(1, keepdims=True) / np.maximum(n - 1, 1)
  std = np.sqrt(var)
  adv = G - mean
  adv = np.where((n >= 2) & (std > eps), adv / np.maximum(std, eps), adv)
  return np.where(m, adv, 0.0).astype(np.float32)


def token_advantages(turn_adv_BxNxK: np.ndarray, turn_ids_BxNxT: np.ndarray) -> np.ndarray:
  """float32 [B, N, T]: each token gets its turn's advantage (0 at tokens of no turn, id -1).

  >>> token_advantages(np.array([[[2.0, -1.0]]]), np.array([[[0, 0, -1, 1, -1]]])).tolist()
  [[[2.0, 2.0, 0.0, -1.0, 0.0]]]
  """
  ids = np.asarray(turn_ids_BxNxT)
  got = np.take_along_axis(np.asarray(turn_adv_BxNxK, np.float32), np.maximum(ids, 0), axis=-1)
  return np.where(ids >= 0, got, 0.0).astype(np.float32)


def _trajectory(turn_rewards, turn_mask, turn_ids, *, gamma, sample_mask=None):
  """Trajectory credit: no per-token advantages (the `rl.advantage` recipe reads the rewards)."""
  del turn_rewards, turn_mask, turn_ids, gamma, sample_mask
  return None


def _turn(turn_rewards, turn_mask, turn_ids, *, gamma, sample_mask=None):
  """Turn credit: per-token advantages of turn-level GRPO."""
  return token_advantages(turn_advantages(turn_rewards, turn_mask, gamma, sample_mask_BxN=sample_mask), turn_ids)


#: name -> `(turn_rewards [B,N,K], turn_mask [B,N,K], turn_ids [B,N,T], *, gamma) -> token advantages or None`.
CREDIT = {"trajectory": _trajectory, "turn": _turn}


def credit(name: str, turn_rewards, turn_mask, turn_ids, *, gamma: float = 1.0, sample_mask=None):
  """The named credit's per-token advantages [B, N, T] (None: trajectory-level, the recipe's).

  >>> credit("turn", np.array([[[0.0, 1.0], [0.0, 0.0]]]), np.ones((1, 2, 2), bool),
  ...        np.array([[[0, 1], [0, 1]]]), gamma=1.0).tolist()
  [[[0.7071067690849304, 0.7071067690849304], [-0.7071067690849304, -0.7071067690849304]]]
  """
  if name not in CREDIT:
    raise ValueError(f"Config key rollout.turn_credit: unknown credit {name!r}; known: {', '.join(CREDIT)}.")
  return CREDIT[name](turn_rewards, turn_mask, turn_ids, gamma=gamma, sample_mask=sample_mask)
