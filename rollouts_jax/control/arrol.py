"""ARRoL online pruning: over-sample, judge partial rollouts with a probe, continue the best mix.

ARRoL ("Prune as You Generate", arXiv 2603.24840): generate more rollouts than the update
needs, stop them after a short prefix, score each partial rollout with a lightweight
quality head on the policy's hidden state that predicts final success (trained on the fly
with binary cross-entropy against the verifier's outcomes of finished rollouts), prune to
the group size so that the survivors' predicted positive share approaches a target rho
(about 0.5: a balanced group has the largest reward variance, hence signal), and continue
only the survivors. The pruned rows cost only their prefix.

Here the head is a logistic probe on the RMS-normalized last hidden state of prompt +
prefix; `prune` keeps the ceil(rho * K) rows the head rates most likely to succeed and the
K - ceil(rho * K) it rates least likely (ours: the paper's exact pruning rule is not
public), and falls back to a random subset until the head has seen `min_examples`
outcomes. The training loop runs it as the generator `rollout.generator="arrol"` (`rollout/arrol.py`).
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class QualityHead:
  """A logistic probe and its Adam state (a pytree; checkpointed with the pipeline).

  Attributes:
    w: float32 [H]; b: float32 scalar.
    m, v: Adam moments of (w, b) concatenated, float32 [H + 1].
    steps: int32, Adam steps taken.
    examples: int32, outcomes seen.
  """
  w: jax.Array
  b: jax.Array
  m: jax.Array
  v: jax.Array
  steps: jax.Array
  examples: jax.Array


def head_init(hidden_size: int) -> QualityHead:
  """An untrained head (predicts 0.5 everywhere)."""
  z = jnp.zeros((hidden_size + 1,), jnp.float32)
  return QualityHead(w=jnp.zeros((hidden_size,), jnp.float32), b=jnp.zeros((), jnp.float32), m=z, v=z,
                     steps=jnp.zeros((), jnp.int32), examples=jnp.zeros((), jnp.int32))


def _features(h_RxH: jax.Array) -> jax.Array:
  h = h_RxH.astype(jnp.float32)
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


@jax.jit
def head_predict(head: QualityHead, h_RxH: jax.Array) -> jax.Array:
  """float32 [R]: predicted probability that each partial rollout ends correct.

  >>> float(head_predict(head_init(4), jnp.ones((1, 4)))[0])
  0.5
  """
  return jax.nn.sigmoid(_features(h_RxH) @ head.w + head.b)


@functools.partial(jax.jit, static_argnames=("steps", "lr", "l2"))
def head_update(head: QualityHead, h_RxH: jax.Array, success_R: jax.Array, mask_R: jax.Array, *,
                steps: int = 25, lr: float = 0.05, l2: float = 1e-3) -> QualityHead:
  """`steps` Adam steps of L2-regularized binary cross-entropy on the masked rows.

  >>> h = jnp.array([[1., 0.], [0., 1.]] * 8); y = jnp.array([1., 0.] * 8)
  >>> head = head_update(head_init(2), h, y, jnp.ones(16, bool), steps=200)
  >>> [round(float(p)) for p in head_predict(head, h[:2])]
  [1, 0]
  """
  x = _features(h_RxH)
  y = success_R.astype(jnp.float32)
  m = mask_R.astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)

  def loss(theta):
    logits = x @ theta[:-1] + theta[-1]
    bce = jnp.maximum(logits, 0) - logits * y + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return jnp.sum(bce * m) / n + l2 * jnp.sum(theta[:-1] ** 2)

  def step(carry, _):
    theta, mo, ve, t = carry
    g = jax.grad(loss)(theta)
    t = t + 1
    mo = 0.9 * mo + 0.1 * g
    ve = 0.999 * ve + 0.001 * g * g
    mhat, vhat = mo / (1 - 0.9 ** t), ve / (1 - 0.999 ** t)
    return (theta - lr * mhat / (jnp.sqrt(vhat) + 1e-8), mo, ve, t), None

  theta0 = jnp.concatenate([head.w, head.b[None]])
  (theta, mo, ve, t), _ = jax.lax.scan(step, (theta0, head.m, head.v, head.steps.astype(jnp.float32)), None,
                                       length=steps)
  any_rows = m.sum() > 0
  keep = lambda new, old: jnp.where(any_rows, new, old)
  return QualityHead(w=keep(theta[:-1], head.w), b=keep(theta[-1], head.b), m=keep(mo, head.m), v=keep(ve, head.v),
                     steps=keep(t.astype(jnp.int32), head.steps),
                     examples=head.examples + m.sum().astype(jnp.int32))


def prune(p_BxM: jax.Array, keep: int, key: jax.Array, *, target: float = 0.5, ready=True) -> jax.Array:
  """int32 [B, keep]: the rows of each group that survive.

  With a `ready` head: the ceil(target * keep) rows with the highest predicted success and
  the rest from the lowest (a balanced group); otherwise a uniformly random subset.

  >>> p = jnp.array([[.9, .1, .8, .2, .5, .6]])
  >>> sorted(prune(p, 4, jax.random.key(0)).tolist()[0])
  [0, 1, 2, 3]
  """
  B, M = p_BxM.shape
  if not 1 <= keep <= M:
    raise ValueError(f"prune keeps 1..{M} rows per group, got {keep}.")
  n_top = min(keep, max(0, math.ceil(target * keep)))
  order = jnp.argsort(-p_BxM, axis=1, stable=True)
  balanced = jnp.concatenate([order[:, :n_top], order[:, M - (keep - n_top):]], axis=1) if keep > n_top else \
      order[:, :n_top]
  random = jnp.argsort(jax.random.uniform(key, (B, M)), axis=1)[:, :keep]
  return jnp.where(jnp.asarray(ready), balanced, random).astype(jnp.int32)


def oversampled(num_samples: int, oversample: float) -> int:
  """Rows generated per prompt before pruning: ceil(N * (1 + oversample)).

  >>> oversampled(8, 0.5)
  12
  """
  return int(math.ceil(num_samples * (1.0 + oversample)))
