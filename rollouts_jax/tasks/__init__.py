"""A `Task` per dataset: loading, prompt format, reference, answer extraction, default reward.

>>> from rollouts_jax import tasks
>>> t = tasks.get("arithmetic")
>>> t.extract("... <answer>936</answer>"), t.reward("... <answer>936</answer>", "936")
('936', 1.0)
"""

from rollouts_jax.tasks.base import (Arithmetic, Countdown, Gsm8k, MathBoxed, Task, cache_root,
                                     canonical_expression, get, majority_answer, names, register, task_reward)
from rollouts_jax.tasks import multiturn as _multiturn

for _task in _multiturn.TASKS:   # the multi-turn environments' tasks (multiply_tool, guess)
  register(_task)

__all__ = ["Arithmetic", "Countdown", "Gsm8k", "MathBoxed", "Task", "cache_root", "canonical_expression", "get",
           "majority_answer", "names", "register", "task_reward"]
