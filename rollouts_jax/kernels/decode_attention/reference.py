"""Shared-prefix decode attention in pure jnp: the naive truth and the cascade form.

One decode step of N samples per prompt. Each query row attends to two key/value sets:

* the prompt's (the *prefix*), stored once per prompt: ``[B, K, P, D]``;
* the row's own generated tokens (the *suffix*), of which the first ``length`` slots
  are filled: keys ``[B*N, K, D, S]`` (head_dim before slot), values ``[B*N, K, S, D]``.

Rows are prompt-major: row ``b * N + j`` is sample ``j`` of prompt ``b``. Queries are
``[B, N, K, G, D]`` (G query heads share each of the K key/value heads).

:func:`naive` copies the prefix to every row and runs one softmax over the concatenated
keys: the definition. :func:`cascade` computes each part's softmax separately and merges
them by their log-sum-exp (cascade attention; FlashInfer's "shared-prefix batch
decoding", Ye et al. 2024): the N samples' queries of one prompt form one ``[N*G, D]``
matrix against the prompt's keys (one larger contraction instead of N*K tiny ones), the
prompt's keys are never copied, and the suffix is reduced over the slots that exist.

>>> import jax.numpy as jnp
>>> B, N, K, G, D, P, S = 1, 2, 1, 2, 4, 3, 5
>>> q = jnp.ones((B, N, K, G, D))
>>> pk = pv = jnp.ones((B, K, P, D)); pm = jnp.ones((B, P), bool)
>>> skt = jnp.ones((B * N, K, D, S)); sv = jnp.ones((B * N, K, S, D))
>>> out = cascade(q, pk, pv, pm, skt, sv, 2)
>>> bool(jnp.allclose(out, naive(q, pk, pv, pm, skt, sv, 2)))
True
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, like the model's mask value: an empty part gets zero weight, never NaN


def naive(q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length) -> jax.Array:
  """The definition: one softmax over [prefix copied per row ; first `length` suffix slots].

  Args:
    q: queries ``[B, N, K, G, D]`` (post-rotary, unscaled).
    prefix_k, prefix_v: ``[B, K, P, D]``.
    prefix_mask: bool ``[B, P]``, True at real prompt tokens.
    suffix_kt: ``[B*N, K, D, S]`` suffix keys, head_dim before slot.
    suffix_v: ``[B*N, K, S, D]``.
    length: int scalar, the number of filled suffix slots (the same for every row).
  Returns:
    ``[B, N, K, G, D]`` attention outputs in ``q.dtype``.
  """
  B, N, K, G, D = q.shape
  R, S = B * N, suffix_v.shape[2]
  rep = lambda x: jnp.repeat(x, N, axis=0)
  k_all = jnp.concatenate([rep(prefix_k), jnp.swapaxes(suffix_kt, -1, -2)], axis=2)  # [R, K, P+S, D]
  v_all = jnp.concatenate([rep(prefix_v), suffix_v], axis=2)
  mask = jnp.concatenate([rep(prefix_mask), jnp.broadcast_to(jnp.arange(S) < length, (R, S))], axis=1)
  qr = q.reshape(R, K, G, D)
  s = jnp.einsum("rkgd,rksd->rkgs", qr, k_all, preferred_element_type=jnp.float32) * (D ** -0.5)
  s = jnp.where(mask[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("rkgs,rksd->rkgd", p, v_all.astype(jnp.float32))
  return out.reshape(B, N, K, G, D).astype(q.dtype)


def merge(out_a, lse_a, out_b, lse_b):
  """Combines two normalized partial attentions over disjoint key sets.

  Args:
    out_a, out_b: ``[..., D]`` outputs, each softmax-normalized over its own keys.
    lse_a, lse_b: ``[...]`` log-sum-exp of each part's scores.
  Returns:
    (out, lse) of the attention over the union of the key sets.

  >>> import jax.numpy as jnp
  >>> o, lse = merge(jnp.ones((1, 2)), jnp.zeros(1), 3 * jnp.ones((1, 2)), jnp.zeros(1))
  >>> o.tolist(), lse.tolist()  # equal mass: the mean
  ([[2.0, 2.0]], [0.6931471824645996])
  """
  m = jnp.maximum(lse_a, lse_b)
  wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = wa + wb
  out = (out_a * (wa / total)[..., None] + out_b * (wb / total)[..., None])
  return out, m + jnp.log(total)


def prefix_part(q, prefix_k, prefix_v, prefix_mask):
  """Attention of all N*G queries of a prompt to its prompt keys, as one contraction.

  Returns:
    (out ``[B, N, K, G, D]`` float32, lse ``[B, N, K, G]``).
  """
  B, N, K, G, D = q.shape
  qg = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(B, K, N * G, D)
  s = jnp.einsum("bkmd,bkpd->bkmp", qg, prefix_k, preferred_element_type=jnp.float32) * (D ** -0.5)
  s = jnp.where(prefix_mask[:, None, None, :], s, NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bkmp,bkpd->bkmd", p, prefix_v.astype(jnp.float32)) / l[..., None]
  back = lambda x: jnp.moveaxis(x.reshape((B, K, N, G) + x.shape[3:]), 2, 1)
  return back(o), back(m[..., 0] + jnp.log(l))


def suffix_part(q, suffix_kt, suffix_v, length):
  """Each row's attention to its own first `length` suffix slots.

  Written as broadcast multiplies and reductions over non-minor axes (keys stored head_dim
  before slot): on XLA:CPU these fuse into vectorized loops, where a batched dot per
  (row, head) runs as thousands of tiny matrix products. Callers pass a static slice
  ``[..., :view]`` covering `length`, so the work follows the filled part of the cache.

  Returns:
    (out ``[B, N, K, G, D]`` float32, lse ``[B, N, K, G]``).
  """
  B, N, K, G, D = q.shape
  S = suffix_v.shape[2]
  qr = q.reshape(B * N, K, G, D).astype(jnp.float32)
  s = jnp.sum(qr[..., None] * suffix_kt[:, :, None].astype(jnp.float32), axis=3) * (D ** -0.5)
  s = jnp.where(jnp.arange(S) < length, s, NEG_INF)  # [R, K, G, S]
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  o = jnp.sum(p[..., None] * suffix_v[:, :, None].astype(jnp.float32), axis=3) / l[..., None]
  return o.reshape(B, N, K, G, D), (m[..., 0] + jnp.log(l)).reshape(B, N, K, G)


def cascade(q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length) -> jax.Array:
  """Same result as :func:`naive`: prefix and suffix attended apart, merged by log-sum-exp.

  Args and Returns: as :func:`naive`.
  """
  o1, lse1 = prefix_part(q, prefix_k, prefix_v, prefix_mask)
  o2, lse2 = suffix_part(q, suffix_kt, suffix_v, length)
  out, _ = merge(o1, lse1, o2, lse2)
  return out.astype(q.dtype)
