"""The grader pool: reward functions (and tools) run isolated from the training process.

`pool` keeps long-lived worker interpreters with per-call deadlines, `common` the per-call
time limit and failure counters graders report into, `registry` graders by name.
`rollouts_jax.rewards` defines the graders and re-exports this package's public names.

>>> from rollouts_jax import graders
>>> graders.is_inline_safe(len)
False
"""
from rollouts_jax.graders import common, pool, registry
from rollouts_jax.graders.pool import (STATUS_NAMES, GraderFailureError, GraderPool, check_grader_health,
                                       default_num_workers, is_inline_safe, mark_inline_safe, merge_stats,
                                       score_batch, shutdown_default_pools, summarize_stats)
from rollouts_jax.graders.registry import get_reward_fn, register_reward_fn, reward_fn_names

__all__ = ["STATUS_NAMES", "GraderFailureError", "GraderPool", "check_grader_health", "common",
           "default_num_workers", "get_reward_fn", "is_inline_safe", "mark_inline_safe", "merge_stats", "pool",
           "register_reward_fn", "registry", "reward_fn_names", "score_batch", "shutdown_default_pools",
           "summarize_stats"]
