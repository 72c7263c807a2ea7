"""The decode engine: prefill, per-row draws, the decode step and its state, the segmented loop.

Decode attention is shared-prefix (cascade) attention (`kernels.decode_attention`): the
prompt's keys and values are stored once per prompt, never copied per sample, and the N
samples' queries of a prompt meet them in one contraction; each sample's own generated
tokens live in per-layer buffers (heads before slots, keys head_dim before slot) that grow
between a few segments of the decode (`cache_views`), so attention covers the filled part
of the cache without recompiling per step; the two parts are merged by log-sum-exp.

Each sample draws from its own random stream (the call's key folded with the sample's
index, then with the step: `row_uniforms`), so outputs do not depend on the chunk, the
batch or the memory budget. `sample`, `continue_from`, trees, DeepLook and multi-turn
decoding are built from these pieces.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from rollouts_jax import models
from rollouts_jax import sharding
from rollouts_jax.kernels import decode_attention
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.models import transformer
from rollouts_jax.sampling.config import SamplingConfig, process_logits

def inverse_cdf_draw(u_R: jax.Array, probs_RxV: jax.Array, block: int = 64) -> jax.Array:
  """One draw per row from `probs` given one uniform number in [0, 1) per row.

  Two levels: the CDF over blocks of `block` tokens picks a block, then the CDF inside
  that block picks the token (a full-vocabulary cumsum was 60% of the sampling time on
  XLA:CPU). The uniform is scaled by the row's total mass. A zero-probability token (or
  block) has the same CDF as the one before it, so the first index whose CDF exceeds u is
  never one; rounding past a block's last positive token is clamped back to it.
  """
  R, V = probs_RxV.shape
  if V <= 2 * block:
    block = V
  pad = (-V) % block
  p_RxNxB = jnp.pad(probs_RxV, ((0, 0), (0, pad))).reshape(R, -1, block)
  last_positive = lambda x: x.shape[-1] - 1 - jnp.argmax((x > 0)[..., ::-1], axis=-1)
  totals_RxN = jnp.sum(p_RxNxB, axis=-1)
  cdf_RxN = jnp.cumsum(totals_RxN, axis=-1)
  u_R = u_R * cdf_RxN[:, -1]
  blk = jnp.minimum(jnp.sum(cdf_RxN <= u_R[:, None], axis=-1), last_positive(totals_RxN))
  offset = jnp.where(blk > 0, jnp.take_along_axis(cdf_RxN, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  p_RxB = jnp.take_along_axis(p_RxNxB, blk[:, None, None], axis=1)[:, 0]
  cdf_RxB = offset[:, None] + jnp.cumsum(p_RxB, axis=-1)
  token = jnp.minimum(jnp.sum(cdf_RxB <= u_R[:, None], axis=-1), last_positive(p_RxB))
  return (blk * block + token).astype(jnp.int32)


def choose(logits_RxV: jax.Array, u_R: jax.Array, config: SamplingConfig):
  """One token per row drawn with uniforms `u_R` from the sampling distribution of `config`.

  Returns:
    (token int32 [R], its log-prob under the sampling distribution (0 when greedy), its
    log-prob under the unmodified policy, the policy's entropy), each [R].
  """
  policy_logp = jax.nn.log_softmax(logits_RxV.astype(jnp.float32), axis=-1)
  policy_p = jnp.exp(policy_logp)
  entropy = -jnp.sum(policy_p * policy_logp, axis=-1)
  if config.is_greedy:
    token = jnp.argmax(policy_logp, axis=-1).astype(jnp.int32)
    sample_lp = jnp.zeros(token.shape, jnp.float32)
  else:
    untouched = (config.temperature == 1.0 and not (config.top_k and config.top_k < logits_RxV.shape[-1])
                 and config.top_p >= 1.0 and config.min_p <= 0.0)
    if untouched:  # the sampling distribution is the policy: reuse it
      sample_logp, sample_p = policy_logp, policy_p
    else:
      sample_logp = jax.nn.log_softmax(process_logits(logits_RxV, config), axis=-1)
      sample_p = jnp.exp(sample_logp)
    token = inverse_cdf_draw(u_R, sample_p)
    sample_lp = jnp.take_along_axis(sample_logp, token[:, None], axis=-1)[:, 0]
  policy_lp = jnp.take_along_axis(policy_logp, token[:, None], axis=-1)[:, 0]
  return token, sample_lp, policy_lp, entropy


def row_uniforms(row_keys_R: jax.Array, step) -> jax.Array:
  """One uniform per row, a function of (that row's key, its completion position) only.

  Each sample owns a key (folded from the call's key and its sample index), so what a
  sample draws does not depend on which chunk it was decoded in, nor on the batch. `step`
  is a scalar or, for continued rows, a per-row [R] completion position, so a row resumed
  from its first t tokens draws what it would have drawn uninterrupted.
  """
  step_R = jnp.broadcast_to(jnp.asarray(step, jnp.int32), row_keys_R.shape[:1])
  return jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (), jnp.float32))(row_keys_R, step_R)


def layer_params(cfg: ModelConfig, params: Params) -> tuple:
  """Each layer's parameters, sliced from the stacked `params["layers"]` (once, before decoding)."""
  return tuple(jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(cfg.num_layers))


def tokens_forward(cfg: ModelConfig, params: Params, layers: tuple, k_cache: tuple, v_cache: tuple, tokens_RxM,
                   positions_RxM, slot_R, visible_RxMxS):
  """M tokens per row through the model against a flat per-row cache; returns (logits, k_cache, v_cache).

  Each layer's cache is [R, S, K, Dh]; the tokens' keys and values are written at slots
  [slot_R, slot_R + M) and each query sees the slots `visible_RxMxS` allows. The verification
  and drafting forward of self-speculative decoding (EfficientRollout).
  """
  x = transformer.embed(params, tokens_RxM, transformer.activation_dtype(cfg, params))
  put = jax.vmap(lambda c, new, s: jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (s, 0, 0)))
  ks, vs = list(k_cache), list(v_cache)
  for l, lp in enumerate(layers):
    q, k, v = transformer.qkv(cfg, lp, x, positions_RxM)
    ks[l], vs[l] = put(ks[l], k, slot_R), put(vs[l], v, slot_R)
    attn = transformer.attend(cfg, q, ks[l].astype(q.dtype), vs[l].astype(q.dtype), visible_RxMxS)
    x = transformer.finish_layer(cfg, lp, x, attn)
  return models.unembed(cfg, params, x).astype(jnp.float32), tuple(ks), tuple(vs)


@flax.struct.dataclass
class DecodeState:
  """What a decoding step reads and writes (R rows, T = max_new_tokens)."""
  step: jax.Array            # int32 scalar: next completion position
  kt: tuple                   # per layer [R, K, Dh, T]: generated keys (head_dim before slot)
  v: tuple                    # per layer [R, K, T, Dh]: generated values
  logits_RxV: jax.Array       # logits for the token at `step`
  tokens_RxT: jax.Array
  logprobs_RxT: jax.Array
  policy_logprobs_RxT: jax.Array
  entropy_RxT: jax.Array
  mask_RxT: jax.Array
  done_R: jax.Array


@flax.struct.dataclass
class Prefix:
  """What every decoding step reads and never writes.

  The prompts' keys and values are stored once per prompt (never copied per sample).
  Layers are unrolled over per-layer buffers: carried through a `scan` over layers, a
  stacked cache was copied at every layer of every step by XLA:CPU (5-10x the step time).
  """
  layers: tuple               # per layer: that layer's parameters (sliced once, before decoding)
  k: tuple                    # per layer [B, K, P, Dh]
  v: tuple                    # per layer [B, K, P, Dh]
  mask: jax.Array             # bool [B, P]
  positions_R: jax.Array      # int32 [R]: rotary position of each row's first generated token
  offset_R: jax.Array | None = None  # int32 [R]: completion tokens before the first decoded one
  limit_R: jax.Array | None = None   # int32 [R]: at most this many tokens are decoded per row


def decode_forward(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: Prefix,
                   state: DecodeState, token_R: jax.Array, view: int):
  """Runs one token per row through the model; attends to the prompt and to slots [0, step].

  The generated-token buffers hold `view` slots (the current segment's); only the first
  `step + 1` are attended.

  Returns:
    (float32 logits [R, V] for the next token, keys per layer, values per layer) with the
    token's keys and values written at slot `state.step`.
  """
  B = prefix.mask.shape[0]
  R = token_R.shape[0]
  n, K, G, Dh = R // B, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  step = state.step
  positions = (prefix.positions_R + step)[:, None]
  x = transformer.embed(params, token_R[:, None], transformer.activation_dtype(cfg, params))
  kts, vs = list(state.kt), list(state.v)
  for l, lp in enumerate(prefix.layers):
    q, k, v = transformer.qkv(cfg, lp, x, positions)
    kts[l] = jax.lax.dynamic_update_slice(kts[l], jnp.transpose(k, (0, 2, 3, 1)).astype(kts[l].dtype),
                                          (0, 0, 0, step))
    vs[l] = jax.lax.dynamic_update_slice(vs[l], jnp.transpose(v, (0, 2, 1, 3)).astype(vs[l].dtype),
                                         (0, 0, step, 0))
    attn = decode_attention.decode_attention(
        q.reshape(B, n, K, G, Dh), prefix.k[l].astype(q.dtype), prefix.v[l].astype(q.dtype), prefix.mask,
        kts[l].astype(q.dtype), vs[l].astype(q.dtype), step + 1,
        implementation=config.attention_implementation)
    x = transformer.finish_layer(cfg, lp, x, attn.reshape(R, 1, -1))
  return models.unembed(cfg, params, x)[:, 0], tuple(kts), tuple(vs)


def sample_step(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: Prefix,
                row_keys_R: jax.Array, view: int, state: DecodeState) -> DecodeState:
  """One decoding step: choose a token per row, write it, run it through the model."""
  position = state.step if prefix.offset_R is None else state.step + prefix.offset_R
  u = row_uniforms(row_keys_R, position)
  token, lp, plp, ent = choose(state.logits_RxV, u, config)
  live = ~state.done_R
  token = jnp.where(live, token, config.pad_id)
  zero = jnp.zeros_like(lp)
  put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, state.step, axis=1)
  done = state.done_R
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  if prefix.limit_R is not None:
    done = done | (state.step + 1 >= prefix.limit_R)
  logits, kt, v = decode_forward(cfg, config, params, prefix, state, token, view)
  return DecodeState(
      step=state.step + 1, kt=kt, v=v, logits_RxV=logits,
      tokens_RxT=put(state.tokens_RxT, token),
      logprobs_RxT=put(state.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(state.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(state.entropy_RxT, jnp.where(live, ent, zero)),
      mask_RxT=put(state.mask_RxT, live), done_R=done)


def cache_views(max_new_tokens: int, segments: int) -> tuple[int, ...]:
  """The growing lengths through which decoding attends to its generated tokens.

  Steps `[views[i-1], views[i])` attend to the first `views[i]` generated slots (one
  compiled loop per view), so attention work follows the filled part of the cache.

  >>> cache_views(128, 4)
  (32, 64, 96, 128)
  >>> cache_views(5, 4)
  (5,)
  """
  seg = -(-max_new_tokens // max(int(segments), 1))
  seg = -(-seg // 8) * 8
  return tuple(min(max_new_tokens, seg * (i + 1)) for i in range(-(-max_new_tokens // seg)))


def decode(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: Prefix, first_logits_RxV, row_keys_R,
           shard_ctx, stop_groups: tuple[int, int] | None = None) -> DecodeState:
  """Decodes R rows from `first_logits_RxV`: one `lax.while_loop` of `sample_step` per `cache_views` view.

  Rows start empty (or done where `prefix.limit_R` <= 0) and stop at EOS, at `prefix.limit_R`
  tokens or at `max_new_tokens`. With `stop_groups=(group_size, target)` decoding also stops
  once `target` groups of `group_size` consecutive rows are all done.
  """
  R, T = first_logits_RxV.shape[0], config.max_new_tokens
  L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  zeros = jnp.zeros((R, T), jnp.float32)
  dtype = prefix.k[0].dtype
  kt_axes, v_axes = ("batch", "kv_heads", "head_dim", "seq"), ("batch", "kv_heads", "seq", "head_dim")
  views = cache_views(T, config.length_segments)
  state = DecodeState(
      step=jnp.zeros((), jnp.int32),
      kt=tuple(jnp.zeros((R, K, Dh, views[0]), dtype) for _ in range(L)),
      v=tuple(jnp.zeros((R, K, views[0], Dh), dtype) for _ in range(L)),
      logits_RxV=first_logits_RxV,
      tokens_RxT=jnp.full((R, T), config.pad_id, jnp.int32), logprobs_RxT=zeros,
      policy_logprobs_RxT=zeros, entropy_RxT=zeros, mask_RxT=jnp.zeros((R, T), bool),
      done_R=jnp.zeros((R,), bool) if prefix.limit_R is None else prefix.limit_R <= 0)

  def running(done_R):
    if stop_groups is None:
      return ~jnp.all(done_R)
    group_size, target = stop_groups
    finished_groups = jnp.sum(jnp.all(done_R.reshape(-1, group_size), axis=1))
    return (finished_groups < target) & ~jnp.all(done_R)

  for i, view in enumerate(views):
    if i:
      # The generated-token cache grows between segments (one copy per segment): attention
      # inside a segment reads whole buffers, never a slice of a buffer updated in place
      # (which XLA:CPU answers with a copy of the buffer at every step).
      grow = view - views[i - 1]
      state = state.replace(kt=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in state.kt),
                            v=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in state.v))
    state = state.replace(kt=tuple(sharding.constrain(x, kt_axes, shard_ctx) for x in state.kt),
                          v=tuple(sharding.constrain(x, v_axes, shard_ctx) for x in state.v))
    cond = lambda s, view=view: (s.step < view) & running(s.done_R)
    body = functools.partial(sample_step, cfg, config, params, prefix, row_keys_R, view)
    state = jax.lax.while_loop(cond, body, state)
  return state


def auto_sample_chunk(cfg: ModelConfig, config: SamplingConfig, batch: int) -> int:
  """Samples per prompt decoded at once: `config.sample_chunk`, or one that fits the budget.

  With `sample_chunk=0` the chunk is the largest that keeps the per-chunk decode state
  (generated keys and values, logits and their softmax temporaries, MLP activations and
  the [rows, T] outputs) within `config.decode_memory_mb`, then evened out so that chunks
  are equal. Peak memory is then set by the budget, not by `num_samples`.

  >>> cfg = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024,
  ...                   num_layers=4, num_heads=8, num_kv_heads=4)
  >>> auto_sample_chunk(cfg, SamplingConfig(num_samples=256, max_new_tokens=64), batch=8)  # 3 chunks
  86
  >>> auto_sample_chunk(cfg, SamplingConfig(num_samples=256, max_new_tokens=64, decode_memory_mb=32), batch=8)
  12
  >>> auto_sample_chunk(cfg, SamplingConfig(num_samples=256, sample_chunk=16), batch=2)
  16
  """
  N = config.num_samples
  if config.sample_chunk:
    return min(config.sample_chunk, N)
  itemsize = jnp.dtype(config.cache_dtype).itemsize if config.cache_dtype else 4
  T = config.max_new_tokens
  per_row = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * T * itemsize
             + 6 * cfg.vocab_size * 4 + 4 * cfg.intermediate_size * 4 + 6 * T * 4)
  rows = max(int(config.decode_memory_mb * 2 ** 20) // per_row, 1)
  chunk = max(min(rows // max(batch, 1), N), 1)
  num_chunks = -(-N // chunk)
  return -(-N // num_chunks)


def two_part_softmax(s1, s2):
  """Softmax over the concatenation of two score sets (last axis), returned as its two parts."""
  m = jnp.maximum(jnp.max(s1, axis=-1, keepdims=True), jnp.max(s2, axis=-1, keepdims=True))
  p1, p2 = jnp.exp(s1 - m), jnp.exp(s2 - m)
  total = jnp.sum(p1, axis=-1, keepdims=True) + jnp.sum(p2, axis=-1, keepdims=True)
  return p1 / total, p2 / total


def prefix_forward(cfg: ModelConfig, params: Params, prompt_k, prompt_v, prompt_mask, start_R, tokens_RxL, mask_RxL):
  """Rows' prefixes through the model, each attending to its prompt's keys and causally to itself.

  Args:
    cfg, params: the model.
    prompt_k, prompt_v: per layer [R, K, P, Dh], each row's prompt keys / values (post-rotary).
    prompt_mask: bool [R, P].
    start_R: int32 [R], the rotary position of each row's first prefix token.
    tokens_RxL, mask_RxL: the prefixes, left-aligned.
  Returns:
    (keys per layer [R, K, Dh, L], values per layer [R, K, L, Dh], float32 logits [R, V]
    after each row's last prefix token).
  """
  R, L = tokens_RxL.shape
  K, G, Dh = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  positions = start_R[:, None] + jnp.arange(L)[None, :]
  own_RxLxL = jnp.tril(jnp.ones((L, L), bool))[None] & mask_RxL[:, None, :]
  x = transformer.embed(params, tokens_RxL, transformer.activation_dtype(cfg, params))
  scale = Dh ** -0.5
  kts, vs = [], []
  for l in range(cfg.num_layers):
    lp = jax.tree.map(lambda a, l=l: a[l], params["layers"])
    q, k, v = transformer.qkv(cfg, lp, x, positions)
    kts.append(jnp.transpose(k, (0, 2, 3, 1)))
    vs.append(jnp.transpose(v, (0, 2, 1, 3)))
    qr = q.reshape(R, L, K, G, Dh)
    s1 = jnp.einsum("rlkgd,rkpd->rklgp", qr, prompt_k[l].astype(q.dtype), preferred_element_type=jnp.float32)
    s1 = jnp.where(prompt_mask[:, None, None, None, :], s1 * scale, decode_attention.NEG_INF)
    s2 = jnp.einsum("rlkgd,rskd->rklgs", qr, k, preferred_element_type=jnp.float32)
    s2 = jnp.where(own_RxLxL[:, None, :, None, :], s2 * scale, decode_attention.NEG_INF)
    p1, p2 = two_part_softmax(s1, s2)
    o = (jnp.einsum("rklgp,rkpd->rlkgd", p1, prompt_v[l].astype(jnp.float32))
         + jnp.einsum("rklgs,rskd->rlkgd", p2, v.astype(jnp.float32)))
    x = transformer.finish_layer(cfg, lp, x, o.reshape(R, L, K * G * Dh).astype(x.dtype))
  last = jnp.maximum(jnp.sum(mask_RxL, axis=1) - 1, 0)
  h = jnp.take_along_axis(x, last[:, None, None], axis=1)
  return tuple(kts), tuple(vs), models.unembed(cfg, params, h)[:, 0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def prefill(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask):
  """Each prompt prefilled once: keys / values per layer [B, K, P, Dh], logits [B, V], lengths [B]."""
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, P = prompt_ids.shape
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  cache = models.init_cache(cfg, B, P, cache_dtype)
  logits, cache = models.forward_with_cache(cfg, params, jnp.where(prompt_mask, prompt_ids, 0), cache, prompt_mask,
                                            last_only=True)
  to_heads = lambda x: tuple(jnp.transpose(x[l], (0, 2, 1, 3)) for l in range(cfg.num_layers))
  return to_heads(cache.k), to_heads(cache.v), logits[:, 0], cache.next_pos


def row_suffix_attention(q, kt, v, valid_RxS):
  """Each row's attention to its own generated slots where `valid` (like the cascade's suffix part).

  Returns:
    (out [B, N, K, G, D] float32, lse [B, N, K, G]).
  """
  B, N, K, G, D = q.shape
  qr = q.reshape(B * N, K, G, D).astype(jnp.float32)
  s = jnp.sum(qr[..., None] * kt[:, :, None].astype(jnp.float32), axis=3) * (D ** -0.5)   # [R, K, G, S]
  s = jnp.where(valid_RxS[:, None, None, :], s, decode_attention.NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  o = jnp.sum(p[..., None] * v[:, :, None].astype(jnp.float32), axis=3) / l[..., None]
  return o.reshape(B, N, K, G, D), (m[..., 0] + jnp.log(l)).reshape(B, N, K, G)


def resume_step(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: Prefix, row_keys_R: jax.Array,
                state: DecodeState) -> DecodeState:
  """One decoding step of resumed rows: row r writes completion position offset_r + step.

  The generated buffers hold each row's completion by position (its prefix in the first
  slots), so rows of one prompt resume from different lengths while still sharing the
  prompt's keys; writes past a buffer (rows already done) are dropped.
  """
  B = prefix.mask.shape[0]
  R = row_keys_R.shape[0]
  n, K, G, Dh = R // B, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  pos = prefix.offset_R + state.step
  token, lp, plp, ent = choose(state.logits_RxV, row_uniforms(row_keys_R, pos), config)
  live = ~state.done_R
  token = jnp.where(live, token, config.pad_id)
  rows = jnp.arange(R)
  put = lambda buf, val: buf.at[rows, pos].set(val, mode="drop")
  done = state.done_R | (pos + 1 >= config.max_new_tokens)
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  x = transformer.embed(params, token[:, None], transformer.activation_dtype(cfg, params))
  positions = (prefix.positions_R + pos)[:, None]
  valid = jnp.arange(state.kt[0].shape[-1])[None, :] <= pos[:, None]
  kts, vs = list(state.kt), list(state.v)
  for l, lp_l in enumerate(prefix.layers):
    q, k, v = transformer.qkv(cfg, lp_l, x, positions)
    kts[l] = kts[l].at[rows, :, :, pos].set(k[:, 0].astype(kts[l].dtype), mode="drop")
    vs[l] = vs[l].at[rows, :, pos, :].set(v[:, 0].astype(vs[l].dtype), mode="drop")
    qg = q.reshape(B, n, K, G, Dh)
    o1, lse1 = decode_attention.prefix_part(qg, prefix.k[l].astype(q.dtype), prefix.v[l].astype(q.dtype), prefix.mask)
    o2, lse2 = row_suffix_attention(qg, kts[l], vs[l], valid)
    attn, _ = decode_attention.merge(o1, lse1, o2, lse2)
    x = transformer.finish_layer(cfg, lp_l, x, attn.reshape(R, 1, -1).astype(x.dtype))
  zero = jnp.zeros_like(lp)
  return DecodeState(
      step=state.step + 1, kt=tuple(kts), v=tuple(vs), logits_RxV=models.unembed(cfg, params, x)[:, 0],
      tokens_RxT=put(state.tokens_RxT, token),
      logprobs_RxT=put(state.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(state.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(state.entropy_RxT, jnp.where(live, ent, zero)),
      mask_RxT=put(state.mask_RxT, live), done_R=done)
