"""Supervised fine-tuning: next-token cross-entropy on the completion of (prompt, completion) pairs.

Used to warm-start a small policy on a synthetic task so that RL starts from non-trivial
accuracy. The warm start is written as a Hugging Face checkpoint folder (plus the
tokenizer), so it is also loadable by `transformers`.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.training.rl_step import TrainState, init_train_state, make_optimizer


def tokenize_pairs(prompts: Sequence[str], completions: Sequence, tokenizer, max_len: int | None = None):
  """Tokens [E, L] (right-padded), attention mask [E, L] and loss mask [E, L] (completion + EOS).

  A completion is a string (all trained) or a list of (text, trained) pieces, each encoded on
  its own as a multi-turn episode appends them (`Task.completion_segments`: a tool's
  observation untrained); EOS follows the last piece and is trained.

  Raises:
    ValueError: an example longer than `max_len`.
  """
  rows, loss_rows = [], []
  for p, c in zip(prompts, completions):
    pieces = [(c, True)] if isinstance(c, str) else list(c)
    p_ids, row, loss_row = tokenizer.encode(p), [], []
    for text, trained in pieces:
      ids = list(tokenizer.encode(text))
      row += ids
      loss_row += [bool(trained)] * len(ids)
    rows.append(p_ids + row + [tokenizer.eos_id])
    loss_rows.append([False] * len(p_ids) + loss_row + [True])
  longest = max(len(r) for r in rows)
  L = max_len or int(-(-longest // 8) * 8)
  if longest > L:
    raise ValueError(f"An SFT example has {longest} tokens, more than max_len {L}.")
  tokens = np.full((len(rows), L), tokenizer.pad_id, np.int32)
  attn = np.zeros((len(rows), L), bool)
  loss = np.zeros((len(rows), L), bool)
  for i, (r, lm) in enumerate(zip(rows, loss_rows)):
    tokens[i, :len(r)] = r
    attn[i, :len(r)] = True
    loss[i, :len(r)] = lm
  return tokens, attn, loss


def sft_loss(cfg: ModelConfig, params: Params, tokens, attn, loss_mask):
  """Mean cross-entropy over loss-mask tokens (predicting token t from tokens < t)."""
  logits = models.forward(cfg, params, tokens[:, :-1], attn[:, :-1])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  m = loss_mask[:, 1:]
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1)


@functools.partial(jax.jit, static_argnames=("cfg", "tx"), donate_argnums=(0,))
def sft_step(state: TrainState, tokens, attn, loss_mask, *, cfg: ModelConfig, tx: optax.GradientTransformation):
  loss, grads = jax.value_and_grad(functools.partial(sft_loss, cfg))(state.params, tokens, attn, loss_mask)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                    opt_state=opt_state), {"loss": loss, "grad_norm": optax.global_norm(grads)}


class _HashableTx:
  """Wraps an optax transformation so it can be a static jit argument (hash by identity)."""

  def __init__(self, tx):
    self.tx = tx
    self.init, self.update = tx.init, tx.update


def train_sft(cfg: ModelConfig, params: Params, tokens: np.ndarray, attn: np.ndarray, loss_mask: np.ndarray,
              *, steps: int, batch_size: int, learning_rate: float, warmup_steps: int = 0,
              weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
              log_fn: Callable[[int, dict], None] | None = None, log_every: int = 50) -> Params:
  """Runs `steps` SFT updates on random minibatches; returns the trained params.

  Args:
    cfg, params: the model.
    tokens, attn, loss_mask: from `tokenize_pairs`.
    steps, batch_size, learning_rate, warmup_steps, weight_decay, grad_clip: optimization.
    seed: minibatch order.
    log_fn: called as log_fn(step, {"loss": ..., ...}) every `log_every` steps.
  """
  tx = _HashableTx(make_optimizer(learning_rate, steps, warmup_steps, weight_decay, grad_clip))
  state = init_train_state(params, tx)
  rng = np.random.default_rng(seed)
  n = tokens.shape[0]
  order = rng.permutation(n)
  pos = 0
  running = []
  for step in range(steps):
    if pos + batch_size > n:
      order, pos = rng.permutation(n), 0
    idx = order[pos:pos + batch_size]
    pos += batch_size
    state, m = sft_step(state, tokens[idx], attn[idx], loss_mask[idx], cfg=cfg, tx=tx)
    running.append(m["loss"])
    if log_fn is not None and ((step + 1) % log_every == 0 or step + 1 == steps):
      log_fn(step + 1, {"sft/loss": float(jnp.mean(jnp.stack(running))), "sft/grad_norm": float(m["grad_norm"])})
      running = []
  return state.params
