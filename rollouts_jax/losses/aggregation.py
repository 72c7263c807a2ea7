"""Loss aggregation over `[S, T]` token values (S sequences, T tokens)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_agg(agg: str) -> None:
  """Raises ValueError if `agg` is not a known aggregation mode."""
  if agg not in AGG_MODES:
    raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}.")


def aggregate(values: Array, mask: Array, agg: str = "token-mean",
              max_len: Optional[int] = None) -> Array:
  """Reduces per-token values `[S, T]` to a scalar under a mask.

  With m the mask, L_i = sum_t m_it the length of sequence i and S' the number of sequences
  with at least one valid token:

  * "token-mean":              sum_it m v / sum_it m  (DAPO: every token weighs the same).
  * "seq-mean-token-sum":      (1/S') sum_i sum_t m v.
  * "seq-mean-token-mean":     (1/S') sum_i (sum_t m v) / L_i  (GRPO, GSPO).
  * "seq-mean-token-sum-norm": sum_it m v / (S * max_len)  (Dr. GRPO: a constant divisor; S is
    the number of rows, T the default max_len).

  Fully masked sequences (e.g. an MC-GRPO pivot) do not count in S' for the seq-mean modes;
  an all-masked input gives 0, never NaN.

  Args:
    values: float[S, T] per-token values.
    mask: bool[S, T]; False tokens do not count.
    agg: one of the modes above (a static Python string).
    max_len: the constant of "seq-mean-token-sum-norm" (the generation budget); default T.

  Returns:
    A float32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> v = jnp.array([[1., 1., 1.], [4., 0., 0.]])
    >>> m = jnp.array([[True, True, True], [True, False, False]])
    >>> float(aggregate(v, m, "token-mean")), float(aggregate(v, m, "seq-mean-token-mean"))
    (1.75, 2.5)
  """
  check_agg(agg)
  values = jnp.asarray(values)
  mask = jnp.asarray(mask)
  if values.ndim != 2 or mask.shape != values.shape:
    raise ValueError(f"aggregate expects values and mask of one shape [S, T], got "
                     f"{values.shape} and {mask.shape}.")
  mask = mask.astype(bool)
  v = jnp.where(mask, values, 0).astype(jnp.promote_types(values.dtype, jnp.float32))
  if agg == "token-mean":
    return jnp.sum(v) / jnp.maximum(jnp.sum(mask), 1)
  seq_sum = jnp.sum(v, axis=-1)
  if agg == "seq-mean-token-sum-norm":
    if max_len is None:
      max_len = values.shape[-1]
    if isinstance(max_len, (int, float)) and max_len <= 0:
      raise ValueError(f"max_len must be > 0, got {max_len}.")
    return jnp.sum(seq_sum) / (values.shape[0] * max_len)
  lengths = jnp.sum(mask, axis=-1)
  nonempty = lengths > 0
  if agg == "seq-mean-token-mean":
    seq_sum = seq_sum / jnp.maximum(lengths, 1)
  return jnp.sum(jnp.where(nonempty, seq_sum, 0)) / jnp.maximum(jnp.sum(nonempty), 1)


def masked_mean(values: Array, mask: Array) -> Array:
  """Mean of `values` over True entries of `mask` (0 if none)."""
  mask = jnp.asarray(mask, bool)
  return jnp.sum(jnp.where(mask, values, 0)) / jnp.maximum(jnp.sum(mask), 1)
