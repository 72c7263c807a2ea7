"""`replay.draft_store`: each prompt's latest rollouts, kept as drafts for SPEC-RL.

SPEC-RL (arXiv 2509.23232) drafts a prompt's rollouts from the previous epoch's rollouts of
the same prompt, with the behaviour log-probs they were sampled with. The store is a pytree
of arrays indexed by dataset prompt index (`[num_prompts, N, T]`), so it checkpoints with
the pipeline; its memory is num_prompts * N * T * 9 bytes (2.4 MB for 256 prompts x 8 x 128).
"""

from __future__ import annotations

from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class DraftState:
  """Attributes: ids int32 [K, N, T], mask bool [K, N, T], logprobs float32 [K, N, T],
  valid bool [K] (the prompt has drafts), version int32 [K] (the step that sampled them)."""
  ids: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  valid: jax.Array
  version: jax.Array


class DraftStore(NamedTuple):
  """`init() -> state`, `put(state, prompt_index_B, ids, mask, logprobs, version) -> state`,
  `get(state, prompt_index_B) -> (ids, mask, logprobs, valid_B)` (rows of prompts without
  drafts come back with an all-False mask)."""
  init: callable
  put: callable
  get: callable


def draft_store(num_prompts: int, num_samples: int, max_new_tokens: int) -> DraftStore:
  """A store of the latest `[N, T]` rollouts of each of `num_prompts` prompts.

  >>> store = draft_store(4, 2, 3)
  >>> s = store.put(store.init(), np.array([2]), np.ones((1, 2, 3), np.int32), np.ones((1, 2, 3), bool),
  ...               np.zeros((1, 2, 3), np.float32), version=5)
  >>> ids, mask, lp, valid = store.get(s, np.array([2, 0]))
  >>> valid.tolist(), mask.sum(axis=(1, 2)).tolist()
  ([True, False], [6, 0])
  """
  K, N, T = int(num_prompts), int(num_samples), int(max_new_tokens)
  if min(K, N, T) < 1:
    raise ValueError(f"draft_store needs positive sizes, got {(K, N, T)}.")

  def init():
    return DraftState(ids=np.zeros((K, N, T), np.int32), mask=np.zeros((K, N, T), bool),
                      logprobs=np.zeros((K, N, T), np.float32), valid=np.zeros((K,), bool),
                      version=np.full((K,), -1, np.int32))

  def put(state, prompt_index, ids, mask, logprobs, version):
    idx = np.asarray(prompt_index)
    ok = idx >= 0
    idx = idx[ok]
    st = jax.tree_util.tree_map(lambda x: np.array(x), state)   # host copies (the state may be device arrays)
    width = min(T, np.asarray(ids).shape[-1])
    pad = lambda x, v: np.pad(np.asarray(x)[ok][..., :width], ((0, 0), (0, 0), (0, T - width)), constant_values=v)
    st.ids[idx], st.mask[idx], st.logprobs[idx] = pad(ids, 0), pad(mask, False), pad(logprobs, 0.0)
    st.valid[idx], st.version[idx] = True, version
    return st

  def get(state, prompt_index):
    idx = np.asarray(prompt_index)
    safe = np.maximum(idx, 0)
    valid = np.asarray(state.valid)[safe] & (idx >= 0)
    mask = np.asarray(state.mask)[safe] & valid[:, None, None]
    return np.asarray(state.ids)[safe], mask, np.asarray(state.logprobs)[safe], valid

  return DraftStore(init, put, get)
