"""FP4 (NVFP4 / MXFP4) weight quantization and matmul: reference, Pallas kernel, dispatch.

>>> import jax.numpy as jnp
>>> from rollouts_jax.kernels import fp4
>>> q = fp4.quantize(jnp.ones((32, 16)), fmt="nvfp4")
>>> fp4.matmul(jnp.ones((1, 32)), q, implementation="xla").shape
(1, 16)
"""
from rollouts_jax.kernels.fp4.api import (FORMATS, IMPLEMENTATIONS, FP4Tensor, dequantize, matmul,
                             quantize)

__all__ = ["FORMATS", "FP4Tensor", "IMPLEMENTATIONS", "dequantize", "matmul", "quantize"]
