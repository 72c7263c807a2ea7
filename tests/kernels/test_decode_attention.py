"""Shared-prefix decode attention: the cascade form and the Pallas kernel equal the definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax.kernels import decode_attention as da
from rollouts_jax.kernels.decode_attention import reference

# One compilation per shape (the suffix length is traced, as in the sampler).
_attend = jax.jit(da.decode_attention, static_argnames=("implementation", "block_s", "interpret"))
_naive = jax.jit(reference.naive)


def _inputs(B=2, N=3, K=2, G=2, D=8, P=5, S=12, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  lens = rng.integers(1, P + 1, size=B)
  prefix_mask = jnp.asarray(np.arange(P)[None] >= (P - lens)[:, None])  # left-padded prompts
  return (f(B, N, K, G, D), f(B, K, P, D), f(B, K, P, D), prefix_mask, f(B * N, K, D, S),
          f(B * N, K, S, D))


@pytest.mark.parametrize("length", [1, 4, 8, 9, 12])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_matches_naive_definition(implementation, length):
  args = _inputs()
  want = _naive(*args, length)
  got = _attend(*args, length, implementation=implementation, block_s=4)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", [dict(N=1, G=1), dict(B=1, N=4, K=1, G=4, P=3, S=7), dict(P=1)])
def test_matches_naive_other_shapes(shape):
  args = _inputs(**shape, seed=1)
  for length in (1, 5, args[-1].shape[2]):
    want = np.asarray(_naive(*args, length))
    for impl in ("xla", "pallas"):
      got = np.asarray(_attend(*args, length, implementation=impl, block_s=4))
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_slots_past_length_are_ignored():
  """What lies beyond `length` (stale finite values) never changes the result."""
  q, pk, pv, pm, skt, sv = _inputs(seed=2)
  length = 5
  skt2, sv2 = skt.at[..., length:].set(1e6), sv.at[:, :, length:].set(-3e5)
  for impl in ("xla", "pallas"):
    a = _attend(q, pk, pv, pm, skt, sv, length, implementation=impl, block_s=4)
    b = _attend(q, pk, pv, pm, skt2, sv2, length, implementation=impl, block_s=4)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_prefix_is_shared_not_per_sample():
  """Samples of one prompt see the same prompt: swapping two prompts' prefixes swaps their rows."""
  q, pk, pv, pm, skt, sv = _inputs(B=2, N=2, seed=3)
  q = jnp.broadcast_to(q[:1], q.shape)             # same queries for both prompts
  out = _attend(q, pk, pv, pm, skt, sv, 3)
  swapped = _attend(q, pk[::-1], pv[::-1], pm[::-1],
                                skt.reshape(2, 2, *skt.shape[1:])[::-1].reshape(skt.shape),
                                sv.reshape(2, 2, *sv.shape[1:])[::-1].reshape(sv.shape), 3)
  np.testing.assert_allclose(np.asarray(out), np.asarray(swapped)[::-1], atol=1e-6)


def test_merge_equals_joint_softmax():
  rng = np.random.default_rng(4)
  s = rng.standard_normal((3, 10)) * 3
  v = rng.standard_normal((10, 4))
  part = lambda sl: (jax.nn.softmax(s[:, sl]) @ v[sl], jax.scipy.special.logsumexp(s[:, sl], axis=-1))
  out, lse = da.merge(*part(slice(0, 6)), *part(slice(6, 10)))
  np.testing.assert_allclose(np.asarray(out), jax.nn.softmax(s) @ v, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), jax.scipy.special.logsumexp(s, axis=-1), atol=1e-5)


def test_bfloat16_inputs_close_to_float32():
  args32 = _inputs(seed=5)
  args16 = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args32)
  want = np.asarray(_naive(*args32, 7))
  for impl in ("xla", "pallas"):
    got = _attend(*args16, 7, implementation=impl, block_s=4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="implementation must be one of"):
    da.decode_attention(*_inputs(), 1, implementation="cuda")
