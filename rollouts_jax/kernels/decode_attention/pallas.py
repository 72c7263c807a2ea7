"""Pallas kernel: shared-prefix decode attention with a length-aware suffix loop.

One program per (prompt b, key/value head k). It loads the queries of the prompt's N
samples for that head as one ``[N*G, D]`` tile and attends them to the prompt's keys in
one dot (the prompt's keys and values are read once per prompt, not once per sample).
It then loops over the samples' own generated keys in blocks of ``block_s`` slots, only
up to the filled ``length`` (a dynamic trip count: no recompilation as decoding
advances), with an online softmax that starts from the prefix part's running maximum
and sum; the two parts are thus merged exactly (the log-sum-exp merge of cascade
attention).

Layouts are those of :mod:`reference` (suffix keys head_dim before slot). The suffix
length S is zero-padded to a multiple of ``block_s`` when it is not one (a copy; the
sampler allocates a multiple). Backends: on CPU only ``interpret=True`` runs it; on GPU it
lowers through Triton (power-of-two N*G, D, P and block_s).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rollouts_jax.kernels.decode_attention.reference import NEG_INF


def _kernel(len_ref, q_ref, pk_ref, pv_ref, pm_ref, skt_ref, sv_ref, o_ref, *, n, g, block_s, scale):
  length = len_ref[0]
  q = q_ref[...].astype(jnp.float32) * scale                     # [N*G, D]
  pk = pk_ref[...].astype(jnp.float32)                            # [P, D]
  s = jax.lax.dot_general(q, pk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = jnp.where(pm_ref[...][None, :] > 0, s, NEG_INF)             # [N*G, P]
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[:, None])
  l = jnp.sum(p, axis=-1)
  acc = jnp.dot(p, pv_ref[...].astype(jnp.float32))               # [N*G, D]
  d = q.shape[-1]
  q3 = q.reshape(n, g, d)
  m, l, acc = m.reshape(n, g), l.reshape(n, g), acc.reshape(n, g, d)

  def block(i, carry):
    m, l, acc = carry
    start = pl.multiple_of(i * block_s, block_s)
    kt = skt_ref[:, :, pl.ds(start, block_s)].astype(jnp.float32)  # [N, D, bs]
    v = sv_ref[:, pl.ds(start, block_s), :].astype(jnp.float32)    # [N, bs, D]
    s = jnp.sum(q3[:, :, :, None] * kt[:, None, :, :], axis=2)     # [N, G, bs]
    slots = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
    s = jnp.where(slots < length, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + jnp.sum(p[..., None] * v[:, None, :, :], axis=2)
    return m_new, l, acc

  num_blocks = (length + block_s - 1) // block_s
  m, l, acc = jax.lax.fori_loop(0, num_blocks, block, (m, l, acc))
  o_ref[...] = (acc / l[..., None]).reshape(n * g, d).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def decode_attention(q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length, *,
                     block_s: int = 32, interpret: bool | None = None) -> jax.Array:
  """Shared-prefix decode attention (see :func:`reference.naive` for the arguments).

  Args:
    q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length: as `reference.naive`.
    block_s: suffix slots per loop step.
    interpret: run in the Pallas interpreter; default True on CPU.
  Returns:
    ``[B, N, K, G, D]`` in ``q.dtype``.

  >>> import jax.numpy as jnp
  >>> B, N, K, G, D, P, S = 1, 2, 1, 2, 4, 3, 8
  >>> out = decode_attention(jnp.ones((B, N, K, G, D)), jnp.ones((B, K, P, D)), jnp.ones((B, K, P, D)),
  ...                        jnp.ones((B, P), bool), jnp.ones((B * N, K, D, S)),
  ...                        jnp.ones((B * N, K, S, D)), 3, block_s=4)
  >>> out.shape
  (1, 2, 1, 2, 4)
  """
  B, N, K, G, D = q.shape
  P, S = prefix_k.shape[2], suffix_v.shape[2]
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  pad = (-S) % block_s
  if pad:
    suffix_kt = jnp.pad(suffix_kt, ((0, 0), (0, 0), (0, 0), (0, pad)))
    suffix_v = jnp.pad(suffix_v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    S += pad
  qg = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(B, K, N * G, D)
  skt = suffix_kt.reshape(B, N, K, D, S)
  sv = suffix_v.reshape(B, N, K, S, D)
  length_1 = jnp.reshape(jnp.asarray(length, jnp.int32), (1,))
  kernel = functools.partial(_kernel, n=N, g=G, block_s=block_s, scale=D ** -0.5)
  out = pl.pallas_call(
      kernel,
      grid=(B, K),
      in_specs=[
          pl.BlockSpec((1,), lambda b, k: (0,)),
          pl.BlockSpec((None, None, N * G, D), lambda b, k: (b, k, 0, 0)),
          pl.BlockSpec((None, None, P, D), lambda b, k: (b, k, 0, 0)),
          pl.BlockSpec((None, None, P, D), lambda b, k: (b, k, 0, 0)),
          pl.BlockSpec((None, P), lambda b, k: (b, 0)),
          pl.BlockSpec((None, N, None, D, S), lambda b, k: (b, 0, k, 0, 0)),
          pl.BlockSpec((None, N, None, S, D), lambda b, k: (b, 0, k, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, N * G, D), lambda b, k: (b, k, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((B, K, N * G, D), q.dtype),
      interpret=interpret,
  )(length_1, qg, prefix_k, prefix_v, prefix_mask.astype(jnp.int32), skt, sv)
  return jnp.transpose(out.reshape(B, K, N, G, D), (0, 2, 1, 3, 4))
