"""The SFT loss and the RL update's log-probs are one quantity: they cannot drift apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models
from rollouts_jax.data.tokenizers import CharTokenizer
from rollouts_jax.training import sft


def _model(tie: bool):
  cfg = models.ModelConfig(vocab_size=CharTokenizer.default().vocab_size, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=tie)
  return cfg, models.init_params(cfg, jax.random.key(3))


def _rows():
  tok = CharTokenizer.default()
  prompts = ["What is 12 + 7?\n", "What is 345 + 9?\n", "1+1?\n"]
  completions = ["2+7+0=9\n<answer>19</answer>", "5+9+0=14\n<answer>354</answer>", "<answer>2</answer>"]
  return sft.tokenize_pairs(prompts, completions, tok)


@pytest.mark.parametrize("tie", [True, False])
def test_sft_loss_is_the_masked_mean_of_the_rl_log_probs(tie):
  """sft_loss == mean over completion tokens of -models.token_logprobs (the RL step's scorer), value and gradient."""
  cfg, params = _model(tie)
  tokens, attn, loss_mask = (jnp.asarray(x) for x in _rows())

  def via_token_logprobs(p):
    lp, _ = models.token_logprobs(cfg, p, tokens, attn, 1)  # every token after the first, given its prefix
    m = loss_mask[:, 1:]
    return jnp.sum(-lp * m) / jnp.sum(m)

  loss, grads = jax.value_and_grad(lambda p: sft.sft_loss(cfg, p, tokens, attn, loss_mask))(params)
  ref_loss, ref_grads = jax.value_and_grad(via_token_logprobs)(params)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-7)


def test_sft_loss_scores_only_the_completion():
  """The loss mask covers each row's completion and EOS only; an empty mask gives 0; a completion token counts."""
  cfg, params = _model(True)
  tokens, attn, loss_mask = _rows()
  base = float(sft.sft_loss(cfg, params, tokens, attn, loss_mask))
  # The loss mask covers the completion and EOS of each row, never the prompt or the padding.
  first = np.argmax(loss_mask, axis=1)
  assert np.all(loss_mask.sum(1) == attn.sum(1) - first) and not np.any(loss_mask & ~attn)
  # With a mask on nothing, the loss is 0 (no division by zero).
  assert float(sft.sft_loss(cfg, params, tokens, attn, np.zeros_like(loss_mask))) == 0.0
  flipped = tokens.copy()
  flipped[0, first[0]] = (flipped[0, first[0]] + 1) % cfg.vocab_size
  assert float(sft.sft_loss(cfg, params, flipped, attn, loss_mask)) != base
