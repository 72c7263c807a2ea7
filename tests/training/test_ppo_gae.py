"""PPO with a value model and GAE (`rl.advantage="gae"`): the critic's init, the update from a validated
config, micro-batch equivalence, critic warmup, LoRA with a full critic, named config errors, and
bitwise resume of the critic (through the checkpointer and through the loop)."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models
from rollouts_jax.io.checkpoint import Checkpointer
from rollouts_jax.models import lora as lora_lib
from rollouts_jax.models import value as value_lib
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop
from rollouts_jax.training import placement as placement_lib
from rollouts_jax.training import rl_step as rl
from tests.training.test_new_algorithms import _model   # the smoke model over VOCAB tokens (the same B, N, P, T, VOCAB)

REPO = pathlib.Path(__file__).resolve().parents[2]
B, N, P, T, VOCAB = 4, 4, 5, 6, 24


def _exp(config="ppo_gae", **rl_settings):
  """A config's smoke variant with these `rl` settings, validated as a launcher would."""
  cd = config_lib.load_config_file(REPO / "configs" / f"{config}.py", "smoke")
  cd.control.prompts_per_step = B
  cd.rollout.num_samples = N
  cd.rl.steps = 4
  for key, value in rl_settings.items():
    if "." in key:
      section, key = key.split(".")
      setattr(getattr(cd, section), key, value)
    else:
      setattr(cd.rl, key, value)
  return config_lib.from_config_dict(cd)


def _rollouts(seed=0):
  """Random groups whose loss masks have holes (multi-turn observation tokens) and trailing padding."""
  rng = np.random.default_rng(seed)
  pmask = np.arange(P)[None] >= (P - rng.integers(1, P + 1, size=B))[:, None]
  lengths = rng.integers(1, T + 1, size=(B, N))
  cmask = (np.arange(T)[None, None] < lengths[..., None]) & (rng.random((B, N, T)) < 0.8)
  cmask[..., 0] = True
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, VOCAB, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, VOCAB, (B, N, T)), jnp.int32),
      completion_mask=jnp.asarray(cmask),
      behaviour_logprobs=jnp.zeros((B, N, T)), policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(rng.choice([0., 1., 0.5], (B, N)), jnp.float32),
      sample_mask=jnp.asarray(rng.random((B, N)) < 0.9), prompt_index=jnp.arange(B, dtype=jnp.int32))


def _params(exp, seed=0):
  return models.init_params(_model(exp), jax.random.key(seed))


def _step(exp, state, batch):
  new_state, metrics = rl.rl_step(state, batch, None, cfg=_model(exp), rl=exp.rl,
                                  temperature=exp.rollout.temperature, max_len=T)
  return new_state, {k: float(v) for k, v in metrics.items()}


def _copy(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


def _equal(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_critic_starts_from_the_policy_trunk_with_a_zero_head():
  exp = _exp()
  cfg, params = _model(exp), _params(exp)
  critic = value_lib.init_critic(params)
  assert set(critic) == {"embed", "layers", "final_norm", "value_head"}
  _equal({k: critic[k] for k in ("embed", "layers", "final_norm")},
         {k: params[k] for k in ("embed", "layers", "final_norm")})
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (3, 7)), jnp.int32)
  assert np.all(np.asarray(value_lib.critic_forward(cfg, critic, tokens)) == 0.0)
  # The same decoder: with token 5's (tied) embedding row as the head, V is the policy's logit of token 5.
  probe = dict(critic, value_head={"w": params["embed"][5], "b": jnp.zeros(())})
  np.testing.assert_allclose(np.asarray(value_lib.critic_forward(cfg, probe, tokens)),
                             np.asarray(models.forward(cfg, params, tokens))[..., 5], rtol=1e-5, atol=1e-5)
  # A LoRA policy's critic is full-parameter, from the merged trunk.
  policy = lora_lib.apply(params, lora_lib.init_adapters(cfg, jax.random.key(1), 4), 8.0, 4)
  from_lora = value_lib.init_critic(policy)
  assert not lora_lib.is_lora(from_lora)
  _equal(from_lora["layers"], lora_lib.merged(policy)["layers"])


def test_gae_update_from_the_config():
  exp = _exp(ppo_epochs=2, num_minibatches=2, warmup_steps=0, learning_rate=1e-2, critic_learning_rate=1e-2,
             advantage_kwargs="gamma=1.0,lam=1.0")
  assert exp.rl.advantage == "gae" and exp.rl.critic_cliprange_value == 0.5
  params = _params(exp)
  state = rl.train_state_init(exp.rl)(params)
  critic0 = _copy(state.critic.params)
  batch = _rollouts(0)
  new, m = _step(exp, state, batch)
  assert int(new.step) == 4 and int(new.critic.step) == 4 and m["nonfinite"] == 0.0
  assert np.isfinite(m["vf_loss"]) and m["vf_loss"] > 0 and m["critic_grad_norm"] > 0 and m["grad_norm"] > 0
  assert not np.array_equal(np.asarray(new.critic.params["value_head"]["w"]), np.asarray(critic0["value_head"]["w"]))
  assert not np.array_equal(np.asarray(new.params["layers"]["q"]), np.asarray(params["layers"]["q"]))
  # The old values are the fresh critic's (0), so with gamma = lam = 1 every loss token's return is its
  # sample's reward; the reward of a sample out of the loss is never seen.
  loss_mask = np.asarray(batch.completion_mask) & np.asarray(batch.sample_mask)[..., None]
  expected = np.sum(np.asarray(batch.rewards)[..., None] * loss_mask) / loss_mask.sum()
  assert m["values_mean"] == 0.0
  assert m["returns_mean"] == pytest.approx(float(expected), rel=1e-6)
  assert m["advantage_abs_mean"] > 0


def test_micro_batches_give_the_same_update():
  kw = dict(ppo_epochs=2, num_minibatches=2, warmup_steps=0, learning_rate=1e-2, critic_learning_rate=1e-2)
  whole, parts = _exp(**kw), _exp(micro_batch_size=2, **kw)
  params = _params(whole)
  a, ma = _step(whole, rl.train_state_init(whole.rl)(params), _rollouts(1))
  b, mb = _step(parts, rl.train_state_init(parts.rl)(params), _rollouts(1))
  for k in ("vf_loss", "vf_clipfrac", "loss", "critic_grad_norm"):
    assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-6), k
  max_diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
                 zip(jax.tree_util.tree_leaves((a.params, a.critic)), jax.tree_util.tree_leaves((b.params, b.critic))))
  assert max_diff < 1e-5


def test_critic_warmup_trains_only_the_critic_first():
  exp = _exp(critic_warmup=1, warmup_steps=0, learning_rate=1e-2)
  params = _params(exp)
  state = rl.train_state_init(exp.rl)(params)
  opt0 = _copy(state.opt_state)
  state, m1 = _step(exp, state, _rollouts(2))
  assert m1["policy_frozen"] == 1.0 and int(state.step) == 0 and int(state.critic.step) == 1
  _equal(state.params, params)
  _equal(state.opt_state, opt0)
  state, m2 = _step(exp, state, _rollouts(3))
  assert m2["policy_frozen"] == 0.0 and int(state.step) == 1 and int(state.critic.step) == 2
  assert not np.array_equal(np.asarray(state.params["layers"]["q"]), np.asarray(params["layers"]["q"]))


def test_lora_policy_with_a_full_parameter_critic():
  # Two updates: the zero head gives the trunk no gradient in the first.
  exp = _exp(**{"lora.rank": 4, "ppo_epochs": 2, "warmup_steps": 0, "learning_rate": 1e-2,
                "critic_learning_rate": 1e-2})
  cfg, base = _model(exp), _params(exp)
  policy = lora_lib.apply(base, lora_lib.init_adapters(cfg, jax.random.key(1), 4, exp.lora.targets), exp.lora.alpha, 4)
  state = rl.train_state_init(exp.rl)(policy)
  critic0 = _copy(state.critic.params)
  new, m = _step(exp, state, _rollouts(4))
  assert m["nonfinite"] == 0.0
  _equal(lora_lib.base_of(new.params), base)    # the frozen base
  assert not np.array_equal(np.asarray(lora_lib.adapters_of(new.params)["q"]["b"]), 0.0)
  assert not np.array_equal(np.asarray(new.critic.params["layers"]["q"]), np.asarray(critic0["layers"]["q"]))


def test_the_update_refuses_a_state_without_critic():
  exp = _exp()
  state = rl.init_train_state(_params(exp), rl.rl_optimizer(exp.rl))
  with pytest.raises(ValueError, match="needs a critic"):
    _step(exp, state, _rollouts(0))


@pytest.mark.slow   # the loop test below resumes the critic bitwise through the checkpoint too
def test_critic_checkpoint_resumes_bitwise(tmp_path):
  exp = _exp(ppo_epochs=2, warmup_steps=1, learning_rate=1e-2, critic_learning_rate=1e-2)
  batches = [_rollouts(s) for s in (5, 6, 7)]
  state, _ = _step(exp, rl.train_state_init(exp.rl)(_params(exp)), batches[0])
  with Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    ckpt.save(1, {"train": state}, {"rl_step": 1})
    restored, _, _ = ckpt.restore({"train": placement_lib.abstract(state)})
  resumed = restored["train"]
  assert isinstance(resumed.critic, rl.CriticState)
  _equal(resumed, state)
  straight = _copy(state)   # rl_step donates its state
  for batch in batches[1:]:
    straight, m_straight = _step(exp, straight, batch)
    resumed, m_resumed = _step(exp, resumed, batch)
    assert m_straight == m_resumed
  _equal(straight, resumed)


@pytest.mark.parametrize("overrides,key", [
    ({"rl.advantage_kwargs": "lam=1.5"}, "rl.advantage_kwargs"),
    ({"rl.advantage_kwargs": "beta=0.5"}, "rl.advantage_kwargs"),
    ({"rl.critic_learning_rate": 0.0}, "rl.critic_learning_rate"),
    ({"rl.critic_cliprange_value": 0.0}, "rl.critic_cliprange_value"),
    ({"rl.critic_loss_coef": -1.0}, "rl.critic_loss_coef"),
    ({"rl.critic_warmup": 4}, "rl.critic_warmup"),
    ({"rollout.generator": "tree"}, "rollout.generator"),
    ({"rollout.distill": "opd", "rollout.teacher_sft_steps": 2}, "rollout.distill"),
    ({"rollout.generator": "multiturn", "rollout.env": "calculator", "rollout.turn_credit": "turn"},
     "rollout.turn_credit"),
])
def test_impossible_combinations_are_named_before_anything_compiles(overrides, key):
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    _exp(**overrides)


@pytest.mark.parametrize("overrides", [
    {},
    {"rollout.generator": "spec_rl"},
    {"rollout.generator": "sol_rl", "rollout.generator_kwargs": "fmt=nvfp4"},
    {"rollout.generator": "arrol"},
    {"rollout.generator": "self_spec"},
    {"rollout.generator": "multiturn", "rollout.env": "calculator"},
    {"rollout.generator": "april"},
    {"replay.name": "fifo", "control.dynamic_sampling": True},
    {"lora.rank": 4},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "sample")
def test_token_level_generators_validate_with_gae(overrides):
  assert _exp(**overrides).rl.advantage == "gae"


def test_loop_trains_and_resumes_the_critic_bitwise(cache, tmp_path):
  cd = config_lib.load_config_file(REPO / "configs" / "ppo_gae.py", "smoke")
  cd.rl.steps = 3
  exp = config_lib.from_config_dict(cd)
  full = loop.train(exp, tmp_path / "full", progress=False)
  stopped = loop.train(dataclasses.replace(exp, stop_after_step=2), tmp_path / "killed", progress=False)
  assert stopped["stopped_at"] == 2
  resumed = loop.train(exp, tmp_path / "killed", progress=False)
  _equal(full["params"], resumed["params"])
  trees = []
  for name in ("full", "killed"):
    with Checkpointer(tmp_path / name / "checkpoints", save_every=1, keep=2) as ckpt:
      trees.append(ckpt.read()[0]["train"]["critic"])
  assert int(np.asarray(trees[0]["step"])) == 3
  _equal(trees[0], trees[1])
  from rollouts_jax.io.metrics import read_jsonl
  rows = [r for r in read_jsonl(tmp_path / "full" / "metrics.jsonl") if "vf_loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["vf_loss"]) for r in rows)
