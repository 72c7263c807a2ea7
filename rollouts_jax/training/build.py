"""From the experiment config to each stage, built once (DESIGN: the stage contracts).

Launchers and `loop.train` build the task's examples, the initial policy, the sampler's and
the evaluator's settings and the rollout pipeline here; nothing below these functions receives
the whole experiment config. `training.loop` re-exports them (`loop.build_pipeline`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax

from rollouts_jax import control, models, replay, rewards, sampling, tasks
from rollouts_jax.rollout import extras as rollout_extras
from rollouts_jax.rollout.pipeline import RolloutPipeline
from rollouts_jax.training.config import ExperimentConfig, deeplook_settings, env_settings, parse_kwargs
from rollouts_jax.training.evaluation import Evaluator, Prompter
from rollouts_jax.training.policy import load_policy as _load_policy, prompt_instruction, warm_start as _warm_start

log = logging.getLogger(__name__)

__all__ = ["load_task", "load_policy", "warm_start", "sampling_config", "prompter", "evaluator", "evaluate",
           "build_pipeline"]


def load_task(exp: ExperimentConfig) -> tuple[Sequence[dict], Sequence[dict]]:
  """(train, test) examples of the configured task."""
  train, test, from_test = tasks.get(exp.data.task).load(exp.data)
  if from_test:
    log.warning("%s has no train split: training prompts come from its test split (test-time RL).", exp.data.task)
  return train, test


def load_policy(exp: ExperimentConfig, train_examples, log_fn=None):
  """(cfg, params, tokenizer) of the configured initial policy."""
  return _load_policy(tasks.get(exp.data.task), train_examples, data=exp.data, tok=exp.tokenizer, m=exp.model,
                      sft=exp.sft, seed=exp.seed, log_fn=log_fn)


def warm_start(exp: ExperimentConfig, train_examples, log_fn=None):
  """(cfg, params, tokenizer, folder) of the SFT warm start, built unless cached."""
  return _warm_start(tasks.get(exp.data.task), train_examples, data=exp.data, tok=exp.tokenizer, m=exp.model,
                     sft=exp.sft, seed=exp.seed, log_fn=log_fn)


def sampling_config(exp: ExperimentConfig, tokenizer) -> sampling.SamplingConfig:
  ro = exp.rollout
  stop = tokenizer.end_of_turn_ids   # EOS and a chat model's end-of-turn ids
  return sampling.SamplingConfig(num_samples=ro.num_samples, max_new_tokens=ro.max_new_tokens,
                                 temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
                                 eos_id=stop[0] if len(stop) == 1 else stop, pad_id=tokenizer.pad_id,
                                 sample_chunk=ro.sample_chunk)


def prompter(exp: ExperimentConfig, tokenizer) -> Prompter:
  task = tasks.get(exp.data.task)
  return Prompter(task, tokenizer, exp.data.template, prompt_instruction(task, exp.tokenizer), exp.data.max_prompt_len)


def evaluator(exp: ExperimentConfig, cfg, tokenizer) -> Evaluator:
  conf = sampling_config(exp, tokenizer).replace(temperature=exp.eval.temperature)
  return Evaluator(cfg, prompter(exp, tokenizer), conf, k=exp.eval.k, batch_size=exp.eval.batch_size,
                   num_workers=exp.reward.num_workers, timeout_s=exp.reward.timeout_s,
                   selection=tuple(r.strip() for r in exp.eval.selection.split(",") if r.strip()),
                   **_deeplook(exp))


def _deeplook(exp: ExperimentConfig) -> dict:
  look, vote = deeplook_settings(exp.eval)
  return {} if look is None else {"deeplook": look, "deeplook_vote": vote}


def evaluate(exp: ExperimentConfig, cfg, params, tokenizer, examples, *, key=None, greedy: bool = True):
  """pass@1, pass@k (unbiased), maj@k and greedy accuracy on `examples`."""
  return evaluator(exp, cfg, tokenizer)(params, examples, jax.random.key(exp.seed + 1) if key is None else key,
                                        greedy=greedy)


def build_pipeline(exp: ExperimentConfig, cfg, tokenizer, train_examples) -> RolloutPipeline:
  """Each stage once, from its own config section."""
  task, rw, c, rp = tasks.get(exp.data.task), exp.reward, exp.control, exp.replay
  scorer = rewards.build_scorer(rw.name, task, timeout_s=rw.timeout_s, num_workers=rw.num_workers,
                                dare_alpha=rw.dare_alpha, dare_tau=rw.dare_tau)
  selector = control.build(c.name, num_prompts=len(train_examples), num_samples=exp.rollout.num_samples,
                           seed=exp.seed, **parse_kwargs(c.kwargs, "control.kwargs"))
  conf = sampling_config(exp, tokenizer)
  ro = exp.rollout
  if ro.distill.endswith("_full"):   # before any teacher is built (the teacher shares the student's vocabulary)
    rollout_extras.check_full_kl_bytes(ro.distill, c.prompts_per_step * ro.num_samples * ro.max_new_tokens,
                                     cfg.vocab_size)
  teacher_cfg = teacher_params = None
  if ro.external_samples or ro.distill:  # ERILS / distillation: a local checkpoint or a longer-trained warm start
    if ro.teacher_path:
      teacher_cfg, teacher_params = models.load_hf_checkpoint(ro.teacher_path, dtype=jax.numpy.dtype(exp.model.dtype))
      if teacher_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"rollout.teacher_path={ro.teacher_path!r}: the teacher's vocabulary "
                         f"({teacher_cfg.vocab_size}) is not the student's ({cfg.vocab_size}).")
    else:
      teacher = dataclasses.replace(exp, sft=dataclasses.replace(exp.sft, steps=ro.teacher_sft_steps))
      teacher_cfg, teacher_params, _, _ = warm_start(teacher, train_examples)
  pipe = RolloutPipeline(
      cfg=cfg, prompter=prompter(exp, tokenizer), examples=train_examples,
      sampling_config=conf, scorer=scorer, selector=selector, generator_name=ro.generator,
      generator_kwargs=parse_kwargs(ro.generator_kwargs, "rollout.generator_kwargs"),
      batch_size=c.prompts_per_step, dynamic_sampling=c.dynamic_sampling, max_refills=c.max_refills,
      max_staleness=rp.max_staleness, clusters=rw.clusters if exp.rl.advantage.startswith("uniqueness") else None,
      needs_seq_logprobs=exp.rl.advantage == "xrpo", ref_samples=rw.ref_samples, ref_refresh=rw.ref_refresh,
      presample=c.name == "pvpo", overlong_buffer=rw.overlong_buffer, max_failure_frac=rw.max_failure_frac,
      teacher_cfg=teacher_cfg, teacher_params=teacher_params, external_samples=ro.external_samples,
      distill=ro.distill, env=env_settings(ro), seed=exp.seed)
  factory = replay.get(rp.name)
  if factory is not None:
    pipe.buffer = factory(rp.capacity, pipe.buffer_example(), max_staleness=rp.max_staleness)
  return pipe
