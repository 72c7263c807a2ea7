"""The fp4 dispatch api: pinned calls, pytree params under jit, no recompiles, errors."""
import doctest
import importlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import load_script  # noqa: E402
from rollouts_jax.kernels import fp4  # noqa: E402


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_pinned_api_pallas_equals_xla(fmt):
  w = jax.random.normal(jax.random.key(0), (48, 32))
  x = jax.random.normal(jax.random.key(1), (2, 3, 48))
  q = fp4.quantize(w, fmt=fmt)
  y_pallas = fp4.matmul(x, q, implementation="pallas")
  y_xla = fp4.matmul(x, q, implementation="xla")
  assert y_pallas.shape == y_xla.shape == (2, 3, 32) and y_pallas.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y_pallas), np.asarray(y_xla), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(fp4.dequantize(q)),
                                np.asarray(fp4.dequantize(q, jnp.float32)))


def test_params_pytree_through_jit_without_recompiling():
  keys = jax.random.split(jax.random.key(2), 4)
  params = {"up": fp4.quantize(jax.random.normal(keys[0], (32, 64)), "nvfp4"),
            "down": fp4.quantize(jax.random.normal(keys[1], (64, 32)), "mxfp4"),
            "scale": jnp.ones(())}
  traces = []

  @jax.jit
  def mlp(p, x):
    traces.append(1)
    h = jax.nn.relu(fp4.matmul(x, p["up"], implementation="pallas"))
    return fp4.matmul(h, p["down"], implementation="pallas") * p["scale"]

  x = jax.random.normal(keys[2], (4, 32))
  y = mlp(params, x)
  want = fp4.matmul(jax.nn.relu(fp4.matmul(x, params["up"], "xla")), params["down"], "xla")
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-4)
  params2 = jax.tree_util.tree_map(lambda a: a, params)  # new containers, same structure
  params2["up"] = fp4.quantize(jax.random.normal(keys[3], (32, 64)), "nvfp4")
  mlp(params2, x + 1.0)
  assert len(traces) == 1


def test_output_dtype_follows_x():
  q = fp4.quantize(jax.random.normal(jax.random.key(3), (32, 16)), "nvfp4")
  for impl in fp4.IMPLEMENTATIONS:
    for dt in (jnp.float32, jnp.bfloat16):
      assert fp4.matmul(jnp.ones((2, 32), dt), q, implementation=impl).dtype == dt


def test_bad_arguments_raise():
  q = fp4.quantize(jnp.ones((32, 16)), "nvfp4")
  with pytest.raises(ValueError, match="implementation"):
    fp4.matmul(jnp.ones((1, 32)), q, implementation="cuda")
  with pytest.raises(ValueError, match="FP4Tensor"):
    fp4.matmul(jnp.ones((1, 32)), jnp.ones((32, 16)))
  with pytest.raises(ValueError, match="format"):
    fp4.quantize(jnp.ones((32, 16)), fmt="fp4")


@pytest.mark.parametrize("module", ["rollouts_jax.kernels.fp4", "rollouts_jax.kernels.fp4.api", "rollouts_jax.kernels.fp4.reference",
                                    "rollouts_jax.kernels.fp4.pallas"])
def test_docstring_examples_run(module):
  result = doctest.testmod(importlib.import_module(module), extraglobs={"jnp": jnp})
  assert result.failed == 0 and result.attempted > 0


def test_bench_bytes_per_parameter():
  bench = load_script("benchmarks.bench_fp4")
  rows = bench.bytes_per_parameter(256, 128)
  # codes: 1/2 byte; scales: 1 byte per 16 (NVFP4) or 32 (MXFP4) weights; + a 4-byte scalar
  assert rows["bf16"] == 2.0
  assert rows["nvfp4"] == pytest.approx(0.5 + 1 / 16 + 4 / (256 * 128))
  assert rows["mxfp4"] == pytest.approx(0.5 + 1 / 32 + 4 / (256 * 128))
