"""Graders by name, so that a config can say ``reward="countdown"``.

The table is filled by the modules that define graders (``rollouts_jax.rewards`` registers
its built-in ones when imported); the pool resolves names here, and never imports them.
"""
from __future__ import annotations

from typing import Any, Callable

RewardFn = Callable[[str, Any], float]

_REGISTRY: dict[str, RewardFn] = {}


def get_reward_fn(name: str) -> RewardFn:
    """The reward callable ``(completion, reference) -> float`` registered under ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
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
