"""The rollout engine: prefill once, decode N samples per prompt under `lax.while_loop`.

The prompt batch is prefilled once. Decoding then runs `sample_chunk` samples per prompt
at a time (chunks one after another under `lax.map`; by default as many as fit
`decode_memory_mb`), each until every row has emitted EOS or `max_new_tokens` is reached.

Decode attention is shared-prefix (cascade) attention (`kernels.decode_attention`): the
prompt's keys and values are stored once per prompt, never copied per sample, and the N
samples' queries of a prompt meet them in one contraction; each sample's own generated
tokens live in per-layer buffers (heads before slots, keys head_dim before slot) that grow
between a few segments of the decode (`cache_views`), so attention covers the filled part
of the cache without recompiling per step; the two parts are merged by log-sum-exp.

Each sample draws from its own random stream (the call's key folded with the sample's
index, then with the step), so outputs do not depend on the chunk or the memory budget.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax import sharding
from rollouts_jax.kernels import decode_attention
from rollouts_jax.kernels.decode_attention import reference as _cascade
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.models import transformer as _tf

DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampling settings (hashable; a change recompiles).

  Attributes:
    num_samples: N, completions per prompt (>= 1; hundreds are fine, see `sample_chunk`).
    max_new_tokens: T, the completion length budget.
    temperature: softmax temperature; 0 means greedy.
    top_k: keep the k most likely tokens (0: off).
    top_p: nucleus sampling mass in (0, 1] (1: off).
    min_p: keep tokens with probability >= min_p * max probability (0: off).
    greedy: argmax decoding (also implied by temperature == 0).
    eos_id: one id or a tuple of ids that end a completion; None: never stop early.
    pad_id: written after EOS.
    sample_chunk: samples per prompt decoded at once (0: automatic, the most that fit
      `decode_memory_mb`; see `auto_sample_chunk`). Peak memory grows with
      B * sample_chunk, not with N. Outputs do not depend on the chunk.
    prompt_buckets: prompts are left-padded to the smallest bucket that fits, so a
      data stream compiles once per bucket. Empty: no bucketing.
    cache_len: an upper bound on bucketed prompt length + max_new_tokens, checked before
      compiling (the prompt's keys take P slots per prompt, the generated ones T per sample).
    cache_dtype: KV-cache dtype name (default: the parameter dtype).
    decode_memory_mb: the budget of the automatic `sample_chunk` for one chunk's decode
      state (generated keys/values, logits, activations), in MiB.
    length_segments: decoding attends to its generated tokens through this many growing
      static views of the cache (one compiled loop each; see `cache_views`).
    attention_implementation: decode attention, one of
      `kernels.decode_attention.IMPLEMENTATIONS` ("xla": the cascade form in jnp, the
      fast one on CPU; "pallas": the kernel, interpreted on CPU).
  """

  num_samples: int = 1
  max_new_tokens: int = 256
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  greedy: bool = False
  eos_id: int | tuple[int, ...] | None = None
  pad_id: int = 0
  sample_chunk: int = 0
  prompt_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
  cache_len: int | None = None
  cache_dtype: str | None = None
  decode_memory_mb: float = 320.0
  length_segments: int = 4
  attention_implementation: str = "xla"

  def __post_init__(self):
    if isinstance(self.eos_id, (list, tuple)):
      object.__setattr__(self, "eos_id", tuple(int(e) for e in self.eos_id))
    object.__setattr__(self, "prompt_buckets", tuple(sorted(int(b) for b in self.prompt_buckets)))
    if int(self.num_samples) < 1:
      raise ValueError(f"num_samples must be >= 1, got {self.num_samples}.")
    if int(self.max_new_tokens) < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
    if not 0.0 < float(self.top_p) <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if not 0.0 <= float(self.min_p) < 1.0:
      raise ValueError(f"min_p must be in [0, 1), got {self.min_p}.")
    if int(self.top_k) < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}.")
    if float(self.temperature) < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if int(self.sample_chunk) < 0:
      raise ValueError(f"sample_chunk must be >= 0, got {self.sample_chunk}.")
    if not float(self.decode_memory_mb) > 0:
      raise ValueError(f"decode_memory_mb must be > 0, got {self.decode_memory_mb}.")
    if int(self.length_segments) < 1:
      raise ValueError(f"length_segments must be >= 1, got {self.length_segments}.")
    if self.attention_implementation not in decode_attention.IMPLEMENTATIONS:
      raise ValueError(f"attention_implementation must be one of {decode_attention.IMPLEMENTATIONS}, "
                       f"got {self.attention_implementation!r}.")

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0.0

  @property
  def eos_ids(self) -> tuple[int, ...]:
    if self.eos_id is None:
      return ()
    return self.eos_id if isinstance(self.eos_id, tuple) else (int(self.eos_id),)

  @property
  def chunk(self) -> int:
    """The explicit chunk (N when `sample_chunk` is 0; the sampler then uses `auto_sample_chunk`)."""
    return self.num_samples if self.sample_chunk in (0, None) else min(self.sample_chunk, self.num_samples)

  def replace(self, **kwargs) -> "SamplingConfig":
    return dataclasses.replace(self, **kwargs)


@flax.struct.dataclass
class SampleOutput:
  """Grouped rollouts. B prompts, N samples, T = max_new_tokens.

  Attributes:
    completion_ids: int32 [B, N, T]; pad_id after EOS.
    completion_mask: bool [B, N, T]; True up to and including EOS.
    logprobs: float32 [B, N, T]; log-probability of each sampled token under the
      sampling distribution actually used (temperature / top-k / top-p / min-p applied;
      0 under greedy decoding, a point mass). 0 where the mask is False.
    policy_logprobs: float32 [B, N, T]; the same tokens under the unmodified policy
      (temperature 1, no truncation). 0 where the mask is False.
    entropy: float32 [B, N, T]; entropy of the unmodified policy at each step.
    lengths: int32 [B, N]; number of True entries of completion_mask.
  """
  completion_ids: jax.Array
  completion_mask: jax.Array
  logprobs: jax.Array
  policy_logprobs: jax.Array
  entropy: jax.Array
  lengths: jax.Array


def mask_after_eos(tokens_BxT: jax.Array, eos_ids: Sequence[int]) -> jax.Array:
  """True up to and including the first EOS of each row (all True if none).

  >>> mask_after_eos(jnp.array([[5, 2, 7, 2]]), eos_ids=(2,)).tolist()
  [[True, True, False, False]]
  """
  if not eos_ids:
    return jnp.ones(tokens_BxT.shape, bool)
  is_eos = jnp.isin(tokens_BxT, jnp.asarray(eos_ids, tokens_BxT.dtype))
  eos_before = jnp.cumsum(is_eos.astype(jnp.int32), axis=-1) - is_eos.astype(jnp.int32)
  return eos_before == 0


def process_logits(logits_RxV: jax.Array, config: SamplingConfig) -> jax.Array:
  """Applies temperature, then top-k, then top-p, then min-p; excluded tokens get -inf.

  Each filter acts on the renormalized output of the previous one (the order used by
  Hugging Face and vLLM). Ties at a threshold keep every tied token.

  >>> process_logits(jnp.log(jnp.array([[.5, .3, .2]])), SamplingConfig(top_p=0.7)).tolist()
  [[-0.6931471824645996, -1.2039728164672852, -inf]]
  """
  logits = logits_RxV.astype(jnp.float32)
  if config.is_greedy:
    return logits
  if config.temperature != 1.0:
    logits = logits / config.temperature
  neg_inf = jnp.array(-jnp.inf, logits.dtype)
  if config.top_k and config.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if config.top_p < 1.0:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p: the token is kept while the mass
    # strictly before it is below top_p. The top token is always kept.
    keep = (mass_before < config.top_p).at[..., 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, neg_inf, logits)
  if config.min_p > 0.0:
    logp = jax.nn.log_softmax(logits, axis=-1)
    cut = jnp.max(logp, axis=-1, keepdims=True) + jnp.log(config.min_p)
    logits = jnp.where(logp < cut, neg_inf, logits)
  return logits


def _inverse_cdf_draw(u_R: jax.Array, probs_RxV: jax.Array, block: int = 64) -> jax.Array:
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


def _inverse_cdf_sample(key: jax.Array, probs_RxV: jax.Array) -> jax.Array:
  """One draw per row from `probs` by inverting its CDF.

  Needs one uniform number per row where Gumbel-max needs one per vocabulary entry; on a
  CPU the random bits were a quarter of the decode time. The uniform is scaled by the
  row's total mass, so a zero-probability token (filtered out, or trailing the last
  positive one) is never chosen.
  """
  return _inverse_cdf_draw(jax.random.uniform(key, (probs_RxV.shape[0],), jnp.float32), probs_RxV)


def _choose_u(logits_RxV: jax.Array, u_R: jax.Array, config: SamplingConfig):
  """Samples one token per row from uniforms `u_R`; returns (token, sampling lp, policy lp, entropy)."""
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
    token = _inverse_cdf_draw(u_R, sample_p)
    sample_lp = jnp.take_along_axis(sample_logp, token[:, None], axis=-1)[:, 0]
  policy_lp = jnp.take_along_axis(policy_logp, token[:, None], axis=-1)[:, 0]
  return token, sample_lp, policy_lp, entropy


def _choose(logits_RxV: jax.Array, key: jax.Array, config: SamplingConfig):
  """Samples one token per row; returns (token, sampling logprob, policy logprob, entropy)."""
  return _choose_u(logits_RxV, jax.random.uniform(key, (logits_RxV.shape[0],), jnp.float32), config)


def _row_uniforms(row_keys_R: jax.Array, step) -> jax.Array:
  """One uniform per row, a function of (that row's key, its completion position) only.

  Each sample owns a key (folded from the call's key and its sample index), so what a
  sample draws does not depend on which chunk it was decoded in, nor on the batch. `step`
  is a scalar or, for continued rows, a per-row [R] completion position, so a row resumed
  from its first t tokens draws what it would have drawn uninterrupted.
  """
  step_R = jnp.broadcast_to(jnp.asarray(step, jnp.int32), row_keys_R.shape[:1])
  return jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (), jnp.float32))(row_keys_R, step_R)


@flax.struct.dataclass
class _DecodeState:
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
class _Prefix:
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


def _decode_forward(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: _Prefix,
                    state: _DecodeState, token_R: jax.Array, view: int):
  """Runs one token per row through the model; attends to the prompt and to slots [0, step].

  The generated-token buffers hold `view` slots (the current segment's); only the first
  `step + 1` are attended.
  """
  B = prefix.mask.shape[0]
  R = token_R.shape[0]
  n, K, G, Dh = R // B, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  step = state.step
  positions = (prefix.positions_R + step)[:, None]
  x = _tf._embed(params, token_R[:, None], _tf._activation_dtype(cfg, params))  # pylint: disable=protected-access
  kts, vs = list(state.kt), list(state.v)
  for l, lp in enumerate(prefix.layers):
    q, k, v = _tf._qkv(cfg, lp, x, positions)  # pylint: disable=protected-access
    kts[l] = jax.lax.dynamic_update_slice(kts[l], jnp.transpose(k, (0, 2, 3, 1)).astype(kts[l].dtype),
                                          (0, 0, 0, step))
    vs[l] = jax.lax.dynamic_update_slice(vs[l], jnp.transpose(v, (0, 2, 1, 3)).astype(vs[l].dtype),
                                         (0, 0, step, 0))
    attn = decode_attention.decode_attention(
        q.reshape(B, n, K, G, Dh), prefix.k[l].astype(q.dtype), prefix.v[l].astype(q.dtype), prefix.mask,
        kts[l].astype(q.dtype), vs[l].astype(q.dtype), step + 1,
        implementation=config.attention_implementation)
    x = _tf._finish_layer(cfg, lp, x, attn.reshape(R, 1, -1))  # pylint: disable=protected-access
  return models.unembed(cfg, params, x)[:, 0], tuple(kts), tuple(vs)


def _sample_step(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: _Prefix,
                 row_keys_R: jax.Array, view: int, state: _DecodeState) -> _DecodeState:
  """One decoding step: choose a token per row, write it, run it through the model."""
  position = state.step if prefix.offset_R is None else state.step + prefix.offset_R
  u = _row_uniforms(row_keys_R, position)
  token, lp, plp, ent = _choose_u(state.logits_RxV, u, config)
  live = ~state.done_R
  token = jnp.where(live, token, config.pad_id)
  zero = jnp.zeros_like(lp)
  put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, state.step, axis=1)
  done = state.done_R
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  if prefix.limit_R is not None:
    done = done | (state.step + 1 >= prefix.limit_R)
  logits, kt, v = _decode_forward(cfg, config, params, prefix, state, token, view)
  return _DecodeState(
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


def _decode(cfg, config, params, prefix: _Prefix, first_logits_RxV, row_keys_R, shard_ctx,
            stop_groups: tuple[int, int] | None = None) -> _DecodeState:
  R, T = first_logits_RxV.shape[0], config.max_new_tokens
  L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  zeros = jnp.zeros((R, T), jnp.float32)
  dtype = prefix.k[0].dtype
  kt_axes, v_axes = ("batch", "kv_heads", "head_dim", "seq"), ("batch", "kv_heads", "seq", "head_dim")
  views = cache_views(T, config.length_segments)
  state = _DecodeState(
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
    body = functools.partial(_sample_step, cfg, config, params, prefix, row_keys_R, view)
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


@functools.partial(jax.jit, static_argnums=(0, 1, 6), static_argnames=("stop_groups",))
def _sample_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask, key,
                shard_ctx: sharding.ShardingContext | None = None, row_ids=None, offset_R=None, limit_R=None,
                stop_groups: tuple[int, int] | None = None):
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, P = prompt_ids.shape
  N, T = config.num_samples, config.max_new_tokens
  n = auto_sample_chunk(cfg, config, B)
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
  layer_params = tuple(jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(cfg.num_layers))

  def run_chunk(chunk_index):
    # Rows are prompt-major: row b * n + j is sample chunk_index * n + j of prompt b.
    rep = lambda x: jnp.repeat(x, n, axis=0)
    sample_ids = (jnp.arange(B)[:, None] * N + chunk_index * n + jnp.arange(n)[None, :]).reshape(-1)
    if row_ids is not None:  # continued rows (N = 1): each keeps its original sample's stream
      sample_ids = row_ids
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(sample_ids)
    prefix = _Prefix(layers=layer_params, k=prefix_k, v=prefix_v, mask=prompt_mask,
                     positions_R=sharding.constrain(rep(cache.next_pos), ("batch",), shard_ctx),
                     offset_R=offset_R, limit_R=limit_R)
    s = _decode(cfg, config, params, prefix, rep(logits_Bx1xV[:, 0]), row_keys, shard_ctx, stop_groups)
    group = lambda x: x.reshape(B, n, T)
    return (group(s.tokens_RxT), group(s.mask_RxT), group(s.logprobs_RxT), group(s.policy_logprobs_RxT),
            group(s.entropy_RxT))

  outs = jax.lax.map(run_chunk, jnp.arange(num_chunks))
  # [chunks, B, n, T] -> [B, chunks * n, T] -> first N samples.
  outs = [jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * n, T)[:, :N] for o in outs]
  tokens, mask, lp, plp, ent = outs
  return SampleOutput(completion_ids=tokens, completion_mask=mask, logprobs=lp, policy_logprobs=plp,
                      entropy=ent, lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32))


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= length (length itself when there are no buckets)."""
  if not buckets:
    return length
  for b in buckets:
    if b >= length:
      return b
  raise ValueError(f"Prompt length {length} exceeds the largest prompt bucket {max(buckets)}; "
                   "add a larger bucket to SamplingConfig.prompt_buckets or truncate the prompt.")


def left_pad_to(prompt_ids, prompt_mask, length: int, pad_id: int):
  """Adds left padding so that prompts have `length` columns."""
  extra = length - prompt_ids.shape[1]
  if extra == 0:
    return prompt_ids, prompt_mask
  xp = np if isinstance(prompt_ids, np.ndarray) else jnp
  ids = xp.pad(prompt_ids, ((0, 0), (extra, 0)), constant_values=pad_id)
  mask = xp.pad(prompt_mask, ((0, 0), (extra, 0)), constant_values=False)
  return ids, mask


@jax.jit
def _prompt_stats(prompt_ids, prompt_mask):
  """Scalars that `_check_prompts` needs, computed where the arrays live (one small sync)."""
  mask = prompt_mask.astype(bool)
  ids = prompt_ids.astype(jnp.int32)
  big = jnp.iinfo(jnp.int32).max
  return dict(
      min_id=jnp.min(jnp.where(mask, ids, big)), max_id=jnp.max(jnp.where(mask, ids, -1)),
      empty_rows=jnp.sum(~jnp.any(mask, axis=1)),
      right_padded_rows=jnp.sum(jnp.any(mask[:, :-1] & ~mask[:, 1:], axis=1)),
      max_len=jnp.max(jnp.sum(mask, axis=1)))


def _check_prompts(cfg: ModelConfig, config: SamplingConfig, prompt_ids, prompt_mask) -> None:
  """Clear errors for prompts the sampler would otherwise run silently and wrongly."""
  if isinstance(prompt_ids, np.ndarray) and isinstance(prompt_mask, np.ndarray):
    mask = prompt_mask.astype(bool)
    real = prompt_ids[mask]
    stats = dict(min_id=real.min() if real.size else 0, max_id=real.max() if real.size else 0,
                 empty_rows=int((~mask.any(axis=1)).sum()),
                 right_padded_rows=int((mask[:, :-1] & ~mask[:, 1:]).any(axis=1).sum()),
                 max_len=int(mask.sum(axis=1).max(initial=0)))
  else:
    stats = jax.device_get(_prompt_stats(jnp.asarray(prompt_ids), jnp.asarray(prompt_mask)))
  stats = {k: int(v) for k, v in stats.items()}
  if stats["empty_rows"]:
    raise ValueError(f"Every prompt needs at least one real token ({stats['empty_rows']} row(s) of "
                     "prompt_mask are all False).")
  if stats["right_padded_rows"]:
    raise ValueError(f"Prompts must be left-padded: {stats['right_padded_rows']} row(s) of prompt_mask have "
                     "a False after a True (right padding); move the padding to the left.")
  if stats["min_id"] < 0 or stats["max_id"] >= cfg.vocab_size:
    raise ValueError(f"Prompt token ids must be in [0, vocab_size={cfg.vocab_size}); got ids from "
                     f"{stats['min_id']} to {stats['max_id']} at real (mask True) positions.")
  if stats["max_len"] + config.max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"The longest prompt ({stats['max_len']} tokens) + max_new_tokens "
                     f"{config.max_new_tokens} exceeds the model's max_position_embeddings "
                     f"{cfg.max_position_embeddings}.")


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
  _check_prompts(cfg, config, prompt_ids, prompt_mask)
  prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, P_bucket, config.pad_id)
  B, N = int(prompt_ids.shape[0]), int(config.num_samples)
  if budget is not None:
    budget = np.asarray(jax.device_get(budget)).astype(np.int64).reshape(-1)
    if budget.shape != (B,) or budget.min(initial=0) < 0 or budget.max(initial=0) > N:
      raise ValueError(f"budget must be [B] = [{B}] values in [0, num_samples={N}]; got {budget.tolist()}.")
    if budget.sum() < B * N:
      return _sample_budget(cfg, params, np.asarray(prompt_ids), np.asarray(prompt_mask), key, config, budget)
  return _sample_jit(cfg, config, params, jnp.asarray(prompt_ids, jnp.int32),
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
  out = _sample_jit(cfg, dataclasses.replace(config, num_samples=1, sample_chunk=0), params,
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


def finished_rows(completion_ids, completion_mask, config: SamplingConfig):
  """bool [..., N]: rows that ended, by an EOS or by reaching `max_new_tokens` tokens.

  A row that is neither was stopped early (`continue_from(..., stop_after_groups=...)`) and
  can be resumed with `continue_from`.

  >>> ids = np.array([[[5, 2, 0], [5, 6, 0], [5, 6, 7]]]); m = ids > 0
  >>> finished_rows(ids, m, SamplingConfig(max_new_tokens=3, eos_id=2)).tolist()
  [[True, False, True]]
  """
  xp = np if isinstance(completion_ids, np.ndarray) else jnp
  lengths = completion_mask.sum(-1)
  done = lengths >= config.max_new_tokens
  if config.eos_ids:
    done = done | xp.any(xp.isin(completion_ids, xp.asarray(config.eos_ids)) & completion_mask, axis=-1)
  return done


def _two_part_softmax(s1, s2):
  """Softmax over the concatenation of two score sets (last axis), returned as its two parts."""
  m = jnp.maximum(jnp.max(s1, axis=-1, keepdims=True), jnp.max(s2, axis=-1, keepdims=True))
  p1, p2 = jnp.exp(s1 - m), jnp.exp(s2 - m)
  total = jnp.sum(p1, axis=-1, keepdims=True) + jnp.sum(p2, axis=-1, keepdims=True)
  return p1 / total, p2 / total


def _prefix_forward(cfg: ModelConfig, params: Params, prompt_k, prompt_v, prompt_mask, start_R, tokens_RxL, mask_RxL):
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
  x = _tf._embed(params, tokens_RxL, _tf._activation_dtype(cfg, params))  # pylint: disable=protected-access
  scale = Dh ** -0.5
  kts, vs = [], []
  for l in range(cfg.num_layers):
    lp = jax.tree.map(lambda a, l=l: a[l], params["layers"])
    q, k, v = _tf._qkv(cfg, lp, x, positions)  # pylint: disable=protected-access
    kts.append(jnp.transpose(k, (0, 2, 3, 1)))
    vs.append(jnp.transpose(v, (0, 2, 1, 3)))
    qr = q.reshape(R, L, K, G, Dh)
    s1 = jnp.einsum("rlkgd,rkpd->rklgp", qr, prompt_k[l].astype(q.dtype), preferred_element_type=jnp.float32)
    s1 = jnp.where(prompt_mask[:, None, None, None, :], s1 * scale, _cascade.NEG_INF)
    s2 = jnp.einsum("rlkgd,rskd->rklgs", qr, k, preferred_element_type=jnp.float32)
    s2 = jnp.where(own_RxLxL[:, None, :, None, :], s2 * scale, _cascade.NEG_INF)
    p1, p2 = _two_part_softmax(s1, s2)
    o = (jnp.einsum("rklgp,rkpd->rlkgd", p1, prompt_v[l].astype(jnp.float32))
         + jnp.einsum("rklgs,rskd->rlkgd", p2, v.astype(jnp.float32)))
    x = _tf._finish_layer(cfg, lp, x, o.reshape(R, L, K * G * Dh).astype(x.dtype))  # pylint: disable=protected-access
  last = jnp.maximum(jnp.sum(mask_RxL, axis=1) - 1, 0)
  h = jnp.take_along_axis(x, last[:, None, None], axis=1)
  return tuple(kts), tuple(vs), models.unembed(cfg, params, h)[:, 0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prompt_prefill_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask):
  """Each prompt prefilled once: keys / values per layer [B, K, P, Dh], logits [B, V], lengths [B]."""
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, P = prompt_ids.shape
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  cache = models.init_cache(cfg, B, P, cache_dtype)
  logits, cache = models.forward_with_cache(cfg, params, jnp.where(prompt_mask, prompt_ids, 0), cache, prompt_mask,
                                            last_only=True)
  to_heads = lambda x: tuple(jnp.transpose(x[l], (0, 2, 1, 3)) for l in range(cfg.num_layers))
  return to_heads(cache.k), to_heads(cache.v), logits[:, 0], cache.next_pos


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
  kts, vs, logits = _prefix_forward(cfg, params, tuple(x[b_M] for x in prompt_k), tuple(x[b_M] for x in prompt_v),
                                    prompt_mask[b_M], next_pos[b_M], take(prefix_ids_RxL), take(prefix_mask_RxL))
  K, Dh, dtype = cfg.num_kv_heads, cfg.head_dim, prompt_k[0].dtype
  put = lambda shape, val: jnp.zeros(shape, dtype).at[rows_M].set(val.astype(dtype), mode="drop")
  kt = tuple(put((R, K, Dh, slots), jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, slots - L)))) for x in kts)
  v = tuple(put((R, K, slots, Dh), jnp.pad(x, ((0, 0), (0, 0), (0, slots - L), (0, 0)))) for x in vs)
  first = jnp.repeat(first_BxV, N, axis=0).at[rows_M].set(logits, mode="drop")
  return kt, v, first


def _row_suffix_attention(q, kt, v, valid_RxS):
  """Each row's attention to its own generated slots where `valid` (like the cascade's suffix part).

  Returns:
    (out [B, N, K, G, D] float32, lse [B, N, K, G]).
  """
  B, N, K, G, D = q.shape
  qr = q.reshape(B * N, K, G, D).astype(jnp.float32)
  s = jnp.sum(qr[..., None] * kt[:, :, None].astype(jnp.float32), axis=3) * (D ** -0.5)   # [R, K, G, S]
  s = jnp.where(valid_RxS[:, None, None, :], s, _cascade.NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  o = jnp.sum(p[..., None] * v[:, :, None].astype(jnp.float32), axis=3) / l[..., None]
  return o.reshape(B, N, K, G, D), (m[..., 0] + jnp.log(l)).reshape(B, N, K, G)


def _resume_step(cfg: ModelConfig, config: SamplingConfig, params: Params, prefix: _Prefix, row_keys_R: jax.Array,
                 state: _DecodeState) -> _DecodeState:
  """One decoding step of resumed rows: row r writes completion position offset_r + step.

  The generated buffers hold each row's completion by position (its prefix in the first
  slots), so rows of one prompt resume from different lengths while still sharing the
  prompt's keys; writes past a buffer (rows already done) are dropped.
  """
  B = prefix.mask.shape[0]
  R = row_keys_R.shape[0]
  n, K, G, Dh = R // B, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  pos = prefix.offset_R + state.step
  token, lp, plp, ent = _choose_u(state.logits_RxV, _row_uniforms(row_keys_R, pos), config)
  live = ~state.done_R
  token = jnp.where(live, token, config.pad_id)
  rows = jnp.arange(R)
  put = lambda buf, val: buf.at[rows, pos].set(val, mode="drop")
  done = state.done_R | (pos + 1 >= config.max_new_tokens)
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  x = _tf._embed(params, token[:, None], _tf._activation_dtype(cfg, params))  # pylint: disable=protected-access
  positions = (prefix.positions_R + pos)[:, None]
  valid = jnp.arange(state.kt[0].shape[-1])[None, :] <= pos[:, None]
  kts, vs = list(state.kt), list(state.v)
  for l, lp_l in enumerate(prefix.layers):
    q, k, v = _tf._qkv(cfg, lp_l, x, positions)  # pylint: disable=protected-access
    kts[l] = kts[l].at[rows, :, :, pos].set(k[:, 0].astype(kts[l].dtype), mode="drop")
    vs[l] = vs[l].at[rows, :, pos, :].set(v[:, 0].astype(vs[l].dtype), mode="drop")
    qg = q.reshape(B, n, K, G, Dh)
    o1, lse1 = _cascade.prefix_part(qg, prefix.k[l].astype(q.dtype), prefix.v[l].astype(q.dtype), prefix.mask)
    o2, lse2 = _row_suffix_attention(qg, kts[l], vs[l], valid)
    attn, _ = _cascade.merge(o1, lse1, o2, lse2)
    x = _tf._finish_layer(cfg, lp_l, x, attn.reshape(R, 1, -1).astype(x.dtype))  # pylint: disable=protected-access
  zero = jnp.zeros_like(lp)
  return _DecodeState(
      step=state.step + 1, kt=tuple(kts), v=tuple(vs), logits_RxV=models.unembed(cfg, params, x)[:, 0],
      tokens_RxT=put(state.tokens_RxT, token),
      logprobs_RxT=put(state.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(state.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(state.entropy_RxT, jnp.where(live, ent, zero)),
      mask_RxT=put(state.mask_RxT, live), done_R=done)


def _resume_views(max_new_tokens: int, prefix_len: int, segments: int) -> tuple[int, ...]:
  """`cache_views` starting at the first view that holds the prefix columns.

  >>> _resume_views(40, 0, 4), _resume_views(40, 20, 4), _resume_views(40, 40, 4)
  ((16, 32, 40), (32, 40), (40,))
  """
  views = cache_views(max_new_tokens, segments)
  first = next((v for v in views if v >= max(prefix_len, 1)), max_new_tokens)
  return (first,) + tuple(v for v in views if v > first)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("shard_ctx", "stop_groups"))
def _resume_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_k, prompt_v, prompt_mask, next_pos,
                kt, v, first_RxV, prefix_ids, prefix_mask, prefix_lp, prefix_plp, prefix_ent, done_BxN, key,
                shard_ctx: sharding.ShardingContext | None = None, stop_groups: tuple[int, int] | None = None):
  """Decodes resumed rows [B, N] against their prompts' shared keys; returns the SampleOutput."""
  params = models.compute_params(cfg, models.lora.sampling_params(params))  # LoRA merged, cast: once
  B, N, L = prefix_ids.shape
  R, T = B * N, config.max_new_tokens
  views = _resume_views(T, L, config.length_segments)
  layers = tuple(jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(cfg.num_layers))
  lengths = jnp.sum(prefix_mask, axis=-1, dtype=jnp.int32).reshape(R)
  pad_T = lambda x: jnp.pad(x.reshape(R, L), ((0, 0), (0, T - L)))
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(R, dtype=jnp.int32))
  kv_axes = ("batch", "kv_heads", "seq", "head_dim")
  heads = lambda xs: tuple(sharding.constrain(x, kv_axes, shard_ctx) for x in xs)
  prefix = _Prefix(layers=layers, k=heads(prompt_k), v=heads(prompt_v), mask=prompt_mask,
                   positions_R=jnp.repeat(next_pos, N), offset_R=lengths)
  state = _DecodeState(
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

  body = functools.partial(_resume_step, cfg, config, params, prefix, row_keys)
  kt_axes, v_axes = ("batch", "kv_heads", "head_dim", "seq"), ("batch", "kv_heads", "seq", "head_dim")
  for i, view in enumerate(views):
    if i:   # the generated-token buffers grow between segments, as in `_decode`
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


def _resume_bucket(rows: int, total: int) -> int:
  """Rows whose prefixes run are padded to a power of two (at least 8, at most `total`).

  >>> _resume_bucket(3, 96), _resume_bucket(20, 96), _resume_bucket(90, 96)
  (8, 32, 96)
  """
  return min(max(8, 1 << max(int(rows) - 1, 0).bit_length()), int(total))


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
  _check_prompts(cfg, config, prompt_ids, prompt_mask)
  prefix_ids = jnp.where(pm, jnp.asarray(prefix_ids, jnp.int32), 0)
  done = finished_rows(prefix_ids, jnp.asarray(pm), config)
  if finished is not None:
    done = done | jnp.asarray(finished, bool)
  ids, mask = left_pad_to(prompt_ids, prompt_mask, bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets),
                          config.pad_id)
  ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  # Each prompt is prefilled once; its N rows decode against its keys together.
  prompt_k, prompt_v, first, next_pos = _prompt_prefill_jit(cfg, config, params, ids, mask)
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
