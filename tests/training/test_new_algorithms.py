"""REINFORCE++ (and -baseline), OPO, GPG, GRPO pass@k, SAPO, Clip-Cov, KL-Cov and the adaptive KL
controller, reached by name from a validated config: one RL update each on the smoke model, named
config errors, and the adaptive coefficient checkpointed with the train state (bitwise resume)."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages, losses, models
from rollouts_jax.io.checkpoint import Checkpointer
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import placement as placement_lib
from rollouts_jax.training import rl_step as rl

REPO = pathlib.Path(__file__).resolve().parents[2]
B, N, P, T, VOCAB = 4, 4, 5, 6, 24


def _exp(**rl_settings):
  """The default config's smoke variant with these `rl` settings, validated as a launcher would."""
  cd = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
  cd.control.prompts_per_step = B
  cd.rollout.num_samples = N
  for key, value in rl_settings.items():
    setattr(cd.rl, key, value)
  return config_lib.from_config_dict(cd)


def _model(exp):
  """The smoke model's architecture (the config's model section) over a small vocabulary."""
  m = exp.model
  return models.ModelConfig(model_type=m.model_type, vocab_size=VOCAB, hidden_size=m.hidden_size,
                            intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
                            num_kv_heads=m.num_kv_heads, tie_word_embeddings=m.tie_word_embeddings)


def _rollouts(seed=0, rewards=None):
  rng = np.random.default_rng(seed)
  pmask = np.arange(P)[None] >= (P - rng.integers(1, P + 1, size=B))[:, None]
  lengths = rng.integers(1, T + 1, size=(B, N))
  if rewards is None:
    rewards = rng.choice([0., 1., 0.5, 1 / 3], (B, N))
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, VOCAB, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, VOCAB, (B, N, T)), jnp.int32),
      completion_mask=jnp.asarray(np.arange(T)[None, None] < lengths[..., None]),
      behaviour_logprobs=jnp.zeros((B, N, T)), policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(rewards, jnp.float32), sample_mask=jnp.asarray(rng.random((B, N)) < 0.9),
      prompt_index=jnp.arange(B, dtype=jnp.int32))


def _step(exp, state=None, batch=None, seed=0):
  cfg = _model(exp)
  params = models.init_params(cfg, jax.random.key(seed))
  ref = params if exp.rl.kl_coef > 0 else None
  if state is None:
    state = rl.init_train_state(params, rl.rl_optimizer(exp.rl))
  batch = _rollouts(seed) if batch is None else batch
  new_state, metrics = rl.rl_step(state, batch, ref, cfg=cfg, rl=exp.rl, temperature=exp.rollout.temperature,
                                  max_len=T)
  return new_state, {k: float(v) for k, v in metrics.items()}


NEW_NAMES = [
    {"advantage": "reinforce_pp"},
    {"advantage": "reinforce_pp_baseline"},
    {"advantage": "opo"},
    {"advantage": "gpg", "advantage_kwargs": "count=mixed_group"},
    {"advantage": "grpo_passk"},
    {"loss_kind": "sapo", "loss_kwargs": "tau_pos=1.0,tau_neg=2.0", "agg": "seq-mean-token-mean"},
    {"loss_kind": "clip_cov", "loss_kwargs": "clip_cov_ratio=0.05,clip_cov_lb=0.0,clip_cov_ub=100.0"},
    {"loss_kind": "kl_cov", "loss_kwargs": "kl_cov_ratio=0.1"},
    {"kl_coef": 0.05, "kl_ctrl": "adaptive", "kl_horizon": 100.0},
]


@pytest.mark.parametrize("settings", NEW_NAMES, ids=lambda s: "-".join(str(v) for v in s.values())[:40])
def test_each_new_name_runs_one_update_from_the_config(settings):
  # Two epochs: the second sees a moved policy, so the gates, covariance selections and KL terms act.
  exp = _exp(ppo_epochs=2, learning_rate=1e-2, warmup_steps=0, **settings)
  for key, value in settings.items():
    assert getattr(exp.rl, key) == value
  state, m = _step(exp)
  assert int(state.step) == 2 and m["nonfinite"] == 0.0
  assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
  if exp.rl.loss_kind in ("clip_cov", "kl_cov"):
    assert 0 < m["cov_frac"] < 1
  if exp.rl.kl_ctrl == "adaptive":
    assert m["kl_coef"] == pytest.approx(0.05) and m["kl"] > 0


@pytest.mark.parametrize("name", ["reinforce_pp", "opo"])
def test_the_update_passes_completion_lengths_to_the_recipe(name):
  exp = _exp(advantage=name)
  batch = _rollouts(seed=3)
  _, m = _step(exp, batch=batch)
  a, mask = advantages.apply(advantages.build(name), batch.rewards, mask=batch.sample_mask,
                             lengths=batch.completion_mask.sum(-1))
  expected = float(jnp.sum(jnp.abs(a) * mask) / jnp.sum(mask))
  assert m["advantage_abs_mean"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("key,value,extra", [
    ("rl.advantage", "reinforce", {}),
    ("rl.advantage_kwargs", "count=valid", {"advantage": "gpg"}),
    ("rl.advantage_kwargs", "single_sample=drop", {"advantage": "opo"}),
    ("rl.loss_kind", "dro", {}),
    ("rl.loss_kwargs", "tau=2.0", {"loss_kind": "sapo"}),
    ("rl.loss_kwargs", "tau_pos=1.0", {}),                       # ppo_clip takes no settings
    ("rl.loss_kwargs", "clip_cov_lb=6.0", {"loss_kind": "clip_cov"}),
    ("rl.kl_ctrl", "pid", {"kl_coef": 0.1}),
    ("rl.kl_ctrl", "adaptive", {"kl_coef": 0.0}),                # nothing to adapt
    ("rl.kl_horizon", 0.0, {"kl_coef": 0.1, "kl_ctrl": "adaptive"}),
    ("rl.kl_horizon", 2.0, {"kl_coef": 0.1, "kl_ctrl": "adaptive"}),   # 16 samples a step could flip its sign
    ("rl.kl_target", -0.1, {"kl_coef": 0.1, "kl_ctrl": "adaptive"}),
])
def test_bad_settings_are_named_before_anything_compiles(key, value, extra):
  name = key.split(".")[1]
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    _exp(**{name: value, **extra})


def test_adaptive_kl_coefficient_follows_the_controller_and_resumes_bitwise(tmp_path):
  exp = _exp(kl_coef=0.05, kl_ctrl="adaptive", kl_target=0.01, kl_horizon=40.0, learning_rate=3e-2,
             warmup_steps=0)
  # Without the controller the optimizer state has no extra entry (old checkpoints still load).
  fixed = rl.rl_optimizer(dataclasses.replace(exp.rl, kl_ctrl="fixed")).init({"w": jnp.zeros(2)})
  assert not any(isinstance(s, losses.KLControllerState) for s in fixed)
  batches = [_rollouts(seed=s) for s in (1, 2, 3)]
  state, m1 = _step(exp, batch=batches[0])
  ctrl = losses.adaptive_kl_controller(0.05, 0.01, 40.0)
  n_samples = float(jnp.sum(batches[0].sample_mask))
  expected = ctrl.update(ctrl.init(), m1["kl"], n_samples).kl_coef
  assert m1["kl_coef"] == pytest.approx(0.05)
  assert float(rl.kl_coef_of(state, exp.rl)) == pytest.approx(float(expected), rel=1e-6)
  # Checkpoint after step 1 as the loop does (the train state in a dict), restore, continue.
  with Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    ckpt.save(1, {"train": state}, {"rl_step": 1})
    restored, _, _ = ckpt.restore({"train": placement_lib.abstract(state)})
  resumed = restored["train"]
  assert float(rl.kl_coef_of(resumed, exp.rl)) == float(rl.kl_coef_of(state, exp.rl))
  copy = jax.tree_util.tree_map(jnp.copy, state)   # rl_step donates its state
  straight, resumed_run = copy, resumed
  for batch in batches[1:]:
    straight, m_straight = _step(exp, state=straight, batch=batch)
    resumed_run, m_resumed = _step(exp, state=resumed_run, batch=batch)
    assert m_straight == m_resumed
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(straight), jax.device_get(resumed_run))
  # The KL is above the target on this batch, so the coefficient grew.
  assert m_straight["kl"] > 0.01 and float(rl.kl_coef_of(straight, exp.rl)) > m_straight["kl_coef"]
