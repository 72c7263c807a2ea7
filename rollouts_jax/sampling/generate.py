"""`sample`: N completions of each prompt (prefill once, then decode in chunks of samples).

The prompt batch is prefilled once. Decoding then runs `sample_chunk` samples per prompt
at a time (chunks one after another under `lax.map`; by default as many as fit
`decode_memory_mb`), each until every row has emitted EOS or `max_new_tokens` is reached.
A per-prompt `budget` decodes only the first `budget[b]` samples of prompt b.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax import sharding
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.config import SampleOutput, SamplingConfig, bucket_length, check_prompts, left_pad_to


def sample(cfg: ModelConfig, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
           key: jax.Array, config: SamplingConfig, budget=None) -> SampleOutput:
  """Samples `config.num_samples` completions for each left-padded prompt.

  Args:
    cfg: model configuration.
    params: params pytree (plain or FP4-quantized linear weights).
    prompt_ids: int32 [B, P], left-padded; ids of real tokens in [0, vocab_size) (padding
      ids are ignored).
    prompt_mask: bool [B, P], True at real prompt tokens. Every row needs at least one, and
      padding only on the left. The longest prompt + max_new_tokens must fit the model's
      max_position_embeddings.
    key: PRNG key; the same key gives the same samples.
    config: a SamplingConfig.
    budget: optional int [B] (host values in [0, N]): decode only the first `budget[b]`
      samples of prompt b (a prompt selector's per-prompt budget). The rows decoded are
      those samples alone, padded to a power of two (`budget_rows`), each on its own sample's
      random stream, so they equal the same samples of an unbudgeted call; the other samples
      come back empty (mask False, length 0). None: every prompt gets N.
  Returns:
    A SampleOutput with [B, N, T] arrays grouped by prompt.
  Raises:
    ValueError: before compiling, for: prompt too long for the buckets, the cache or the
      model's positions; token ids outside the vocabulary; an all-padding row; right
      padding; bad shapes or settings.

  out = sample(cfg, params, ids, mask, jax.random.key(0),
               SamplingConfig(num_samples=8, max_new_tokens=32, eos_id=2))
  out.completion_ids.shape
  # (B, 8, 32)
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} "
                     f"and {prompt_mask.shape}.")
  P = int(prompt_ids.shape[1])
  P_bucket = bucket_length(P, config.prompt_buckets)
  needed = P_bucket + config.max_new_tokens
  if config.cache_len is not None and needed > config.cache_len:
    raise ValueError(
        f"Prompt length {P} (bucketed to {P_bucket}) + max_new_tokens {config.max_new_tokens} = {needed} "
        f"exceeds the cache length {config.cache_len}.")
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, P_bucket, config.pad_id)
  B, N = int(prompt_ids.shape[0]), int(config.num_samples)
  if budget is not None:
    budget = np.asarray(jax.device_get(budget)).astype(np.int64).reshape(-1)
    if budget.shape != (B,) or budget.min(initial=0) < 0 or budget.max(initial=0) > N:
      raise ValueError(f"budget must be [B] = [{B}] values in [0, num_samples={N}]; got {budget.tolist()}.")
    if budget.sum() < B * N:
      return _sample_budget(cfg, params, np.asarray(prompt_ids), np.asarray(prompt_mask), key, config, budget)
  return sample_jit(cfg, config, params, jnp.asarray(prompt_ids, jnp.int32),
                    jnp.asarray(prompt_mask, bool), key, sharding.current_context())


def budget_rows(rows: int, total: int) -> int:
  """Rows a budgeted call decodes for `rows` samples: a power of two, at least 8, at most `total`.

  A handful of shapes compile however the budgets vary from step to step.

  >>> budget_rows(3, 64), budget_rows(20, 64), budget_rows(50, 64)
  (8, 32, 64)
  """
  return min(max(8, 1 << max(int(rows) - 1, 0).bit_length()), int(total))


def _sample_budget(cfg, params, prompt_ids, prompt_mask, key, config: SamplingConfig, budget) -> SampleOutput:
  """`sample` with per-prompt budgets: one row per budgeted sample, scattered back to [B, N, T]."""
  B, N, T = prompt_ids.shape[0], config.num_samples, config.max_new_tokens
  prompt_of = np.repeat(np.arange(B), budget)
  slot_of = np.concatenate([np.arange(b) for b in budget]) if B else np.zeros((0,), np.int64)
  R = int(prompt_of.size)
  if R == 0:
    z = np.zeros((B, N, T), np.float32)
    return SampleOutput(completion_ids=np.full((B, N, T), config.pad_id, np.int32), completion_mask=z.astype(bool),
                        logprobs=z, policy_logprobs=z, entropy=z, lengths=np.zeros((B, N), np.int32))
  rows = budget_rows(R, B * N)
  pad = rows - R   # filler rows repeat the last sample; they are decoded and dropped
  prompt_of = np.concatenate([prompt_of, np.full((pad,), prompt_of[-1])])
  slot_of = np.concatenate([slot_of, np.full((pad,), slot_of[-1])])
  out = sample_jit(cfg, dataclasses.replace(config, num_samples=1, sample_chunk=0), params,
                   jnp.asarray(prompt_ids[prompt_of], jnp.int32), jnp.asarray(prompt_mask[prompt_of], bool), key,
                   sharding.current_context(), row_ids=jnp.asarray(prompt_of * N + slot_of, jnp.int32))
  out = jax.device_get(out)

  def scatter(x, fill):
    full = np.full((B, N) + x.shape[2:], fill, x.dtype)
    full[prompt_of[:R], slot_of[:R]] = x[:R, 0]
    return full

  return SampleOutput(completion_ids=scatter(out.completion_ids, config.pad_id),
                      completion_mask=scatter(out.completion_mask, False), logprobs=scatter(out.logprobs, 0.0),
                      policy_logprobs=scatter(out.policy_logprobs, 0.0), entropy=scatter(out.entropy, 0.0),
                      lengths=scatter(out.lengths, 0))


@functools.partial(jax.jit, static_argnums=(0, 1, 6), static_argnames=("stop_groups",))
def sample_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask, key,
               shard_ctx: sharding.ShardingContext | None = None, row_ids=None, offset_R=None, limit_R=None,
               stop_groups: tuple[int, int] | None = None) -> SampleOutput:
  """The compiled body of `sample` for bucketed, checked prompts [B, P]; returns a SampleOutput [B, N, T].

  `row_ids` (int32 [B], with N = 1) gives row b the stream of sample `row_ids[b]`; `offset_R`
  and `limit_R` are `engine.Prefix`'s; `stop_groups` is `engine.decode`'s.
  """
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, P = prompt_ids.shape
  N, T = config.num_samples, config.max_new_tokens
  n = engine.auto_sample_chunk(cfg, config, B)
  num_chunks = -(-N // n)
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  prompt_ids = jnp.where(prompt_mask, prompt_ids, 0)  # padding never reaches the embedding table
  # Prefill: the prompt batch runs once, into a cache of P slots (layout hint for the cache:
  # identity unless sample() ran inside sharding.use_rules).
  cache = sharding.constrain_kv_cache(models.init_cache(cfg, B, P, cache_dtype), shard_ctx)
  logits_Bx1xV, cache = models.forward_with_cache(cfg, params, prompt_ids, cache, prompt_mask, last_only=True)
  cache = sharding.constrain_kv_cache(cache, shard_ctx)
  # Heads before slots, so the N samples' queries of a prompt meet its keys in one contraction.
  kv_axes = ("batch", "kv_heads", "seq", "head_dim")
  to_heads = lambda x: tuple(sharding.constrain(jnp.transpose(x[l], (0, 2, 1, 3)), kv_axes, shard_ctx)
                             for l in range(cfg.num_layers))
  prefix_k, prefix_v = to_heads(cache.k), to_heads(cache.v)
  layer_params = engine.layer_params(cfg, params)

  def run_chunk(chunk_index):
    # Rows are prompt-major: row b * n + j is sample chunk_index * n + j of prompt b.
    rep = lambda x: jnp.repeat(x, n, axis=0)
    sample_ids = (jnp.arange(B)[:, None] * N + chunk_index * n + jnp.arange(n)[None, :]).reshape(-1)
    if row_ids is not None:  # continued rows (N = 1): each keeps its original sample's stream
      sample_ids = row_ids
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(sample_ids)
    prefix = engine.Prefix(layers=layer_params, k=prefix_k, v=prefix_v, mask=prompt_mask,
                           positions_R=sharding.constrain(rep(cache.next_pos), ("batch",), shard_ctx),
                           offset_R=offset_R, limit_R=limit_R)
    s = engine.decode(cfg, config, params, prefix, rep(logits_Bx1xV[:, 0]), row_keys, shard_ctx, stop_groups)
    group = lambda x: x.reshape(B, n, T)
    return (group(s.tokens_RxT), group(s.mask_RxT), group(s.logprobs_RxT), group(s.policy_logprobs_RxT),
            group(s.entropy_RxT))

  outs = jax.lax.map(run_chunk, jnp.arange(num_chunks))
  # [chunks, B, n, T] -> [B, chunks * n, T] -> first N samples.
  outs = [jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * n, T)[:, :N] for o in outs]
  tokens, mask, lp, plp, ent = outs
  return SampleOutput(completion_ids=tokens, completion_mask=mask, logprobs=lp, policy_logprobs=plp,
                      entropy=ent, lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32))
