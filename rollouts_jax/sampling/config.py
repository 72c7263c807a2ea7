"""Sampling settings, the output type, logit processing and the prompt checks every sampler shares."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.kernels import decode_attention
from rollouts_jax.models import ModelConfig
# The prompt-length buckets live on the bottom floor, so data/ pads prompts without importing sampling/.
from rollouts_jax.types import DEFAULT_PROMPT_BUCKETS, bucket_length  # noqa: F401 - re-exported


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


def left_pad_to(prompt_ids, prompt_mask, length: int, pad_id: int):
  """Adds left padding so that prompts have `length` columns."""
  extra = length - prompt_ids.shape[1]
  if extra == 0:
    return prompt_ids, prompt_mask
  xp = np if isinstance(prompt_ids, np.ndarray) else jnp
  ids = xp.pad(prompt_ids, ((0, 0), (extra, 0)), constant_values=pad_id)
  mask = xp.pad(prompt_mask, ((0, 0), (extra, 0)), constant_values=False)
  return ids, mask


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


@jax.jit
def _prompt_stats(prompt_ids, prompt_mask):
  """Scalars that `check_prompts` needs, computed where the arrays live (one small sync)."""
  mask = prompt_mask.astype(bool)
  ids = prompt_ids.astype(jnp.int32)
  big = jnp.iinfo(jnp.int32).max
  return dict(
      min_id=jnp.min(jnp.where(mask, ids, big)), max_id=jnp.max(jnp.where(mask, ids, -1)),
      empty_rows=jnp.sum(~jnp.any(mask, axis=1)),
      right_padded_rows=jnp.sum(jnp.any(mask[:, :-1] & ~mask[:, 1:], axis=1)),
      max_len=jnp.max(jnp.sum(mask, axis=1)))


def check_prompts(cfg: ModelConfig, config: SamplingConfig, prompt_ids, prompt_mask) -> None:
  """Clear errors for prompts the sampler would otherwise run silently and wrongly.

  Raises:
    ValueError: for an all-padding row, right padding, ids outside [0, vocab_size) at real
      positions, or a longest prompt + `max_new_tokens` beyond `max_position_embeddings`.
  """
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
