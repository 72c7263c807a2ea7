"""The RL loop: it builds each stage once from its config section and composes them.

    GENERATE (sampling) -> FILTER (rewards) -> CONTROL (selector, group filters) -> REPLAY -> update

Every random choice of step s derives from (seed, s), and the pipeline's state (the prompt
selector's statistics, the replay buffer, cached reference rewards) is checkpointed with the
train state, so a killed run resumed from its workdir continues to the same result as a run
that was never interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import time
from typing import Any

import jax

from rollouts_jax import rewards, sampling, sharding
from rollouts_jax.models import lora as lora_lib
from rollouts_jax.rollout import source as source_lib
from rollouts_jax.training.build import (  # noqa: F401  the launchers' entry points, re-exported
    build_pipeline, evaluate, evaluator, load_policy, load_task, prompter, sampling_config, warm_start)
from rollouts_jax.io.checkpoint import Checkpointer
from rollouts_jax.training.config import ExperimentConfig
from rollouts_jax.io.metrics import MetricsLogger, NullLogger
from rollouts_jax.io.plots import plot_curves
from rollouts_jax.training import placement as placement_lib
from rollouts_jax.training.placement import Placement
from rollouts_jax.training import workdir as workdir_lib
from rollouts_jax.training.rl_step import rl_step, train_state_init

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
  """Raised when too many consecutive updates were non-finite."""


def make_train_step(step_args: dict, state_shardings=None, mesh=None):
  """The donated update `(state, batch, ref_params) -> (state, metrics)`.

  On a mesh the state leaves with the shardings it was built with (`state_shardings`), so it
  never drifts between steps and the step compiles once; on one device it is `rl_step` itself.
  """
  if state_shardings is None:
    return functools.partial(rl_step, **step_args)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(functools.partial(rl_step, **step_args), out_shardings=(state_shardings, replicated),
                 donate_argnums=(0,))


def train(exp: ExperimentConfig, workdir: str | os.PathLike, *, progress: bool = True,
          allow_config_change: bool = False, threaded: bool = False) -> dict[str, Any]:
  """Runs (or resumes) an experiment in `workdir`; returns a summary dict.

  The summary holds the evaluation before and after RL and the final step. Writes
  `metrics.jsonl`, TensorBoard events under `tb/`, orbax checkpoints under `checkpoints/`,
  PNG learning curves under `plots/` and `summary.json` to the workdir. A workdir is tied to
  its config: a rerun whose settings change results raises before any work (naming the keys)
  unless `allow_config_change`.

  With `async_rl.max_staleness` > 0 a producer thread generates the batches while the trainer
  updates (`rollout.source`); `threaded=True` runs it also at 0, which is the
  synchronous loop computed by the threaded machinery (a check of both).
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  workdir_lib.check_workdir_config(workdir, dataclasses.asdict(exp), allow_change=allow_config_change,
                                   write=jax.process_index() == 0)
  lead = jax.process_index() == 0  # one process writes the logs, plots and summary of a multi-process run
  logger = MetricsLogger(workdir, total_steps=exp.rl.steps if progress else None, desc="rl") if lead else NullLogger()
  train_examples, test_examples = load_task(exp)
  with (MetricsLogger(workdir / "sft", total_steps=None, desc="sft") if lead else NullLogger()) as sft_logger:  # own steps
    cfg, params, tokenizer = load_policy(exp, train_examples, log_fn=sft_logger.log)
  placement = Placement(exp.mesh, cfg)
  params = placement.params(params)
  # The initial policy, for the KL penalty, PVPO's reference rollouts and CaT's anchor.
  anchor = any(t == "cat" for t, _ in rewards.parse_reward_spec(exp.reward.name))
  ref_params = params if exp.rl.kl_coef > 0 or exp.reward.ref_samples > 0 or anchor else None
  # With lora.rank > 0 the policy is base + adapters (the base above is the free KL reference).
  policy = with_adapters(exp, cfg, params)
  pipeline = build_pipeline(exp, cfg, tokenizer, train_examples)
  evaluate_fn = evaluator(exp, cfg, tokenizer)
  eval_key = jax.random.key(exp.seed + 1)
  # eval_shape -> shardings -> jit(init, out_shardings): each device writes only its shard of the state.
  train_state, state_shardings = sharding.init_sharded_state(train_state_init(exp.rl), policy,
                                                             placement.policy_shardings(policy))
  state = {"train": train_state, "pipeline": pipeline.init_state()}
  async_state = source_lib.init_state(exp.async_rl, train_state.params, threaded=threaded)
  if async_state is not None:   # the versions a restarted producer needs, the EWMA
    state["async"] = async_state
  mesh = placement.mesh if placement.active else None
  ckpt = Checkpointer(workdir / "checkpoints", save_every=exp.checkpoint.every, keep=exp.checkpoint.keep)
  eval_examples = list(test_examples[:exp.eval.num_examples])
  start, nonfinite_run, summary = 0, 0, {}
  if ckpt.latest_step() is not None:
    on_disk = state_on_disk(dict(state, pipeline=placement_lib.replicated(state["pipeline"], mesh)))
    restored, meta, _ = ckpt.restore_latest_intact(placement_lib.abstract(on_disk), quarantine=True)
    state = state_from_disk(restored, dict(state, pipeline=restored["pipeline"]))
    state["pipeline"] = placement_lib.local(state["pipeline"])
    start, nonfinite_run, summary = meta["rl_step"], meta["nonfinite_run"], meta["summary"]
    log.info("Resumed from step %d", start)
  logger.truncate_after(start if start else -1)  # rows past the resumed step; all before a first checkpoint
  if start == 0:
    summary["before"] = evaluate_fn(state["train"].params, eval_examples, eval_key)
    # PVPO's pre-sampling (control.name=pvpo): reference rollouts of every prompt before step 1.
    state["pipeline"], presampled = pipeline.presample_state(state["pipeline"], ref_params,
                                                             jax.random.fold_in(jax.random.key(exp.seed), 1 << 20))
    logger.log(0, {**summary["before"], **presampled})
  base_key = jax.random.key(exp.seed)
  step_args = dict(cfg=cfg, rl=exp.rl, temperature=exp.rollout.temperature, max_len=exp.rollout.max_new_tokens)
  train_step = make_train_step(step_args, state_shardings, mesh)
  # The pipeline works on host copies of every rollout. Across processes each process needs the whole
  # batch, so sampling runs without the rules' batch constraint there (its outputs stay replicated).
  rollout_context = placement.rollout_context if jax.process_count() == 1 else contextlib.nullcontext
  # Batches come in line, or from a producer thread with `async_rl.max_staleness` > 0.
  collect = lambda ps, p, s, v: pipeline.collect(ps, p, s, jax.random.fold_in(base_key, s), ref_params=ref_params,
                                                 version=v)
  score = source_lib.scorer(cfg, temperature=exp.rollout.temperature, micro_rows=exp.rl.micro_batch_size,
                            chunk=exp.rl.logprob_chunk, shared_prompt=exp.rl.shared_prompt)
  source = source_lib.BatchSource(exp.async_rl, collect, score, state.get("async"), state["train"].params,
                                  start=start, stop=exp.rl.steps, pipeline_state=state["pipeline"],
                                  handoff=placement.rollout_params, context=rollout_context, threaded=threaded,
                                  batch_rollouts=exp.control.prompts_per_step * exp.rollout.num_samples,
                                  producer_share=placement.producer_share)
  try:
    for step in range(start, exp.rl.steps):
      t0 = time.perf_counter()
      batch, pstate, info, version = source.next(step, state["pipeline"], state["train"].params)
      t1 = time.perf_counter()
      train_state, m = train_step(state["train"], placement.batch(batch), ref_params)
      source.updated(step, train_state.params)
      state = dict(state, train=train_state, pipeline=pstate)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      t2 = time.perf_counter()
      info.update(m, **{"time/update": t2 - t1, "time/step": t2 - t0})
      source.metrics(info, batch, step, version)
      info["tokens_per_s"] = info["generated_tokens"] / max(info["time/sample"], 1e-9)
      nonfinite_run = nonfinite_run + 1 if m["nonfinite"] > 0 else 0
      if m["nonfinite"] > 0:
        log.warning("Step %d: non-finite loss or gradient; update skipped (%d in a row).", step + 1, nonfinite_run)
      if exp.eval.every and (step + 1) % exp.eval.every == 0 and step + 1 < exp.rl.steps:
        info.update(evaluate_fn(state["train"].params, eval_examples, eval_key, greedy=False))
      logger.log(step + 1, info)
      done = step + 1 == exp.rl.steps
      if done:
        summary["after"] = evaluate_fn(state["train"].params, eval_examples, eval_key)
        logger.log(step + 1, summary["after"])
      stop = nonfinite_run >= exp.max_nonfinite_steps
      meta = {"rl_step": step + 1, "nonfinite_run": nonfinite_run, "summary": summary}
      if "async" in state:
        state["async"] = source.state(step)
      # Skipped updates leave the state finite.
      ckpt.save(step + 1, state_on_disk(dict(state, pipeline=placement_lib.replicated(state["pipeline"], mesh))),
                meta, force=done or stop)
      if stop:
        logger.close()
        ckpt.close()
        raise TrainingStopped(f"{nonfinite_run} consecutive non-finite updates (max_nonfinite_steps="
                              f"{exp.max_nonfinite_steps}); stopping at step {step + 1}.")
      if exp.stop_after_step >= 0 and step + 1 >= exp.stop_after_step and not done:
        logger.close()
        ckpt.close()
        return {"stopped_at": step + 1, "params": state["train"].params}
  finally:
    source.close()
  logger.close()
  ckpt.close()
  plots = plot_curves(workdir / "metrics.jsonl", workdir / "plots") if lead else []
  summary.update(final_step=exp.rl.steps, plots=[str(p) for p in plots])
  if lead:
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
  return dict(summary, params=state["train"].params)


def with_adapters(exp: ExperimentConfig, cfg, params):
  """The policy the update trains: `params`, or with `lora.rank` > 0 `params` + fresh adapters (`models.lora`).

  The adapters' B is zero, so the policy starts exactly at `params`; their A draws from the
  experiment's seed, so a resumed run rebuilds the same tree before restoring the trained adapters.
  """
  lo = exp.lora
  if not lo.rank:
    return params
  adapters = lora_lib.init_adapters(cfg, jax.random.fold_in(jax.random.key(exp.seed), 0x10a), lo.rank, lo.targets)
  return lora_lib.apply(params, adapters, lo.alpha, lo.rank)


def state_on_disk(state: dict) -> dict:
  """The state as checkpointed: with LoRA every policy in it (the train state's params, the async
  snapshots and moving average) is written as its adapters alone.

  The frozen base is not written: a resumed run reloads it from the model source (`load_policy`).
  """
  return jax.tree_util.tree_map(lambda x: lora_lib.partition(x)[0] if lora_lib.is_lora(x) else x, state,
                                is_leaf=lora_lib.is_lora)


def state_from_disk(restored: dict, template: dict) -> dict:
  """The inverse of `state_on_disk`: each restored policy's adapters over the base of the same policy in
  `template` (the state as built before the restore; the identity without LoRA)."""
  return jax.tree_util.tree_map(lambda t, r: lora_lib.partition(t)[1](r) if lora_lib.is_lora(t) else r, template,
                                restored, is_leaf=lora_lib.is_lora)


def latest_params(exp: ExperimentConfig, workdir: str | os.PathLike, params_template):
  """The params of the latest intact checkpoint in `workdir` (structure and dtypes from `params_template`).

  With `lora.rank` > 0 the checkpoint holds the adapters: the result is `params_template` (the
  base, from the model source) with them, a LoRA policy (`models.merge_lora` gives plain params).
  """
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", save_every=exp.checkpoint.every,
                      keep=exp.checkpoint.keep)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints.")
  tree, _, _ = ckpt.read()
  ckpt.close()
  if exp.lora.rank:
    adapters = jax.tree_util.tree_map(lambda x: jax.numpy.asarray(x, jax.numpy.float32), tree["train"]["params"])
    return lora_lib.apply(lora_lib.base_of(params_template), adapters, exp.lora.alpha, exp.lora.rank)
  return jax.tree_util.tree_map(lambda t, x: jax.numpy.asarray(x, t.dtype), params_template, tree["train"]["params"])
