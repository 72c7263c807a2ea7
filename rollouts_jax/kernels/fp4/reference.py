"""FP4 weight quantization in pure jnp: the reference every kernel is tested against.

Two formats share one element type, E2M1 (1 sign bit, 2 exponent bits with bias 1,
1 mantissa bit; no Inf/NaN): the 16 codes decode to ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.

* **NVFP4** (NVIDIA; ModelOpt ``NVFP4QTensor``): a float32 per-tensor scale
  ``s_g = amax(|W|) / (6 * 448)`` and, per 16 consecutive elements along K, a block scale
  ``s_b = amax_b / (6 * s_g)`` rounded to ``float8_e4m3fn`` (round-to-nearest-even).
  A block scale that is zero after rounding (an all-zero block, or one so small that its
  scale underflows E4M3) is replaced by 1.0; such a block quantizes to all-zero codes.
  ``q = E2M1(w / (s_b * s_g))`` and ``w_hat = e2m1(q) * s_b * s_g``.
* **MXFP4** (OCP Microscaling v1.0): per 32 consecutive elements along K a power-of-two
  scale ``2^e`` stored as E8M0 (an unsigned byte ``e + 127``; 0xFF is NaN), with
  ``e = floor(log2(amax_b)) - 2`` (2 = emax of E2M1) clamped to ``[-127, 127]``; an
  all-zero block gets ``e = -127`` (byte 0), as in ``microsoft/microxcaling``. The
  ``"ceil"`` variant instead takes the smallest ``e`` with ``amax_b <= 6 * 2^e``, so no
  element saturates. ``q = E2M1(w / 2^e)`` and ``w_hat = e2m1(q) * 2^e``.

E2M1 rounding is round-to-nearest-even with saturation at ±6: decision bounds on ``|x|``
are ``[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]`` and a tie goes to the even-mantissa code
(0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4). The sign bit (bit 3) is set for
``x < 0``, so small negatives round to the code of -0.

Layout (weights are ``[K, N]``, the model computes ``x[..., K] @ w[K, N]``):

* blocks run along K, the contraction axis;
* ``codes``: ``uint8 [K_pad // 2, N]``, two codes per byte packed along K, **the even K
  element in the low nibble** (``byte = q[2i] | q[2i + 1] << 4``);
* ``block_scales``: ``[K_pad // block, N]``; ``float8_e4m3fn`` for NVFP4, ``uint8`` E8M0
  bytes for MXFP4;
* K that is not a multiple of the block size is **zero-padded at quantize time** to
  ``K_pad``; the original ``(K, N)`` is kept in the static field ``shape`` and
  :func:`dequantize` slices the padding off.

Numerics: quantization multiplies by ``2^-e`` (a normal float) rather than dividing by a
possibly subnormal ``2^e``, so codes are exact on backends that flush denormals (XLA:CPU
does); dequantized values below 2^-126 (only from blocks with ``amax_b < 2^-124``) may
still flush to zero there.

Paper: Sol-RL (FP4 Explore, BF16 Train), arXiv 2604.06916, which runs its rollouts with an
NVFP4 model; the OCP Microscaling Formats (MX) v1.0 specification for MXFP4.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
BLOCK_SIZES = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
FORMATS = tuple(BLOCK_SIZES)
MX_SCALE_ROUNDINGS = ("floor", "ceil")

# Code c -> value; bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# (bound, tie goes up): ties go up exactly where the upper neighbour has an even code.
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                (2.5, False), (3.5, True), (5.0, False))


@flax.struct.dataclass
class FP4Tensor:
  """A quantized ``[K, N]`` weight: a pytree that passes through ``jax.jit`` and tree maps.

  Attributes:
    codes: uint8 ``[K_pad // 2, N]``; E2M1 codes packed along K, even K element in the
      low nibble.
    block_scales: ``[K_pad // block_size, N]``; NVFP4: ``float8_e4m3fn``; MXFP4: uint8
      E8M0 exponent bytes (bias 127).
    tensor_scale: float32 ``[]``; NVFP4 per-tensor scale, 1.0 for MXFP4.
    fmt: ``"nvfp4"`` or ``"mxfp4"`` (static).
    shape: the original ``(K, N)`` before padding K (static).
    dtype: name of the original dtype, the default output of :func:`dequantize` (static).

  Stacked weights (``jax.vmap(quantize)`` over ``[L, K, N]``) give arrays with a leading
  ``L`` axis and the per-layer ``shape``; slicing them in ``lax.scan`` gives per-layer
  tensors.
  """
  codes: jax.Array
  block_scales: jax.Array
  tensor_scale: jax.Array
  fmt: str = flax.struct.field(pytree_node=False, default="nvfp4")
  shape: tuple[int, int] = flax.struct.field(pytree_node=False, default=(0, 0))
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  @property
  def block_size(self) -> int:
    return BLOCK_SIZES[self.fmt]

  @property
  def padded_k(self) -> int:
    return 2 * self.codes.shape[-2]

  @property
  def nbytes(self) -> int:
    """Bytes held by the arrays (codes, block scales and the tensor scale)."""
    return int(self.codes.nbytes + self.block_scales.nbytes + self.tensor_scale.nbytes)


def _check_fmt(fmt: str) -> int:
  if fmt not in BLOCK_SIZES:
    raise ValueError(f"Unknown FP4 format {fmt!r}; expected one of {FORMATS}.")
  return BLOCK_SIZES[fmt]


# ----------------------------------------------------------------------------- E2M1


def e2m1_encode(x: jax.Array) -> jax.Array:
  """Rounds float values to E2M1 codes (round-to-nearest-even, saturating at ±6).

  Args:
    x: float array, already divided by its scale.

  Returns:
    uint8 array of the same shape holding codes in ``[0, 15]`` (bit 3 = sign).

  >>> e2m1_encode(jnp.array([0.25, 0.75, 2.5, -7.0])).tolist()
  [0, 2, 4, 15]
  """
  x = jnp.asarray(x, jnp.float32)
  a = jnp.abs(x)
  mag = jnp.zeros(x.shape, jnp.uint8)
  for bound, tie_up in _E2M1_BOUNDS:
    mag = mag + ((a >= bound) if tie_up else (a > bound)).astype(jnp.uint8)
  return mag | ((x < 0).astype(jnp.uint8) << 3)


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """Maps E2M1 codes (uint8 in ``[0, 15]``) to float32 values by table lookup.

  >>> e2m1_decode(jnp.array([1, 7, 13], jnp.uint8)).tolist()
  [0.5, 6.0, -3.0]
  """
  return jnp.asarray(E2M1_VALUES)[jnp.asarray(codes).astype(jnp.int32) & 15]


def pack_nibbles(codes: jax.Array, axis: int = 0) -> jax.Array:
  """Packs 4-bit codes two per byte along ``axis``: even element low nibble, odd high.

  Args:
    codes: uint8 codes in ``[0, 15]``; ``codes.shape[axis]`` must be even.
    axis: the axis to pack along (K, axis 0, for weights).

  Returns:
    uint8 array with ``shape[axis]`` halved: ``out[i] = codes[2i] | codes[2i+1] << 4``.

  >>> pack_nibbles(jnp.array([1, 2, 15, 0], jnp.uint8)).tolist()
  [33, 15]
  """
  codes = jnp.asarray(codes)
  axis = axis % codes.ndim
  if codes.shape[axis] % 2:
    raise ValueError(f"pack_nibbles needs an even length along axis {axis}; got shape "
                     f"{codes.shape}.")
  codes = codes.astype(jnp.uint8)
  even = jax.lax.slice_in_dim(codes, 0, None, 2, axis)
  odd = jax.lax.slice_in_dim(codes, 1, None, 2, axis)
  return (even & 15) | ((odd & 15) << 4)


def unpack_nibbles(packed: jax.Array, axis: int = 0) -> jax.Array:
  """Inverse of :func:`pack_nibbles`: doubles ``shape[axis]``, low nibble first.

  >>> unpack_nibbles(jnp.array([33, 15], jnp.uint8)).tolist()
  [1, 2, 15, 0]
  """
  packed = jnp.asarray(packed).astype(jnp.uint8)
  axis = axis % packed.ndim
  lo, hi = packed & 15, packed >> 4
  both = jnp.stack([lo, hi], axis=axis + 1)
  shape = list(packed.shape)
  shape[axis] *= 2
  return both.reshape(shape)


# ------------------------------------------------------------------ block scales


def e8m0_decode(exp_bytes: jax.Array) -> jax.Array:
  """E8M0 bytes to float32 ``2^(byte - 127)`` (exact; byte 0 -> 2^-127, 0xFF -> NaN).

  >>> e8m0_decode(jnp.array([127, 128, 125], jnp.uint8)).tolist()
  [1.0, 2.0, 0.25]
  """
  e = jnp.asarray(exp_bytes).astype(jnp.int32)
  bits = jnp.where(e == 0, jnp.int32(0x00400000), e << 23)  # 2^-127 is an fp32 subnormal
  val = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jnp.where(e == 255, jnp.float32(jnp.nan), val)


def e8m0_reciprocal(exp_bytes: jax.Array) -> jax.Array:
  """``1 / e8m0_decode(b) = 2^(127 - b)``, built exactly; always a normal fp32 for b < 255.

  Multiplying by this instead of dividing by a possibly subnormal scale keeps quantization
  exact on backends that flush denormals (XLA:CPU does).
  """
  e = jnp.asarray(exp_bytes).astype(jnp.int32)
  return e8m0_decode(jnp.where(e == 255, 255, 254 - e).astype(jnp.uint8))


def _floor_log2_biased(a: jax.Array) -> jax.Array:
  """The fp32 biased exponent of ``a >= 0``: floor(log2(a)) + 127 for normals, exact."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32)


def mxfp4_block_exponents(amax_b: jax.Array, scale_rounding: str = "floor") -> jax.Array:
  """E8M0 bytes for blocks with absolute maxima ``amax_b`` (see module docstring).

  Args:
    amax_b: float32 block maxima, ``>= 0``.
    scale_rounding: ``"floor"`` (OCP: ``floor(log2(amax_b)) - 2``, values up to ~8/6 of
      the scaled max saturate) or ``"ceil"`` (smallest e with ``amax_b <= 6 * 2^e``).

  Returns:
    uint8 exponent bytes ``e + 127``; 0 for all-zero blocks, 0xFF for non-finite maxima.

  >>> mxfp4_block_exponents(jnp.array([6.0, 8.0, 0.0])).tolist()
  [127, 128, 0]
  """
  if scale_rounding not in MX_SCALE_ROUNDINGS:
    raise ValueError(f"Unknown MXFP4 scale_rounding {scale_rounding!r}; expected one of "
                     f"{MX_SCALE_ROUNDINGS}.")
  amax_b = jnp.asarray(amax_b, jnp.float32)
  biased = _floor_log2_biased(amax_b)
  # e + 127 = floor(log2(amax)) - 2 + 127 = biased - 2; subnormal/zero maxima clamp to 0.
  stored = jnp.clip(biased - 2, 0, 254)
  if scale_rounding == "ceil":
    too_big = amax_b * e8m0_reciprocal(stored) > E2M1_MAX  # exact: a power-of-two factor
    stored = jnp.minimum(stored + too_big.astype(jnp.int32), 254)
  stored = jnp.where(jnp.isfinite(amax_b), stored, 255)
  return stored.astype(jnp.uint8)


def nvfp4_scales(w_kn: jax.Array) -> tuple[jax.Array, jax.Array]:
  """NVFP4 scales of a K-padded weight: (tensor_scale f32 [], block_scales e4m3 [K/16, N])."""
  w_kn = jnp.asarray(w_kn, jnp.float32)
  k, n = w_kn.shape
  amax = jnp.max(jnp.abs(w_kn))
  s_g = amax / jnp.float32(E2M1_MAX * E4M3_MAX)
  s_g = jnp.where(s_g == 0, jnp.float32(1.0), s_g)  # all-zero tensor (or underflow)
  amax_b = jnp.max(jnp.abs(w_kn.reshape(k // NVFP4_BLOCK, NVFP4_BLOCK, n)), axis=1)
  s_b = jnp.minimum(amax_b / (jnp.float32(E2M1_MAX) * s_g), E4M3_MAX)
  s_b = s_b.astype(jnp.float8_e4m3fn)  # round-to-nearest-even
  s_b = jnp.where(s_b.astype(jnp.float32) == 0, jnp.ones_like(s_b), s_b)
  return s_g, s_b


# ---------------------------------------------------------------- quantize / dequantize


@functools.partial(jax.jit, static_argnames=("fmt", "scale_rounding"))
def quantize(w: jax.Array, fmt: str = "nvfp4", *, scale_rounding: str = "floor") -> FP4Tensor:
  """Quantizes a ``[K, N]`` weight to NVFP4 or MXFP4 (blocks along K).

  Args:
    w: float array ``[K, N]``. K need not be a multiple of the block size: it is
      zero-padded to one (the original K is kept in ``shape``).
    fmt: ``"nvfp4"`` (16-element blocks, E4M3 block scale, fp32 tensor scale) or
      ``"mxfp4"`` (32-element blocks, E8M0 power-of-two scale).
    scale_rounding: MXFP4 only: ``"floor"`` (OCP, default) or ``"ceil"``.

  Returns:
    An :class:`FP4Tensor`.

  >>> q = quantize(jnp.ones((32, 4)), "nvfp4")
  >>> q.codes.shape, q.block_scales.shape, q.block_scales.dtype
  ((16, 4), (2, 4), dtype(float8_e4m3fn))

  Paper: Sol-RL (arXiv 2604.06916) rollouts in NVFP4; OCP MX v1.0 for MXFP4.
  """
  block = _check_fmt(fmt)
  w = jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"quantize expects a 2-D weight [K, N]; got shape {w.shape} "
                     "(use jax.vmap for stacked weights).")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"quantize expects a floating weight; got dtype {w.dtype}.")
  if fmt == "nvfp4" and scale_rounding != "floor":
    raise ValueError("scale_rounding applies to mxfp4 only (nvfp4 scales are E4M3).")
  k, n = w.shape
  k_pad = -(-k // block) * block
  w_kn = jnp.pad(w.astype(jnp.float32), ((0, k_pad - k), (0, 0)))
  w_bxgxn = w_kn.reshape(k_pad // block, block, n)
  if fmt == "nvfp4":
    tensor_scale, block_scales = nvfp4_scales(w_kn)
    scaled = w_bxgxn / (block_scales.astype(jnp.float32) * tensor_scale)[:, None, :]
  else:
    amax_b = jnp.max(jnp.abs(w_bxgxn), axis=1)
    block_scales = mxfp4_block_exponents(amax_b, scale_rounding)
    tensor_scale = jnp.float32(1.0)
    scaled = w_bxgxn * e8m0_reciprocal(block_scales)[:, None, :]  # == w / 2^e, exactly
  codes = e2m1_encode(scaled).reshape(k_pad, n)
  return FP4Tensor(codes=pack_nibbles(codes, axis=0), block_scales=block_scales,
                   tensor_scale=jnp.asarray(tensor_scale, jnp.float32), fmt=fmt,
                   shape=(int(k), int(n)), dtype=jnp.dtype(w.dtype).name)


def block_scales_f32(q: FP4Tensor) -> jax.Array:
  """The block scales of ``q`` as float32 ``[K_pad // block, N]``."""
  if q.fmt == "nvfp4":
    return q.block_scales.astype(jnp.float32)
  return e8m0_decode(q.block_scales)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: FP4Tensor, dtype: Any = None) -> jax.Array:
  """Reconstructs ``w_hat [K, N] = e2m1(codes) * block_scale * tensor_scale``.

  Args:
    q: an :class:`FP4Tensor`.
    dtype: output dtype; default the original weight dtype (``q.dtype``).

  Returns:
    ``[K, N]`` array (computed in float32, K padding removed).

  >>> w = jnp.array([[0.5], [-6.0]] * 8)
  >>> bool(jnp.all(dequantize(quantize(w, "mxfp4")) == w))
  True
  """
  _check_fmt(q.fmt)
  k, n = q.shape
  vals_kn = e2m1_decode(unpack_nibbles(q.codes, axis=0))
  k_pad = vals_kn.shape[0]
  vals_bxgxn = vals_kn.reshape(k_pad // q.block_size, q.block_size, n)
  w_kn = (vals_bxgxn * block_scales_f32(q)[:, None, :]).reshape(k_pad, n)
  if q.fmt == "nvfp4":
    w_kn = w_kn * q.tensor_scale
  return w_kn[:k].astype(q.dtype if dtype is None else dtype)


@jax.jit
def matmul(x: jax.Array, q: FP4Tensor) -> jax.Array:
  """Reference ``x @ dequantize(q)`` in float32 (HIGHEST precision), returned in x's dtype.

  Args:
    x: ``[..., K]``.
    q: an :class:`FP4Tensor` of shape ``(K, N)``.

  Returns:
    ``[..., N]`` in ``x.dtype``.

  >>> q = quantize(jnp.eye(16), "nvfp4")
  >>> matmul(jnp.arange(16.0)[None], q).shape
  (1, 16)
  """
  x = jnp.asarray(x)
  if x.shape[-1] != q.shape[0]:
    raise ValueError(f"matmul: x has K={x.shape[-1]} but the weight is {q.shape}.")
  y = jnp.matmul(x.astype(jnp.float32), dequantize(q, jnp.float32),
                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
