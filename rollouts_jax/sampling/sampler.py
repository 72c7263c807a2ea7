"""The rollout engine: prefill once, decode N samples per prompt under `lax.while_loop`.

The prompt batch is prefilled once; its KV cache is repeated for the samples of one
chunk (`sample_chunk` samples per prompt at a time), so the prompt is never re-run per
sample and peak memory is set by the chunk, not by `num_samples`. Chunks run one after
another under `lax.map`, each decoding until every row has emitted EOS or
`max_new_tokens` is reached.
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
from rollouts_jax.models import ModelConfig, Params

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
    sample_chunk: samples per prompt decoded at once (0: all N at once). Peak memory
      grows with B * sample_chunk, not with N.
    prompt_buckets: prompts are left-padded to the smallest bucket that fits, so a
      data stream compiles once per bucket. Empty: no bucketing.
    cache_len: total KV-cache slots; default bucketed prompt length + max_new_tokens.
    cache_dtype: KV-cache dtype name (default: the parameter dtype).
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


def _inverse_cdf_sample(key: jax.Array, probs_RxV: jax.Array) -> jax.Array:
  """One draw per row from `probs` by inverting its CDF.

  Needs one uniform number per row where Gumbel-max needs one per vocabulary entry; on a
  CPU the random bits were a quarter of the decode time. The uniform is scaled by the
  row's total mass, so a zero-probability token (filtered out, or trailing the last
  positive one) is never chosen.
  """
  cdf_RxV = jnp.cumsum(probs_RxV, axis=-1)
  u_Rx1 = jax.random.uniform(key, (probs_RxV.shape[0], 1), jnp.float32) * cdf_RxV[:, -1:]
  # The first index whose CDF exceeds u. A token with p_i = 0 has cdf_i = cdf_{i-1}, so the
  # index before it is taken first; u rounding up to the total is clamped to the last
  # positive-probability token.
  token = jnp.sum(cdf_RxV <= u_Rx1, axis=-1)
  V = probs_RxV.shape[-1]
  last_positive = V - 1 - jnp.argmax((probs_RxV > 0)[:, ::-1], axis=-1)
  return jnp.minimum(token, last_positive).astype(jnp.int32)


def _choose(logits_RxV: jax.Array, key: jax.Array, config: SamplingConfig):
  """Samples one token per row; returns (token, sampling logprob, policy logprob, entropy)."""
  policy_logp = jax.nn.log_softmax(logits_RxV.astype(jnp.float32), axis=-1)
  entropy = -jnp.sum(jnp.exp(policy_logp) * policy_logp, axis=-1)
  if config.is_greedy:
    token = jnp.argmax(policy_logp, axis=-1).astype(jnp.int32)
    sample_lp = jnp.zeros(token.shape, jnp.float32)
  else:
    processed = process_logits(logits_RxV, config)
    sample_logp = jax.nn.log_softmax(processed, axis=-1)
    token = _inverse_cdf_sample(key, jnp.exp(sample_logp))
    sample_lp = jnp.take_along_axis(sample_logp, token[:, None], axis=-1)[:, 0]
  policy_lp = jnp.take_along_axis(policy_logp, token[:, None], axis=-1)[:, 0]
  return token, sample_lp, policy_lp, entropy


@flax.struct.dataclass
class _DecodeState:
  step: jax.Array            # int32 scalar: next completion position
  key: jax.Array
  cache: models.KVCache
  logits_RxV: jax.Array       # logits for the token at `step`
  tokens_RxT: jax.Array
  logprobs_RxT: jax.Array
  policy_logprobs_RxT: jax.Array
  entropy_RxT: jax.Array
  mask_RxT: jax.Array
  done_R: jax.Array


def _sample_step(cfg: ModelConfig, config: SamplingConfig, params: Params, state: _DecodeState) -> _DecodeState:
  """One decoding step: choose a token per row, write it, run it through the model."""
  key, sub = jax.random.split(state.key)
  token, lp, plp, ent = _choose(state.logits_RxV, sub, config)
  live = ~state.done_R
  token = jnp.where(live, token, config.pad_id)
  zero = jnp.zeros_like(lp)
  put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, state.step, axis=1)
  done = state.done_R
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  logits, cache = models.forward_with_cache(cfg, params, token[:, None], state.cache)
  return _DecodeState(
      step=state.step + 1, key=key, cache=cache, logits_RxV=logits[:, 0],
      tokens_RxT=put(state.tokens_RxT, token),
      logprobs_RxT=put(state.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(state.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(state.entropy_RxT, jnp.where(live, ent, zero)),
      mask_RxT=put(state.mask_RxT, live), done_R=done)


def _decode(cfg, config, params, cache, first_logits_RxV, key) -> _DecodeState:
  R, T = first_logits_RxV.shape[0], config.max_new_tokens
  zeros = jnp.zeros((R, T), jnp.float32)
  state = _DecodeState(
      step=jnp.zeros((), jnp.int32), key=key, cache=cache, logits_RxV=first_logits_RxV,
      tokens_RxT=jnp.full((R, T), config.pad_id, jnp.int32), logprobs_RxT=zeros,
      policy_logprobs_RxT=zeros, entropy_RxT=zeros, mask_RxT=jnp.zeros((R, T), bool),
      done_R=jnp.zeros((R,), bool))
  cond = lambda s: (s.step < T) & ~jnp.all(s.done_R)
  return jax.lax.while_loop(cond, functools.partial(_sample_step, cfg, config, params), state)


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def _sample_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask, key,
                shard_ctx: sharding.ShardingContext | None = None):
  B, P = prompt_ids.shape
  N, T, n = config.num_samples, config.max_new_tokens, config.chunk
  num_chunks = -(-N // n)
  cache_len = config.cache_len or (P + T)
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  # Layout hint for the cache (identity unless sample() ran inside sharding.use_rules).
  cache = sharding.constrain_kv_cache(models.init_cache(cfg, B, cache_len, cache_dtype), shard_ctx)
  logits_Bx1xV, cache = models.forward_with_cache(cfg, params, prompt_ids, cache, prompt_mask, last_only=True)

  def run_chunk(chunk_index):
    # Rows are prompt-major: row b * n + j is sample j of prompt b in this chunk.
    rep = lambda x: jnp.repeat(x, n, axis=0)
    chunk_cache = models.KVCache(k=jnp.repeat(cache.k, n, axis=1), v=jnp.repeat(cache.v, n, axis=1),
                                 mask=rep(cache.mask), next_pos=rep(cache.next_pos), index=cache.index)
    chunk_cache = sharding.constrain_kv_cache(chunk_cache, shard_ctx)
    s = _decode(cfg, config, params, chunk_cache, rep(logits_Bx1xV[:, 0]), jax.random.fold_in(key, chunk_index))
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


def sample(cfg: ModelConfig, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
           key: jax.Array, config: SamplingConfig) -> SampleOutput:
  """Samples `config.num_samples` completions for each left-padded prompt.

  Args:
    cfg: model configuration.
    params: params pytree (plain or FP4-quantized linear weights).
    prompt_ids: int32 [B, P], left-padded.
    prompt_mask: bool [B, P], True at real prompt tokens. Every row needs at least one.
    key: PRNG key; the same key gives the same samples.
    config: a SamplingConfig.
  Returns:
    A SampleOutput with [B, N, T] arrays grouped by prompt.
  Raises:
    ValueError: prompt too long for the buckets or the cache, bad shapes or settings.

  >>> out = sample(cfg, params, ids, mask, jax.random.key(0),
  ...              SamplingConfig(num_samples=8, max_new_tokens=32, eos_id=2))  # doctest: +SKIP
  >>> out.completion_ids.shape  # doctest: +SKIP
  (B, 8, 32)
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
  if isinstance(prompt_mask, np.ndarray) and not prompt_mask.any(axis=1).all():
    raise ValueError("Every prompt needs at least one real token (a row of prompt_mask is all False).")
  prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, P_bucket, config.pad_id)
  return _sample_jit(cfg, config, params, jnp.asarray(prompt_ids, jnp.int32),
                     jnp.asarray(prompt_mask, bool), key, sharding.current_context())
