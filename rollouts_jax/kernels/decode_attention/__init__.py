"""Shared-prefix (cascade) decode attention: pure-jnp reference, Pallas kernel, dispatch.

>>> from rollouts_jax.kernels import decode_attention as da
>>> da.IMPLEMENTATIONS
('naive', 'xla', 'pallas')
"""
from rollouts_jax.kernels.decode_attention.api import IMPLEMENTATIONS, decode_attention
from rollouts_jax.kernels.decode_attention.reference import merge

__all__ = ["IMPLEMENTATIONS", "decode_attention", "merge"]
