"""Shared-prefix (cascade) decode attention: pure-jnp reference, Pallas kernel, dispatch.

>>> from rollouts_jax.kernels import decode_attention as da
>>> da.IMPLEMENTATIONS
('naive', 'xla', 'pallas')
"""
from rollouts_jax.kernels.decode_attention.api import IMPLEMENTATIONS, decode_attention
from rollouts_jax.kernels.decode_attention.reference import NEG_INF, merge, prefix_part

__all__ = ["IMPLEMENTATIONS", "NEG_INF", "decode_attention", "merge", "prefix_part"]
