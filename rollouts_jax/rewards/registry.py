"""Reward functions by name, so that a config can say ``reward="countdown"``."""
from __future__ import annotations

import functools
from typing import Any, Callable

from rollouts_jax.rewards.arithmetic import arithmetic_reward
from rollouts_jax.rewards.countdown import countdown_reward
from rollouts_jax.rewards.format import format_reward
from rollouts_jax.rewards.gsm8k import gsm8k_reward
from rollouts_jax.rewards.math_verifier import math_reward

RewardFn = Callable[[str, Any], float]

_REGISTRY: dict[str, RewardFn] = {
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


def get_reward_fn(name: str) -> RewardFn:
    """The reward callable ``(completion, reference) -> float`` registered under ``name``.

    Built in: ``math``, ``gsm8k``, ``arithmetic`` (one number in ``<answer>`` tags),
    ``countdown`` (every number once), ``countdown_at_most_once``,
    ``format`` (= ``format_think_answer``), ``format_answer_tag``, ``format_boxed``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).

    >>> get_reward_fn("gsm8k")("... #### 18", "18")
    1.0
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(_REGISTRY)}") from None


def register_reward_fn(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Registers ``fn`` under ``name``.

    For use with the process pool, ``fn`` must be picklable (a module-level function or a
    ``functools.partial`` of one); workers receive the function itself, not the name.

    Raises:
        ValueError: ``name`` is taken (and ``overwrite`` is False) or ``fn`` is not callable.
    """
    if not callable(fn):
        raise ValueError(f"reward function for {name!r} is not callable: {fn!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True")
    _REGISTRY[name] = fn


def reward_fn_names() -> list[str]:
    """Sorted names of the registered rewards."""
    return sorted(_REGISTRY)
