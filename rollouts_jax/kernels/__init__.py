"""Pallas kernels, one folder per op, each beside its pure-jnp reference.

>>> from rollouts_jax.kernels import fp4
>>> sorted(fp4.FORMATS)
['mxfp4', 'nvfp4']
"""
