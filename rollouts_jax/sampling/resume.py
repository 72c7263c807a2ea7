"""`continue_from`: resume partial completions from their prefixes (partial rollouts, APRIL)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax import sharding
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.config import (SampleOutput, SamplingConfig, bucket_length, check_prompts, finished_rows,
                                          left_pad_to)


def continue_from(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, prefix_ids, prefix_mask,
                  key: jax.Array, config: SamplingConfig, *, prefix_logprobs=None, prefix_policy_logprobs=None,
                  prefix_entropy=None, finished=None, stop_after_groups: int = 0) -> SampleOutput:
  """Resumes N partial completions per prompt from their prefixes (partial rollouts).

  Row (b, n) continues after its prefix's `len(b, n)` tokens until EOS or until it holds
  `config.max_new_tokens` tokens in all. Its random stream is sample b * N + n of `key`
  with the draws at completion positions len, len + 1, ... . So resuming the first t
  tokens of `sample(..., key, config)` under the same params draws the same uniforms the
  uninterrupted sample did (the tokens then agree up to the numerics of a prefill against
  a decode). A fresh prompt is a continuation from an empty prefix.

  Cost: each prompt is prefilled once; only the rows that hold a prefix and still run put
  their prefix through the model, against their prompt's keys (in a power-of-two bucket of
  rows); then the N rows of a prompt decode together against the prompt's keys stored once
  (cascade attention, the XLA form whatever `attention_implementation` says), each row
  writing its own completion positions. Memory grows with B * N (`sample_chunk` does not
  apply).

  Args:
    cfg, params: the model (the policy that now continues the rows).
    prompt_ids, prompt_mask: int32 / bool [B, P], left-padded, as for `sample`.
    prefix_ids: int32 [B, N, L] (L <= max_new_tokens), each row's completion so far.
    prefix_mask: bool [B, N, L], True on a left-aligned run of tokens (the prefix).
    key: PRNG key.
    config: the SamplingConfig; `num_samples` is ignored (N comes from the prefixes).
    prefix_logprobs, prefix_policy_logprobs, prefix_entropy: optional float32 [B, N, L],
      kept as the outputs' values at prefix positions (the earlier policy's behaviour
      log-probs survive the resume; zeros where not given).
    finished: optional bool [B, N], rows not to extend (also implied by an EOS in the
      prefix or a full-length prefix).
    stop_after_groups: if > 0, decoding stops once this many prompts have every one of
      their N rows finished (APRIL's early stop); the other rows come back partial, with
      `finished_rows` False, to be resumed later. 0: every row runs to its end.
  Returns:
    A SampleOutput [B, N, T]: prefixes followed by their continuations.
  Raises:
    ValueError: for mismatched shapes, a prefix longer than max_new_tokens, a prefix mask
      that is not left-aligned, and every error `sample` raises for its prompts.

  >>> cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
  ...                   num_heads=2, num_kv_heads=1, head_dim=8)
  >>> params = models.init_params(cfg, jax.random.key(0))
  >>> config = SamplingConfig(num_samples=2, max_new_tokens=6, prompt_buckets=())
  >>> ids, mask = jnp.array([[3, 4, 5]]), jnp.ones((1, 3), bool)
  >>> from rollouts_jax.sampling import sample
  >>> full = sample(cfg, params, ids, mask, jax.random.key(1), config)
  >>> part = full.completion_ids[:, :, :2]
  >>> resumed = continue_from(cfg, params, ids, mask, part, jnp.ones_like(part, bool),
  ...                         jax.random.key(1), config)
  >>> bool((resumed.completion_ids[:, :, :2] == part).all())
  True
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} "
                     f"and {prompt_mask.shape}.")
  B = prompt_ids.shape[0]
  if prefix_ids.ndim != 3 or prefix_mask.shape != prefix_ids.shape or prefix_ids.shape[0] != B:
    raise ValueError(f"prefix_ids and prefix_mask must both be [B={B}, N, L]; got {prefix_ids.shape} "
                     f"and {prefix_mask.shape}.")
  _, N, L = prefix_ids.shape
  T = config.max_new_tokens
  if L > T:
    raise ValueError(f"Prefixes hold {L} columns, more than max_new_tokens={T}.")
  for name, value in (("prefix_logprobs", prefix_logprobs), ("prefix_policy_logprobs", prefix_policy_logprobs),
                      ("prefix_entropy", prefix_entropy)):
    if value is not None and tuple(value.shape) != (B, N, L):
      raise ValueError(f"{name} must be [B, N, L]={(B, N, L)}, got {tuple(value.shape)}.")
  if finished is not None and tuple(finished.shape) != (B, N):
    raise ValueError(f"finished must be [B, N]={(B, N)}, got {tuple(finished.shape)}.")
  if not 0 <= int(stop_after_groups) <= B:
    raise ValueError(f"stop_after_groups must be in [0, B={B}], got {stop_after_groups}.")
  pm = np.asarray(jax.device_get(prefix_mask), bool)
  if (pm[..., 1:] & ~pm[..., :-1]).any():
    raise ValueError("prefix_mask must be True on a left-aligned run of each row (no gap after the first "
                     "False); right-pad the prefixes.")
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  prefix_ids = jnp.where(pm, jnp.asarray(prefix_ids, jnp.int32), 0)
  done = finished_rows(prefix_ids, jnp.asarray(pm), config)
  if finished is not None:
    done = done | jnp.asarray(finished, bool)
  ids, mask = left_pad_to(prompt_ids, prompt_mask, bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets),
                          config.pad_id)
  ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  # Each prompt is prefilled once; its N rows decode against its keys together.
  prompt_k, prompt_v, first, next_pos = engine.prefill(cfg, config, params, ids, mask)
  R = B * N
  slots = _resume_views(T, L, config.length_segments)[0]
  # Only rows that hold a prefix and still run need their prefix's keys and values.
  resume = np.flatnonzero((pm.any(-1) & ~np.asarray(jax.device_get(done))).reshape(-1))
  if resume.size:
    rows = np.full((_resume_bucket(resume.size, R),), R, np.int32)
    rows[:resume.size] = resume
    kt, v, first = _resume_rows_jit(cfg, params, prompt_k, prompt_v, mask, next_pos, first, jnp.asarray(rows),
                                    prefix_ids.reshape(R, L), jnp.asarray(pm.reshape(R, L)), slots=slots)
  else:
    K, Dh = cfg.num_kv_heads, cfg.head_dim
    kt = tuple(jnp.zeros((R, K, Dh, slots), prompt_k[0].dtype) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros((R, K, slots, Dh), prompt_k[0].dtype) for _ in range(cfg.num_layers))
    first = jnp.repeat(first, N, axis=0)
  given = lambda x: (jnp.zeros((B, N, L), jnp.float32) if x is None
                     else jnp.where(pm, jnp.asarray(x, jnp.float32), 0.0))
  stop = (N, int(stop_after_groups)) if stop_after_groups else None
  return _resume_jit(cfg, config, params, prompt_k, prompt_v, mask, next_pos, kt, v, first, prefix_ids,
                     jnp.asarray(pm), given(prefix_logprobs), given(prefix_policy_logprobs), given(prefix_entropy),
                     done, key, shard_ctx=sharding.current_context(), stop_groups=stop)


def _resume_bucket(rows: int, total: int) -> int:
  """Rows whose prefixes run are padded to a power of two (at least 8, at most `total`).

  >>> _resume_bucket(3, 96), _resume_bucket(20, 96), _resume_bucket(90, 96)
  (8, 32, 96)
  """
  return min(max(8, 1 << max(int(rows) - 1, 0).bit_length()), int(total))


def _resume_views(max_new_tokens: int, prefix_len: int, segments: int) -> tuple[int, ...]:
  """`cache_views` starting at the first view that holds the prefix columns.

  >>> _resume_views(40, 0, 4), _resume_views(40, 20, 4), _resume_views(40, 40, 4)
  ((16, 32, 40), (32, 40), (40,))
  """
  views = engine.cache_views(max_new_tokens, segments)
  first = next((v for v in views if v >= max(prefix_len, 1)), max_new_tokens)
  return (first,) + tuple(v for v in views if v > first)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("slots",))
def _resume_rows_jit(cfg: ModelConfig, params: Params, prompt_k, prompt_v, prompt_mask, next_pos, first_BxV, rows_M,
                     prefix_ids_RxL, prefix_mask_RxL, *, slots: int):
  """Where resumed rows start decoding: their prefixes' keys / values and the logits after them.

  Only rows `rows_M` (an index of R marks an unused entry) run their prefix, against their
  prompt's keys; the result fills generated slots [0, L) of [R, K, Dh, slots] buffers. Every
  other row keeps empty buffers and its prompt's next-token logits.
  """
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B = prompt_mask.shape[0]
  R, L = prefix_ids_RxL.shape
  N = R // B
  b_M = jnp.minimum(rows_M, R - 1) // N
  take = lambda x: jnp.take(x, rows_M, axis=0, mode="clip")
  kts, vs, logits = engine.prefix_forward(cfg, params, tuple(x[b_M] for x in prompt_k),
                                          tuple(x[b_M] for x in prompt_v), prompt_mask[b_M], next_pos[b_M],
                                          take(prefix_ids_RxL), take(prefix_mask_RxL))
  K, Dh, dtype = cfg.num_kv_heads, cfg.head_dim, prompt_k[0].dtype
  put = lambda shape, val: jnp.zeros(shape, dtype).at[rows_M].set(val.astype(dtype), mode="drop")
  kt = tuple(put((R, K, Dh, slots), jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, slots - L)))) for x in kts)
  v = tuple(put((R, K, slots, Dh), jnp.pad(x, ((0, 0), (0, 0), (0, slots - L), (0, 0)))) for x in vs)
  first = jnp.repeat(first_BxV, N, axis=0).at[rows_M].set(logits, mode="drop")
  return kt, v, first


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("shard_ctx", "stop_groups"))
def _resume_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_k, prompt_v, prompt_mask, next_pos,
                kt, v, first_RxV, prefix_ids, prefix_mask, prefix_lp, prefix_plp, prefix_ent, done_BxN, key,
                shard_ctx: sharding.ShardingContext | None = None, stop_groups: tuple[int, int] | None = None):
  """Decodes resumed rows [B, N] against their prompts' shared keys; returns the SampleOutput."""
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, N, L = prefix_ids.shape
  R, T = B * N, config.max_new_tokens
  views = _resume_views(T, L, config.length_segments)
  layers = engine.layer_params(cfg, params)
  lengths = jnp.sum(prefix_mask, axis=-1, dtype=jnp.int32).reshape(R)
  pad_T = lambda x: jnp.pad(x.reshape(R, L), ((0, 0), (0, T - L)))
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(R, dtype=jnp.int32))
  kv_axes = ("batch", "kv_heads", "seq", "head_dim")
  heads = lambda xs: tuple(sharding.constrain(x, kv_axes, shard_ctx) for x in xs)
  prefix = engine.Prefix(layers=layers, k=heads(prompt_k), v=heads(prompt_v), mask=prompt_mask,
                         positions_R=jnp.repeat(next_pos, N), offset_R=lengths)
  state = engine.DecodeState(
      step=jnp.zeros((), jnp.int32), kt=kt, v=v, logits_RxV=first_RxV,
      tokens_RxT=jnp.where(pad_T(prefix_mask), pad_T(prefix_ids), config.pad_id),
      logprobs_RxT=pad_T(prefix_lp), policy_logprobs_RxT=pad_T(prefix_plp), entropy_RxT=pad_T(prefix_ent),
      mask_RxT=pad_T(prefix_mask), done_R=done_BxN.reshape(R) | (lengths >= T))

  def running(s):
    if stop_groups is None:
      return ~jnp.all(s.done_R)
    group_size, target = stop_groups
    finished = jnp.sum(jnp.all(s.done_R.reshape(-1, group_size), axis=1))
    return (finished < target) & ~jnp.all(s.done_R)

  body = functools.partial(engine.resume_step, cfg, config, params, prefix, row_keys)
  kt_axes, v_axes = ("batch", "kv_heads", "head_dim", "seq"), ("batch", "kv_heads", "seq", "head_dim")
  for i, view in enumerate(views):
    if i:   # the generated-token buffers grow between segments, as in `engine.decode`
      grow = view - views[i - 1]
      state = state.replace(kt=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in state.kt),
                            v=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in state.v))
    state = state.replace(kt=tuple(sharding.constrain(x, kt_axes, shard_ctx) for x in state.kt),
                          v=tuple(sharding.constrain(x, v_axes, shard_ctx) for x in state.v))
    # A segment ends when the furthest running row would write past its buffers.
    cond = lambda s, view=view: running(s) & (jnp.max(jnp.where(s.done_R, -1, prefix.offset_R + s.step)) < view)
    state = jax.lax.while_loop(cond, body, state)
  g = lambda x: x.reshape(B, N, T)
  return SampleOutput(completion_ids=g(state.tokens_RxT), completion_mask=g(state.mask_RxT),
                      logprobs=g(state.logprobs_RxT), policy_logprobs=g(state.policy_logprobs_RxT),
                      entropy=g(state.entropy_RxT), lengths=jnp.sum(g(state.mask_RxT), axis=-1, dtype=jnp.int32))
