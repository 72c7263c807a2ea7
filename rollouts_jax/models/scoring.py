"""Teacher-forced scoring: the log-probs and entropies of given completion tokens.

One definition, used by the RL update (current, old and reference log-probs) and by
rollout recomputation (Sol-RL's full-precision log-probs of FP4 samples), so the update's
ratio always compares like with like: both sides divide the logits by the same temperature.

With a large vocabulary the logits dominate the update's memory: R rows of T positions
hold R T V float32 logits, and a gradient keeps them (and their softmax) for the backward.
`token_logprobs(..., chunk=C)` sends the positions through the output head C at a time,
each chunk recomputed in the backward, so no more than [R, C, V] logits are ever held.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rollouts_jax.models import transformer
from rollouts_jax.models.config import ModelConfig
from rollouts_jax.types import teacher_forced_rows

# The parameters the output head reads (`transformer.unembed`).
_HEAD_KEYS = ("final_norm", "embed", "lm_head")


def token_logprobs(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int, *,
                   temperature: float = 1.0, chunk: int = 0, share: int = 1) -> tuple[jax.Array, jax.Array]:
  """Log-probs and entropies of tokens `[prompt_len:]` given everything before them.

  With `share` = S > 1, each block of S consecutive rows holds one prompt (the same first
  `prompt_len` tokens and mask, as the S samples of a group do) and the prompt runs through the
  layers once per block (`transformer.forward_shared_prompt`): the same values up to float
  rounding, with the prompt's share of the work divided by S.

  Args:
    cfg: model configuration.
    params: the policy.
    tokens_RxL: int32 [R, L], prompt (left-padded, length prompt_len) then completion.
    mask_RxL: bool [R, L] attention mask.
    prompt_len: P, the (padded) prompt length.
    temperature: the logits are divided by it (the sampler's temperature), > 0.
    chunk: C > 0 scores C positions at a time (see `hidden_logprobs`); 0: all T at once.
    share: rows per shared prompt (it must divide R); 1: every row on its own.

  Returns:
    (logprobs float32 [R, T], entropy float32 [R, T]) of the tempered distribution, T = L - P.

  >>> import jax, jax.numpy as jnp
  >>> from rollouts_jax import models
  >>> cfg = models.ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_layers=1,
  ...                          num_heads=2, num_kv_heads=1)
  >>> params = models.init_params(cfg, jax.random.key(0))
  >>> toks = jnp.array([[1, 2, 3, 4]])
  >>> lp, ent = token_logprobs(cfg, params, toks, toks > 0, 2)
  >>> lp.shape, bool(jnp.all(lp <= 0)), bool(jnp.all(ent >= 0))
  ((1, 2), True, True)
  >>> lp1, ent1 = token_logprobs(cfg, params, toks, toks > 0, 2, chunk=1)
  >>> bool(jnp.allclose(lp, lp1, atol=1e-6)) and bool(jnp.allclose(ent, ent1, atol=1e-6))
  True
  >>> two = jnp.array([[1, 2, 3, 4], [1, 2, 5, 6]])   # one prompt (1, 2), two completions
  >>> lp2, _ = token_logprobs(cfg, params, two, two > 0, 2, share=2)
  >>> bool(jnp.allclose(lp2, token_logprobs(cfg, params, two, two > 0, 2)[0], atol=1e-6))
  True
  """
  hidden = completion_hidden(cfg, params, tokens_RxL, mask_RxL, prompt_len, share)
  return hidden_logprobs(cfg, params, hidden, tokens_RxL[:, prompt_len:], temperature=temperature, chunk=chunk)


def completion_hidden(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int,
                      share: int = 1) -> jax.Array:
  """[R, T, D]: the final hidden states (before the final norm) that predict tokens `[prompt_len:]`;
  the prompt's last position predicts the first completion token.

  With `share` = S > 1 each block of S consecutive rows holds one prompt, which runs through the
  layers once per block (`transformer.forward_shared_prompt`). What the log-prob scorers, the
  vocabulary scorer and the critic read.
  """
  if share <= 1:
    return transformer.forward(cfg, params, tokens_RxL, mask_RxL, return_hidden=True)[:, prompt_len - 1:-1]
  R, L = tokens_RxL.shape
  if R % share:
    raise ValueError(f"share={share} rows per prompt must divide the {R} rows.")
  G, P, T = R // share, prompt_len, L - prompt_len
  blocks = tokens_RxL.reshape(G, share, L)
  hp, hc = transformer.forward_shared_prompt(cfg, params, blocks[:, 0, :P], mask_RxL.reshape(G, share, L)[:, 0, :P],
                                             blocks[:, :, P:])
  first = jnp.broadcast_to(hp[:, None, -1:], (G, share, 1, hp.shape[-1]))
  return jnp.concatenate([first, hc[:, :, :-1]], axis=2).reshape(R, T, -1)


def hidden_logprobs(cfg: ModelConfig, params, hidden_RxTxD: jax.Array, tokens_RxT: jax.Array, *,
                    temperature: float = 1.0, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """(log-prob [R, T], entropy [R, T]) of `tokens_RxT` from the final hidden states that predict them.

  With `chunk` = C > 0 (and C < T) the positions are split into chunks of C (the last one
  padded); each chunk's head, tempered log-softmax, pick and entropy run under
  `jax.checkpoint` inside a scan, so the forward holds one chunk's [R, C, V] logits at a
  time and the backward recomputes them chunk by chunk (one more head matmul) instead of
  keeping all [R, T, V]. The values are those of `chunk=0` up to float rounding.

  Args:
    cfg: model configuration.
    params: the policy (only the output head and final norm are read).
    hidden_RxTxD: final hidden states (before the final norm), position t predicting token t.
    tokens_RxT: int32 [R, T], the tokens scored.
    temperature: the logits are divided by it, > 0.
    chunk: positions per chunk; 0 (or >= T): all at once.
  """
  if chunk < 0:
    raise ValueError(f"chunk must be >= 0 (0: unchunked), got {chunk}.")
  R, T = tokens_RxT.shape
  if chunk == 0 or chunk >= T:
    return pick_and_entropy(_tempered_logp(cfg, params, hidden_RxTxD, temperature), tokens_RxT)
  n = -(-T // chunk)
  pad = n * chunk - T
  # Padded positions have zero hidden states (finite: uniform logits after the norm) and
  # token 0; they are cut off below, so they get no gradient.
  h = jnp.pad(hidden_RxTxD, ((0, 0), (0, pad), (0, 0)))
  tok = jnp.pad(tokens_RxT, ((0, 0), (0, pad)))
  h_NxRxCxD = jnp.moveaxis(h.reshape(R, n, chunk, h.shape[-1]), 1, 0)
  tok_NxRxC = jnp.moveaxis(tok.reshape(R, n, chunk), 1, 0)
  head = {k: params[k] for k in _HEAD_KEYS if k in params}

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def score(head_params, h_RxCxD, tok_RxC):
    return pick_and_entropy(_tempered_logp(cfg, head_params, h_RxCxD, temperature), tok_RxC)

  _, (lp, ent) = jax.lax.scan(lambda carry, xs: (carry, score(head, *xs)), None, (h_NxRxCxD, tok_NxRxC))
  unchunk = lambda x_NxRxC: jnp.moveaxis(x_NxRxC, 0, 1).reshape(R, n * chunk)[:, :T]
  return unchunk(lp), unchunk(ent)


def vocab_logprobs(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int, *,
                   temperature: float = 1.0, share: int = 1) -> jax.Array:
  """float32 [R, T, V]: the tempered log-softmax over the vocabulary before each of tokens `[prompt_len:]`.

  What `token_logprobs` gathers from (full-vocabulary distillation needs it whole, R T V floats).
  Args as `token_logprobs` (`share` rows per shared prompt).
  """
  hidden = completion_hidden(cfg, params, tokens_RxL, mask_RxL, prompt_len, share)
  return _tempered_logp(cfg, params, hidden, temperature)


def _tempered_logp(cfg: ModelConfig, params, hidden_RxTxD: jax.Array, temperature: float) -> jax.Array:
  """float32 [R, T, V]: log-softmax of the head's logits divided by the temperature."""
  logits_RxTxV = transformer.unembed(cfg, params, hidden_RxTxD).astype(jnp.float32)
  if temperature != 1.0:
    logits_RxTxV = logits_RxTxV / temperature
  return jax.nn.log_softmax(logits_RxTxV, axis=-1)


def pick_and_entropy(logp_RxTxV: jax.Array, tokens_RxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log-prob of each token [R, T], entropy [R, T]) from log-probs over the vocabulary."""
  lp = jnp.take_along_axis(logp_RxTxV, tokens_RxT[..., None], axis=-1)[..., 0]
  return lp, -jnp.sum(jnp.exp(logp_RxTxV) * logp_RxTxV, axis=-1)


def rows_logprobs(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int,
                  num_micro: int = 1, temperature: float = 1.0, *, vocab: bool = False, chunk: int = 0,
                  entropy: bool = False, share: int = 1):
  """Completion log-probs [R, T] of teacher-forced rows (or over the vocabulary, [R, T, V]), no gradient.

  The rows go through the model in `num_micro` micro-batches in a scan (it must divide R); `chunk`
  positions through the output head at a time (0: all; not with `vocab`); `share` rows per
  shared prompt (`completion_hidden`; it must divide a micro-batch's rows). With
  `entropy`, (log-probs [R, T], entropies [R, T]) of the tempered distribution.
  """
  split = lambda x: x.reshape((num_micro, x.shape[0] // num_micro) + x.shape[1:])
  merge = lambda x: jax.lax.stop_gradient(x.reshape((-1,) + x.shape[2:]))

  def body(_, xs):
    if vocab:
      return None, vocab_logprobs(cfg, params, xs[0], xs[1], prompt_len, temperature=temperature, share=share)
    lp, ent = token_logprobs(cfg, params, xs[0], xs[1], prompt_len, temperature=temperature, chunk=chunk,
                             share=share)
    return None, (lp, ent) if entropy else lp
  _, out = jax.lax.scan(body, None, (split(tokens_RxL), split(mask_RxL)))
  return jax.tree_util.tree_map(merge, out)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "micro_rows", "vocab", "chunk", "entropy",
                                             "shared_prompt"))
def batch_logprobs(params, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array,
                   completion_mask: jax.Array, *, cfg: ModelConfig, temperature: float = 1.0,
                   micro_rows: int = 0, vocab: bool = False, chunk: int = 0, entropy: bool = False,
                   shared_prompt: bool = False):
  """Log-probs [B, N, T] of a batch's completion tokens under `params` (no gradient; 0 off the mask).

  The one teacher-forced scorer of a grouped batch: the update's old and reference log-probs
  use its row form (`rows_logprobs`), the asynchronous loop's stale-batch and proximal-policy
  log-probs call it, and so do the distillation teacher's and Sol-RL's recompute (with `entropy`:
  (log-probs, entropies), both [B, N, T]). With `vocab`, the log-probs over
  the whole vocabulary at those positions, [B, N, T, V] (the teacher's side of
  full-vocabulary distillation, `losses.full_reverse_kl`). `micro_rows` rows go through the
  model at a time (0: all B * N; it must divide B * N), and `chunk` completion positions
  through the output head at a time (0: all; not with `vocab`). With `shared_prompt` each group's
  prompt runs once for its samples in a micro-batch (`share_of`).
  """
  tokens, attn = teacher_forced_rows(prompt_ids, prompt_mask, completion_ids)
  R = tokens.shape[0]
  micro = micro_rows or R
  if R % micro:
    raise ValueError(f"micro_rows {micro} must divide the batch's {R} rows.")
  share = share_of(micro, completion_ids.shape[1]) if shared_prompt else 1
  out = rows_logprobs(cfg, params, tokens, attn, prompt_ids.shape[1], R // micro, temperature, vocab=vocab,
                      chunk=chunk, entropy=entropy and not vocab, share=share)

  def shaped(x):
    x = x.reshape(completion_ids.shape + x.shape[2:])
    return jnp.where(completion_mask.reshape(completion_mask.shape + (1,) * (x.ndim - 3)), x, 0.0)
  return jax.tree_util.tree_map(shaped, out)


def share_of(micro_rows: int, num_samples: int) -> int:
  """Rows per shared prompt when a group's N rows are consecutive and micro-batches of `micro_rows` rows
  start at multiples of it: gcd(micro_rows, N), which divides both, so a block never crosses a group.

  >>> share_of(16, 8), share_of(16, 128), share_of(12, 8)
  (8, 16, 4)
  """
  return math.gcd(int(micro_rows), int(num_samples))
