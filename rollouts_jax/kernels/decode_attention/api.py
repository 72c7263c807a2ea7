"""Shared-prefix decode attention: dispatch between the naive truth, XLA and Pallas.

>>> import jax.numpy as jnp
>>> from rollouts_jax.kernels import decode_attention as da
>>> B, N, K, G, D, P, S = 1, 2, 1, 2, 4, 3, 8
>>> args = (jnp.ones((B, N, K, G, D)), jnp.ones((B, K, P, D)), jnp.ones((B, K, P, D)),
...         jnp.ones((B, P), bool), jnp.ones((B * N, K, D, S)), jnp.ones((B * N, K, S, D)), 3)
>>> [da.decode_attention(*args, implementation=i).shape for i in da.IMPLEMENTATIONS]
[(1, 2, 1, 2, 4), (1, 2, 1, 2, 4), (1, 2, 1, 2, 4)]

Paper: cascade / shared-prefix attention as in FlashInfer (Ye et al., "FlashInfer:
Efficient and Customizable Attention Engine for LLM Inference Serving", 2025) and Hydragen
(Juravsky et al., 2024): attend the shared prefix once per prompt and merge with the
per-sample part by log-sum-exp.
"""
from __future__ import annotations

import jax

from rollouts_jax.kernels.decode_attention import pallas as _pallas
from rollouts_jax.kernels.decode_attention import reference as _reference

IMPLEMENTATIONS = ("naive", "xla", "pallas")


def decode_attention(q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length, *,
                     implementation: str = "xla", interpret: bool | None = None,
                     block_s: int = 32) -> jax.Array:
  """One decode step of attention for N samples per prompt sharing the prompt's keys.

  Args:
    q: queries ``[B, N, K, G, D]`` (rows prompt-major; post-rotary, unscaled).
    prefix_k, prefix_v: the prompts' keys / values ``[B, K, P, D]``, stored once per prompt.
    prefix_mask: bool ``[B, P]``, True at real prompt tokens.
    suffix_kt: generated keys ``[B*N, K, D, S]`` (head_dim before slot).
    suffix_v: generated values ``[B*N, K, S, D]``.
    length: int scalar; suffix slots ``[0, length)`` are attended (all rows alike).
    implementation: ``"naive"`` (prefix copied per row, one softmax: the definition),
      ``"xla"`` (cascade in pure jnp; the fast form on CPU) or ``"pallas"`` (the kernel;
      length-aware loop over suffix blocks).
    interpret: Pallas only; default True on CPU.
    block_s: Pallas only; suffix slots per loop step.
  Returns:
    ``[B, N, K, G, D]`` in ``q.dtype``.
  """
  args = (q, prefix_k, prefix_v, prefix_mask, suffix_kt, suffix_v, length)
  if implementation == "naive":
    return _reference.naive(*args)
  if implementation == "xla":
    return _reference.cascade(*args)
  if implementation == "pallas":
    return _pallas.decode_attention(*args, block_s=block_s, interpret=interpret)
  raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
