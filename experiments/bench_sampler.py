r"""Sampler throughput: rollouts_jax's sampler against transformers' `generate` (torch, CPU).

Both sample the same small random Llama checkpoint (built locally; no download) at equal
batch, samples per prompt, prompt length and new tokens, with the same sampling settings
(temperature 1, no truncation, no early EOS stop). Prints tokens/s of both and the
ratio, our compile time apart, and our achieved FLOP/s over a matmul's FLOP/s measured
in the same run.

  python experiments/bench_sampler.py                        # batch 64 x N 8, 128 new tokens
  python experiments/bench_sampler.py --batch=8 --new_tokens=32 --repeats=1   # quick
"""

import os
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 64, "Prompts per call.")
flags.DEFINE_integer("num_samples", 8, "Samples per prompt.")
flags.DEFINE_integer("prompt_len", 32, "Prompt length (tokens).")
flags.DEFINE_integer("new_tokens", 128, "New tokens per sample.")
flags.DEFINE_integer("hidden", 256, "Hidden size.")
flags.DEFINE_integer("layers", 4, "Layers.")
flags.DEFINE_integer("vocab", 4096, "Vocabulary size.")
flags.DEFINE_integer("sample_chunk", 0, "Samples per prompt decoded at once (0: all).")
flags.DEFINE_integer("repeats", 2, "Timed repetitions (best is reported).")
flags.DEFINE_integer("threads", 0, "torch threads (0: as many as JAX's CPU backend uses, os.cpu_count()).")
flags.DEFINE_bool("skip_hf", False, "Only time our sampler.")


def _best(fn, repeats):
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def main(_):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from rollouts_jax import models, sampling

  threads = FLAGS.threads or os.cpu_count()
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  B, N, P, T = FLAGS.batch, FLAGS.num_samples, FLAGS.prompt_len, FLAGS.new_tokens
  hf_conf = transformers.LlamaConfig(
      vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden, intermediate_size=FLAGS.hidden * 4,
      num_hidden_layers=FLAGS.layers, num_attention_heads=max(FLAGS.hidden // 64, 1),
      num_key_value_heads=max(FLAGS.hidden // 128, 1), max_position_embeddings=4096,
      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
  hf_model = transformers.LlamaForCausalLM(hf_conf).eval()
  with tempfile.TemporaryDirectory() as d:
    hf_model.save_pretrained(d, safe_serialization=True)
    cfg, params = models.load_hf_checkpoint(d, dtype=jnp.float32)
  print(f"model: llama hidden={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads}/"
        f"{cfg.num_kv_heads} vocab={cfg.vocab_size} params={cfg.num_params() / 1e6:.2f}M")
  print(f"shape: batch={B} samples/prompt={N} prompt_len={P} new_tokens={T} "
        f"devices={jax.devices()} torch_threads={threads}")

  rng = np.random.default_rng(0)
  prompt = rng.integers(1, cfg.vocab_size, size=(B, P)).astype(np.int32)
  mask = np.ones((B, P), bool)
  conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0,
                                 eos_id=None, sample_chunk=FLAGS.sample_chunk, prompt_buckets=())

  def ours(seed=0):
    out = sampling.sample(cfg, params, prompt, mask, jax.random.key(seed), conf)
    return jax.block_until_ready(out)

  t0 = time.perf_counter()
  out = ours()
  first = time.perf_counter() - t0
  ours_s = _best(ours, FLAGS.repeats)
  compile_s = max(first - ours_s, 0.0)
  n_tokens = B * N * T
  assert int(out.lengths.sum()) == n_tokens
  ours_tps = n_tokens / ours_s
  print(f"rollouts_jax: {ours_s:.2f} s for {n_tokens} tokens = {ours_tps:,.0f} tokens/s "
        f"(first call {first:.2f} s; compile ~{compile_s:.2f} s apart)")

  # FLOPs actually done: matmuls per token (2 * weights) and attention over the fixed-length cache.
  S = P + T
  matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # the embedding is a gather
  attn_per_token = 4 * cfg.num_layers * S * cfg.num_heads * cfg.head_dim
  flops = B * P * (2 * matmul_params + attn_per_token) + B * N * T * (2 * matmul_params + attn_per_token)
  M = 512
  a = jnp.asarray(rng.standard_normal((M, 2048)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((2048, 2048)), jnp.float32)
  mm = jax.jit(jnp.dot)
  jax.block_until_ready(mm(a, b))
  mm_s = _best(lambda: jax.block_until_ready(mm(a, b)), 5)
  mm_flops = 2 * M * 2048 * 2048 / mm_s
  ours_flops = flops / ours_s
  print(f"achieved {ours_flops / 1e9:.1f} GFLOP/s vs matmul {mm_flops / 1e9:.1f} GFLOP/s "
        f"= {ours_flops / mm_flops:.1%} of matmul throughput")

  if FLAGS.skip_hf:
    return
  ids_t = torch.tensor(prompt, dtype=torch.long)
  mask_t = torch.ones_like(ids_t)

  def theirs():
    with torch.no_grad():
      return hf_model.generate(input_ids=ids_t, attention_mask=mask_t, do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, num_return_sequences=N, max_new_tokens=T,
                               min_new_tokens=T, eos_token_id=None, pad_token_id=0)

  seq = theirs()
  assert seq.shape == (B * N, P + T), seq.shape
  hf_s = _best(theirs, FLAGS.repeats)
  hf_tps = n_tokens / hf_s
  print(f"transformers generate: {hf_s:.2f} s = {hf_tps:,.0f} tokens/s")
  print(f"ratio (rollouts_jax / transformers): {ours_tps / hf_tps:.2f}x")


if __name__ == "__main__":
  app.run(main)
