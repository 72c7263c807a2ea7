"""CONTROL: which prompts, how many rollouts each, which groups and samples are kept.

Prompt selectors follow the contract of `control.base` (optax-style `init / select / update`
over a per-prompt state pytree); group filters are pure functions::

    sel = control.uniform(num_prompts, num_samples=8)
    state = sel.init()
    plan, state = sel.select(state, key, batch_size)          # plan.indices, plan.budget [B]
    state = sel.update(state, plan, rewards_BxN, mask_BxN)
    keep, group_mask = control.dynamic_sampling(rewards_BxN, target=B)
    idx_BxK = control.select_subset(pool_rewards_BxM, k, "contrastive")   # Sol-RL subset

A config chooses a selector by name (`control.name`, settings in `control.kwargs`):

>>> from rollouts_jax import control
>>> sel = control.build("uniform", num_prompts=10, num_samples=4, seed=0)
>>> control.names()[:1]
['uniform']
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from rollouts_jax.control import arrol
from rollouts_jax.control.base import Plan, PromptSelector, full_budget
from rollouts_jax.control.filters import dynamic_sampling, informative
from rollouts_jax.control.subset import SUBSET_MODES, select_subset
from rollouts_jax.control.uniform import uniform
from rollouts_jax.control.hive import hive
from rollouts_jax.control.pilot_commit import pilot_commit
from rollouts_jax.control.pvpo import pvpo_presample
from rollouts_jax.control.vade import vade
from rollouts_jax.control.xrpo import xrpo_allocation

#: name -> selector factory `(num_prompts, *, num_samples, seed, **settings) -> PromptSelector`.
REGISTRY: dict[str, Callable[..., PromptSelector]] = {
    "uniform": uniform,
    "vade": vade,
    "hive": hive,
    "pilot_commit": pilot_commit,
    "xrpo": xrpo_allocation,
    "pvpo": pvpo_presample,
}


def names() -> list[str]:
  """The selector names a config may use (`control.name`), the default first."""
  return ["uniform"] + sorted(n for n in REGISTRY if n != "uniform")


def get(name: str, key: str = "control.name") -> Callable[..., PromptSelector]:
  """The selector factory registered under `name`; an unknown name is an error naming `key`."""
  if name not in REGISTRY:
    raise ValueError(f"Config key {key}: unknown prompt selector {name!r}; known: {', '.join(names())}.")
  return REGISTRY[name]


def check_kwargs(name: str, kwargs: dict[str, Any], key: str = "control.kwargs") -> None:
  """Raises ValueError naming `key` when `kwargs` holds a setting the selector does not take."""
  params = inspect.signature(get(name)).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  reserved = {"num_prompts", "num_samples", "seed"}
  allowed = sorted(set(params) - reserved)
  for k in kwargs:
    if k not in allowed or k in reserved:
      raise ValueError(f"Config key {key}: selector {name!r} has no setting {k!r}; its settings: "
                       f"{', '.join(allowed) or 'none'}.")


def build(name: str, *, num_prompts: int, num_samples: int, seed: int = 0, **kwargs: Any) -> PromptSelector:
  """Builds the named selector over a dataset of `num_prompts` prompts."""
  check_kwargs(name, kwargs)
  return get(name)(num_prompts, num_samples=num_samples, seed=seed, **kwargs)


def register(name: str, factory: Callable[..., PromptSelector], *, overwrite: bool = False) -> None:
  """Registers a selector factory under `name` (a research plug-in)."""
  if name in REGISTRY and not overwrite:
    raise ValueError(f"A prompt selector {name!r} is already registered; pass overwrite=True.")
  REGISTRY[name] = factory


__all__ = ["arrol", "Plan", "PromptSelector", "REGISTRY", "SUBSET_MODES", "build", "check_kwargs", "dynamic_sampling",
           "full_budget", "get", "informative", "names", "register", "select_subset", "uniform",
           "vade", "hive", "pilot_commit", "xrpo_allocation", "pvpo_presample"]
