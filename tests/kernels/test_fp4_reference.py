"""The pure-jnp FP4 reference against hand tables and an independent NumPy model."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rollouts_jax.kernels.fp4 import pallas as fp4_pallas  # noqa: E402
from rollouts_jax.kernels.fp4 import reference as ref  # noqa: E402

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

# (input, expected value) built by hand; ties go to the even-mantissa neighbour.
HAND_TABLE = [
    (0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.5, 0.5), (0.74, 0.5),
    (0.75, 1.0), (1.0, 1.0), (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.74, 1.5),
    (1.75, 2.0), (2.0, 2.0), (2.5, 2.0), (2.51, 3.0), (3.0, 3.0), (3.49, 3.0),
    (3.5, 4.0), (4.0, 4.0), (5.0, 4.0), (5.01, 6.0), (6.0, 6.0), (6.5, 6.0),
    (7.0, 6.0), (1e30, 6.0), (np.inf, 6.0),
]


def np_e2m1_encode(x):
  """Independent model: nearest magnitude by distance, ties to the even index."""
  x = np.asarray(x, np.float32)
  a = np.abs(x)[..., None]
  d = np.abs(a - MAGS)
  d = np.where(np.isinf(a), np.where(MAGS == 6.0, 0.0, np.inf), d)
  best = d.min(-1, keepdims=True)
  cand = d == best
  # among tied candidates prefer the even index
  even_pref = np.where(cand & (np.arange(8) % 2 == 0), 1, 0) * 16 + cand * (8 - np.arange(8))
  mag = np.argmax(even_pref, axis=-1)
  return (mag | ((x < 0) << 3)).astype(np.uint8)


def np_nvfp4(w):
  """Independent NVFP4 model in float32 NumPy with ml_dtypes E4M3 rounding."""
  w = np.asarray(w, np.float32)
  k, n = w.shape
  kp = -(-k // 16) * 16
  w = np.pad(w, ((0, kp - k), (0, 0)))
  amax = np.float32(np.abs(w).max())
  s_g = np.float32(amax / np.float32(2688.0))
  if s_g == 0:
    s_g = np.float32(1.0)
  wb = w.reshape(kp // 16, 16, n)
  amax_b = np.abs(wb).max(1)
  s_b = np.minimum(amax_b / (np.float32(6.0) * s_g), np.float32(448.0)).astype(np.float32)
  s_b8 = s_b.astype(ml_dtypes.float8_e4m3fn)
  s_b8 = np.where(s_b8.astype(np.float32) == 0, np.float32(1.0), s_b8.astype(np.float32)).astype(
      ml_dtypes.float8_e4m3fn)
  div = s_b8.astype(np.float32) * s_g
  codes = np_e2m1_encode(wb / div[:, None, :]).reshape(kp, n)
  return s_g, s_b8, codes


def np_mxfp4(w, rounding="floor"):
  """Independent MXFP4 model: exponents from np.frexp (exact)."""
  w = np.asarray(w, np.float32)
  k, n = w.shape
  kp = -(-k // 32) * 32
  wb = np.pad(w, ((0, kp - k), (0, 0))).reshape(kp // 32, 32, n)
  amax_b = np.abs(wb).max(1)
  _, ex = np.frexp(np.where(amax_b == 0, np.float32(2.0 ** -126), amax_b))
  e = ex.astype(np.int64) - 1 - 2                    # floor(log2(amax)) - emax
  if rounding == "ceil":
    e = e + (amax_b.astype(np.float64) / np.exp2(e.astype(np.float64)) > 6)
  e = np.clip(e, -127, 127)
  scale = np.exp2(e.astype(np.float64)).astype(np.float32)
  codes = np_e2m1_encode((wb / scale[:, None, :]).astype(np.float32)).reshape(kp, n)
  return (e + 127).astype(np.uint8), codes


def unpacked_codes(q):
  return np.asarray(ref.unpack_nibbles(q.codes, axis=0))


# ------------------------------------------------------------------------ E2M1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_hand_table(sign):
  xs = np.array([sign * x for x, _ in HAND_TABLE], np.float32)
  want = np.array([sign * v for _, v in HAND_TABLE], np.float32)
  codes = np.asarray(ref.e2m1_encode(jnp.asarray(xs)))
  got = np.asarray(ref.e2m1_decode(jnp.asarray(codes)))
  np.testing.assert_array_equal(got, want)
  # code bits: magnitude index of the value, sign bit for negative inputs
  mag_idx = np.array([int(np.where(MAGS == v)[0][0]) for _, v in HAND_TABLE])
  want_codes = mag_idx | ((8 if sign < 0 else 0) * (xs != 0))
  np.testing.assert_array_equal(codes, want_codes)


def test_e2m1_matches_nearest_even_model():
  rng = np.random.default_rng(0)
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  x = np.concatenate([
      rng.normal(0, 3, 4000).astype(np.float32),
      rng.uniform(-8, 8, 4000).astype(np.float32),
      mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 10), MAGS, -MAGS,
  ])
  np.testing.assert_array_equal(np.asarray(ref.e2m1_encode(jnp.asarray(x))), np_e2m1_encode(x))


def test_e2m1_decode_all_codes_lut_and_arithmetic():
  codes = jnp.arange(16, dtype=jnp.uint8)
  want = np.concatenate([MAGS, -MAGS])
  np.testing.assert_array_equal(np.asarray(ref.e2m1_decode(codes)), want)
  np.testing.assert_array_equal(
      np.asarray(fp4_pallas._decode_e2m1(codes.astype(jnp.int32))), want)
  # encode(decode(c)) == c except -0 -> +0
  back = np.asarray(ref.e2m1_encode(ref.e2m1_decode(codes)))
  np.testing.assert_array_equal(back, np.where(np.arange(16) == 8, 0, np.arange(16)))


def test_kernel_scale_decoders_match_dtypes():
  bits = np.arange(256, dtype=np.uint8)
  e4m3 = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(fp4_pallas._decode_e4m3(jnp.asarray(bits, jnp.int32)))
  finite = np.isfinite(e4m3)
  assert (~finite).sum() == 2  # 0x7F and 0xFF are the only NaNs
  np.testing.assert_array_equal(got[finite], e4m3[finite])
  want = np.array([2.0 ** (b - 127) for b in range(255)] + [np.nan], np.float32)
  for decode in (ref.e8m0_decode, lambda b: fp4_pallas._decode_e8m0(b.astype(jnp.int32))):
    got = np.asarray(decode(jnp.asarray(bits)))
    np.testing.assert_array_equal(got[:255], want[:255])
    assert np.isnan(got[255])


# ---------------------------------------------------------------------- packing


def test_pack_even_element_in_low_nibble():
  codes = jnp.array([[1, 9], [2, 10], [15, 3], [0, 4]], jnp.uint8)
  packed = ref.pack_nibbles(codes, axis=0)
  np.testing.assert_array_equal(np.asarray(packed), [[0x21, 0xA9], [0x0F, 0x43]])
  np.testing.assert_array_equal(np.asarray(ref.pack_nibbles(codes.T, axis=1)),
                                [[0x21, 0x0F], [0xA9, 0x43]])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_unpack_round_trip(axis):
  rng = np.random.default_rng(1)
  codes = jnp.asarray(rng.integers(0, 16, (6, 8, 4)), jnp.uint8)
  np.testing.assert_array_equal(
      np.asarray(ref.unpack_nibbles(ref.pack_nibbles(codes, axis), axis)), np.asarray(codes))
  all_bytes = jnp.arange(256, dtype=jnp.uint8)
  np.testing.assert_array_equal(
      np.asarray(ref.pack_nibbles(ref.unpack_nibbles(all_bytes))), np.arange(256))


def test_pack_odd_length_raises():
  with pytest.raises(ValueError, match="even"):
    ref.pack_nibbles(jnp.zeros((3, 2), jnp.uint8))


# ------------------------------------------------------------------------ NVFP4


def _check_nvfp4(w):
  q = ref.quantize(jnp.asarray(w), "nvfp4")
  s_g, s_b8, codes = np_nvfp4(w)
  assert q.block_scales.dtype == jnp.float8_e4m3fn and q.codes.dtype == jnp.uint8
  np.testing.assert_array_equal(np.float32(q.tensor_scale), s_g)
  np.testing.assert_array_equal(np.asarray(q.block_scales).view(np.uint8), s_b8.view(np.uint8))
  np.testing.assert_array_equal(unpacked_codes(q), codes)
  return q


@pytest.mark.parametrize("shape", [(64, 24), (40, 8), (16, 1)])
def test_nvfp4_matches_formula_random(shape):
  w = np.random.default_rng(2).normal(0, 0.02, shape).astype(np.float32)
  q = _check_nvfp4(w)
  assert q.codes.shape == (-(-shape[0] // 16) * 8, shape[1])
  assert q.shape == shape
  w_hat = np.asarray(ref.dequantize(q))
  assert w_hat.shape == shape
  s_b = np.asarray(q.block_scales).astype(np.float32)
  assert s_b.min() > 0
  vals = np_decode(unpacked_codes(q)).reshape(-1, 16, shape[1])
  want = ((vals * s_b[:, None]) * np.float32(q.tensor_scale)).reshape(-1, shape[1])
  np.testing.assert_array_equal(w_hat, want[:shape[0]])  # K padding removed


def np_decode(codes):
  return np.concatenate([MAGS, -MAGS])[codes]


def test_nvfp4_adversarial_blocks():
  rng = np.random.default_rng(3)
  w = rng.normal(0, 1, (96, 4)).astype(np.float32)
  w[0:16, 0] = 0.0                          # all-zero block -> scale 1.0, zero codes
  w[16:32, 1] = rng.normal(0, 1e-3, 16)     # tiny block
  w[20, 1] = 2688.0                         # one huge value: sets s_g = 1 exactly
  w[32:48, 1] = rng.normal(0, 1e-3, 16)
  w[33, 1] = 0.06                           # s_b = 0.01: an E4M3 subnormal
  w[48:64, 1] = 1e-4 * rng.normal(0, 1, 16)  # s_b < 2^-10 rounds to 0 -> 1.0, zero codes
  q = _check_nvfp4(w)
  sb = np.asarray(q.block_scales).astype(np.float32)
  codes = unpacked_codes(q)
  w_hat = np.asarray(ref.dequantize(q))
  assert np.float32(q.tensor_scale) == 1.0
  assert sb[0, 0] == 1.0 and not codes[0:16, 0].any() and not w_hat[0:16, 0].any()
  assert sb[1, 1] == 448.0 and w_hat[20, 1] == 2688.0
  assert not w_hat[16:20, 1].any()          # small neighbours of the huge value flush to 0
  assert 0 < sb[2, 1] < 2.0 ** -6           # subnormal E4M3 scale
  assert sb[2, 1] == np.float32(ml_dtypes.float8_e4m3fn(0.01))
  assert abs(w_hat[33, 1] - 0.06) <= 0.06 / 8
  assert sb[3, 1] == 1.0 and not (codes[48:64, 1] & 7).any() and not w_hat[48:64, 1].any()


def test_nvfp4_all_zero_tensor():
  q = _check_nvfp4(np.zeros((32, 3), np.float32))
  assert float(q.tensor_scale) == 1.0
  assert np.all(np.asarray(q.block_scales).astype(np.float32) == 1.0)
  w_hat = np.asarray(ref.dequantize(q))
  assert np.all(w_hat == 0) and np.all(np.isfinite(w_hat))


# ------------------------------------------------------------------------ MXFP4


def _check_mxfp4(w, rounding="floor"):
  q = ref.quantize(jnp.asarray(w), "mxfp4", scale_rounding=rounding)
  e, codes = np_mxfp4(w, rounding)
  assert q.block_scales.dtype == jnp.uint8 and float(q.tensor_scale) == 1.0
  np.testing.assert_array_equal(np.asarray(q.block_scales), e)
  np.testing.assert_array_equal(unpacked_codes(q), codes)
  return q


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mxfp4_matches_formula_random(rounding):
  rng = np.random.default_rng(4)
  w = rng.normal(0, 1, (96, 6)) * np.exp2(rng.integers(-100, 100, (1, 6)))
  q = _check_mxfp4(w.astype(np.float32), rounding)
  _check_mxfp4(w[:70].astype(np.float32), rounding)  # K padded to 96
  if rounding == "ceil":  # no saturation: every element is within 6 * 2^e
    scale = np.exp2(np.asarray(q.block_scales).astype(np.float64) - 127)
    amax_b = np.abs(w.reshape(3, 32, 6)).max(1)
    assert np.all(amax_b <= 6 * scale)


def test_mxfp4_adversarial_blocks():
  w = np.ones((32 * 7, 1), np.float32)
  w[0:32] = 0.0                           # all-zero block -> e = -127 (byte 0)
  w[32:64] = 1e-40                        # fp32-subnormal maxima -> clamped to byte 0
  w[64:96] = 2.0 ** -125                  # floor(log2) - 2 = -127 -> byte 0
  w[96:128] = 2.0 ** -124                 # -> byte 1
  w[128:160] = 0.01
  w[128 + 5] = 7.99                       # floor -> 2^0, 7.99 saturates to 6
  w[160:192] = 0.5
  w[160] = 8.0                            # exact power of two -> 2^1
  w[192:224] = -3.0e38                    # near fp32 max -> byte 127 + 125
  q = _check_mxfp4(w)
  np.testing.assert_array_equal(np.asarray(q.block_scales)[:, 0], [0, 0, 0, 1, 127, 128, 252])
  w_hat = np.asarray(ref.dequantize(q))[:, 0]
  assert not w_hat[0:32].any()
  assert w_hat[133] == 6.0 and not w_hat[128:133].any()  # 0.01 < 0.25 * 2^0 flushes to 0
  assert w_hat[160] == 8.0
  assert np.all(w_hat[192:224] == np.float32(-6.0 * 2.0 ** 125))  # -7.05 * 2^125 saturates
  q_ceil = _check_mxfp4(w, "ceil")
  assert np.asarray(q_ceil.block_scales)[4, 0] == 128
  assert np.asarray(ref.dequantize(q_ceil))[133, 0] == 8.0


def test_mxfp4_requantize_is_idempotent():
  w = np.random.default_rng(5).normal(0, 1, (128, 16)).astype(np.float32)
  q = ref.quantize(jnp.asarray(w), "mxfp4")
  q2 = ref.quantize(ref.dequantize(q), "mxfp4")
  np.testing.assert_array_equal(np.asarray(q2.block_scales), np.asarray(q.block_scales))
  # codes agree up to the sign of zero (-0 dequantizes to -0.0, which re-encodes as +0)
  np.testing.assert_array_equal(np.asarray(ref.dequantize(q2)), np.asarray(ref.dequantize(q)))
  c, c2 = unpacked_codes(q), unpacked_codes(q2)
  np.testing.assert_array_equal(np.where(c == 8, 0, c), c2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_power_of_two_rescaling_keeps_codes(fmt):
  w = np.random.default_rng(6).normal(0, 1, (64, 8)).astype(np.float32)
  q = ref.quantize(jnp.asarray(w), fmt)
  q8 = ref.quantize(jnp.asarray(w * 8.0), fmt)
  np.testing.assert_array_equal(np.asarray(q8.codes), np.asarray(q.codes))
  np.testing.assert_array_equal(np.asarray(ref.dequantize(q8)), 8.0 * np.asarray(ref.dequantize(q)))


# -------------------------------------------------------------- error, pytree, errors


def test_gaussian_relative_frobenius_error():
  w = jax.random.normal(jax.random.key(0), (1024, 512), jnp.float32)
  err = {}
  for fmt in ("nvfp4", "mxfp4"):
    w_hat = ref.dequantize(ref.quantize(w, fmt))
    err[fmt] = float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w))
  print(f"relative Frobenius error on N(0,1) weights: {err}")
  # E2M1 has a relative step of 1/3 to 1/2 near the block max; a Gaussian block of 16 or 32
  # puts most mass well below it, giving ~0.08-0.12 (NVFP4's finer blocks and fractional
  # scales make it the more accurate format).
  assert 0.07 < err["nvfp4"] < 0.11
  assert 0.09 < err["mxfp4"] < 0.14
  assert err["nvfp4"] < err["mxfp4"]


def test_fp4_tensor_is_a_pytree_through_jit():
  w = jax.random.normal(jax.random.key(1), (48, 8))
  q = ref.quantize(w, "nvfp4")
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3
  q2 = jax.tree_util.tree_unflatten(treedef, leaves)
  assert (q2.fmt, q2.shape, q2.dtype) == ("nvfp4", (48, 8), "float32")
  np.testing.assert_array_equal(np.asarray(jax.jit(ref.dequantize)(q)),
                                np.asarray(ref.dequantize(q)))
  q_jit = jax.jit(ref.quantize, static_argnums=1)(w, "mxfp4")
  np.testing.assert_array_equal(np.asarray(q_jit.codes),
                                np.asarray(ref.quantize(w, "mxfp4").codes))


def test_vmapped_quantize_matches_per_layer_and_scans():
  w_lxkxn = jax.random.normal(jax.random.key(2), (3, 32, 16))
  q_stack = jax.vmap(lambda w: ref.quantize(w, "nvfp4"))(w_lxkxn)
  assert q_stack.codes.shape == (3, 16, 16) and q_stack.shape == (32, 16)
  x = jax.random.normal(jax.random.key(3), (2, 32))

  def step(h, q_layer):
    return h, ref.matmul(h, q_layer)

  _, ys = jax.lax.scan(step, x, q_stack)
  for layer in range(3):
    want = ref.matmul(x, ref.quantize(w_lxkxn[layer], "nvfp4"))
    np.testing.assert_array_equal(np.asarray(ys[layer]), np.asarray(want))


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="format"):
    ref.quantize(jnp.ones((16, 4)), "int4")
  with pytest.raises(ValueError, match="2-D"):
    ref.quantize(jnp.ones((2, 16, 4)), "nvfp4")
  with pytest.raises(ValueError, match="floating"):
    ref.quantize(jnp.ones((16, 4), jnp.int32), "nvfp4")
  with pytest.raises(ValueError, match="scale_rounding"):
    ref.quantize(jnp.ones((32, 4)), "mxfp4", scale_rounding="up")
  with pytest.raises(ValueError, match="K="):
    ref.matmul(jnp.ones((2, 15)), ref.quantize(jnp.ones((16, 4))))


def test_dequantize_dtype_and_bf16_source():
  w = jax.random.normal(jax.random.key(4), (32, 8)).astype(jnp.bfloat16)
  q = ref.quantize(w, "nvfp4")
  assert q.dtype == "bfloat16" and ref.dequantize(q).dtype == jnp.bfloat16
  assert ref.dequantize(q, jnp.float32).dtype == jnp.float32
