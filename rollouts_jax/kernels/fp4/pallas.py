"""Pallas kernel: ``x @ W`` straight from packed FP4 codes and block scales.

Each program computes one ``[block_m, block_n]`` output tile and loops over K in chunks of
``block_k``. Per chunk it loads ``block_k // 2`` rows of packed codes and the matching
block scales, decodes both arithmetically from their bits (integer shifts and masks, no
table gather, so the same body lowers on Triton, Mosaic TPU and in interpret mode),
multiplies the codes by their block scale in-tile and accumulates two dots in float32:

    acc += x[:, even K] @ w_hat[low nibbles] + x[:, odd K] @ w_hat[high nibbles]

Splitting x into its even and odd K columns (outside the kernel; x is small in decode)
avoids interleaving the two nibbles of each byte inside the tile. The NVFP4 per-tensor
scale multiplies the float32 result once at the end. For bf16 inputs the decoded tile is
bf16, which is exact: an E2M1 value times an E4M3 scale has at most 5 significant bits, and
times a power of two it keeps E2M1's 2 bits. Other input dtypes use float32 tiles.

Shapes: M is zero-padded to a multiple of ``block_m``; K (already padded to the format's
block size at quantize time) and N are zero-padded to multiples of ``block_k`` and
``block_n`` when they are not (this copies the weight every call, so pick block sizes that
divide K and N: :func:`default_block_sizes` does). The result is sliced back.

Backends: on GPU the kernel is lowered through Triton (``pallas.triton.CompilerParams``;
block sizes must be powers of two and ``block_m, block_k // 2, block_n >= 16`` for
``tl.dot``); on TPU through Mosaic; on CPU only ``interpret=True`` runs it. Mosaic GPU's
``pallas_call`` path is not used (it is deprecated in favour of ``plgpu.kernel``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rollouts_jax.kernels.fp4 import reference

_E4M3_SUBNORMAL_UNIT = 2.0 ** -9


def _decode_e2m1(nib_i32: jax.Array) -> jax.Array:
  """E2M1 codes (int32 in [0, 15]) to float32: 2*|v| = m (e == 0) or (2 + m) << (e - 1)."""
  sign = (nib_i32 >> 3) & 1
  exp = (nib_i32 >> 1) & 3
  man = nib_i32 & 1
  twice = jnp.where(exp == 0, man, (2 + man) << jnp.maximum(exp - 1, 0))
  mag = twice.astype(jnp.float32) * 0.5
  return jnp.where(sign == 1, -mag, mag)


def _decode_e4m3(bits_i32: jax.Array) -> jax.Array:
  """float8_e4m3fn bit patterns (int32) to float32; 2^9 |v| = m (e == 0) or (8 + m) << (e - 1).

  The NaN pattern (0x7F) is never produced by quantize and decodes to 480 here.
  """
  sign = (bits_i32 >> 7) & 1
  exp = (bits_i32 >> 3) & 15
  man = bits_i32 & 7
  units = jnp.where(exp == 0, man, (8 + man) << jnp.maximum(exp - 1, 0))
  mag = units.astype(jnp.float32) * _E4M3_SUBNORMAL_UNIT
  return jnp.where(sign == 1, -mag, mag)


def _decode_e8m0(bits_i32: jax.Array) -> jax.Array:
  """E8M0 bytes (int32) to float32 2^(b - 127) by building the fp32 exponent field."""
  fbits = jnp.where(bits_i32 == 0, jnp.int32(0x00400000), bits_i32 << 23)
  val = jax.lax.bitcast_convert_type(fbits, jnp.float32)
  return jnp.where(bits_i32 == 255, jnp.float32(jnp.nan), val)


def _fp4_matmul_kernel(xe_ref, xo_ref, codes_ref, scales_ref, out_ref, *, num_k_steps,
                       block_k, block_size, scale_kind, compute_dtype, precision):
  """One [block_m, block_n] output tile; loops over K in block_k chunks."""
  block_m, block_n = out_ref.shape
  rows = block_k // 2                    # packed rows per chunk
  num_scales = block_k // block_size     # scale rows per chunk
  group = block_size // 2                # packed rows sharing one scale
  decode_scale = _decode_e4m3 if scale_kind == "e4m3" else _decode_e8m0

  def dequant(nib_i32, scale_sxn):
    w_sxgxn = _decode_e2m1(nib_i32).reshape(num_scales, group, block_n)
    return (w_sxgxn * scale_sxn[:, None, :]).reshape(rows, block_n).astype(compute_dtype)

  def body(step, acc_mxn):
    r0 = pl.multiple_of(step * rows, rows)
    s0 = pl.multiple_of(step * num_scales, num_scales)
    # the & masks keep the bytes right even if a backend sign-extends uint8 -> int32
    codes = codes_ref[pl.ds(r0, rows), :].astype(jnp.int32) & 0xFF
    scale_sxn = decode_scale(scales_ref[pl.ds(s0, num_scales), :].astype(jnp.int32) & 0xFF)
    w_lo = dequant(codes & 15, scale_sxn)          # even K rows
    w_hi = dequant((codes >> 4) & 15, scale_sxn)   # odd K rows
    x_even = xe_ref[:, pl.ds(r0, rows)]
    x_odd = xo_ref[:, pl.ds(r0, rows)]
    acc_mxn += jnp.dot(x_even, w_lo, precision=precision, preferred_element_type=jnp.float32)
    acc_mxn += jnp.dot(x_odd, w_hi, precision=precision, preferred_element_type=jnp.float32)
    return acc_mxn

  acc = jax.lax.fori_loop(0, num_k_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
  out_ref[...] = acc


def _is_pow2(v: int) -> bool:
  return v > 0 and (v & (v - 1)) == 0


def default_block_sizes(m: int, k_pad: int, n: int, fmt: str,
                        backend: str = "gpu") -> tuple[int, int, int]:
  """Power-of-two block sizes that divide K and N where possible (no weight padding).

  On TPU, ``block_n`` is a multiple of 128 lanes and ``block_k // 2`` too, as Mosaic
  requires for the blocks and the in-kernel K slices.

  >>> default_block_sizes(1, 4096, 4096, "nvfp4")
  (16, 64, 256)
  """
  block_m = min(64, max(16, pl.next_power_of_2(max(m, 1))))
  if backend == "tpu":
    n_choices, k_choices = (128, 256), (512, 256, 1024)
  else:
    n_choices = (64, 128, 32, 16)
    k_choices = tuple(b for b in (256, 512, 128, 64, 32) if b >= reference.BLOCK_SIZES[fmt])
  block_n = next((b for b in n_choices if n % b == 0), n_choices[0])
  block_k = next((b for b in k_choices if k_pad % b == 0), k_choices[0])
  return block_m, block_n, block_k


def _compiler_params(backend: str, num_warps: int | None, num_stages: int | None):
  if backend == "gpu":
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  return None


@functools.partial(jax.jit, static_argnames=(
    "block_m", "block_n", "block_k", "interpret", "backend", "num_warps", "num_stages"))
def fp4_matmul(x: jax.Array, q: reference.FP4Tensor, *, block_m: int | None = None,
               block_n: int | None = None, block_k: int | None = None,
               interpret: bool | None = None, backend: str | None = None,
               num_warps: int | None = 4, num_stages: int | None = 3) -> jax.Array:
  """``x @ dequantize(q)`` with a Pallas kernel that dequantizes in-tile (fp32 accumulate).

  Args:
    x: ``[..., K]`` activations (any float dtype; bf16 keeps a bf16 MMA).
    q: an :class:`~kernels.fp4.reference.FP4Tensor` of shape ``(K, N)``.
    block_m, block_n, block_k: tile sizes (default :func:`default_block_sizes`).
      ``block_k`` must be a multiple of the format's block size (16 NVFP4, 32 MXFP4).
    interpret: run the kernel in the Pallas interpreter; default True on CPU.
    backend: the platform to lower for (``"cpu"``, ``"gpu"``, ``"tpu"``); default
      ``jax.default_backend()``. Chooses the compiler parameters.
    num_warps, num_stages: Triton parameters (GPU only).

  Returns:
    ``[..., N]`` in ``x.dtype``.

  >>> q = reference.quantize(jnp.eye(32), "nvfp4")
  >>> fp4_matmul(jnp.ones((2, 32)), q).shape
  (2, 32)

  Paper: Sol-RL (arXiv 2604.06916) samples rollouts with NVFP4 weights.
  """
  x = jnp.asarray(x)
  k, n = q.shape
  if q.codes.ndim != 2:
    raise ValueError(f"fp4_matmul expects a single [K, N] weight; got codes "
                     f"{q.codes.shape} (map over stacked weights).")
  if x.shape[-1] != k:
    raise ValueError(f"fp4_matmul: x has K={x.shape[-1]} but the weight is {q.shape}.")
  block = q.block_size
  k_pad = q.padded_k
  lead = x.shape[:-1]
  x_mxk = x.reshape(-1, k)
  m = x_mxk.shape[0]
  backend = jax.default_backend() if backend is None else backend
  dm, dn, dk = default_block_sizes(m, k_pad, n, q.fmt, backend)
  block_m = dm if block_m is None else block_m
  block_n = dn if block_n is None else block_n
  block_k = dk if block_k is None else block_k
  if min(block_m, block_n, block_k) <= 0 or block_k % block != 0:
    raise ValueError(f"fp4_matmul: block_k={block_k} must be a positive multiple of the "
                     f"{q.fmt} block size {block}; block_m={block_m}, block_n={block_n} > 0.")
  if interpret is None:
    interpret = backend == "cpu"
  if backend == "gpu" and not interpret and not all(
      _is_pow2(b) for b in (block_m, block_n, block_k)):
    raise ValueError(f"fp4_matmul on GPU needs power-of-two blocks; got "
                     f"{(block_m, block_n, block_k)}.")

  compute_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
  precision = (jax.lax.Precision.DEFAULT if compute_dtype == jnp.bfloat16
               else jax.lax.Precision.HIGHEST)
  m_pad = -(-m // block_m) * block_m
  k_run = -(-k_pad // block_k) * block_k
  n_pad = -(-n // block_n) * block_n

  # Even K columns meet the low nibbles, odd ones the high nibbles.
  x_mxk = jnp.pad(x_mxk.astype(compute_dtype), ((0, m_pad - m), (0, k_run - k)))
  x_even, x_odd = x_mxk[:, 0::2], x_mxk[:, 1::2]
  if q.fmt == "nvfp4":
    scales = jax.lax.bitcast_convert_type(q.block_scales, jnp.uint8)
    scale_kind, scale_pad = "e4m3", 0
  else:
    scales, scale_kind, scale_pad = q.block_scales, "e8m0", 127
  codes = q.codes
  if k_run != k_pad or n_pad != n:  # padding codes are zero, so they add nothing
    codes = jnp.pad(codes, ((0, (k_run - k_pad) // 2), (0, n_pad - n)))
    scales = jnp.pad(scales, ((0, (k_run - k_pad) // block), (0, n_pad - n)),
                     constant_values=scale_pad)

  kernel = functools.partial(
      _fp4_matmul_kernel, num_k_steps=k_run // block_k, block_k=block_k, block_size=block,
      scale_kind=scale_kind, compute_dtype=compute_dtype, precision=precision)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), jnp.float32),
      grid=(m_pad // block_m, n_pad // block_n),
      in_specs=[
          pl.BlockSpec((block_m, k_run // 2), lambda i, j: (i, 0)),
          pl.BlockSpec((block_m, k_run // 2), lambda i, j: (i, 0)),
          pl.BlockSpec((k_run // 2, block_n), lambda i, j: (0, j)),
          pl.BlockSpec((k_run // block, block_n), lambda i, j: (0, j)),
      ],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(backend, num_warps, num_stages),
      name="fp4_matmul",
  )(x_even, x_odd, codes, scales)
  y = out[:m, :n] * q.tensor_scale
  return y.astype(x.dtype).reshape(*lead, n)
