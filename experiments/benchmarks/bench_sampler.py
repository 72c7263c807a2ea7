r"""Sampler throughput and memory: rollouts_jax's sampler against transformers' `generate` (torch, CPU).

Both sides sample the same small random Llama (vocab 2048, hidden 256, MLP 1024, 4 layers,
8 query / 4 key-value heads; built locally, no download) at equal batch, samples per
prompt, prompt length and new tokens, with the same settings (temperature 1, no
truncation, no early EOS stop). For each shape the two sides alternate in one process
(ours, theirs, ours, ...), `--repeats` timed calls each, and medians are reported:

* tokens/s of both sides and their ratio (ours / generate);
* our compile time (first call minus the median), apart;
* peak memory of one call: resident-set growth over the call for both sides (sampled
  every 2 ms in a separate, untimed call), and for ours XLA's own buffer assignment
  (temporaries + outputs of the compiled program);
* our decode FLOP/s over a plain 512x2048x2048 float32 matmul's, measured in the same run
  (FLOPs counted as the weights' matmuls per token plus attention over the real context);
* peak memory against N past the timed shapes (prompt 256, N up to `--memory_sweep`'s
  largest): XLA's buffer assignment for our compiled program (compiled, not run), with the
  automatic `sample_chunk`, to show that the memory budget, not N, sets it.

Contention: torch's `generate` slows far more than JAX's sampler when other processes use
the CPU, which flatters us. The script refuses to start when the 1-minute load average is
above `--max_load` and, during every timed call, measures the CPU time other processes
used (from /proc/stat minus our own). A timing during which others used more than
`--max_other_cores` cores on average is marked BUSY; if any timing is BUSY the script
exits with status 2 (after writing its JSON) unless `--allow_busy`.

  python -m experiments.benchmarks.bench_sampler                 # all shapes, 3 repetitions (a few minutes)
  python -m experiments.benchmarks.bench_sampler --quick         # 2 shapes, 1 repetition
  python -m experiments.benchmarks.bench_sampler --json=out.json --allow_busy
"""

import json
import os
import statistics
import tempfile

from absl import app, flags

from experiments.benchmarks import timing
from experiments.benchmarks.timing import peak_rss_growth, timed

FLAGS = flags.FLAGS
timing.define_flags("bench_sampler_results.json")
flags.DEFINE_string("shapes", "", "Comma-separated subset of shape names to run (default: all).")
flags.DEFINE_integer("threads", 0, "torch threads (0: os.cpu_count(), what XLA:CPU uses).")
flags.DEFINE_bool("skip_hf", False, "Only time our sampler.")
flags.DEFINE_float("decode_memory_mb", 0, "Our automatic sample_chunk's budget (0: the default).")
flags.DEFINE_string("memory_sweep", "8,64,256,1024,4096",
                    "Samples per prompt (prompt 256, batch 2, 64 new tokens) whose compiled peak memory is "
                    "reported ('' for none).")

# name: (batch, samples per prompt, prompt length, new tokens)
SHAPES = {
    "b16_n4_t64": (16, 4, 32, 64),
    "b64_n8_t128": (64, 8, 32, 128),
    "p256_n8": (2, 8, 256, 64),
    "p256_n64": (2, 64, 256, 64),
    "p256_n256": (2, 256, 256, 64),
}
QUICK = ("b16_n4_t64", "p256_n64")


def main(_):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from rollouts_jax import models, sampling
  from rollouts_jax.sampling import engine, generate

  load1 = timing.check_load(FLAGS.max_load, FLAGS.allow_busy)
  threads = FLAGS.threads or os.cpu_count()
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  hf_conf = transformers.LlamaConfig(
      vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
      num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
      eos_token_id=None, pad_token_id=0)
  hf_model = transformers.LlamaForCausalLM(hf_conf).eval()
  with tempfile.TemporaryDirectory() as d:
    hf_model.save_pretrained(d, safe_serialization=True)
    cfg, params = models.load_hf_checkpoint(d, dtype=jnp.float32)
  print(f"model: llama hidden={cfg.hidden_size} mlp={cfg.intermediate_size} layers={cfg.num_layers} "
        f"heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} params={cfg.num_params() / 1e6:.2f}M; "
        f"devices={jax.devices()} torch_threads={threads} cpus={os.cpu_count()} load1={load1:.2f}")

  # The matmul reference, measured in this run.
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((512, 2048)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((2048, 2048)), jnp.float32)
  mm = jax.jit(jnp.dot)
  jax.block_until_ready(mm(a, b))

  def matmul_flops():  # measured again beside every shape, so both see the same machine state
    mm_s = statistics.median(timed(lambda: jax.block_until_ready(mm(a, b)))[0] for _ in range(7))
    return 2 * 512 * 2048 * 2048 / mm_s

  mm_flops = matmul_flops()
  print(f"matmul 512x2048x2048 float32: {mm_flops / 1e9:.1f} GFLOP/s")

  names = [s for s in (FLAGS.shapes.split(",") if FLAGS.shapes else (QUICK if FLAGS.quick else SHAPES))]
  repeats = 1 if FLAGS.quick else FLAGS.repeats
  matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # the embedding is a gather
  attn_per_ctx = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # q.k and p.v per context token
  results = dict(load1_at_start=load1, matmul_gflops=mm_flops / 1e9, threads=threads, shapes={})
  any_busy = False
  for name in names:
    B, N, P, T = SHAPES[name]
    mm_before = matmul_flops()
    prompt = rng.integers(1, cfg.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.ones((B, P), bool)
    conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, temperature=1.0, eos_id=None,
                                   prompt_buckets=())
    if FLAGS.decode_memory_mb:
      conf = conf.replace(decode_memory_mb=FLAGS.decode_memory_mb)
    chunk = engine.auto_sample_chunk(cfg, conf, B)
    n_tokens = B * N * T
    seed = [0]

    def ours():
      seed[0] += 1
      out = sampling.sample(cfg, params, prompt, mask, jax.random.key(seed[0]), conf)
      return jax.block_until_ready(out)

    ids_t = torch.tensor(prompt, dtype=torch.long)
    mask_t = torch.ones_like(ids_t)

    def theirs():
      with torch.no_grad():
        return hf_model.generate(input_ids=ids_t, attention_mask=mask_t, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, num_return_sequences=N, max_new_tokens=T,
                                 min_new_tokens=T, eos_token_id=None, pad_token_id=0)

    first, _ = timed(ours)
    out = ours()
    assert int(out.lengths.sum()) == n_tokens
    if not FLAGS.skip_hf:
      seq = theirs()  # warm-up
      assert seq.shape == (B * N, P + T), seq.shape
    sides = {"ours": ours} if FLAGS.skip_hf else {"ours": ours, "generate": theirs}
    t = timing.alternate(sides, repeats, max_other_cores=FLAGS.max_other_cores)
    ours_t, theirs_t, busy = t.times["ours"], t.times.get("generate"), t.notes
    ours_s = statistics.median(ours_t)
    compiled = generate.sample_jit.lower(cfg, conf, params, jnp.asarray(prompt), jnp.asarray(mask),
                                             jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    xla_bytes = mem.temp_size_in_bytes + mem.output_size_in_bytes
    ours_rss = peak_rss_growth(ours)
    # FLOPs: prefill (causal) and decode (each new token against prompt + tokens so far).
    prefill = B * P * 2 * matmul_params + B * attn_per_ctx * P * (P + 1) / 2
    decode = n_tokens * 2 * matmul_params + B * N * attn_per_ctx * sum(P + t + 1 for t in range(T))
    ours_flops = (prefill + decode) / ours_s
    mm_flops = (mm_before + matmul_flops()) / 2  # the matmul just before and just after this shape
    r = dict(batch=B, num_samples=N, prompt_len=P, new_tokens=T, sample_chunk=chunk, ours_s=ours_t,
             ours_tokens_per_s=n_tokens / ours_s, compile_s=max(first - ours_s, 0.0),
             ours_peak_rss_mb=ours_rss / 2 ** 20, ours_xla_temp_plus_output_mb=xla_bytes / 2 ** 20,
             ours_gflops=ours_flops / 1e9, matmul_gflops=mm_flops / 1e9,
             fraction_of_matmul=ours_flops / mm_flops, busy=busy)
    line = (f"{name}: batch {B} x N {N}, prompt {P}, {T} new tokens (chunk {chunk}): ours "
            f"{n_tokens / ours_s:,.0f} tokens/s (median of {len(ours_t)}; compile {r['compile_s']:.1f} s apart), "
            f"{ours_flops / 1e9:.1f} GFLOP/s = {ours_flops / mm_flops:.0%} of matmul's {mm_flops / 1e9:.0f}; peak memory: RSS +"
            f"{ours_rss / 2 ** 20:.0f} MiB, XLA temp+out {xla_bytes / 2 ** 20:.0f} MiB")
    if not FLAGS.skip_hf:
      theirs_s = statistics.median(theirs_t)
      theirs_rss = peak_rss_growth(theirs)
      r.update(generate_s=theirs_t, generate_tokens_per_s=n_tokens / theirs_s,
               generate_peak_rss_mb=theirs_rss / 2 ** 20, ratio=theirs_s / ours_s)
      line += (f"\n    generate {n_tokens / theirs_s:,.0f} tokens/s, peak RSS +{theirs_rss / 2 ** 20:.0f} MiB; "
               f"ratio (ours / generate) {theirs_s / ours_s:.2f}x")
    if busy:
      any_busy = True
      line += "\n    BUSY: " + "; ".join(busy)
    print(line, flush=True)
    results["shapes"][name] = r

  sweep = [int(n) for n in FLAGS.memory_sweep.split(",") if n.strip()]
  if sweep:
    B, _, P, T = SHAPES["p256_n256"]
    prompt, mask = jnp.ones((B, P), jnp.int32), jnp.ones((B, P), bool)
    results["memory_sweep"] = {}
    for n in sweep:
      conf = sampling.SamplingConfig(num_samples=n, max_new_tokens=T, eos_id=None, prompt_buckets=())
      if FLAGS.decode_memory_mb:
        conf = conf.replace(decode_memory_mb=FLAGS.decode_memory_mb)
      mem = generate.sample_jit.lower(cfg, conf, params, prompt, mask, jax.random.key(0)).compile().memory_analysis()
      mb = (mem.temp_size_in_bytes + mem.output_size_in_bytes) / 2 ** 20
      chunk = engine.auto_sample_chunk(cfg, conf, B)
      results["memory_sweep"][n] = dict(sample_chunk=chunk, ours_xla_temp_plus_output_mb=mb)
    print(f"peak memory against N (prompt {P}, batch {B}, {T} new tokens; XLA temp+out, compiled, budget "
          f"{conf.decode_memory_mb:g} MiB): " + ", ".join(
              f"N {n}: {r['ours_xla_temp_plus_output_mb']:.0f} MiB (chunk {r['sample_chunk']})"
              for n, r in results["memory_sweep"].items()), flush=True)

  results["load1_at_end"] = os.getloadavg()[0]
  results["busy"] = any_busy
  print(f"load average at end: {results['load1_at_end']:.2f}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=1)
    print(f"wrote {FLAGS.json}")
  if any_busy and not FLAGS.allow_busy:
    raise SystemExit("Some timings were taken while other processes used the CPU (BUSY above); "
                     "rerun on a quiet machine, or pass --allow_busy to accept them.")


if __name__ == "__main__":
  app.run(main)
