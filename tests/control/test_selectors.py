"""Properties of the prompt selectors of `rollouts_jax.control` (VADE, HIVE, Pilot-Commit, XRPO, PVPO)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import control
from rollouts_jax.control import base

K, N, B = 24, 8, 6
NAMES = ["uniform", "vade", "hive", "pilot_commit", "xrpo", "pvpo"]


def _bandit_rewards(key, p_K, plan, n=N):
  """Bernoulli rewards [B, n] of the plan's prompts, with the plan's sample mask."""
  r = (jax.random.uniform(key, (plan.indices.shape[0], n)) < p_K[plan.indices][:, None]).astype(jnp.float32)
  return r, plan.sample_mask(n)


def _extras(plan, rewards, key):
  """Extras as the loop passes them (entropy highest where the group is mixed), plus an unknown one."""
  p = jnp.mean(rewards, axis=1, keepdims=True)
  ent = 0.1 + p * (1 - p) + 0.01 * jax.random.uniform(key, rewards.shape)
  return {"entropy_BxN": ent, "lengths_BxN": jnp.full(rewards.shape, 7), "something_new": 3}


@functools.lru_cache(maxsize=None)
def _round(sel, batch):
  """One jitted select/(refine)/update round against Bernoulli prompts (compiled once per selector).

  As in the loop: a selector with a second phase sees the first phase's samples, then its
  refined budgets' (one draw of N per prompt; each phase reads the samples within its budget).
  """

  @jax.jit
  def one(state, k, p_K):
    k_sel, k_r, k_e = jax.random.split(k, 3)
    plan, state = sel.select(state, k_sel, batch)
    r, m = _bandit_rewards(k_r, p_K, plan)
    if sel.refine is not None:
      plan, state = sel.refine(state, plan, jnp.where(m, r, 0.0), m)
      m = plan.sample_mask(N)
    ex = _extras(plan, r, k_e)
    ex.pop("something_new")
    return plan, sel.update(state, plan, r, m, **ex)

  return one


def _run(sel, state, p_K, steps, key, batch=B):
  plans = []
  for t in range(steps):
    plan, state = _round(sel, batch)(state, jax.random.fold_in(key, t), p_K)
    plans.append(plan)
  return plans, state


def _p_mixture():
  """A third of the prompts never solved, a third always, a third at p = 1/2 (shuffled)."""
  p = np.array([0.0, 1.0, 0.5] * (K // 3), np.float32)
  return jnp.asarray(np.random.default_rng(0).permutation(p))


@pytest.mark.parametrize("name", NAMES)
def test_plan_shape_range_and_budget(name):
  sel = control.build(name, num_prompts=K, num_samples=N)
  plans, _ = _run(sel, sel.init(), _p_mixture(), 8, jax.random.key(1))
  for plan in plans:
    idx, bud = np.asarray(plan.indices), np.asarray(plan.budget)
    assert idx.shape == (B,) and bud.shape == (B,)
    assert plan.indices.dtype == jnp.int32 and plan.budget.dtype == jnp.int32
    assert len(set(idx.tolist())) == B and idx.min() >= 0 and idx.max() < K   # distinct prompts
    assert bud.min() >= 1 and bud.max() <= N


@pytest.mark.parametrize("name", NAMES)
def test_plans_deterministic_given_key_and_jit_matches(name):
  sel = control.build(name, num_prompts=K, num_samples=N)
  _, state = _run(sel, sel.init(), _p_mixture(), 5, jax.random.key(2))
  key = jax.random.key(7)
  a, sa = sel.select(state, key, B)
  b, sb = sel.select(state, key, B)
  jitted = jax.jit(sel.select, static_argnums=2)
  c, sc = jitted(state, key, B)
  for x in (b, c):
    np.testing.assert_array_equal(a.indices, x.indices)
    np.testing.assert_array_equal(a.budget, x.budget)
  for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sc)):
    np.testing.assert_array_equal(x, y)
  # update under jit gives the same state as eagerly
  r, m = _bandit_rewards(jax.random.key(3), _p_mixture(), a)
  ex = _extras(a, r, jax.random.key(4))
  ex.pop("something_new")
  u1 = sel.update(sa, a, r, m, **ex)
  u2 = jax.jit(sel.update)(sa, a, r, m, **ex)
  for x, y in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_extras_are_ignored(name):
  sel = control.build(name, num_prompts=K, num_samples=N)
  plan, state = sel.select(sel.init(), jax.random.key(0), B)
  r, m = _bandit_rewards(jax.random.key(1), _p_mixture(), plan)
  s1 = sel.update(state, plan, r, m)
  s2 = sel.update(state, plan, r, m, lengths_BxN=jnp.ones_like(r), unheard_of=jnp.zeros(3))
  for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_resumes_bitwise(name, tmp_path):
  """Flatten -> host numpy -> unflatten, and an orbax save/restore, continue the same stream."""
  from rollouts_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  sel = control.build(name, num_prompts=K, num_samples=N)
  p = _p_mixture()
  _, state = _run(sel, sel.init(), p, 4, jax.random.key(5))
  leaves, treedef = jax.tree_util.tree_flatten(state)
  copied = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(np.asarray(x)) for x in leaves])
  checkpoint.save_params(tmp_path / "sel", state)
  restored = checkpoint.load_params(tmp_path / "sel", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                                  state))
  ref_plans, ref_state = _run(sel, state, p, 3, jax.random.key(6))
  for other in (copied, restored):
    plans, st = _run(sel, other, p, 3, jax.random.key(6))
    for x, y in zip(ref_plans, plans):
      np.testing.assert_array_equal(x.indices, y.indices)
      np.testing.assert_array_equal(x.budget, y.budget)
    for x, y in zip(jax.tree.leaves(ref_state), jax.tree.leaves(st)):
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["vade", "hive", "pilot_commit", "pvpo"])
def test_degenerate_prompts_are_chosen_less_and_less(name):
  """Prompts with p = 0 or 1 (two thirds of the data) get a shrinking share of the rollouts."""
  sel = control.build(name, num_prompts=K, num_samples=N)
  p = _p_mixture()
  state = sel.init()
  if name == "pvpo":   # the reference policy is the (fixed) policy here
    state = sel.init(ref_accuracy=p)
  plans, _ = _run(sel, state, p, 40, jax.random.key(8))

  def degenerate_share(ps):
    spent = sum(float(jnp.sum(pl.budget)) for pl in ps)
    bad = sum(float(jnp.sum(jnp.where((p[pl.indices] == 0) | (p[pl.indices] == 1), pl.budget, 0))) for pl in ps)
    return bad / spent

  early, late = degenerate_share(plans[:4]), degenerate_share(plans[-10:])
  assert late < early or early == 0.0
  # Uniform spends 2/3 there. Pilot-Commit keeps piloting unsolved prompts (2 samples each
  # sweep: too-hard prompts return to the candidate sweep), so its share stays higher.
  assert late < (0.4 if name == "pilot_commit" else 0.25), (early, late)


def test_vade_posterior_counts_equal_observed_successes_and_failures():
  sel = control.vade(K, num_samples=N, fast_decay=1.0, slow_decay=1.0, prior_alpha=1.0, prior_beta=2.0)
  p = _p_mixture()
  state = sel.init()
  succ, fail = np.zeros(K), np.zeros(K)
  for t in range(12):
    plan, state = sel.select(state, jax.random.key(t), B)
    r, m = _bandit_rewards(jax.random.key(100 + t), p, plan)
    m = m & (jax.random.uniform(jax.random.key(200 + t), m.shape) < 0.8)   # some samples masked out
    state = sel.update(state, plan, r, m)
    for b in range(B):
      i = int(plan.indices[b])
      succ[i] += float(jnp.sum(r[b] * m[b]))
      fail[i] += float(jnp.sum((1 - r[b]) * m[b]))
  np.testing.assert_allclose(np.asarray(state.alpha) - 1.0, succ, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.beta) - 2.0, fail, atol=1e-5)


def test_vade_two_scale_decay_moves_evidence_toward_the_prior():
  sel = control.vade(4, num_samples=2, fast_decay=0.5, slow_decay=0.9)
  state = sel.init().replace(alpha=jnp.array([11., 11., 1., 1.]), beta=jnp.array([1., 1., 5., 1.]))
  plan = base.Plan(jnp.array([0]), jnp.array([2]))
  state = sel.update(state, plan, jnp.array([[1., 1.]]), None)
  # observed prompt: (10 * 0.5 * 0.9) + 2 successes; the others only the slow decay
  np.testing.assert_allclose(state.alpha, [1 + 4.5 + 2, 1 + 9.0, 1, 1], rtol=1e-6)
  np.testing.assert_allclose(state.beta, [1, 1, 1 + 3.6, 1], rtol=1e-6)


def test_vade_prefers_prompts_near_one_half():
  sel = control.vade(3, num_samples=8)
  state = sel.init().replace(alpha=jnp.array([1., 50., 200.]), beta=jnp.array([200., 50., 1.]))
  picks = [int(sel.select(state, jax.random.key(t), 1)[0].indices[0]) for t in range(20)]
  assert picks == [1] * 20


def test_hive_prunes_low_entropy_prompts_from_the_learning_edge_pool():
  sel = control.hive(6, num_samples=4, pool_factor=2.0, explore=0.0)
  # Prompts 0-3 at the learning edge (m = 1/2), 4-5 solved; entropies 0.9, 0.1, 0.8, 0.2.
  st = sel.init().replace(succ=jnp.array([4., 4., 4., 4., 9., 9.]), n=jnp.array([8., 8., 8., 8., 9., 9.]),
                          entropy=jnp.array([0.9, 0.1, 0.8, 0.2, 1.0, 1.0]), has_entropy=jnp.ones(6, bool))
  for t in range(5):
    plan, _ = sel.select(st, jax.random.key(t), 2)
    assert sorted(plan.indices.tolist()) == [0, 2]   # the pool is 0-3; the two confident ones are pruned
  # Without entropy it falls back to the history score (still never the solved prompts).
  plan, _ = sel.select(st.replace(has_entropy=jnp.zeros(6, bool)), jax.random.key(0), 2)
  assert set(plan.indices.tolist()) <= {0, 1, 2, 3}


def test_hive_fresh_entropy_ranks_the_pool_by_the_current_policy_not_stale_records():
  sel = control.hive(8, num_samples=2, pool_factor=2.0, fresh_entropy=True, entropy_tokens=5)
  state = sel.init()
  # Stale records say prompts 0-3 are the uncertain ones; the fresh signal says 4-7.
  plan0 = control.Plan(indices=jnp.arange(8, dtype=jnp.int32), budget=jnp.full((8,), 2, jnp.int32))
  state = sel.update(state, plan0, jnp.zeros((8, 2)), jnp.ones((8, 2), bool),
                     entropy_BxN=jnp.repeat(jnp.array([1., 1., 1., 1., 0., 0., 0., 0.])[:, None], 2, 1))
  asked = []

  def fresh(idx, tokens):
    asked.append((sorted(np.asarray(idx).tolist()), tokens))
    return (np.asarray(idx) >= 4).astype(np.float32)

  plan, _ = sel.select(state, jax.random.key(0), 4, prompt_entropy_fn=fresh)
  assert asked == [(list(range(8)), 5)]                  # one call on the whole pool (2B = 8)
  assert sorted(plan.indices.tolist()) == [4, 5, 6, 7]
  stale, _ = sel.select(state, jax.random.key(0), 4)     # no function given: the records
  assert sorted(stale.indices.tolist()) == [0, 1, 2, 3]
  plain = control.hive(8, num_samples=2, pool_factor=2.0)  # fresh_entropy off: the function is not called
  asked.clear()
  plain.select(state, jax.random.key(0), 4, prompt_entropy_fn=fresh)
  assert asked == []
  with pytest.raises(ValueError, match="entropy_tokens"):
    control.hive(8, num_samples=2, entropy_tokens=0)


def test_hive_history_counts_and_entropy_record():
  sel = control.hive(5, num_samples=3, history_decay=1.0)
  plan = base.Plan(jnp.array([3, 1]), jnp.array([3, 2]))
  r = jnp.array([[1., 0., 1.], [0., 0., 1.]])   # row 1's third sample is past its budget
  ent = jnp.array([[0.3, 0.6, 0.9], [0.2, 0.4, 100.]])
  st = sel.update(sel.init(), plan, r, None, entropy_BxN=ent)
  np.testing.assert_allclose(st.succ, [0, 0, 0, 2, 0])
  np.testing.assert_allclose(st.n, [0, 2, 0, 3, 0])
  np.testing.assert_allclose(st.entropy, [0, 0.3, 0, 0.6, 0], rtol=1e-6)
  assert st.has_entropy.tolist() == [False, True, False, True, False]


def test_pilot_commit_in_the_same_step_commits_the_mixed_pilots_into_their_groups():
  sel = control.pilot_commit(16, num_samples=8, pilot_fraction=0.5)
  plan, state = sel.select(sel.init(), jax.random.key(0), 4)
  assert plan.budget.tolist() == [2, 2, 2, 2]
  r = jnp.array([[1, 1], [0, 1], [0, 0], [1, 0]], jnp.float32)
  refined, state = sel.refine(state, plan, jnp.pad(r, ((0, 0), (0, 6))), plan.sample_mask(8))
  np.testing.assert_array_equal(refined.indices, plan.indices)      # the same groups, grown
  assert refined.budget.tolist() == [2, 8, 2, 8]                     # both mixed pilots (2 slots)
  state = sel.update(state, refined, jnp.ones((4, 8)).at[:, 0].set(0.0), refined.sample_mask(8))
  assert state.obs_pilot[plan.indices].tolist() == [True, False, True, False]   # committed: consumed
  plan2, _ = sel.select(state, jax.random.key(1), 4)
  assert plan2.budget.tolist() == [2, 2, 2, 2]                       # no cross-step commits


def test_pilot_commit_phases_and_kept_pilot_statistics():
  sel = control.pilot_commit(16, num_samples=8, pilot_fraction=0.5, same_step=False)
  state = sel.init()
  plan, state = sel.select(state, jax.random.key(0), 4)
  assert plan.budget.tolist() == [2, 2, 2, 2]
  # Pilot outcomes: prompt rows 0, 1 mixed, row 2 solved, row 3 unsolved.
  r = jnp.array([[1, 0] + [1] * 6, [0, 1] + [1] * 6, [1, 1] + [0] * 6, [0, 0] + [1] * 6], jnp.float32)
  state = sel.update(state, plan, r, plan.sample_mask(8))
  idx = plan.indices
  np.testing.assert_allclose(state.obs_succ[idx], [1, 1, 2, 0])   # only the pilot's 2 samples count
  np.testing.assert_allclose(state.obs_n[idx], [2, 2, 2, 2])
  assert state.obs_pilot[idx].tolist() == [True] * 4
  plan2, state = sel.select(state, jax.random.key(1), 4)
  commits = plan2.indices[plan2.budget == 8].tolist()
  assert sorted(commits) == sorted(idx[:2].tolist())                  # both mixed pilots, nothing else
  assert plan2.budget.tolist() == [8, 8, 2, 2]
  assert not set(plan2.indices[2:].tolist()) & set(idx.tolist())     # pilots go to unseen prompts
  # A commit consumes the pilot: those prompts are not committed again without a new pilot.
  r2 = jnp.ones((4, 8)).at[:, 0].set(0.0)
  state = sel.update(state, plan2, r2, plan2.sample_mask(8))
  assert not bool(jnp.any(state.obs_pilot[jnp.array(commits)]))


def test_pilot_commit_evicts_always_solved_prompts():
  sel = control.pilot_commit(8, num_samples=8, exclude_after=4)
  state = sel.init()
  for t in range(12):
    plan, state = sel.select(state, jax.random.key(t), 2)
    state = sel.update(state, plan, jnp.ones((2, 8)), plan.sample_mask(8))
  assert bool(jnp.all(state.evicted))   # every prompt was solved 4 samples in a row


@pytest.mark.parametrize("frac,min_s", [(0.5, 2), (0.75, 3), (1.0, 2), (0.25, 2)])
def test_xrpo_allocation_sums_to_the_budget_and_follows_uncertainty(frac, min_s):
  sel = control.xrpo_allocation(K, num_samples=N, budget_fraction=frac, min_samples=min_s)
  plans, _ = _run(sel, sel.init(), _p_mixture(), 6, jax.random.key(9))
  total = max(round(frac * B * N), B * min_s)
  for plan in plans:
    assert int(jnp.sum(plan.budget)) == total
    assert int(plan.budget.min()) >= min_s and int(plan.budget.max()) <= N
  tq = jnp.asarray(control.xrpo.t_quantiles(N, 0.95), jnp.float32)
  s = jnp.array([0.5, 0.0, 0.3, 0.45, 0.1, 0.2])
  n = control.xrpo.allocate(s, 30, 2, N, tq)
  assert int(n.sum()) == 30
  order = np.argsort(-np.asarray(s))
  assert np.all(np.diff(np.asarray(n)[order]) <= 0)   # larger std -> at least as many rollouts
  assert int(n[1]) == 2                                # a prompt with s = 0 gets the minimum


def test_xrpo_in_two_phases_decodes_the_minimum_then_the_rest_by_the_first_phase_s_spread():
  sel = control.xrpo_allocation(K, num_samples=N, budget_fraction=0.5, prior_count=0.1, explore=0.0)
  plan, state = sel.select(sel.init(), jax.random.key(0), B)
  assert plan.budget.tolist() == [2] * B
  r = jnp.zeros((B, N)).at[:3, 0].set(1.0)       # three mixed pilot groups, three all-wrong
  refined, _ = sel.refine(state, plan, r, plan.sample_mask(N))
  np.testing.assert_array_equal(refined.indices, plan.indices)
  assert int(refined.budget.sum()) == B * N // 2 and np.all(refined.budget >= plan.budget)
  assert refined.budget[:3].min() > refined.budget[3:].max()
  with pytest.raises(ValueError, match="phases"):
    control.xrpo_allocation(K, num_samples=N, phases=3)


def test_xrpo_budget_one_is_uniform():
  a = control.xrpo_allocation(K, num_samples=N, budget_fraction=1.0, seed=3, phases=1)
  u = control.uniform(K, num_samples=N, seed=3)
  sa, su = a.init(), u.init()
  for t in range(6):
    pa, sa = a.select(sa, jax.random.key(t), B)
    pu, su = u.select(su, jax.random.key(t), B)
    np.testing.assert_array_equal(pa.indices, pu.indices)
    np.testing.assert_array_equal(pa.budget, pu.budget)


def test_pvpo_reference_rollouts_fill_the_accuracy_and_drop_degenerate_prompts():
  sel = control.pvpo_presample(6, num_samples=4)
  state = sel.init()
  plan = base.Plan(jnp.array([0, 1, 2]), jnp.full((3,), 4, jnp.int32))
  ref = jnp.array([[1., 1., 1.], [0., 0., 0.], [1., 0., 0.]])
  state = sel.update(state, plan, jnp.zeros((3, 4)), None, ref_rewards_BxM=ref)
  np.testing.assert_allclose(state.ref_acc[:3], [1.0, 0.0, 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(state.ref_count, [3, 3, 3, 0, 0, 0])
  seen = []
  for t in range(4):       # four eligible prompts (2-5), two per step: each once per sweep
    p, state = sel.select(state, jax.random.key(t), 2)
    seen.append(sorted(p.indices.tolist()))
  assert sorted(seen[0] + seen[1]) == [2, 3, 4, 5] and sorted(seen[2] + seen[3]) == [2, 3, 4, 5]
  # on-policy rewards never change the reference accuracy
  st2 = sel.update(state, plan, jnp.ones((3, 4)), None)
  np.testing.assert_array_equal(st2.ref_acc, state.ref_acc)


def test_registry_settings_and_errors():
  for name in NAMES:
    assert name in control.names()
  sel = control.build("vade", num_prompts=K, num_samples=N, fast_decay=0.9)
  assert isinstance(sel, base.PromptSelector)
  with pytest.raises(ValueError, match="control.kwargs"):
    control.check_kwargs("hive", {"beta_decay": 0.9})
  with pytest.raises(ValueError):
    control.pilot_commit(K, num_samples=4, pilot_samples=4)
  assert functools.reduce(lambda a, b: a and b, [callable(control.get(n)) for n in NAMES])
