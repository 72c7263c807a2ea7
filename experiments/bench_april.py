r"""APRIL partial rollouts against synchronous rollouts, at an equal number of finished groups.

Both sides run the real rollout pipeline (`loop.build_pipeline`) of one config on the same
policy (the config's warm start), alternating step by step in one process:

* synchronous: every step samples B prompts x N and waits for the longest rollout;
* APRIL (`rollout.partial_rollouts`): every step requests ceil(B * (1 + over_provision))
  groups (stored unfinished groups first), stops once B groups have finished and stores the
  rest for the next step.

Each step delivers B finished, scored groups on both sides. Reported (medians over the timed
steps, after warm-up steps that compile): rollout time per step and its ratio, the padding
fraction of the decode loop (row-steps that produced no token: the accelerator-idle proxy),
tokens decoded per step, and APRIL's accounting (groups started = groups used + groups still
stored, so nothing is dropped) and its off-policy token share. The policy is not updated
here (pure rollout cost); learning parity is a training run of the two configs.

  python experiments/bench_april.py                      # configs/countdown_april.py
  python experiments/bench_april.py --steps=4 --warmup=1 --allow_busy   # a quick look
"""

import json
import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", os.path.join(os.path.dirname(__file__), "..", "configs", "countdown_april.py"),
                    "A config; the APRIL side turns rollout.partial_rollouts on, the synchronous side off.")
flags.DEFINE_float("over_provision", 0.0, "APRIL's over-provisioning (0: the config's rollout.over_provision).")
flags.DEFINE_integer("steps", 8, "Timed steps per side.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per side first (compilation, the APRIL store filling up).")
flags.DEFINE_float("max_load", 1.0, "Refuse to start above this 1-minute load average.")
flags.DEFINE_bool("allow_busy", False, "Run (and report) even when the machine is busy.")
flags.DEFINE_string("json", os.path.join(os.path.dirname(__file__), "results", "bench_april.json"), "Output file.")


def run(config_path: str, steps: int, warmup: int, over_provision: float = 0.0) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top

  exp = config_lib.load_config_file(config_path)
  exp = config_lib.from_config_dict(exp) if not isinstance(exp, config_lib.ExperimentConfig) else exp
  exp = dataclasses.replace(exp, rollout=dataclasses.replace(
      exp.rollout, partial_rollouts=True, over_provision=over_provision or exp.rollout.over_provision),
      control=dataclasses.replace(exp.control, dynamic_sampling=False))
  config_lib.validate(exp)
  sync_exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, partial_rollouts=False))
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
         "max_new_tokens": exp.rollout.max_new_tokens, "over_provision": exp.rollout.over_provision,
         "steps": steps, "warmup": warmup, "per_step": rec}
  for name in sides:
    out[name] = {k: med(name, k) for k in ("wall", "sample", "padding", "tokens", "groups", "reward")}
  out["rollout_time_ratio_sync_over_april"] = out["sync"]["sample"] / out["april"]["sample"]
  out["step_time_ratio_sync_over_april"] = out["sync"]["wall"] / out["april"]["wall"]
  april_state = jax.device_get(states["april"].partial)
  out["april_accounting"] = {  # over every step, warm-up included: started = used + stored
      "groups_started": started, "groups_used": used,
      "groups_in_store_at_end": int(np.asarray(april_state.valid).sum()),
      "off_policy_token_frac": statistics.median(r["off_policy"] for r in rec["april"])}
  return out


def main(argv):
  del argv
  load1 = os.getloadavg()[0]
  if load1 > FLAGS.max_load and not FLAGS.allow_busy:
    raise SystemExit(f"1-minute load average {load1:.2f} > {FLAGS.max_load}: other processes are using the CPU. "
                     "Wait, or pass --allow_busy.")
  out = run(FLAGS.config, FLAGS.steps, FLAGS.warmup, FLAGS.over_provision)
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


if __name__ == "__main__":
  app.run(main)
