r"""APRIL partial rollouts against synchronous rollouts, at an equal number of finished groups.

Both sides run the real rollout pipeline (`loop.build_pipeline`) of one config on the same
policy (the config's warm start), alternating step by step in one process:

* synchronous: every step samples B prompts x N and waits for the longest rollout;
* APRIL (`rollout.generator="april"`): every step requests ceil(B * (1 + over_provision))
  groups (stored unfinished groups first), stops once B groups have finished and stores the
  rest for the next step.

Each step delivers B finished, scored groups on both sides. Reported (medians over the timed
steps, after warm-up steps that compile): rollout time per step and its ratio, the padding
fraction of the decode loop (row-steps that produced no token: the accelerator-idle proxy),
tokens decoded per step, and APRIL's accounting (groups started = groups used + groups still
stored, so nothing is dropped) and its off-policy token share. The policy is not updated
here (pure rollout cost); learning parity is `experiments/studies/april_parity.py`.

Then the continuation itself, on one APRIL request taken from the pipeline after the timed
steps (the store's unfinished groups first, then fresh prompts, prefixes cut to the
pipeline's width), alternating the two formulations `--cont_reps` times each:

* shared prompt (`sampling.continue_from`): each prompt prefilled once, only the rows that
  still run put their prefixes through the model, the N rows of a prompt decoding against
  its keys stored once;
* re-prefill (the earlier formulation, rebuilt here): every row is its own prompt
  (prompt + prefix, bucketed) and is prefilled and decoded alone.

It prints the ratio re-prefill / shared-prompt time and checks that both give the same rows.

  python -m experiments.benchmarks.bench_april                      # configs/countdown_april.py
  python -m experiments.benchmarks.bench_april --steps=4 --warmup=1 --allow_busy   # a quick look
"""

import json
import os
import statistics
import time

from absl import app, flags

from experiments.benchmarks import timing

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = flags.FLAGS
timing.define_flags(os.path.join(HERE, "results", "bench_april.json"), names=("max_load", "allow_busy"))
flags.DEFINE_string("config", os.path.join(HERE, "..", "..", "configs", "countdown_april.py"),
                    "A config; the APRIL side runs rollout.generator='april', the synchronous side 'sample'.")
flags.DEFINE_float("over_provision", 0.0, "APRIL's over-provisioning (0: the config's, in rollout.generator_kwargs).")
flags.DEFINE_integer("steps", 8, "Timed steps per side.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per side first (compilation, the APRIL store filling up).")
flags.DEFINE_integer("cont_reps", 5, "Timed calls per continuation formulation (0: skip that part).")


def _reprefill_continue(cfg, params, req, L, key, conf, stop_after_groups):
  """The earlier continuation: each row is its own prompt (prompt + prefix), prefilled and decoded alone.

  Returns the new tokens [B, N, T] (token j of row r is its completion position len_r + j).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import sampling, sharding  # pylint: disable=g-import-not-at-top
  from rollouts_jax.sampling import generate  # pylint: disable=g-import-not-at-top
  ids, pmask = np.asarray(req.prompt_ids), np.asarray(req.prompt_mask)
  pre, pm = np.asarray(req.completion_ids)[..., :L], np.asarray(req.completion_mask)[..., :L]
  B, N, _ = pre.shape
  T = conf.max_new_tokens
  lengths = pm.sum(-1)
  done = np.asarray(sampling.finished_rows(req.completion_ids, req.completion_mask, conf)) | ~np.asarray(
      req.sample_mask)
  rows = np.concatenate([np.repeat(ids, N, 0), np.where(pm, pre, 0).reshape(B * N, L)], 1)
  rmask = np.concatenate([np.repeat(pmask, N, 0), pm.reshape(B * N, L)], 1)
  shift = (np.arange(rows.shape[1])[None] - (L - lengths.reshape(-1))[:, None]) % rows.shape[1]
  rows, rmask = np.take_along_axis(rows, shift, 1), np.take_along_axis(rmask, shift, 1)   # padding to the left
  rows, rmask = sampling.left_pad_to(rows, rmask, sampling.bucket_length(rows.shape[1], conf.prompt_buckets),
                                     conf.pad_id)
  limit = np.where(done, 0, T - lengths).reshape(-1)
  out = generate.sample_jit(cfg, conf.replace(num_samples=1, sample_chunk=1), params,
                            jnp.asarray(rows, jnp.int32), jnp.asarray(rmask), key, sharding.current_context(),
                            row_ids=jnp.arange(B * N, dtype=jnp.int32), offset_R=jnp.asarray(lengths.reshape(-1)),
                            limit_R=jnp.asarray(limit), stop_groups=(N, stop_after_groups))
  return out.completion_ids.reshape(B, N, T), out.completion_mask.reshape(B, N, T)


def continuation(pipe, state, cfg, params, reps: int, key) -> dict:
  """Times one APRIL request's continuation both ways (alternating); returns medians and agreement."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import sampling  # pylint: disable=g-import-not-at-top
  from rollouts_jax.types import RolloutBatch  # pylint: disable=g-import-not-at-top
  conf, N, B = pipe.sampling_config, pipe.num_samples, pipe.batch_size
  T = conf.max_new_tokens
  store = jax.device_get(state.generator)   # APRIL's store: the groups it resumes first
  resumed = store.data.take(np.flatnonzero(np.asarray(store.valid)))
  n_new = pipe.generator.wants(state.generator)
  P = resumed.prompt_ids.shape[1]
  ids, mask = pipe.prompter(pipe.examples[:n_new])
  ids, mask = sampling.left_pad_to(np.asarray(ids), np.asarray(mask), P, conf.pad_id)
  fresh = RolloutBatch.empty(n_new, N, P, T).replace(
      prompt_ids=ids.astype(np.int32), prompt_mask=mask.astype(bool), prompt_index=np.arange(n_new, dtype=np.int32),
      sample_mask=np.ones((n_new, N), bool), entropy=np.zeros((n_new, N, T), np.float32))
  req = jax.device_get(sampling.concat([resumed, fresh]) if resumed.prompt_ids.shape[0] else fresh)
  was = np.asarray(req.completion_mask)
  done = np.asarray(sampling.finished_rows(req.completion_ids, was, conf)) | ~np.asarray(req.sample_mask)
  L = next(w for w in (max(T // 4, 1), max(T // 2, 1), T) if w >= int(was.sum(-1).max(initial=0)))

  def shared():
    out = sampling.continue_from(cfg, params, req.prompt_ids, req.prompt_mask, np.asarray(req.completion_ids)[..., :L],
                                 was[..., :L], key, conf, finished=done, stop_after_groups=B)
    return jax.block_until_ready(out)

  def reprefill():
    return jax.block_until_ready(_reprefill_continue(cfg, params, req, L, key, conf, B))

  a, (b_ids, b_mask) = shared(), reprefill()   # compile both
  times = timing.alternate({"shared": shared, "reprefill": reprefill}, reps).times
  # The same rows: the re-prefill output holds row r's new tokens from index 0, the shared-prompt
  # output holds the whole completion (prefix first).
  t = np.arange(T)
  in_prefix = t < was[..., :L].sum(-1)[..., None]
  src = np.clip(t - was[..., :L].sum(-1)[..., None], 0, T - 1)
  old_mask = in_prefix | np.take_along_axis(np.asarray(b_mask), src, -1)
  old_ids = np.where(in_prefix, np.asarray(req.completion_ids), np.take_along_axis(np.asarray(b_ids), src, -1))
  new_ids, new_mask = np.asarray(a.completion_ids), np.asarray(a.completion_mask)
  same = ((old_mask == new_mask) & (np.where(old_mask, old_ids, 0) == np.where(new_mask, new_ids, 0))).all(-1)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {"groups": int(req.prompt_ids.shape[0]), "resumed_groups": int(resumed.prompt_ids.shape[0]),
          "rows_resuming": int((was.any(-1) & ~done).sum()), "prefix_width": L, "reps": reps,
          "shared_s": med["shared"], "reprefill_s": med["reprefill"], "times": times,
          "ratio_reprefill_over_shared": med["reprefill"] / med["shared"], "same_rows": float(same.mean())}


def run(config_path: str, steps: int, warmup: int, over_provision: float = 0.0, cont_reps: int = 0) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top

  exp = config_lib.load_config_file(config_path)
  exp = config_lib.from_config_dict(exp) if not isinstance(exp, config_lib.ExperimentConfig) else exp
  kwargs = (config_lib.parse_kwargs(exp.rollout.generator_kwargs, "rollout.generator_kwargs")
            if exp.rollout.generator == "april" else {})
  if over_provision:
    kwargs["over_provision"] = over_provision
  exp = dataclasses.replace(exp, rollout=dataclasses.replace(
      exp.rollout, generator="april", generator_kwargs=",".join(f"{k}={v}" for k, v in kwargs.items())),
      control=dataclasses.replace(exp.control, dynamic_sampling=False))
  config_lib.validate(exp)
  sync_exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, generator="sample",
                                                                  generator_kwargs=""))
  train_examples, _ = loop.load_task(exp)
  cfg, params, tok = loop.load_policy(exp, train_examples)
  sides = {"sync": loop.build_pipeline(sync_exp, cfg, tok, train_examples),
           "april": loop.build_pipeline(exp, cfg, tok, train_examples)}
  states = {k: p.init_state() for k, p in sides.items()}
  rec = {k: [] for k in sides}
  started = used = 0
  for step in range(warmup + steps):
    for name, pipe in sides.items():   # alternate the two sides every step
      t0 = time.perf_counter()
      batch, states[name], info = pipe.collect(states[name], params, step, jax.random.key(step))
      wall = time.perf_counter() - t0
      if name == "april":
        started += info["rollouts"] / pipe.num_samples
        used += int(np.asarray(batch.sample_mask).any(1).sum())
      if step >= warmup:
        rec[name].append(dict(wall=wall, sample=info["time/sample"], padding=info["rollout/padding_frac"],
                              tokens=info["generated_tokens"], groups=int(np.asarray(batch.sample_mask).any(1).sum()),
                              started=info["rollouts"] / pipe.num_samples, reward=info["reward_mean"],
                              stored=info.get("april/stored_groups", 0.0),
                              off_policy=info.get("april/off_policy_token_frac", 0.0)))
  med = lambda name, k: statistics.median(r[k] for r in rec[name])
  out = {"config": os.path.basename(config_path), "B": exp.control.prompts_per_step, "N": exp.rollout.num_samples,
         "max_new_tokens": exp.rollout.max_new_tokens,
         "april_kwargs": exp.rollout.generator_kwargs,
         "steps": steps, "warmup": warmup, "per_step": rec}
  for name in sides:
    out[name] = {k: med(name, k) for k in ("wall", "sample", "padding", "tokens", "groups", "reward")}
  out["rollout_time_ratio_sync_over_april"] = out["sync"]["sample"] / out["april"]["sample"]
  out["step_time_ratio_sync_over_april"] = out["sync"]["wall"] / out["april"]["wall"]
  april_state = jax.device_get(states["april"].generator)
  out["april_accounting"] = {  # over every step, warm-up included: started = used + stored
      "groups_started": started, "groups_used": used,
      "groups_in_store_at_end": int(np.asarray(april_state.valid).sum()),
      "off_policy_token_frac": statistics.median(r["off_policy"] for r in rec["april"])}
  if cont_reps:
    out["continuation"] = continuation(sides["april"], states["april"], cfg, params, cont_reps,
                                       jax.random.key(warmup + steps))
  return out


def main(argv):
  del argv
  load1 = timing.check_load(FLAGS.max_load, FLAGS.allow_busy)
  out = run(FLAGS.config, FLAGS.steps, FLAGS.warmup, FLAGS.over_provision, FLAGS.cont_reps)
  out["load1_at_start"], out["load1_at_end"] = load1, os.getloadavg()[0]
  os.makedirs(os.path.dirname(FLAGS.json), exist_ok=True)
  with open(FLAGS.json, "w") as f:
    json.dump(out, f, indent=1)
  s, a = out["sync"], out["april"]
  print(f"{out['config']}: B={out['B']} N={out['N']} T={out['max_new_tokens']}, "
        f"median of {out['steps']} steps per side (load {load1:.2f} -> {out['load1_at_end']:.2f})")
  print(f"  rollout time/step   sync {s['sample']:.2f}s   april {a['sample']:.2f}s   "
        f"ratio {out['rollout_time_ratio_sync_over_april']:.2f}x")
  print(f"  whole step          sync {s['wall']:.2f}s   april {a['wall']:.2f}s   "
        f"ratio {out['step_time_ratio_sync_over_april']:.2f}x")
  print(f"  padding fraction    sync {s['padding']:.3f}   april {a['padding']:.3f}")
  print(f"  tokens decoded/step sync {s['tokens']:.0f}   april {a['tokens']:.0f}   (finished groups/step: "
        f"{s['groups']:.0f} vs {a['groups']:.0f})")
  print(f"  APRIL accounting: {out['april_accounting']}")
  c = out.get("continuation")
  if c:
    print(f"  continuation of one request ({c['groups']} groups, {c['resumed_groups']} resumed, {c['rows_resuming']} "
          f"rows resuming, prefix width {c['prefix_width']}; median of {c['reps']}): re-prefill {c['reprefill_s']:.3f}s"
          f"   shared prompt {c['shared_s']:.3f}s   ratio {c['ratio_reprefill_over_shared']:.2f}x   "
          f"same rows {c['same_rows']:.3f}")


if __name__ == "__main__":
  app.run(main)
