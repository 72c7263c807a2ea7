"""Per-token advantages for tree rollouts (TreeRL) and ECHO's entropy-confidence shaping.

Both return per-token advantages `[B, N, T]` (B prompts, N leaves / samples, T positions),
which `losses.policy_loss` accepts flattened to `[B*N, T]`.

A tree is described as in `sampling.tree.TreeInfo`: `split[b, i, j]` is the first position
where leaves i and j may differ (they share tokens `[0, split)`; T on the diagonal). The node
holding token t of leaf i has the leaves `{j : split[i, j] > t}` below it; its parent node is
the one holding token `b - 1`, where b is the start of the node's segment (the largest split
value <= t), and the root (all leaves of the prompt) when b = 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _masked_mean(x_BxIxJxT, w_BxIxJxT):
  n = jnp.sum(w_BxIxJxT, axis=2)
  return jnp.sum(jnp.where(w_BxIxJxT, x_BxIxJxT, 0.0), axis=2) / jnp.maximum(n, 1), n


def tree_node_advantages(rewards_BxN: Array, split_BxNxN: Array, leaf_mask_BxN: Array,
                         completion_mask_BxNxT: Array) -> Array:
  """TreeRL's process advantages: every token of a node's segment gets R(s).

  For a node s with V(s) the mean reward of the leaves below it: G(s) = V(s) - V(root),
  L(s) = V(s) - V(parent(s)), R(s) = (G(s) + L(s)) / sqrt(|leaves(s)|) (TreeRL, Hou et al.,
  2025, arXiv 2506.11902). V(root) is the mean over the prompt's leaves (the group baseline);
  the prefix shared by every leaf belongs to the root itself and gets 0.

  Args:
    rewards_BxN: float [B, N] leaf rewards.
    split_BxNxN: int [B, N, N] divergence positions (`TreeInfo.split`).
    leaf_mask_BxN: bool [B, N]; False for rows that are not leaves (excluded everywhere).
    completion_mask_BxNxT: bool [B, N, T]; the advantage is 0 where it is False.

  Returns:
    float32 [B, N, T].

  Example (two leaves that share their first token, rewards 1 and 0):
    >>> split = jnp.array([[[3, 1], [1, 3]]])
    >>> adv = tree_node_advantages(jnp.array([[1., 0.]]), split, jnp.ones((1, 2), bool),
    ...                            jnp.ones((1, 2, 3), bool))
    >>> adv.tolist()  # shared token: root (0); own tokens: G = L = +-0.5, one leaf
    [[[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]]]
  """
  r = jnp.asarray(rewards_BxN, jnp.float32)
  valid = jnp.asarray(leaf_mask_BxN, bool)
  split = jnp.asarray(split_BxNxN, jnp.int32)
  mask = jnp.asarray(completion_mask_BxNxT, bool)
  T = mask.shape[-1]
  pos = jnp.arange(T)[None, None, None, :]
  s = split[..., None]                                           # [B, i, j, 1]
  vj = valid[:, None, :, None]                                   # [B, 1, j, 1]
  rj = jnp.broadcast_to(r[:, None, :, None], s.shape[:3] + (T,))
  below = vj & (s > pos)                                         # leaves of the node of (i, t)
  v_node, n_node = _masked_mean(rj, below)
  seg = jnp.max(jnp.where(vj & (s <= pos), s, -1), axis=2)       # [B, i, T]; -1: the root's own segment
  parent_set = vj & (s >= seg[:, :, None, :])                    # seg = 0 -> all leaves (the root)
  v_parent, _ = _masked_mean(rj, parent_set)
  n_valid = jnp.sum(valid, axis=1)
  v_root = jnp.sum(jnp.where(valid, r, 0.0), axis=1) / jnp.maximum(n_valid, 1)
  g = v_node - v_root[:, None, None]
  l = jnp.where(seg >= 0, v_node - v_parent, 0.0)
  adv = (g + l) / jnp.sqrt(jnp.maximum(n_node, 1).astype(jnp.float32))
  return jnp.where(mask & valid[..., None], adv, 0.0)


def normalized_confidence(confidence_BxN: Array, mask_BxN: Array | None = None) -> Array:
  """Each response's confidence min-max normalised within its group (1 where the group is flat).

  >>> normalized_confidence(jnp.array([[1., 3., 2.], [5., 5., 5.]])).tolist()
  [[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]]
  """
  c = jnp.asarray(confidence_BxN, jnp.float32)
  m = jnp.ones(c.shape, bool) if mask_BxN is None else jnp.asarray(mask_BxN, bool)
  lo = jnp.min(jnp.where(m, c, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(m, c, -jnp.inf), axis=1, keepdims=True)
  span = hi - lo
  flat = ~(span > 0)
  out = jnp.where(flat, 1.0, (c - jnp.where(flat, 0.0, lo)) / jnp.where(flat, 1.0, span))
  return jnp.where(m, out, 0.0)


def mean_token_confidence(confidence_BxNxT: Array, completion_mask_BxNxT: Array) -> Array:
  """Response confidence: the mean token confidence over its valid tokens, [B, N]."""
  m = jnp.asarray(completion_mask_BxNxT, bool)
  c = jnp.asarray(confidence_BxNxT, jnp.float32)
  return jnp.sum(jnp.where(m, c, 0.0), axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1)


def echo_hybrid_advantages(advantages_BxN: Array, entropy_BxNxT: Array, confidence_BxN: Array,
                           completion_mask_BxNxT: Array, *, lam: float = 0.5,
                           sample_mask_BxN: Array | None = None) -> Array:
  """ECHO's entropy-confidence hybrid shaping of per-response advantages (forms ours).

  A_{i,t} = A_i [(1 - lam) + lam H_{i,t} / mean_t H_{i,.}] (c_i if A_i > 0 else 1), where c_i is
  response i's confidence min-max normalised within its group (ECHO, arXiv 2602.02150; the
  paper gives the idea, the exact form is ours). A response with zero mean entropy keeps the
  unshaped weight; a zero advantage stays zero (so zero-std groups keep A = 0).

  Args:
    advantages_BxN: per-response advantages [B, N] (e.g. GRPO's), or per-token ones [B, N, T]
      or [B, N, 1] (shaped token by token: the sign of A_{i,t} picks the confidence factor).
    entropy_BxNxT: per-token policy entropy (`SampleOutput.entropy`).
    confidence_BxN: per-response confidence (e.g. `mean_token_confidence` of `TreeInfo.confidence`).
    completion_mask_BxNxT: valid tokens.
    lam: the mixing weight lambda in [0, 1].
    sample_mask_BxN: responses that count in the group's min-max (default all).

  Returns:
    float32 [B, N, T], 0 where the completion mask is False.

  Example:
    >>> a = echo_hybrid_advantages(jnp.array([[1., -1.]]), jnp.array([[[1., 3.], [2., 2.]]]),
    ...                            jnp.array([[2., 1.]]), jnp.ones((1, 2, 2), bool))
    >>> a.tolist()  # the positive one: confidence 1 (the group's max); entropy 1 and 3 around a mean of 2
    [[[0.75, 1.25], [-1.0, -1.0]]]
  """
  m = jnp.asarray(completion_mask_BxNxT, bool)
  h = jnp.where(m, jnp.asarray(entropy_BxNxT, jnp.float32), 0.0)
  mean_h = jnp.sum(h, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1)
  rel = jnp.where(mean_h > 0, h / jnp.where(mean_h > 0, mean_h, 1.0), 1.0)
  a = jnp.asarray(advantages_BxN, jnp.float32)
  a = a[..., None] if a.ndim == 2 else a
  c = normalized_confidence(confidence_BxN, sample_mask_BxN)[..., None]
  out = a * ((1.0 - lam) + lam * rel) * jnp.where(a > 0, c, 1.0)
  return jnp.where(m, out, 0.0)
