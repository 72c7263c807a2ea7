"""Tree advantages (TreeRL) and ECHO's hybrid shaping: hand-made trees and equivalences."""

import math

import jax.numpy as jnp
import numpy as np

from rollouts_jax import advantages
from rollouts_jax.advantages import tree as tree_adv

# Leaves 0, 1, 2 share positions [0, 2); 0 and 1 share [0, 3); leaf 3 shares only position 0;
# row 4 is not a leaf (its reward and splits must be ignored).
SPLIT = np.array([[4, 3, 2, 1, 0],
                  [3, 4, 2, 1, 0],
                  [2, 2, 4, 1, 0],
                  [1, 1, 1, 4, 0],
                  [0, 0, 0, 0, 4]])[None]
LEAVES = np.array([[True, True, True, True, False]])
MASK = np.ones((1, 5, 4), bool)


def test_hand_made_tree():
  r = jnp.array([[1., 0., 1., 0., 7.]])
  adv = np.asarray(tree_adv.tree_node_advantages(r, SPLIT, LEAVES, MASK))
  a, b = 1 / (3 * math.sqrt(3)), -1 / (6 * math.sqrt(2))  # node {0,1,2}: G = L = 1/6; node {0,1}: G = 0, L = -1/6
  expected = np.array([[0, a, b, 1],        # leaf 0: own token G = L = 1/2
                       [0, a, b, -1],
                       [0, a, 5 / 6, 5 / 6],  # node {2}: G = 1/2, L = 1 - 2/3
                       [0, -1, -1, -1],     # node {3}: G = L = -1/2
                       [0, 0, 0, 0]])
  np.testing.assert_allclose(adv[0], expected, atol=1e-6)


def test_equal_rewards_give_zero():
  for value in (0., 1., 0.3):
    r = jnp.full((1, 5), value).at[0, 4].set(9.)
    np.testing.assert_array_equal(np.asarray(tree_adv.tree_node_advantages(r, SPLIT, LEAVES, MASK)), 0)


def test_independent_samples_give_twice_dr_grpo():
  """A flat tree (every leaf its own root) has G = L = r - mean: twice Dr. GRPO's advantage on every token."""
  rng = np.random.default_rng(0)
  B, N, T = 3, 5, 6
  r = rng.random((B, N)).astype(np.float32)
  split = np.where(np.eye(N, dtype=bool), T, 0)[None].repeat(B, 0)
  mask = rng.random((B, N, T)) < 0.8
  adv = np.asarray(tree_adv.tree_node_advantages(r, split, np.ones((B, N), bool), mask))
  ref, _ = advantages.apply(advantages.dr_grpo(), jnp.asarray(r))
  np.testing.assert_allclose(adv, np.where(mask, 2 * np.asarray(ref)[..., None], 0), atol=1e-6)


def test_hybrid_shaping_properties():
  rng = np.random.default_rng(1)
  B, N, T = 2, 4, 7
  a = jnp.asarray(rng.normal(size=(B, N)), jnp.float32)
  h = jnp.asarray(rng.random((B, N, T)) * 2, jnp.float32)
  c = jnp.asarray(rng.random((B, N)), jnp.float32)
  m = jnp.ones((B, N, T), bool)
  out = np.asarray(tree_adv.echo_hybrid_advantages(a, h, c, m, lam=0.5))
  # the entropy factor averages to 1 over a response, so a negative advantage keeps its mean
  neg = np.asarray(a) < 0
  np.testing.assert_allclose(out.mean(-1)[neg], np.asarray(a)[neg], rtol=1e-5)
  # a positive one is scaled by its normalised confidence
  pos = ~neg
  chat = np.asarray(tree_adv.normalized_confidence(c))
  np.testing.assert_allclose(out.mean(-1)[pos], (np.asarray(a) * chat)[pos], rtol=1e-5, atol=1e-6)
  # lam = 0 and a flat confidence: the plain advantage on every token
  flat = np.asarray(tree_adv.echo_hybrid_advantages(a, h, jnp.ones((B, N)), m, lam=0.0))
  np.testing.assert_allclose(flat, np.broadcast_to(np.asarray(a)[..., None], (B, N, T)), rtol=1e-6)
  # zero advantages stay zero (zero-std groups)
  assert not np.asarray(tree_adv.echo_hybrid_advantages(jnp.zeros((B, N)), h, c, m)).any()
