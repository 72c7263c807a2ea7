"""A value model (critic) on the decoder: the policy's trunk with a scalar head.

PPO's critic (`rl.advantage="gae"`): `init_critic` copies the policy's embedding, layers and
final norm (adapters merged, no output head) and adds a zero-initialised scalar head, so the
critic starts at V = 0 everywhere. `critic_forward` runs the same decoder (`transformer.forward`)
and reads one value per position off the final normed hidden state.

Critic params are a policy-shaped tree plus `value_head`: its leaves sit at the policy's paths
(`layers/q` ...), so the logical-axis rules shard them as they shard the policy, and the head,
which no rule names, is replicated (`sharding.tree_shardings_like`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollouts_jax.models import lora, scoring, transformer
from rollouts_jax.models.config import ModelConfig

Params = transformer.Params
#: The key of the scalar head in a critic tree.
HEAD = "value_head"
_TRUNK = ("embed", "layers", "final_norm")


def init_critic(params: Params) -> Params:
  """A critic initialised from a policy: its trunk (copied; LoRA adapters merged) and a zero head.

  Args:
    params: the policy (plain or with LoRA adapters, `models.lora`).
  Returns:
    {"embed", "layers", "final_norm": the policy's, "value_head": {"w": float32 [D] zeros, "b": float32 0}}.

  >>> cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
  ...                   num_kv_heads=1)
  >>> critic = init_critic(transformer.init_params(cfg, jax.random.key(0)))
  >>> sorted(critic), critic["value_head"]["w"].shape
  (['embed', 'final_norm', 'layers', 'value_head'], (8,))
  """
  plain = lora.merged(params)
  trunk = {k: jax.tree_util.tree_map(jnp.copy, plain[k]) for k in _TRUNK}
  D = plain["embed"].shape[-1]
  return dict(trunk, **{HEAD: {"w": jnp.zeros((D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}})


def critic_forward(cfg: ModelConfig, critic_params: Params, tokens: jax.Array,
                   attention_mask: jax.Array | None = None) -> jax.Array:
  """Values float32 [B, L]: V at each position (of the prefix up to and including that token).

  Args:
    cfg: the policy's model configuration.
    critic_params: a critic tree (`init_critic`).
    tokens: int32 [B, L].
    attention_mask: bool [B, L] (left padding supported); default all True.

  >>> cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
  ...                   num_kv_heads=1)
  >>> critic = init_critic(transformer.init_params(cfg, jax.random.key(0)))
  >>> critic_forward(cfg, critic, jnp.ones((2, 5), jnp.int32)).tolist()[0]
  [0.0, 0.0, 0.0, 0.0, 0.0]
  """
  trunk = {k: critic_params[k] for k in _TRUNK}
  return _value_head(cfg, critic_params, transformer.forward(cfg, trunk, tokens, attention_mask, return_hidden=True))


def _value_head(cfg: ModelConfig, critic_params: Params, hidden: jax.Array) -> jax.Array:
  """float32 [..., L]: the final norm and the scalar head on final hidden states [..., L, D]."""
  norm = transformer.compute_params(cfg, {"n": critic_params["final_norm"]})["n"]
  h = transformer.rms_norm(hidden, norm, cfg.rms_norm_eps).astype(jnp.float32)
  head = critic_params[HEAD]
  return h @ head["w"].astype(jnp.float32) + head["b"].astype(jnp.float32)


def completion_values(cfg: ModelConfig, critic_params: Params, tokens_RxL: jax.Array, mask_RxL: jax.Array,
                      prompt_len: int, share: int = 1) -> jax.Array:
  """V(s_t) float32 [R, T] for completion tokens t = prompt_len ..: the value of the prefix before each token.

  As verl's critic (`values[:, -T - 1:-1]`): position t's value is read at position t - 1. With
  `share` = S > 1 each block of S consecutive rows holds one prompt, run through the trunk once
  (`scoring.completion_hidden`); the same values up to float rounding.
  """
  if share <= 1:   # the head on every position, then the slice: what the row form has always computed
    return critic_forward(cfg, critic_params, tokens_RxL, mask_RxL)[:, prompt_len - 1:-1]
  trunk = {k: critic_params[k] for k in _TRUNK}
  hidden = scoring.completion_hidden(cfg, trunk, tokens_RxL, mask_RxL, prompt_len, share)
  return _value_head(cfg, critic_params, hidden)
