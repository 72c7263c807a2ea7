"""On-policy distillation (OPD), ESR and ADWIN through the pipeline, with a stand-in teacher."""

import dataclasses

import jax
import numpy as np
import pytest

from rollouts_jax import models
from rollouts_jax.training import config as config_lib, rl_step

from tests.pipeline.test_stages import _exp, _pipeline


def _distill_pipeline(monkeypatch, **rollout):
  """A pipeline whose teacher is a random policy of the student's size (in place of the SFT warm start)."""
  from rollouts_jax.training import build
  cfg = _pipeline(_exp())[0].cfg
  monkeypatch.setattr(build, "warm_start", lambda e, ex: (cfg, models.init_params(cfg, jax.random.key(11)), None, None))
  exp = _exp(rollout={"num_samples": 4, "max_new_tokens": 16, "teacher_sft_steps": 5, **rollout})
  return _pipeline(exp)


def _teacher_minus_student(batch, teacher_cfg, teacher_params, student_cfg, student_params):
  """log p_teacher - log p_student of every completion token, [B, N, T], recomputed independently."""
  lp = lambda cfg, params: np.asarray(rl_step.batch_logprobs(
      params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, cfg=cfg))
  return lp(teacher_cfg, teacher_params) - lp(student_cfg, student_params)


def test_opd_token_advantages_are_teacher_minus_student_logprobs(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd")
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  m = np.asarray(batch.completion_mask)
  adv = np.asarray(batch.token_advantages)
  np.testing.assert_allclose(adv[m], _teacher_minus_student(batch, p.cfg, p.teacher_params, p.cfg, params)[m],
                             atol=2e-4)
  assert (adv[~m] == 0).all()
  assert info["distill/reverse_kl"] == pytest.approx(-adv[m].mean(), rel=1e-4)


def test_esr_generates_only_the_window(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd", generator="esr", generator_kwargs="window=4")
  state = p.init_state()
  batch, state, info = p.collect(state, params, 0, jax.random.key(0))
  assert batch.completion_ids.shape[-1] <= 8 and int(np.asarray(batch.lengths).max()) <= 4
  assert info["generated_tokens"] <= 4 * 4 * 4 and info["distill/window"] == 4
  m = np.asarray(batch.completion_mask)   # the teacher's signal on the window's tokens
  np.testing.assert_allclose(np.asarray(batch.token_advantages)[m],
                             _teacher_minus_student(batch, p.cfg, p.teacher_params, p.cfg, params)[m], atol=2e-4)


def test_adwin_adapts_the_window_from_full_probes(monkeypatch):
  p, params = _distill_pipeline(monkeypatch, distill="opd", generator="adwin",
                                generator_kwargs="window=8,every=1,tau=1.0")
  state = p.init_state()
  _, state, info = p.collect(state, params, 0, jax.random.key(0))
  # tau = 1: a prefix is never perfectly aligned with the full rollout, so the window grows.
  assert int(state.generator) == 12 and info["distill/probe_tokens"] > 0
  assert info["generated_tokens"] > info["distill/probe_tokens"]
  p, _ = _distill_pipeline(monkeypatch, distill="opd", generator="adwin", generator_kwargs="window=8,every=1,tau=-1.0")
  # tau = -1: always aligned enough, so it shrinks, never below 4.
  for step in range(6):
    _, state, info = p.collect(state, params, step, jax.random.key(step))
  assert int(state.generator) == 4 and info["distill/window"] == 4


def test_a_teacher_of_another_size_from_a_local_checkpoint(tmp_path):
  """`rollout.teacher_path`: a larger teacher (same vocabulary) is loaded and scores the student's
  tokens with its own config; a teacher of another vocabulary is refused, naming the key."""
  from tests.pipeline.test_stages import TOK
  student = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, eos_token_ids=(TOK.eos_id,), pad_token_id=TOK.pad_id)
  big = dataclasses.replace(student, hidden_size=32, intermediate_size=64, num_layers=2)
  models.save_hf_checkpoint(tmp_path / "teacher", big, models.init_params(big, jax.random.key(5)))
  p, params = _pipeline(_exp(rollout={"num_samples": 4, "max_new_tokens": 16, "distill": "opd",
                                      "teacher_path": str(tmp_path / "teacher")}))
  assert p.teacher_cfg.num_layers == 2 and p.teacher_cfg.hidden_size == 32
  batch, _, _ = p.collect(p.init_state(), params, 0, jax.random.key(0))
  m = np.asarray(batch.completion_mask)
  np.testing.assert_allclose(np.asarray(batch.token_advantages)[m],
                             _teacher_minus_student(batch, big, p.teacher_params, p.cfg, params)[m], atol=2e-4)
  other = dataclasses.replace(big, vocab_size=big.vocab_size + 3)
  models.save_hf_checkpoint(tmp_path / "other", other, models.init_params(other, jax.random.key(6)))
  with pytest.raises(ValueError, match="rollout.teacher_path.*vocabulary"):
    _pipeline(_exp(rollout={"max_new_tokens": 16, "distill": "opd", "teacher_path": str(tmp_path / "other")}))
  with pytest.raises(FileNotFoundError, match="rollout.teacher_path"):
    _exp(rollout={"max_new_tokens": 16, "distill": "opd", "teacher_path": str(tmp_path / "nothing")})


@pytest.mark.parametrize("rollout,match", [
    ({"distill": "kd"}, "rollout.distill"),
    ({"distill": "opd"}, "rollout.teacher_sft_steps"),
    ({"distill": "opd", "teacher_sft_steps": 5, "generator": "esr", "generator_kwargs": "window=0"},
     "rollout.generator_kwargs.*'esr'.*window"),
    ({"generator": "esr"}, "rollout.generator='esr'.*rollout.distill"),
    ({"distill": "opd", "teacher_sft_steps": 5, "generator": "adwin", "generator_kwargs": "window=4,gamma=1.5"},
     "rollout.generator_kwargs.*'adwin'.*gamma"),
    ({"distill": "opd", "teacher_sft_steps": 5, "generator": "spec_rl"}, "rollout.distill.*rollout.generator='spec_rl'"),
])
def test_distill_config_errors_name_the_key(rollout, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate(_exp(rollout=rollout))
