"""The built-in reward functions by name (`graders.registry` holds the table).

>>> get_reward_fn("gsm8k")("... #### 18", "18")
1.0
"""
from __future__ import annotations

import functools

from rollouts_jax.graders.registry import RewardFn, get_reward_fn, register_reward_fn, reward_fn_names  # noqa: F401
from rollouts_jax.rewards.arithmetic import arithmetic_reward
from rollouts_jax.rewards.countdown import countdown_reward
from rollouts_jax.rewards.format import format_reward
from rollouts_jax.rewards.gsm8k import gsm8k_reward
from rollouts_jax.rewards.math_verifier import math_reward

#: Built in: ``math``, ``gsm8k``, ``arithmetic`` (one number in ``<answer>`` tags), ``countdown``
#: (every number once), ``countdown_at_most_once``, ``format`` (= ``format_think_answer``),
#: ``format_answer_tag``, ``format_boxed``.
BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "arithmetic": arithmetic_reward,
    "gsm8k": gsm8k_reward,
    "countdown": countdown_reward,
    "countdown_at_most_once": functools.partial(countdown_reward, use_all=False),
    "format": format_reward,
    "format_think_answer": functools.partial(format_reward, style="think_answer"),
    "format_answer_tag": functools.partial(format_reward, style="answer_tag"),
    "format_boxed": functools.partial(format_reward, style="boxed"),
}
for _name, _fn in BUILTIN.items():
  register_reward_fn(_name, _fn, overwrite=True)
