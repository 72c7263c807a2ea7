r"""Rollout reuse against plain sampling, measured in the same run: SPEC-RL, EfficientRollout, APRIL.

One small random Llama (vocab 2048, hidden 256, MLP 1024, 4 layers, 8 query / 4 key-value
heads; no download), its layer weights scaled up so that next-token distributions are peaked
and input-dependent (the mean entropy is printed), sampled at temperature 1 with an EOS token.
Each section alternates its sides in one process (`--repeats` timed calls each, after a
compiling call) and reports medians:

* `section_spec_rl`: epoch 1 samples B prompts x N completions with the policy; epoch 2's
  policy is the same weights times (1 + eps * noise), a small update. Epoch 2 either samples
  afresh (`sampling.sample`) or verifies epoch 1's rollouts as drafts
  (`speculative_sample`): lenience 1 with the exact residual (the epoch-1 policy as
  drafter), lenience 1 and e^0.5 with SPEC-RL's free redraw. Reported: tokens/s, decode
  steps (the continuation's longest row; plain sampling's longest row), tokens decoded,
  the acceptance rate (accepted / drafted tokens) and reused rows, and each side's ratio
  over plain sampling.
* `section_efficient_rollout`: the FP4 (NVFP4) copy of the policy drafts gamma tokens per
  round, the policy verifies them (`self_speculative_sample`), against `sampling.sample`,
  at several row counts (B x N), without EOS so both sides make the same tokens. It also
  times one drafter step and one verification forward (gamma_max + 1 tokens) against one
  plain decoding step, the costs of the gamma rule (`choose_gamma`), and reports the row
  counts where speculation pays (ratio > 1): the switch (`max_spec_rows`) belongs at the
  largest of them, and off everywhere when there is none.

* `section_april`: APRIL partial rollouts against synchronous rollouts at an equal number of
  finished groups, through the real pipeline of `--april_config` (its warm start), via
  `bench_april.run`: rollout time per step, its ratio, the padding fraction, the accounting.

Contention: the script refuses to start when the 1-minute load average is above
`--max_load`, and marks a timing BUSY when other processes used more than
`--max_other_cores` cores during it (the helper of `bench_sampler.py`); it exits with status 2
after writing its JSON if any timing was BUSY, unless `--allow_busy`.

  python -m experiments.benchmarks.bench_rollout_reuse                       # both sections (~10 minutes)
  python -m experiments.benchmarks.bench_rollout_reuse --quick               # one repetition, fewer shapes
  python -m experiments.benchmarks.bench_rollout_reuse --sections=spec_rl --allow_busy
"""

import json
import math
import os
import pathlib
import statistics
import sys

from absl import app, flags

from experiments.benchmarks import timing
from experiments.benchmarks.timing import timed

HERE = pathlib.Path(__file__).resolve().parent
FLAGS = flags.FLAGS
timing.define_flags(str(HERE / "results" / "bench_rollout_reuse.json"))
flags.DEFINE_string("sections", "spec_rl,efficient_rollout,april", "Comma-separated sections to run.")
flags.DEFINE_string("april_config", str(HERE.parents[1] / "configs" / "default.py"),
                    "APRIL section: the config whose pipeline runs.")
flags.DEFINE_float("perturbation", 0.002, "SPEC-RL: epoch 2 weights = epoch 1 weights * (1 + eps * N(0, 1)).")
flags.DEFINE_integer("gamma_max", 4, "EfficientRollout: most draft tokens per round.")
flags.DEFINE_string("rows", "4,16,64", "EfficientRollout: row counts (prompts x 4 samples) to measure.")

EOS = 2


def build_model():
  """(cfg, params): the benchmark's small random Llama with peaked next-token distributions."""
  import jax
  from rollouts_jax import models
  cfg = models.ModelConfig(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=1024,
                           num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=1024)
  params = models.init_params(cfg, jax.random.key(0))
  params = jax.tree_util.tree_map(lambda x: x * 3 if x.ndim == 3 else x, params)
  params["lm_head"] = params["lm_head"] * 12
  return cfg, params


def perturb(params, eps, seed):
  """params * (1 + eps * N(0, 1)) for every weight matrix (norms kept)."""
  import jax
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [x * (1 + eps * jax.random.normal(k, x.shape, x.dtype)) if x.ndim >= 2 else x for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, out)


def alternate(sides, repeats):
  """`timing.alternate` after one compiling call per side: {name: (median s, last result, BUSY notes, times)}."""
  t = timing.alternate(sides, repeats, warmup=1, max_other_cores=FLAGS.max_other_cores)
  return {name: (t.median(name), t.last[name], t.busy[name], t.times[name]) for name in sides}


def section_spec_rl(cfg, params, repeats):
  """SPEC-RL: epoch-1 rollouts as drafts for a perturbed epoch-2 policy, against sampling afresh."""
  import jax
  import numpy as np
  from rollouts_jax import sampling
  from rollouts_jax.sampling import speculative as spec
  B, N, P, T = 16, 8, 32, 64
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, cfg.vocab_size, size=(B, P)).astype(np.int32)
  mask = np.ones((B, P), bool)
  conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, temperature=1.0, eos_id=EOS, prompt_buckets=())
  epoch1 = sampling.sample(cfg, params, prompt, mask, jax.random.key(1), conf)
  drafts = spec.Drafts.from_output(epoch1)
  new_params = perturb(params, FLAGS.perturbation, seed=1)
  seed = [10]

  def key():
    seed[0] += 1
    return jax.random.key(seed[0])

  def plain():
    out = jax.block_until_ready(sampling.sample(cfg, new_params, prompt, mask, key(), conf))
    lengths = np.asarray(out.lengths)
    return dict(tokens=int(lengths.sum()), decode_steps=int(lengths.max()), decoded_tokens=int(lengths.sum()))

  def speculative(**kw):
    def run():
      out, st = spec.speculative_sample(cfg, new_params, prompt, mask, key(), conf, drafts=drafts, **kw)
      jax.block_until_ready(out)
      return dict(tokens=int(np.asarray(out.lengths).sum()), decoded_tokens=st["generated_tokens"], **st)
    return run

  sides = {"sample": plain,
           "spec_l1_exact": speculative(lenience=1.0, draft_params=params),
           "spec_l1_free": speculative(lenience=1.0, residual=False),
           "spec_l1.65_free": speculative(lenience=math.exp(0.5), residual=False)}
  res = alternate(sides, repeats)
  base = res["sample"][0]
  ent = float((np.asarray(epoch1.entropy) * np.asarray(epoch1.completion_mask)).sum() / np.asarray(epoch1.lengths).sum())
  out = dict(batch=B, num_samples=N, prompt_len=P, max_new_tokens=T, perturbation=FLAGS.perturbation,
             epoch1_mean_length=float(np.asarray(epoch1.lengths).mean()), mean_entropy_nats=ent, sides={})
  print(f"[spec_rl] B={B} N={N} P={P} T={T}, eps={FLAGS.perturbation}; epoch-1 mean length "
        f"{out['epoch1_mean_length']:.1f}, mean policy entropy {ent:.2f} nats")
  for name, (sec, r, busy, times) in res.items():
    row = dict(seconds=times, median_s=sec, tokens_per_s=r["tokens"] / sec, ratio_vs_sample=base / sec, busy=busy, **r)
    if "draft_tokens" in r:
      row["acceptance_rate"] = r["accepted_tokens"] / max(r["draft_tokens"], 1)
    out["sides"][name] = row
    line = (f"  {name:16s} {sec:6.2f} s  {row['tokens_per_s']:8,.0f} tokens/s  ratio {base / sec:5.2f}x  "
            f"decode steps {r['decode_steps']:3d}  decoded tokens {r['decoded_tokens']:5d}")
    if "draft_tokens" in r:
      line += (f"  accepted {row['acceptance_rate']:.1%} of drafted, rows reused whole "
               f"{r['fully_accepted_rows']}/{B * N}, continued {r['rows_continued']}")
    if busy:
      line += "  BUSY: " + "; ".join(busy)
    print(line, flush=True)
  return out


def _step_costs(cfg, params, draft_params, rows, P, T, G, repeats):
  """Seconds of one drafter step (1 token), one verification (G + 1 tokens), one plain step (1 token)."""
  import jax
  import jax.numpy as jnp
  from rollouts_jax.sampling import engine
  S = P + T + G + 2
  cache = tuple(jnp.zeros((rows, S, cfg.num_kv_heads, cfg.head_dim), jnp.float32) for _ in range(cfg.num_layers))
  vis = lambda m: jnp.ones((rows, m, S), bool)

  @jax.jit
  def run(p, tokens):
    m = tokens.shape[1]
    logits, _, _ = engine.tokens_forward(cfg, p, engine.layer_params(cfg, p), cache, cache, tokens,
                                         jnp.zeros((rows, m), jnp.int32) + P, jnp.full((rows,), P, jnp.int32), vis(m))
    return logits

  one, wide = jnp.ones((rows, 1), jnp.int32), jnp.ones((rows, G + 1), jnp.int32)
  calls = {"draft": lambda: jax.block_until_ready(run(draft_params, one)),
           "verify": lambda: jax.block_until_ready(run(params, wide)),
           "plain": lambda: jax.block_until_ready(run(params, one))}
  for f in calls.values():
    f()
  return {k: statistics.median(timed(f)[0] for _ in range(max(5, repeats * 3))) for k, f in calls.items()}


def section_efficient_rollout(cfg, params, repeats):
  """EfficientRollout: the FP4 self-drafter against plain sampling at several row counts."""
  import jax
  import numpy as np
  from rollouts_jax import models, sampling
  from rollouts_jax.sampling import speculative as spec
  N, P, T, G = 4, 32, 64, FLAGS.gamma_max
  draft_params = models.quantize_params(cfg, params, "nvfp4")
  out = dict(num_samples=N, prompt_len=P, max_new_tokens=T, gamma_max=G, fmt="nvfp4", shapes={})
  rows_list = [int(r) for r in FLAGS.rows.split(",")]
  print(f"[efficient_rollout] N={N} P={P} T={T} (no EOS), gamma_max={G}, drafter NVFP4 "
        f"({jax.default_backend()} matmul: {'dequantize + dot' if jax.default_backend() == 'cpu' else 'kernel'})")
  for rows in rows_list:
    B = max(rows // N, 1)
    costs = _step_costs(cfg, params, draft_params, B * N, P, T, G, repeats)
    draft_cost = costs["draft"] / costs["verify"]
    rng = np.random.default_rng(rows)
    prompt = rng.integers(3, cfg.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.ones((B, P), bool)
    conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, temperature=1.0, eos_id=None, prompt_buckets=())
    seed = [100]

    def key():
      seed[0] += 1
      return jax.random.key(seed[0])

    def plain():
      o = jax.block_until_ready(sampling.sample(cfg, params, prompt, mask, key(), conf))
      return dict(tokens=int(np.asarray(o.lengths).sum()), decode_steps=T)

    def self_spec():
      o, st = spec.self_speculative_sample(cfg, params, prompt, mask, key(), conf, draft_params=draft_params,
                                           gamma_max=G, draft_cost=draft_cost)
      jax.block_until_ready(o)
      return dict(tokens=int(np.asarray(o.lengths).sum()), **st)

    res = alternate({"sample": plain, "self_spec": self_spec}, repeats)
    (base, _, busy0, t0), (sec, r, busy1, t1) = res["sample"], res["self_spec"]
    predicted = spec.expected_speedup(r["acceptance_rate"], G, costs["draft"] / costs["plain"],
                                      costs["verify"] / costs["plain"])
    row = dict(batch=B, rows=B * N, sample_s=t0, self_spec_s=t1, sample_tokens_per_s=B * N * T / base,
               self_spec_tokens_per_s=r["tokens"] / sec, ratio=base / sec, step_costs_s=costs,
               draft_cost=draft_cost, predicted_ratio_vs_plain_steps=predicted, busy=busy0 + busy1, **r)
    out["shapes"][str(B * N)] = row
    line = (f"  rows {B * N:4d}: sample {B * N * T / base:8,.0f} tokens/s, self-spec {r['tokens'] / sec:8,.0f} "
            f"tokens/s, ratio {base / sec:5.2f}x; acceptance {r['acceptance_rate']:.1%}, rounds {r['rounds']} for "
            f"{T} tokens; step costs (ms) draft {costs['draft'] * 1e3:.2f}, verify {costs['verify'] * 1e3:.2f}, "
            f"plain {costs['plain'] * 1e3:.2f}; cost-model ratio {predicted:.2f}x")
    if busy0 + busy1:
      line += "  BUSY: " + "; ".join(busy0 + busy1)
    print(line, flush=True)
  pays = [int(k) for k, v in out["shapes"].items() if v["ratio"] > 1.0]
  out["switch_max_spec_rows"] = max(pays) if pays else 0
  print(f"  switch: speculation pays at row counts {pays or 'none'} -> max_spec_rows = "
        f"{out['switch_max_spec_rows']} ({'off everywhere measured' if not pays else 'on up to it'})")
  return out


SECTIONS = {"spec_rl": section_spec_rl, "efficient_rollout": section_efficient_rollout}


def section_april(cfg, params, repeats):
  """APRIL partial rollouts vs synchronous rollouts through the real pipeline (`bench_april.run`).

  Uses the `--april_config` config's own policy (its warm start), not the random model: the
  early stop needs real length spread. Both sides deliver B finished groups per step.
  """
  del cfg, params
  from experiments.benchmarks import bench_april  # pylint: disable=g-import-not-at-top
  out = bench_april.run(FLAGS.april_config, steps=max(2, 2 * repeats), warmup=2)
  s, a = out["sync"], out["april"]
  print(f"[april] rollout time/step sync {s['sample']:.2f}s april {a['sample']:.2f}s "
        f"ratio {out['rollout_time_ratio_sync_over_april']:.2f}x; padding {s['padding']:.3f} vs {a['padding']:.3f}; "
        f"accounting {out['april_accounting']}")
  return out


SECTIONS["april"] = section_april


def main(_):
  import jax
  load1 = timing.check_load(FLAGS.max_load, FLAGS.allow_busy)
  cfg, params = build_model()
  repeats = 1 if FLAGS.quick else FLAGS.repeats
  if FLAGS.quick:
    FLAGS.rows = FLAGS.rows.split(",")[0]
  print(f"devices={jax.devices()} cpus={os.cpu_count()} load1={load1:.2f} repeats={repeats}")
  results = dict(load1_at_start=load1, repeats=repeats, sections={})
  for name in FLAGS.sections.split(","):
    results["sections"][name] = SECTIONS[name](cfg, params, repeats)
  results["load1_at_end"] = os.getloadavg()[0]
  busy = any(s.get("busy") for sec in results["sections"].values()
             for s in list(sec.get("sides", {}).values()) + list(sec.get("shapes", {}).values()))
  results["busy"] = busy
  print(f"load average at end: {results['load1_at_end']:.2f}")
  if FLAGS.json:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=1)
    print(f"wrote {FLAGS.json}")
  if busy and not FLAGS.allow_busy:
    print("Some timings were taken while other processes used the CPU (BUSY above); rerun on a quiet machine, "
          "or pass --allow_busy to accept them.")
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
