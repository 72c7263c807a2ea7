"""Multi-device checks of rollouts_jax.sharding on 8 host CPU devices.

XLA_FLAGS must be set before JAX starts, so test_sharding.py runs this file in a
subprocess. To run it directly:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q tests/sharding/multidevice_suite.py
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rollouts_jax import models, sampling
from rollouts_jax import sharding as sh
from rollouts_jax.sampling import generate

pytestmark = pytest.mark.skipif(
    jax.device_count() != 8,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (run via test_sharding.py)")

CFG = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2)
B, L = 8, 12
# Every mesh runs the most demanding preset; on (8,1,1) and (1,1,1) it reduces to pure data parallel.
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 1)]
TOL = 1e-5
# Adam's first update is lr * g / (|g| + eps). With the default eps=1e-8 a gradient entry of ~1e-9
# turns fp32 reduction-order noise (~1e-7 relative, which differs between meshes) into update
# differences ~1e-5; eps=1e-6 keeps the step well conditioned, so 1e-5 tests the sharding, not that.
OPT = optax.adamw(1e-3, eps=1e-6)
GREEDY = sampling.SamplingConfig(num_samples=2, max_new_tokens=6, greedy=True, prompt_buckets=())


def mesh_of(shape):
  return sh.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])


def max_diff(a, b):
  """Largest absolute difference over matching leaves (compared on the host)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(la, lb))


def same_sharding(x, spec, mesh):
  return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


@functools.cache
def ref_params():
  return models.init_params(CFG, jax.random.key(0))


@functools.cache
def batch_np():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, (B, L)).astype(np.int32)
  pad = rng.integers(0, 4, B)  # left padding
  mask = np.arange(L)[None, :] >= pad[:, None]
  adv = rng.normal(size=B).astype(np.float32)
  return {"tokens": tokens, "mask": mask, "adv": adv}


def pg_loss(params, batch):
  """Policy-gradient style loss: -mean over real next tokens of adv * log p(token)."""
  logits = models.forward(CFG, params, batch["tokens"], batch["mask"])
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  tok_lp = jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1)[..., 0]
  m = (batch["mask"][:, 1:] & batch["mask"][:, :-1]).astype(jnp.float32)
  return -jnp.sum(batch["adv"][:, None] * tok_lp * m) / jnp.sum(m)


def rl_step(state, batch):
  loss, grads = jax.value_and_grad(pg_loss)(state["params"], batch)
  updates, opt_state = OPT.update(grads, state["opt_state"], state["params"])
  aux = {"loss": loss, "grad_norm": optax.global_norm(grads)}
  return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, aux


# ------------------------------------------------------------------ meshes and errors


def test_make_mesh_axes_and_fill():
  mesh = sh.make_mesh((2, 4, 1))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  assert dict(sh.make_mesh((1, -1, 2)).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("shape, needle", [((3, 1, 1), r"3 devices.*device count 8"),
                                           ((2, 2, 4), r"16 devices.*device count 8"),
                                           ((-1, 3, 1), r"\(3\) does not divide the device count 8")])
def test_mesh_shape_not_matching_devices_raises(shape, needle):
  with pytest.raises(ValueError, match=needle):
    sh.make_mesh(shape)


def test_mesh_shape_wrong_length_raises():
  with pytest.raises(ValueError, match="axis names"):
    sh.make_mesh((8, 1))


def test_indivisible_parameter_raises_naming_param_axis_and_sizes():
  cfg = CFG.replace(vocab_size=100)
  with pytest.raises(ValueError) as e:
    sh.param_shardings(cfg, sh.make_mesh((1, 1, 8)), sh.get_rules("fsdp_tp"))
  msg = str(e.value)
  for part in ("'embed'", "dimension 0", "'vocab'", "size 100", "mesh axis 'tensor'", "size 8"):
    assert part in msg, msg
  odd = CFG.replace(hidden_size=36, num_heads=2, num_kv_heads=2)
  with pytest.raises(ValueError, match=r"'embed': dimension 1 \('embed'\) has size 36.*'fsdp' of size 8"):
    sh.param_shardings(odd, sh.make_mesh((1, 8, 1)), sh.get_rules("fsdp"))
  with pytest.raises(ValueError, match=r"'embed'.*size 100.*'tensor' of size 8"):
    sh.shard_params(jax.tree.map(np.zeros, models.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)),
                    jax.tree.map(lambda s: NamedSharding(sh.make_mesh((1, 1, 8)), s),
                                 sh.param_specs(cfg, sh.get_rules("fsdp_tp"))))


def test_batch_not_divisible_raises():
  with pytest.raises(ValueError, match=r"global batch size 6.*\('data', 'fsdp'\) of size 8"):
    sh.shard_batch(np.zeros((6, 3)), sh.make_mesh((2, 4, 1)))


# ------------------------------------------------------------------ parameters are sharded as the preset says


@pytest.mark.parametrize("preset", ["pure_dp", "fsdp", "fsdp_tp"])
def test_params_sharded_as_preset(preset):
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules(preset)
  params = sh.shard_params(ref_params(), sh.param_shardings(CFG, mesh, rules))
  axes = models.param_axes(CFG)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_axes = jax.tree.structure(params).flatten_up_to(axes)
  for (path, x), names in zip(flat, flat_axes):
    spec = sh.logical_to_spec(names, rules)
    assert x.sharding.spec == spec, (path, x.sharding.spec, spec)
    # Each device really holds only its block: global shape / mesh-axis sizes.
    split = [int(np.prod([mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ())]))
             for e in tuple(spec) + (None,) * (x.ndim - len(spec))]
    expected = tuple(d // s for d, s in zip(x.shape, split))
    assert all(s.data.shape == expected for s in x.addressable_shards), (path, expected)
    assert len({str(s.index) for s in x.addressable_shards}) == int(np.prod(split))
  q = params["layers"]["q"]
  if preset == "pure_dp":
    assert q.addressable_shards[0].data.shape == q.shape
  elif preset == "fsdp":
    assert q.sharding.spec == P(None, "fsdp", None)
  else:
    assert q.sharding.spec == P(None, "fsdp", "tensor")
    assert params["embed"].sharding.spec == P("tensor", "fsdp")


@pytest.mark.slow
def test_sharded_init_matches_single_device_init():
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  params = sh.sharded_init(CFG, jax.random.key(0), mesh, rules)
  assert max_diff(params, ref_params()) < 1e-7
  shardings = sh.param_shardings(CFG, mesh, rules)
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, params, shardings))


def test_tree_shardings_like_train_state():
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, mesh, rules)
  state = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                    "opt_state": OPT.init(p)}, ref_params())
  s = sh.tree_shardings_like(state, ps, ref_params())
  assert s["params"]["layers"]["down"] == ps["layers"]["down"]
  assert s["opt_state"][0].mu["layers"]["q"] == ps["layers"]["q"]
  assert s["opt_state"][0].nu["embed"] == ps["embed"]
  assert s["opt_state"][0].count.spec == P() and s["step"].spec == P()


# ------------------------------------------------------------------ forward, sampler, RL step: mesh equivalence


@pytest.mark.parametrize("shape", MESHES)
def test_forward_matches_single_device(shape):
  mesh, rules = mesh_of(shape), sh.get_rules("fsdp_tp")
  b = batch_np()
  ref = models.forward(CFG, ref_params(), b["tokens"], b["mask"])
  params = sh.shard_params(ref_params(), sh.param_shardings(CFG, mesh, rules))
  tokens, mask = sh.shard_batch((b["tokens"], b["mask"]), mesh)
  out = models.forward(CFG, params, tokens, mask)
  assert max_diff(out, ref) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["pure_dp", "fsdp"])
def test_forward_other_presets_on_full_mesh(preset):
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules(preset)
  b = batch_np()
  params = sh.shard_params(ref_params(), sh.param_shardings(CFG, mesh, rules))
  out = models.forward(CFG, params, *sh.shard_batch((b["tokens"], b["mask"]), mesh))
  assert max_diff(out, models.forward(CFG, ref_params(), b["tokens"], b["mask"])) <= TOL


@functools.cache
def ref_samples():
  b = batch_np()
  return sampling.sample(CFG, ref_params(), b["tokens"], b["mask"], jax.random.key(3), GREEDY)


@pytest.mark.parametrize("shape", MESHES)
def test_greedy_sampler_matches_single_device(shape):
  mesh, rules = mesh_of(shape), sh.get_rules("fsdp_tp")
  b = batch_np()
  params = sh.shard_params(ref_params(), sh.param_shardings(CFG, mesh, rules))
  tokens, mask = sh.shard_batch((b["tokens"], b["mask"]), mesh)
  with sh.use_rules(mesh, rules):
    out = sampling.sample(CFG, params, tokens, mask, jax.random.key(3), GREEDY)
  ref = ref_samples()
  np.testing.assert_array_equal(np.asarray(out.completion_ids), np.asarray(ref.completion_ids))
  np.testing.assert_array_equal(np.asarray(out.completion_mask), np.asarray(ref.completion_mask))
  assert max_diff(out.policy_logprobs, ref.policy_logprobs) <= TOL


def test_kv_cache_constraint_hook():
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  ctx = sh.ShardingContext(mesh, rules)
  make = lambda b: sh.constrain_kv_cache(models.init_cache(CFG, b, 16), ctx)
  cache = jax.jit(make, static_argnums=0)(8)
  assert same_sharding(cache.k, P(None, ("data", "fsdp"), None, "tensor", None), mesh)
  assert same_sharding(cache.mask, P(("data", "fsdp"), None), mesh)
  # A hint never fails: 6 rows do not split 4 ways, so only the 'data' axis is kept.
  assert same_sharding(jax.jit(make, static_argnums=0)(6).k, P(None, "data", None, "tensor", None), mesh)
  # No rules active: identity, and the sampler's program carries no constraints.
  plain = models.init_cache(CFG, 2, 4)
  assert sh.constrain_kv_cache(plain) is plain
  b = batch_np()
  lower = lambda c: generate.sample_jit.lower(CFG, GREEDY, ref_params(), b["tokens"], b["mask"],
                                                  jax.random.key(0), c).as_text()
  # Constraints over the mesh (Shardy syntax, or a GSPMD custom call with a device tile).
  count = lambda text: len(re.findall(r"sharding_constraint[^\n]*<@mesh,|@Sharding[^\n]*devices=\[", text))
  assert count(lower(None)) == 0
  assert count(lower(ctx)) >= 8  # k, v, mask, next_pos at prefill and per chunk


@pytest.mark.parametrize("shape", MESHES)
def test_rl_step_matches_single_device_and_donates(shape):
  mesh, rules = mesh_of(shape), sh.get_rules("fsdp_tp")
  b = batch_np()
  ref_state = {"params": ref_params(), "opt_state": OPT.init(ref_params())}
  ref_new, ref_aux = jax.jit(rl_step)(ref_state, b)

  ps = sh.param_shardings(CFG, mesh, rules)
  params = sh.shard_params(ref_params(), ps)
  state = {"params": params, "opt_state": sh.init_sharded_opt_state(OPT, params, ps)}
  state_shardings = sh.tree_shardings_like(state, ps, params)
  step = sh.jit_sharded_step(rl_step, state_shardings, sh.data_sharding(mesh))
  old_leaf = state["params"]["layers"]["q"]
  new, aux = step(state, sh.shard_batch(b, mesh))

  assert abs(float(aux["loss"]) - float(ref_aux["loss"])) <= TOL
  assert abs(float(aux["grad_norm"]) - float(ref_aux["grad_norm"])) <= TOL * float(ref_aux["grad_norm"])
  assert max_diff(new, ref_new) <= TOL
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, new, state_shardings))
  assert old_leaf.is_deleted()  # the state was donated
  before = step._cache_size()
  new, _ = step(new, sh.shard_batch(b, mesh))
  assert step._cache_size() == before  # same shardings in and out: no recompile


@functools.cache
def library_rollouts():
  """A grouped rollout batch for training.rl_step: 8 prompts x 2 samples."""
  from rollouts_jax.training.rl_step import Rollouts
  rng = np.random.default_rng(3)
  Bp, N, P, T = 8, 2, 5, 4
  pmask = np.arange(P)[None] >= rng.integers(0, P, size=Bp)[:, None]
  return Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(1, 128, (Bp, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask), completion_ids=jnp.asarray(rng.integers(1, 128, (Bp, N, T)), jnp.int32),
      completion_mask=jnp.asarray(np.arange(T)[None, None] < rng.integers(1, T + 1, (Bp, N))[..., None]),
      behaviour_logprobs=jnp.zeros((Bp, N, T)), policy_version=jnp.zeros((Bp, N, T), jnp.int32),
      rewards=jnp.asarray(rng.integers(0, 2, (Bp, N)), jnp.float32),
      sample_mask=jnp.ones((Bp, N), bool), prompt_index=jnp.arange(Bp, dtype=jnp.int32))


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1)])
def test_library_rl_step_on_a_mesh_matches_single_device(shape):
  """The training loop's own jitted step (advantages, micro-batches, Adam) on sharded state."""
  from rollouts_jax.training import rl_step as rl
  from rollouts_jax.training.config import RLConfig
  conf = RLConfig(steps=3, learning_rate=1e-3, warmup_steps=0, micro_batch_size=8, adam_eps=1e-6)
  tx = rl.rl_optimizer(conf)
  ref_state, ref_m = rl.rl_step(rl.init_train_state(ref_params(), tx), library_rollouts(), None, cfg=CFG, rl=conf)
  mesh, rules = mesh_of(shape), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, mesh, rules)
  state = rl.init_train_state(ref_params(), tx)
  params = sh.shard_params(state.params, ps)
  opt_state = jax.tree.map(jax.device_put, state.opt_state, sh.tree_shardings_like(state.opt_state, ps, state.params))
  state = rl.TrainState(step=state.step, params=params, opt_state=opt_state)
  new, m = rl.rl_step(state, sh.shard_batch(library_rollouts(), mesh), None, cfg=CFG, rl=conf)
  assert abs(float(m["loss"]) - float(ref_m["loss"])) <= TOL
  assert max_diff(new.params, ref_state.params) <= TOL
  assert new.params["layers"]["q"].sharding.is_equivalent_to(ps["layers"]["q"], 3)


def lora_policy():
  """ref_params() with rank-4 adapters on every projection, B nonzero so the adapters matter."""
  from rollouts_jax.models import lora
  adapters = lora.init_adapters(CFG, jax.random.key(5), rank=4)
  keys = iter(jax.random.split(jax.random.key(6), len(adapters)))
  adapters = {n: dict(ab, b=0.05 * jax.random.normal(next(keys), ab["b"].shape)) for n, ab in adapters.items()}
  return lora.apply(ref_params(), adapters, alpha=8.0, rank=4)


def test_lora_policy_is_sharded_by_its_weights_rules_and_its_step_matches_single_device():
  """A LoRA policy on a mesh: W keeps its sharding, A is split like W's input side and B like its
  output side (rank replicated), Adam's moments of the adapters follow them; the loop's donated step
  trains the adapters alone and matches one device, and the sampler's merged weights land on W's sharding."""
  from rollouts_jax.models import lora
  from rollouts_jax.training import loop, rl_step as rl
  from rollouts_jax.training.config import RLConfig
  conf = RLConfig(steps=3, learning_rate=1e-3, warmup_steps=0, micro_batch_size=8, adam_eps=1e-6)
  init = rl.train_state_init(conf)
  ref_state, ref_m = rl.rl_step(init(lora_policy()), library_rollouts(), None, cfg=CFG, rl=conf)
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, mesh, rules)
  pol = sh.policy_shardings(ps, lora_policy())
  q, down = pol["layers"]["q"], pol["layers"]["down"]
  assert q.w == ps["layers"]["q"] and q.a.spec == P(None, "fsdp", None) and q.b.spec == P(None, None, "tensor")
  assert down.a.spec == P(None, "tensor", None) and down.b.spec == P(None, None, "fsdp")
  assert sh.policy_shardings(ps, ref_params()) is ps
  state, shardings = sh.init_sharded_state(init, sh.shard_params(lora_policy(), pol), pol)
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state.params, pol))
  moments = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]}
  for name, s in (("['q']['a']", q.a), ("['down']['b']", down.b)):
    hits = [x for k, x in moments.items() if k.endswith(name)]
    assert len(hits) >= 2 and all(x.sharding == s for x in hits), name   # Adam's mu and nu
  assert not any("embed" in k for k in moments)   # the base is not in the optimizer
  step = loop.make_train_step(dict(cfg=CFG, rl=conf), shardings, mesh)
  new, m = step(state, sh.shard_batch(library_rollouts(), mesh), None)
  assert abs(float(m["loss"]) - float(ref_m["loss"])) <= TOL
  assert max_diff(new.params, ref_state.params) <= TOL
  assert max_diff(lora.base_of(new.params), ref_params()) == 0.0
  assert max_diff(lora.adapters_of(new.params), lora.adapters_of(lora_policy())) > 1e-4   # the adapters moved
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, new, shardings))
  merged = jax.jit(lora.sampling_params)(new.params)
  assert merged["layers"]["q"].sharding.is_equivalent_to(ps["layers"]["q"], 3)
  assert max_diff(merged, lora.merged(ref_state.params)) <= TOL


@pytest.mark.slow   # ~45 s; the default suite keeps the LoRA step on a mesh above
def test_lora_loop_on_a_mesh_resumes_and_matches_one_device(tmp_path, monkeypatch):
  """configs/lora.py:smoke trained on devices 0-3 (fsdp) with rollouts on 4-7 (fsdp_tp), stopped after
  step 1 and resumed from its checkpoint, ends where the one-device run ends (float tolerance: the
  meshes sum in another order); its adapters are sharded like their weights."""
  import pathlib
  from rollouts_jax.models import lora
  from rollouts_jax.training import config as config_lib, loop
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  repo = pathlib.Path(__file__).resolve().parents[2]

  def exp_of(shape, rollout_shape=(), **over):
    cd = config_lib.load_config_file(repo / "configs" / "lora.py", "smoke")
    cd.rl.steps, cd.rl.learning_rate, cd.rl.warmup_steps, cd.rl.adam_eps = 2, 1e-2, 0, 1e-6
    cd.rl.entropy_coef = 0.01   # the smoke model's rewards are all 0: the bonus gives a gradient
    cd.mesh.shape, cd.mesh.rollout_shape, cd.mesh.rollout_preset = shape, rollout_shape, "fsdp_tp"
    for k, v in over.items():
      setattr(cd, k, v)
    return config_lib.from_config_dict(cd)

  one = loop.train(exp_of((1, 1, 1)), tmp_path / "one", progress=False)["params"]
  stopped = loop.train(exp_of((1, 4, 1), (2, 1, 2), stop_after_step=1), tmp_path / "mesh", progress=False)
  assert stopped["stopped_at"] == 1
  summary = loop.train(exp_of((1, 4, 1), (2, 1, 2)), tmp_path / "mesh", progress=False)
  assert summary["final_step"] == 2
  mesh_params = summary["params"]
  q = mesh_params["layers"]["q"]
  assert {d.id for d in q.a.sharding.device_set} == {0, 1, 2, 3}
  assert q.a.sharding.spec == P(None, "fsdp", None) and q.w.sharding.spec == P(None, "fsdp", None)
  assert max(float(np.max(np.abs(ab["b"]))) for ab in lora.adapters_of(one).values()) > 1e-4   # B starts at 0
  assert max_diff(lora.base_of(mesh_params), lora.base_of(one)) == 0.0
  assert max_diff(lora.adapters_of(mesh_params), lora.adapters_of(one)) <= TOL   # moved ~1e-2, differ ~4e-8


def test_ppo_critic_is_sharded_by_the_policy_rules_and_its_step_matches_single_device():
  """rl.advantage="gae": the loop's init path places the critic like the policy (leaves at the policy's
  paths get their shardings, the value head is replicated), and the donated sharded step (policy,
  critic, both Adam states) matches one device."""
  from rollouts_jax.training import loop, rl_step as rl
  from rollouts_jax.training.config import RLConfig
  conf = RLConfig(steps=3, advantage="gae", learning_rate=1e-3, critic_learning_rate=1e-3, warmup_steps=0,
                  ppo_epochs=2, micro_batch_size=8, adam_eps=1e-6)
  ref_state, ref_m = rl.rl_step(rl.train_state_init(conf)(ref_params()), library_rollouts(), None, cfg=CFG, rl=conf)
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, mesh, rules)
  state, shardings = sh.init_sharded_state(rl.train_state_init(conf), sh.shard_params(ref_params(), ps), ps)
  critic = state.critic.params
  for name in ("q", "down"):
    assert critic["layers"][name].sharding == ps["layers"][name]
  assert critic["embed"].sharding == ps["embed"] and critic["embed"].sharding.spec != P()
  assert critic["value_head"]["w"].sharding.spec == P() and state.critic.step.sharding.spec == P()
  mu_q = [x for path, x in jax.tree_util.tree_flatten_with_path(state.critic.opt_state)[0]
          if jax.tree_util.keystr(path).endswith("['layers']['q']")]
  assert len(mu_q) >= 2 and all(x.sharding == ps["layers"]["q"] for x in mu_q)
  step = loop.make_train_step(dict(cfg=CFG, rl=conf), shardings, mesh)
  new, m = step(state, sh.shard_batch(library_rollouts(), mesh), None)
  assert abs(float(m["vf_loss"]) - float(ref_m["vf_loss"])) <= TOL
  assert max_diff(new.critic, ref_state.critic) <= TOL and max_diff(new.params, ref_state.params) <= TOL
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, new, shardings))


def test_train_state_built_in_place_matches_and_survives_donation():
  """The loop's init path (eval_shape -> shardings -> jit(init, out_shardings)) gives the single-device
  state with every leaf on its sharding; the loop's donated step leaves the params it was built from
  intact, matches the single-device step and keeps the state's shardings (no recompile)."""
  import functools
  from rollouts_jax.training import loop, rl_step as rl
  from rollouts_jax.training.config import RLConfig
  conf = RLConfig(steps=3, learning_rate=1e-3, warmup_steps=0, adam_eps=1e-6)
  tx = rl.rl_optimizer(conf)
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, mesh, rules)
  params = sh.shard_params(ref_params(), ps)
  state, shardings = sh.init_sharded_state(functools.partial(rl.init_train_state, tx=tx), params, ps)
  ref = rl.init_train_state(ref_params(), tx)
  assert max_diff(state, ref) == 0.0
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state, shardings))
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state.params, ps))
  moments_q = [x for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
               if jax.tree_util.keystr(path).endswith("['layers']['q']")]
  assert len(moments_q) >= 2 and all(x.sharding == ps["layers"]["q"] for x in moments_q)  # Adam's mu and nu
  assert state.step.sharding.spec == P()
  batch = sh.shard_batch(library_rollouts(), mesh)
  step = loop.make_train_step(dict(cfg=CFG, rl=conf), shardings, mesh)
  new, _ = step(state, batch, None)
  assert state.params["layers"]["q"].is_deleted() and not params["layers"]["q"].is_deleted()
  assert max_diff(params, ref_params()) == 0.0
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, new, shardings))
  ref_new, _ = rl.rl_step(ref, library_rollouts(), None, cfg=CFG, rl=conf)
  assert max_diff(new, ref_new) <= TOL
  before = step._cache_size()
  step(new, batch, None)
  assert step._cache_size() == before


def test_training_loop_with_separate_rollout_mesh(tmp_path, monkeypatch):
  """The loop trains on devices 0-3 and samples on devices 4-7 after a hand-off."""
  import dataclasses
  import pathlib
  from rollouts_jax.training import config as config_lib, loop
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  repo = pathlib.Path(__file__).resolve().parents[2]
  cd = config_lib.load_config_file(repo / "configs" / "default.py", "smoke")
  cd.mesh.shape, cd.mesh.rollout_shape, cd.mesh.rollout_preset = (1, 4, 1), (2, 1, 2), "fsdp_tp"
  cd.rl.steps = 2
  exp = config_lib.from_config_dict(cd)
  train_examples, _ = loop.load_task(exp)
  cfg, params, _ = loop.load_policy(exp, train_examples)
  placement = loop.Placement(exp.mesh, cfg)
  trained = placement.params(params)
  handed = placement.rollout_params(trained)
  train_devices = {d.id for x in jax.tree.leaves(trained) for d in x.sharding.device_set}
  rollout_devices = {d.id for x in jax.tree.leaves(handed) for d in x.sharding.device_set}
  assert train_devices == {0, 1, 2, 3} and rollout_devices == {4, 5, 6, 7}
  assert max_diff(handed, params) == 0.0
  summary = loop.train(exp, tmp_path / "run", progress=False)
  final_devices = {d.id for x in jax.tree.leaves(summary["params"]) for d in x.sharding.device_set}
  assert final_devices == {0, 1, 2, 3} and summary["final_step"] == 2


# ------------------------------------------------------------------ checkpoints and roles


def test_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path):
  b = batch_np()
  # fsdp_tp on (8, 1, 1) replicates every parameter (its fsdp and tensor axes have size 1), and
  # reuses the step compiled by the (8, 1, 1) step test.
  src_mesh, src_rules = sh.make_mesh((8, 1, 1)), sh.get_rules("fsdp_tp")
  ps = sh.param_shardings(CFG, src_mesh, src_rules)
  params = sh.shard_params(ref_params(), ps)
  state = {"params": params, "opt_state": sh.init_sharded_opt_state(OPT, params, ps)}
  shardings = sh.tree_shardings_like(state, ps, params)
  state, _ = sh.jit_sharded_step(rl_step, shardings, sh.data_sharding(src_mesh))(state, sh.shard_batch(b, src_mesh))
  sh.save_sharded(tmp_path / "ckpt", state)

  for shape, preset in [((2, 2, 2), "fsdp_tp"), ((1, 1, 1), "fsdp")]:
    mesh, rules = mesh_of(shape), sh.get_rules(preset)
    dst_ps = sh.param_shardings(CFG, mesh, rules)
    target = sh.abstract_tree(jax.eval_shape(lambda s: s, state),
                              sh.tree_shardings_like(state, dst_ps, params))
    restored = sh.restore_sharded(tmp_path / "ckpt", target)
    assert max_diff(restored, state) == 0.0
    assert restored["params"]["layers"]["q"].sharding == dst_ps["layers"]["q"]
    assert restored["opt_state"][0].mu["embed"].sharding == dst_ps["embed"]
    assert int(restored["opt_state"][0].count) == 1


@pytest.mark.slow
def test_separate_rollout_and_train_meshes_handoff():
  roles = sh.RolloutTrainMeshes.create(sh.MeshConfig((1, 4, 1), "fsdp", (2, 1, 2), "fsdp_tp"))
  assert roles.separate
  train_ids = {d.id for d in roles.train_mesh.devices.flat}
  rollout_ids = {d.id for d in roles.rollout_mesh.devices.flat}
  assert train_ids == {0, 1, 2, 3} and rollout_ids == {4, 5, 6, 7}
  train_params = sh.shard_params(ref_params(), roles.train_shardings(CFG))
  rollout_params = roles.to_rollout(CFG, train_params)
  assert max_diff(rollout_params, ref_params()) == 0.0
  for x in jax.tree.leaves(rollout_params):
    assert {d.id for d in x.devices()} <= rollout_ids
  assert rollout_params["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor")
  b = batch_np()
  tokens, mask = sh.shard_batch((b["tokens"], b["mask"]), roles.rollout_mesh)
  with roles.rollout_context():
    out = sampling.sample(CFG, rollout_params, tokens, mask, jax.random.key(3), GREEDY)
  np.testing.assert_array_equal(np.asarray(out.completion_ids), np.asarray(ref_samples().completion_ids))
  half = sh.handoff(train_params, roles.rollout_shardings(CFG), dtype=jnp.bfloat16)
  assert half["embed"].dtype == jnp.bfloat16 and half["embed"].sharding == roles.rollout_shardings(CFG)["embed"]


def test_colocated_roles_and_bad_splits():
  roles = sh.RolloutTrainMeshes.create(sh.MeshConfig((2, 4, 1), "fsdp"))
  assert not roles.separate and roles.train_mesh is roles.rollout_mesh
  fill = sh.RolloutTrainMeshes.create(sh.MeshConfig((-1, 1, 1), "pure_dp", (1, 1, 2), "fsdp_tp"))
  assert fill.train_mesh.devices.size == 6 and fill.rollout_mesh.devices.size == 2
  with pytest.raises(ValueError, match=r"need 10 devices but 8 are available"):
    sh.RolloutTrainMeshes.create(sh.MeshConfig((2, 2, 2), "fsdp", (2, 1, 1)))


def test_to_global_gives_each_device_its_part_of_the_host_copy():
  """`placement.to_global` (a restored state, a received batch): each device holds its slice of the whole value."""
  from rollouts_jax.training import placement
  mesh = mesh_of((2, 4, 1))
  host = {"w": np.arange(8 * 8, dtype=np.float32).reshape(8, 8), "b": np.arange(4, dtype=np.int32)}
  specs = {"w": NamedSharding(mesh, P("data", "fsdp")), "b": NamedSharding(mesh, P())}
  got = placement.to_global(host, specs)
  assert not got["w"].is_fully_replicated and got["b"].is_fully_replicated
  for name, x in got.items():
    assert x.sharding == specs[name]
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), host[name][shard.index])
  one = placement.to_global(host, NamedSharding(mesh, P()))     # one sharding for every leaf
  assert all(x.is_fully_replicated for x in one.values())
  np.testing.assert_array_equal(np.asarray(one["w"]), host["w"])
