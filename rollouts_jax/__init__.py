"""rollouts_jax: rollout-centric RL for language models in JAX.

Submodules are imported explicitly: ``from rollouts_jax import models, sampling``.
"""

__version__ = "0.1.0"
