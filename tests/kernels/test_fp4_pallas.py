"""The Pallas FP4 matmul (interpret mode on CPU) against the reference matmul."""
import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rollouts_jax.kernels.fp4 import pallas as fp4_pallas  # noqa: E402
from rollouts_jax.kernels.fp4 import reference as ref  # noqa: E402

ON_CPU = jax.default_backend() == "cpu"


def _operands(m, k, n, fmt, seed=0, lead=()):
  kx, kw = jax.random.split(jax.random.key(seed))
  w = jax.random.normal(kw, (k, n), jnp.float32)
  x = jax.random.normal(kx, (*lead, m, k), jnp.float32)
  return x, ref.quantize(w, fmt)


def _assert_close_fp32(y, x, q):
  """|y - y_ref| <= 1e-5 * (|x| @ |w_hat|): a summation-order bound for fp32 accumulation."""
  y_ref = ref.matmul(x, q)
  assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
  bound = jnp.matmul(jnp.abs(x), jnp.abs(ref.dequantize(q, jnp.float32)),
                     precision=jax.lax.Precision.HIGHEST)
  excess = jnp.abs(y - y_ref) - 1e-5 * bound
  assert float(jnp.max(excess)) <= 0.0, float(jnp.max(jnp.abs(y - y_ref) / (bound + 1e-30)))


# (m, k, n, block_m, block_n, block_k): first rows are multiples of the blocks, the rest
# are not (M, N and K padded inside the kernel wrapper; K also padded at quantize time).
SHAPES = [
    (32, 128, 64, 16, 32, 64),   # 2x2 grid, two K steps
    (5, 64, 24, 16, 16, 32),     # M and N not multiples
    (3, 40, 16, 16, 16, 32),     # K=40: nvfp4 pads to 48 (block_k 32 pads again), mxfp4 to 64
]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,k,n,bm,bn,bk", SHAPES)
def test_interpret_matches_reference(fmt, m, k, n, bm, bn, bk):
  x, q = _operands(m, k, n, fmt)
  y = fp4_pallas.fp4_matmul(x, q, block_m=bm, block_n=bn, block_k=bk, interpret=True)
  _assert_close_fp32(y, x, q)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_leading_dims_and_default_blocks(fmt):
  x, q = _operands(3, 80, 48, fmt, seed=1, lead=(2,))
  y = fp4_pallas.fp4_matmul(x, q)  # interpret defaults to True on CPU
  assert y.shape == (2, 3, 48)
  _assert_close_fp32(y, x, q)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_identity_input_recovers_dequantized_weight_exactly(fmt):
  # One-hot rows make each output a single product 1 * w_hat: the in-tile decode of codes,
  # E4M3 / E8M0 scales and the tensor scale must equal the reference bit for bit.
  rng = np.random.default_rng(0)
  w = rng.normal(0, 1, (64, 16)).astype(np.float32)
  w[0:32, 0] = 0.0                       # zero blocks
  w[32:48, 1] = rng.normal(0, 1e-3, 16)  # subnormal NVFP4 scale next to a huge value
  w[40, 2] = 1e3
  q = ref.quantize(jnp.asarray(w), fmt)
  y = fp4_pallas.fp4_matmul(jnp.eye(64), q, block_m=16, block_n=16, block_k=32,
                            interpret=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref.dequantize(q)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bf16_inputs(fmt):
  x, q = _operands(8, 64, 32, fmt, seed=2)
  x16 = x.astype(jnp.bfloat16)
  y = fp4_pallas.fp4_matmul(x16, q, block_m=16, block_n=16, block_k=32, interpret=True)
  assert y.dtype == jnp.bfloat16
  # the bf16 tile is exact, so only the final bf16 rounding of the output differs
  y_ref = ref.matmul(x16.astype(jnp.float32), q)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref),
                             rtol=2.0 ** -8, atol=1e-6)


def test_block_sizes_do_not_change_the_result():
  x, q = _operands(20, 128, 64, "nvfp4", seed=3)
  y1 = fp4_pallas.fp4_matmul(x, q, block_m=16, block_n=16, block_k=32, interpret=True)
  y2 = fp4_pallas.fp4_matmul(x, q, block_m=32, block_n=64, block_k=128, interpret=True)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5)


def test_bad_blocks_and_shapes_raise():
  x, q = _operands(4, 64, 32, "mxfp4")
  with pytest.raises(ValueError, match="block_k"):
    fp4_pallas.fp4_matmul(x, q, block_k=16, interpret=True)  # mxfp4 blocks are 32
  with pytest.raises(ValueError, match="K="):
    fp4_pallas.fp4_matmul(x[:, :60], q, interpret=True)
  with pytest.raises(ValueError, match="power-of-two"):
    fp4_pallas.fp4_matmul(x, q, block_n=24, backend="gpu", interpret=False)


def test_default_block_sizes_divide_shapes():
  assert fp4_pallas.default_block_sizes(1, 4096, 4096, "nvfp4") == (16, 64, 256)
  assert fp4_pallas.default_block_sizes(64, 4096, 11008, "mxfp4")[1:] == (64, 256)
  bm, bn, bk = fp4_pallas.default_block_sizes(8, 4096, 4096, "nvfp4", backend="tpu")
  assert bn % 128 == 0 and (bk // 2) % 128 == 0


@pytest.mark.parametrize("platform,backend,target", [
    ("cuda", "gpu", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_for_triton_and_mosaic_tpu(platform, backend, target, dtype):
  # Lowering (not compiling) for a foreign platform runs the Triton / Mosaic TPU lowering
  # rules on this machine; unsupported ops or block shapes fail here.
  q = ref.quantize(jnp.ones((512, 256)), "nvfp4")
  x = jnp.ones((8, 512), dtype)
  f = functools.partial(fp4_pallas.fp4_matmul, backend=backend, interpret=False)
  text = jax.jit(f).trace(x, q).lower(lowering_platforms=(platform,)).as_text()
  assert target in set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.skipif(ON_CPU, reason="compiled kernel needs a GPU or TPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_compiled_matches_reference(fmt, m):
  x, q = _operands(m, 1024, 512, fmt)
  y = fp4_pallas.fp4_matmul(x.astype(jnp.bfloat16), q, interpret=False)
  y_ref = ref.matmul(x.astype(jnp.bfloat16).astype(jnp.float32), q)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref), rtol=2e-2, atol=2e-2)
