"""REPLAY: fixed-capacity rollout buffers (contract in `replay.base`).

    buf = replay.fifo(capacity, example_batch)
    bstate = buf.init(); bstate = buf.add(bstate, batch); batch, bstate = buf.sample(bstate, key, n)

A config chooses a buffer by name (`replay.name`: "none" or a registered buffer):

>>> from rollouts_jax import replay
>>> replay.names()
['none', 'fifo', 'prioritized']
"""

from __future__ import annotations

from typing import Callable

from rollouts_jax.replay.base import BufferState, RolloutBuffer, group_versions
from rollouts_jax.replay.drafts import DraftState, DraftStore, draft_store
from rollouts_jax.replay.fifo import fifo
from rollouts_jax.replay.partial import partial_rollouts
from rollouts_jax.replay.prioritized import group_usefulness, prioritized

#: name -> buffer factory `(capacity, example, *, max_staleness) -> RolloutBuffer`.
#: (`partial_rollouts` is not here: it is APRIL's store, held by the `april` generator.)
REGISTRY: dict[str, Callable[..., RolloutBuffer]] = {"fifo": fifo, "prioritized": prioritized}


def names() -> list[str]:
  return ["none"] + list(REGISTRY)


def get(name: str, key: str = "replay.name"):
  """The buffer factory registered under `name` (None for "none"); unknown names name `key`."""
  if name == "none":
    return None
  if name not in REGISTRY:
    raise ValueError(f"Config key {key}: unknown replay buffer {name!r}; known: {', '.join(names())}.")
  return REGISTRY[name]


__all__ = ["BufferState", "DraftState", "DraftStore", "REGISTRY", "draft_store", "RolloutBuffer", "fifo", "get", "group_usefulness", "group_versions", "names",
           "partial_rollouts", "prioritized"]
