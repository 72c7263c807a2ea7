"""FP4 weights: quantize once, then ``matmul`` by the reference XLA path or the Pallas kernel.

>>> import jax.numpy as jnp
>>> from rollouts_jax.kernels import fp4
>>> w = jnp.ones((64, 32))
>>> q = fp4.quantize(w, fmt="nvfp4")                  # or "mxfp4"
>>> y = fp4.matmul(jnp.ones((2, 64)), q, implementation="pallas")  # interpret on CPU
>>> y.shape
(2, 32)

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916) samples its rollouts with NVFP4
weights and trains in BF16; MXFP4 follows the OCP Microscaling v1.0 specification.
"""
from __future__ import annotations

from typing import Any

import jax

from rollouts_jax.kernels.fp4 import pallas as _pallas
from rollouts_jax.kernels.fp4 import reference as _reference
from rollouts_jax.kernels.fp4.reference import FORMATS, FP4Tensor

IMPLEMENTATIONS = ("pallas", "xla")


def quantize(w: jax.Array, fmt: str = "nvfp4", *, scale_rounding: str = "floor") -> FP4Tensor:
  """Quantizes a weight ``w [K, N]`` to FP4 with blocks along K.

  Args:
    w: float ``[K, N]`` (the model computes ``x[..., K] @ w``). K that is not a multiple
      of the block size is zero-padded at quantize time; the original K is kept.
    fmt: ``"nvfp4"`` (16-element blocks, E4M3 scales, fp32 tensor scale) or ``"mxfp4"``
      (32-element blocks, E8M0 power-of-two scales).
    scale_rounding: MXFP4 only, ``"floor"`` (OCP) or ``"ceil"`` (no saturation).

  Returns:
    An :class:`FP4Tensor` pytree (codes uint8 ``[K_pad//2, N]``, even K in the low nibble).

  >>> import jax.numpy as jnp
  >>> quantize(jnp.ones((16, 8)), "nvfp4").codes.shape
  (8, 8)
  >>> quantize(jnp.ones((16, 8)), "mxfp4").codes.shape  # K padded to 32
  (16, 8)
  """
  return _reference.quantize(w, fmt, scale_rounding=scale_rounding)


def dequantize(q: FP4Tensor, dtype: Any = None) -> jax.Array:
  """The dequantized ``[K, N]`` weight (default dtype: the original one).

  >>> import jax.numpy as jnp
  >>> dequantize(quantize(jnp.ones((16, 8)))).shape
  (16, 8)
  """
  return _reference.dequantize(q, dtype)


def matmul(x: jax.Array, q: FP4Tensor, implementation: str = "pallas", *,
           interpret: bool | None = None, block_m: int | None = None,
           block_n: int | None = None, block_k: int | None = None, **kernel_kwargs) -> jax.Array:
  """``x @ dequantize(q)`` accumulated in float32, returned in ``x.dtype``.

  Args:
    x: ``[..., K]``.
    q: an :class:`FP4Tensor` of shape ``(K, N)``.
    implementation: ``"pallas"`` (the kernel; dequantizes in-tile) or ``"xla"``
      (dequantize then dot, the reference path).
    interpret: Pallas only; default True when ``jax.default_backend() == "cpu"``.
    block_m, block_n, block_k: Pallas tile sizes (default: chosen to divide K and N).
    **kernel_kwargs: passed to :func:`kernels.fp4.pallas.fp4_matmul` (``num_warps`` ...).

  Returns:
    ``[..., N]`` in ``x.dtype``.

  >>> import jax.numpy as jnp
  >>> matmul(jnp.ones((3, 16)), quantize(jnp.eye(16)), "xla").shape
  (3, 16)
  """
  if not isinstance(q, FP4Tensor):
    raise ValueError(f"matmul expects an FP4Tensor from fp4.quantize; got {type(q).__name__}.")
  if implementation == "xla":
    return _reference.matmul(x, q)
  if implementation == "pallas":
    return _pallas.fp4_matmul(x, q, interpret=interpret, block_m=block_m, block_n=block_n,
                              block_k=block_k, **kernel_kwargs)
  raise ValueError(f"Unknown implementation {implementation!r}; expected one of "
                   f"{IMPLEMENTATIONS}.")


__all__ = ["FORMATS", "FP4Tensor", "IMPLEMENTATIONS", "dequantize", "matmul", "quantize"]
