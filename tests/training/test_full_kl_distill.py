"""Full-vocabulary on-policy distillation: the loss, its gradient, the update, the pipeline, the config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax import losses, models
from rollouts_jax.sampling.batch import RolloutBatch, concat
from rollouts_jax.training import config as config_lib
from rollouts_jax.rollout import extras as rollout_extras
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig

CFG = models.ModelConfig(model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32,
                         num_layers=1, num_heads=2, num_kv_heads=1, tie_word_embeddings=True)


def _log_softmax(rng, shape, scale=2.0):
  return jax.nn.log_softmax(jnp.asarray(rng.normal(size=shape) * scale, jnp.float32), axis=-1)


# ------------------------------------------------------------------------------ the loss

def test_full_kl_equals_a_hand_computation():
  ps = np.array([[[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]])
  pt = np.array([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]])
  kl = losses.full_reverse_kl(jnp.log(ps), jnp.log(pt))
  hand0 = 0.7 * np.log(0.7 / 0.1) + 0.2 * np.log(0.2 / 0.6) + 0.1 * np.log(0.1 / 0.3)
  np.testing.assert_allclose(np.asarray(kl), [[hand0, 0.0]], atol=1e-6)
  # Aggregated like the policy loss: token-mean over the mask, seq-mean-token-sum per row.
  m = jnp.array([[True, True]])
  assert float(losses.full_reverse_kl(jnp.log(ps), jnp.log(pt), m, agg="token-mean")) == pytest.approx(hand0 / 2)
  assert float(losses.full_reverse_kl(jnp.log(ps), jnp.log(pt), m, agg="seq-mean-token-sum")) == pytest.approx(hand0)


def test_full_kl_is_zero_with_zero_gradient_when_student_is_teacher():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
  teacher = jax.nn.log_softmax(logits, -1)
  mask = jnp.asarray(rng.random((3, 5)) < 0.7)
  f = lambda z: losses.full_reverse_kl(jax.nn.log_softmax(z, -1), teacher, mask, agg="token-mean")
  assert abs(float(f(logits))) < 1e-6
  assert float(jnp.max(jnp.abs(jax.grad(f)(logits)))) < 1e-6
  # ... and positive elsewhere (Gibbs' inequality), per position.
  other = _log_softmax(rng, (3, 5, 7))
  assert bool(jnp.all(losses.full_reverse_kl(other, teacher) > 0))


def test_full_kl_gradient_matches_the_closed_form():
  """d/dz_v KL(softmax(z) || p_t) = p_s(v) (d_v - sum_u p_s(u) d_u), d = log p_s - log p_t."""
  rng = np.random.default_rng(1)
  z = jnp.asarray(rng.normal(size=(2, 4, 6)) * 1.5, jnp.float32)
  teacher = _log_softmax(rng, (2, 4, 6))
  g = jax.grad(lambda z: jnp.sum(losses.full_reverse_kl(jax.nn.log_softmax(z, -1), teacher)))(z)
  ls = np.asarray(jax.nn.log_softmax(z, -1), np.float64)
  p, d = np.exp(ls), ls - np.asarray(teacher, np.float64)
  closed = p * (d - (p * d).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(g), closed, atol=1e-5)
  # No gradient reaches the teacher.
  gt = jax.grad(lambda t: jnp.sum(losses.full_reverse_kl(jax.nn.log_softmax(z, -1), t)))(teacher)
  assert float(jnp.max(jnp.abs(gt))) == 0.0


def test_forward_kl_is_a_soft_cross_entropy_with_the_bounded_gradient():
  """KL(p_t || softmax(z)) = H(p_t, p_s) - H(p_t); its gradient in z is p_s - p_t."""
  rng = np.random.default_rng(5)
  z = jnp.asarray(rng.normal(size=(2, 3, 6)) * 2, jnp.float32)
  teacher = _log_softmax(rng, (2, 3, 6))
  ls = jax.nn.log_softmax(z, -1)
  pt = np.exp(np.asarray(teacher, np.float64))
  hand = (pt * (np.asarray(teacher, np.float64) - np.asarray(ls, np.float64))).sum(-1)
  np.testing.assert_allclose(np.asarray(losses.full_forward_kl(ls, teacher)), hand, atol=1e-5)
  g = jax.grad(lambda z: jnp.sum(losses.full_forward_kl(jax.nn.log_softmax(z, -1), teacher)))(z)
  np.testing.assert_allclose(np.asarray(g), np.exp(np.asarray(ls, np.float64)) - pt, atol=1e-5)
  assert float(jnp.max(jnp.abs(losses.full_forward_kl(teacher, teacher)))) < 1e-6


def test_masked_positions_carry_no_value_and_no_gradient():
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
  teacher = _log_softmax(rng, (2, 6, 5))
  window = jnp.arange(6)[None] < jnp.array([[3], [4]])   # an ESR window of 3 and 4 tokens
  f = lambda z: losses.full_reverse_kl(jax.nn.log_softmax(z, -1), teacher, window, agg="seq-mean-token-sum")
  g = np.asarray(jax.grad(f)(z))
  assert np.all(g[~np.asarray(window)] == 0) and np.any(g[np.asarray(window)] != 0)
  # Changing the student outside the window changes nothing.
  z2 = jnp.where(window[..., None], z, z + 5 * jnp.asarray(rng.normal(size=z.shape), jnp.float32))
  assert float(f(z)) == pytest.approx(float(f(z2)), abs=1e-6)
  kl = np.asarray(losses.full_reverse_kl(jax.nn.log_softmax(z, -1), teacher, window))
  assert np.all(kl[~np.asarray(window)] == 0)


def test_shape_errors_are_named():
  with pytest.raises(ValueError, match=r"\[S, T, V\]"):
    losses.full_reverse_kl(jnp.zeros((2, 3)), jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="mask"):
    losses.full_reverse_kl(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), jnp.ones((2, 4), bool))


# ------------------------------------------------------------------------------ the update

def _rollouts(B=2, N=3, P=4, T=5, seed=0):
  rng = np.random.default_rng(seed)
  pmask = np.arange(P)[None] >= (P - rng.integers(1, P + 1, size=B))[:, None]
  cmask = np.arange(T)[None, None] < rng.integers(1, T + 1, size=(B, N))[..., None]
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, 24, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, 24, (B, N, T)), jnp.int32), completion_mask=jnp.asarray(cmask),
      behaviour_logprobs=jnp.zeros((B, N, T)), policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(rng.integers(0, 2, (B, N)), jnp.float32), sample_mask=jnp.ones((B, N), bool),
      prompt_index=jnp.arange(B, dtype=jnp.int32))


def _teacher_logprobs(params, r, temperature=1.0):
  return rl.batch_logprobs(params, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, cfg=CFG,
                           temperature=temperature, vocab=True)


def test_vocab_logprobs_gather_to_the_sampled_tokens_logprobs():
  r = _rollouts()
  params = models.init_params(CFG, jax.random.key(3))
  full = _teacher_logprobs(params, r, temperature=0.7)
  tok = rl.batch_logprobs(params, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, cfg=CFG,
                          temperature=0.7)
  gathered = jnp.take_along_axis(full, r.completion_ids[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(gathered), np.asarray(tok), atol=1e-5)
  assert bool(jnp.all(jnp.where(r.completion_mask[..., None], True, full == 0)))


@pytest.mark.parametrize("agg,direction", [("token-mean", "reverse"), ("seq-mean-token-mean", "forward")])
def test_update_minimizes_the_full_kl_of_its_own_numerics(agg, direction):
  conf = RLConfig(steps=5, learning_rate=3e-3, warmup_steps=0, agg=agg, distill_kl=direction)
  r = _rollouts()
  student = models.init_params(CFG, jax.random.key(0))
  teacher = models.init_params(CFG, jax.random.key(1))
  r = r.replace(teacher_logprobs=_teacher_logprobs(teacher, r))
  own = _teacher_logprobs(student, r)
  mask = r.completion_mask.reshape(-1, r.completion_ids.shape[-1])
  V = CFG.vocab_size
  kl = losses.full_reverse_kl if direction == "reverse" else losses.full_forward_kl
  expect = kl(own.reshape(-1, mask.shape[1], V), r.teacher_logprobs.reshape(-1, mask.shape[1], V), mask, agg=agg)
  state = rl.init_train_state(student, rl.rl_optimizer(conf))
  kls = []
  for _ in range(4):
    state, m = rl.rl_step(state, r, None, cfg=CFG, rl=conf)
    kls.append(float(m["distill_kl"]))
  assert kls[0] == pytest.approx(float(expect), rel=1e-4)   # the loss is the closed form, before the step
  assert "pg_loss" not in m and kls[-1] < kls[0]             # no policy gradient; the KL falls


def test_update_does_not_move_a_student_equal_to_its_teacher():
  conf = RLConfig(steps=5, learning_rate=3e-3, warmup_steps=0)   # (the update compiled by the test above)
  r = _rollouts(seed=4)
  params = models.init_params(CFG, jax.random.key(0))
  r = r.replace(teacher_logprobs=_teacher_logprobs(params, r))
  state = rl.init_train_state(params, rl.rl_optimizer(conf))
  state, m = rl.rl_step(state, r, None, cfg=CFG, rl=conf)
  assert float(m["distill_kl"]) == pytest.approx(0.0, abs=1e-5) and float(m["grad_norm"]) < 1e-4
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(mu)) < 1e-5


def test_batch_trim_and_concat_keep_the_vocabulary_axis():
  b = RolloutBatch.empty(1, 2, 3, 6).replace(teacher_logprobs=np.ones((1, 2, 6, 5), np.float32))
  assert b.trim(4).teacher_logprobs.shape == (1, 2, 4, 5)
  c = concat([b, b.trim(4)])
  assert c.teacher_logprobs.shape == (2, 2, 6, 5) and np.all(c.teacher_logprobs[1, :, 4:] == 0)


# ------------------------------------------------------------------------------ the pipeline and the config

def _distill_pipeline(monkeypatch, **rollout):
  from tests.pipeline.test_distill import _distill_pipeline as pipeline
  return pipeline(monkeypatch, **rollout)


def test_pipeline_full_mode_carries_the_teachers_vocabulary_logprobs(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd_full")
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert batch.token_advantages is None and batch.teacher_logprobs.shape[:3] == batch.completion_ids.shape
  assert batch.teacher_logprobs.shape[-1] == p.cfg.vocab_size
  m = np.asarray(batch.completion_mask)
  t = np.asarray(batch.teacher_logprobs)
  np.testing.assert_allclose(np.exp(t[m]).sum(-1), 1.0, atol=1e-4)   # a distribution at every live position
  assert np.all(t[~m] == 0)
  tok = np.asarray(rl.batch_logprobs(p.teacher_params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                     batch.completion_mask, cfg=p.cfg))
  np.testing.assert_allclose(np.take_along_axis(t, np.asarray(batch.completion_ids)[..., None], -1)[..., 0][m], tok[m],
                             atol=2e-4)
  # The logged sampled estimate is the same as the single-sample form's.
  adv = tok - np.asarray(batch.behaviour_logprobs)
  assert info["distill/reverse_kl"] == pytest.approx(-adv[m].mean(), rel=1e-3, abs=1e-4)


def test_esr_full_keeps_the_window(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd_full", generator="esr", generator_kwargs="window=4")
  state = p.init_state()
  batch, state, info = p.collect(state, params, 0, jax.random.key(0))
  assert int(np.asarray(batch.lengths).max()) <= 4 and info["distill/window"] == 4
  assert np.all(np.asarray(batch.teacher_logprobs)[:, :, 4:] == 0)


def test_full_mode_refuses_a_vocabulary_too_large(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd_full")
  monkeypatch.setattr(rollout_extras, "FULL_KL_MAX_BYTES", 1000)
  with pytest.raises(ValueError, match=r"rollout.distill='opd_full'.*single-sample form \(rollout.distill='opd'\)"):
    p.collect(p.init_state(), params, 0, jax.random.key(0))


def test_full_mode_is_refused_before_the_teacher_is_built(monkeypatch):
  from rollouts_jax.training import build
  from tests.pipeline.test_stages import _exp, _pipeline
  built = []
  cfg = _pipeline(_exp())[0].cfg
  monkeypatch.setattr(build, "warm_start", lambda *a, **k: built.append(1) or (cfg, None, None, None))
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 16, "teacher_sft_steps": 5, "distill": "opd_full",
                      "generator": "esr", "generator_kwargs": "window=4"})
  monkeypatch.setattr(rollout_extras, "FULL_KL_MAX_BYTES", 1000)
  with pytest.raises(ValueError, match=r"rollout.distill='opd_full'.*single-sample form \(rollout.distill='opd'\)"):
    _pipeline(exp)
  assert not built
  monkeypatch.setattr(rollout_extras, "FULL_KL_MAX_BYTES", 2**30)
  _pipeline(exp)   # within the limit the teacher is built
  assert built == [1]


def test_config_names_the_key():
  from tests.pipeline.test_stages import _exp
  with pytest.raises(ValueError, match="rollout.distill must be one of"):
    _exp(rollout={"distill": "full", "teacher_sft_steps": 5})
  with pytest.raises(ValueError, match="rollout.teacher_sft_steps"):
    _exp(rollout={"distill": "opd_full"})
  with pytest.raises(ValueError, match="rollout.distill does not combine with replay.name"):
    _exp(rollout={"distill": "opd_full", "teacher_sft_steps": 5, "generator": "adwin", "generator_kwargs": "window=4"},
         replay={"name": "fifo"})
  with pytest.raises(ValueError, match="rl.distill_kl must be one of"):
    _exp(rollout={"distill": "opd_full", "teacher_sft_steps": 5}, rl={"distill_kl": "jsd"})
  with pytest.raises(ValueError, match=r"rl.distill_kl='forward' needs full-vocabulary distillation"):
    _exp(rollout={"distill": "opd", "teacher_sft_steps": 5}, rl={"distill_kl": "forward"})
  esr = _exp(rollout={"distill": "opd_full", "teacher_sft_steps": 5, "generator": "esr", "generator_kwargs": "window=4"})
  assert (esr.rollout.distill, esr.rollout.generator) == ("opd_full", "esr")
  fwd = _exp(rollout={"distill": "opd_full", "teacher_sft_steps": 5}, rl={"distill_kl": "forward"})
  assert fwd.rl.distill_kl == "forward"
  assert dataclasses.is_dataclass(config_lib.RolloutConfig) and config_lib.RolloutConfig().distill == ""
