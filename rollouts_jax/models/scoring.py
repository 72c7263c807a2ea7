"""Teacher-forced scoring: the log-probs and entropies of given completion tokens.

One definition, used by the RL update (current, old and reference log-probs) and by
rollout recomputation (Sol-RL's full-precision log-probs of FP4 samples), so the update's
ratio always compares like with like: both sides divide the logits by the same temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollouts_jax.models import transformer
from rollouts_jax.models.config import ModelConfig


def token_logprobs(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int, *,
                   temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Log-probs and entropies of tokens `[prompt_len:]` given everything before them.

  Args:
    cfg: model configuration.
    params: the policy.
    tokens_RxL: int32 [R, L], prompt (left-padded, length prompt_len) then completion.
    mask_RxL: bool [R, L] attention mask.
    prompt_len: P, the (padded) prompt length.
    temperature: the logits are divided by it (the sampler's temperature), > 0.

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
  """
  return pick_and_entropy(vocab_logprobs(cfg, params, tokens_RxL, mask_RxL, prompt_len, temperature=temperature),
                          tokens_RxL[:, prompt_len:])


def vocab_logprobs(cfg: ModelConfig, params, tokens_RxL: jax.Array, mask_RxL: jax.Array, prompt_len: int, *,
                   temperature: float = 1.0) -> jax.Array:
  """float32 [R, T, V]: the tempered log-softmax over the vocabulary before each of tokens `[prompt_len:]`.

  What `token_logprobs` gathers from (full-vocabulary distillation needs it whole, R T V floats).
  Args as `token_logprobs`.
  """
  hidden = transformer.forward(cfg, params, tokens_RxL, mask_RxL, return_hidden=True)
  logits_RxTxV = transformer.unembed(cfg, params, hidden[:, prompt_len - 1:-1]).astype(jnp.float32)
  if temperature != 1.0:
    logits_RxTxV = logits_RxTxV / temperature
  return jax.nn.log_softmax(logits_RxTxV, axis=-1)


def pick_and_entropy(logp_RxTxV: jax.Array, tokens_RxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log-prob of each token [R, T], entropy [R, T]) from log-probs over the vocabulary."""
  lp = jnp.take_along_axis(logp_RxTxV, tokens_RxT[..., None], axis=-1)[..., 0]
  return lp, -jnp.sum(jnp.exp(logp_RxTxV) * logp_RxTxV, axis=-1)
