"""A deterministic, resumable, sharded stream of prompt batches.

Epoch ``e`` visits the examples in a permutation fixed by ``(seed, e)`` alone (a SplitMix64
hash of each index, sorted: the same on every platform and NumPy version). Host ``i`` of
``S`` takes every ``S``-th example of that order, starting at ``i``, and cuts its share
into batches of ``batch_size`` (per host), dropping the remainder so that every host has
the same number of batches. So global batch ``k`` (all hosts' batch ``k`` together) is
exactly the slice ``[k*B*S, (k+1)*B*S)`` of the epoch's order: the same examples whatever
the number of hosts, as long as the global batch ``B*S`` is the same.

The position is two integers (epoch, step). ``state()`` returns it with the stream's
identity; ``restore()`` puts it back, and a resumed run then sees exactly the batches the
interrupted one would have seen.

>>> stream = PromptStream(list(range(10)), batch_size=4, seed=0)
>>> first = next(stream); saved = stream.state(); second = next(stream)
>>> stream.restore(saved); next(stream) == second
True
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["shuffled_order", "PromptStream", "host_prompt_stream"]

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64 finalizer, a bijection of uint64 (arrays wrap around silently)."""
  z = x + _U64(0x9E3779B97F4A7C15)
  z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
  return z ^ (z >> _U64(31))


def shuffled_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The permutation of ``range(num_examples)`` for ``(seed, epoch)``.

  Args:
    num_examples: the dataset size.
    seed: non-negative int.
    epoch: non-negative int.

  Returns:
    int64[num_examples], a permutation.

  >>> sorted(shuffled_order(5, 0, 0).tolist())
  [0, 1, 2, 3, 4]
  """
  if seed < 0 or epoch < 0:
    raise ValueError(f"seed and epoch must be non-negative, got {seed}, {epoch}")
  salt = _splitmix64(_splitmix64(np.array([seed], dtype=_U64)) ^ np.array([epoch], dtype=_U64))
  # (i ^ salt) is injective and so is the mix, so the keys are distinct: no ties to break.
  keys = _splitmix64(np.arange(num_examples, dtype=_U64) ^ salt)
  return np.argsort(keys, kind="stable").astype(np.int64)


class PromptStream:
  """Endless, deterministic batches of examples for one host.

  Args:
    examples: a random-access sequence (a list, or a TFDS-backed ``ExampleSource``).
    batch_size: examples per batch on this host.
    seed: shuffling seed.
    shard_index: this host's index in ``[0, num_shards)``.
    num_shards: number of hosts sharing the stream.

  Iterating yields lists of ``batch_size`` examples, epoch after epoch.

  >>> a = PromptStream(list(range(8)), 2, seed=1, shard_index=0, num_shards=2)
  >>> b = PromptStream(list(range(8)), 2, seed=1, shard_index=1, num_shards=2)
  >>> whole = PromptStream(list(range(8)), 4, seed=1)
  >>> sorted(next(a) + next(b)) == sorted(next(whole))
  True
  """

  def __init__(self, examples: Sequence[Any], batch_size: int, seed: int, shard_index: int = 0,
               num_shards: int = 1):
    if num_shards < 1 or not 0 <= shard_index < num_shards:
      raise ValueError(f"need 0 <= shard_index < num_shards, got shard_index={shard_index}, "
                       f"num_shards={num_shards}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    self.examples = examples
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shard_index = int(shard_index)
    self.num_shards = int(num_shards)
    self.num_examples = len(examples)
    if self.batches_per_epoch == 0:
      raise ValueError(
          f"{self.num_examples} examples over {num_shards} shard(s) do not fill one batch of "
          f"{batch_size} per shard")
    self._epoch = 0
    self._step = 0
    self._cached_epoch = -1
    self._cached_indices: np.ndarray | None = None

  @property
  def examples_per_shard(self) -> int:
    """Examples this host sees per epoch, before dropping the last partial batch."""
    return self.num_examples // self.num_shards

  @property
  def batches_per_epoch(self) -> int:
    """Batches per epoch (the same on every host)."""
    return self.examples_per_shard // self.batch_size

  @property
  def global_batch_size(self) -> int:
    return self.batch_size * self.num_shards

  def _shard_indices(self, epoch: int) -> np.ndarray:
    if epoch != self._cached_epoch:
      order = shuffled_order(self.num_examples, self.seed, epoch)
      self._cached_indices = order[self.shard_index::self.num_shards][:self.examples_per_shard]
      self._cached_epoch = epoch
    return self._cached_indices

  def batch_indices(self, epoch: int, step: int) -> np.ndarray:
    """Dataset indices of this host's batch ``step`` of ``epoch``: int64[batch_size]."""
    if not 0 <= step < self.batches_per_epoch:
      raise ValueError(f"step must be in [0, {self.batches_per_epoch}), got {step}")
    start = step * self.batch_size
    return self._shard_indices(epoch)[start:start + self.batch_size]

  def __iter__(self) -> "PromptStream":
    return self

  def __next__(self) -> list[Any]:
    indices = self.batch_indices(self._epoch, self._step)
    self._step += 1
    if self._step == self.batches_per_epoch:
      self._epoch, self._step = self._epoch + 1, 0
    return [self.examples[int(i)] for i in indices]

  @property
  def epoch(self) -> int:
    """The epoch of the next batch."""
    return self._epoch

  def state(self) -> dict[str, int]:
    """The position of the next batch and the stream's identity (JSON-serializable ints)."""
    return {"epoch": self._epoch, "step": self._step, "seed": self.seed,
            "num_examples": self.num_examples, "global_batch_size": self.global_batch_size}

  def restore(self, state: dict[str, int]) -> None:
    """Moves to a position saved by :meth:`state`.

    The saved stream must have the same seed, dataset size and global batch size (the
    number of hosts may differ: global batches do not depend on it).

    Raises:
      ValueError: the state belongs to a different stream, or the position is invalid.
    """
    for key in ("seed", "num_examples", "global_batch_size"):
      if key in state and int(state[key]) != getattr(self, key):
        raise ValueError(f"cannot restore: saved {key}={state[key]} but this stream has "
                         f"{key}={getattr(self, key)}")
    epoch, step = int(state["epoch"]), int(state["step"])
    if epoch < 0 or not 0 <= step < self.batches_per_epoch:
      raise ValueError(f"invalid position epoch={epoch}, step={step} "
                       f"(batches per epoch: {self.batches_per_epoch})")
    self._epoch, self._step = epoch, step


def host_prompt_stream(examples: Sequence[Any], batch_size: int, seed: int) -> PromptStream:
  """A :class:`PromptStream` for this JAX process (``jax.process_index()`` of
  ``jax.process_count()``).

  Args:
    examples: the whole dataset (every host passes the same one).
    batch_size: examples per batch on each host.
    seed: shuffling seed (the same on every host).

  Returns:
    This host's stream.
  """
  import jax

  return PromptStream(examples, batch_size, seed, shard_index=jax.process_index(),
                      num_shards=jax.process_count())
