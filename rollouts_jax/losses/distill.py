"""Full-vocabulary reverse KL to a teacher on the student's own rollouts (on-policy distillation).

GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv 2306.13649) with the reverse KL as its divergence: at each
position t of a sequence the student sampled, the loss is the exact KL of the student's
next-token distribution from the teacher's,

  loss_t = sum_v p_s(v | y_<t) (log p_s(v | y_<t) - log p_t(v | y_<t)),

differentiated through the student's logits only (the teacher's log-probs are constants, and
so are the sampled prefixes). The single-sample form (log p_t(y_t) - log p_s(y_t) as a
per-token advantage of the policy gradient) estimates the same quantity from the sampled
token alone; the full form sums over the whole vocabulary, so every position moves the
student's whole next-token distribution. It needs the teacher's log-probs over the vocabulary
at every position, [S, T, V] floats (4 S T V bytes).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rollouts_jax.losses.aggregation import aggregate

Array = jax.Array


def full_reverse_kl(student_logprobs: Array, teacher_logprobs: Array, mask: Optional[Array] = None,
                    agg: Optional[str] = None, max_len: Optional[int] = None) -> Array:
  """Per-position KL(p_student || p_teacher) over the vocabulary, optionally aggregated.

  Args:
    student_logprobs: float[S, T, V] the student's (tempered) log-softmax at each position.
    teacher_logprobs: float[S, T, V] the teacher's at the same positions (a constant: no
      gradient flows into it).
    mask: optional bool[S, T]; masked positions give 0 (e.g. past EOS, outside an ESR window).
    agg: None for the per-position values [S, T], else an aggregation mode of `aggregate`.
    max_len: the constant of "seq-mean-token-sum-norm".

  Returns:
    float[S, T] per-position KLs (>= 0), or a scalar when `agg` is given.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.log(jnp.array([[[0.5, 0.5]]]))
    >>> t = jnp.log(jnp.array([[[0.25, 0.75]]]))
    >>> round(float(full_reverse_kl(s, t)[0, 0]), 4)   # 0.5 ln 2 + 0.5 ln(2/3)
    0.1438
    >>> float(full_reverse_kl(s, s, agg="token-mean"))
    0.0
  """
  return _full_kl(student_logprobs, teacher_logprobs, mask, agg, max_len, reverse=True)


def full_forward_kl(student_logprobs: Array, teacher_logprobs: Array, mask: Optional[Array] = None,
                    agg: Optional[str] = None, max_len: Optional[int] = None) -> Array:
  """Per-position KL(p_teacher || p_student) over the vocabulary (GKD's forward-KL variant).

  loss_t = sum_v p_t(v) (log p_t(v) - log p_s(v)) at the student's own prefixes: a
  cross-entropy to the teacher's soft next-token distribution, whose gradient in the
  student's logits is p_s - p_t (bounded, like supervised fine-tuning's), where the reverse
  KL's, p_s (d - E_s d) with d = log p_s - log p_t, grows with d.

  Args and returns: as `full_reverse_kl`.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.log(jnp.array([[[0.5, 0.5]]]))
    >>> t = jnp.log(jnp.array([[[0.25, 0.75]]]))
    >>> round(float(full_forward_kl(s, t)[0, 0]), 4)   # 0.25 ln 0.5 + 0.75 ln 1.5
    0.1308
  """
  return _full_kl(student_logprobs, teacher_logprobs, mask, agg, max_len, reverse=False)


def _full_kl(student_logprobs, teacher_logprobs, mask, agg, max_len, *, reverse: bool) -> Array:
  """KL(p_s || p_t) (`reverse`) or KL(p_t || p_s) per position; masked, then optionally aggregated."""
  name = "full_reverse_kl" if reverse else "full_forward_kl"
  student_logprobs = jnp.asarray(student_logprobs)
  teacher_logprobs = jnp.asarray(teacher_logprobs)
  if student_logprobs.ndim != 3 or student_logprobs.shape != teacher_logprobs.shape:
    raise ValueError(f"{name} expects student and teacher log-probs of one shape [S, T, V], got "
                     f"{student_logprobs.shape} and {teacher_logprobs.shape}.")
  dtype = jnp.promote_types(student_logprobs.dtype, jnp.float32)
  s = student_logprobs.astype(dtype)
  t = jax.lax.stop_gradient(teacher_logprobs.astype(dtype))
  # The first distribution weighs the log-ratio; 0 * log 0 = 0: an entry it gives no mass
  # contributes nothing (and no NaN from a -inf log-prob of the other there).
  a, b = (s, t) if reverse else (t, s)
  p = jnp.exp(a)
  kl = jnp.sum(jnp.where(p > 0, p * (a - b), 0.0), axis=-1)
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
    if mask.shape != kl.shape:
      raise ValueError(f"mask {mask.shape} must have the shape [S, T] {kl.shape}.")
    kl = jnp.where(mask, kl, 0.0)
  if agg is None:
    return kl
  if mask is None:
    mask = jnp.ones(kl.shape, bool)
  return aggregate(kl, mask, agg, max_len)


DIRECTIONS = {"reverse": full_reverse_kl, "forward": full_forward_kl}
