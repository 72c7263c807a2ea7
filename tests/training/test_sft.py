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


def test_a_chat_tool_target_trains_the_policy_turns_and_not_the_tool_message():
  """`multiply_tool` in the chat format: the call and the answer are trained, the calculator's `tool` message
  (as the episode renders it, `envs.ChatRenderer`) is not; the plain format keeps its whole target."""
  from rollouts_jax import envs, tasks
  tok = CharTokenizer.default(chat_template=(
      "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
  task = tasks.get("multiply_tool")
  ex = next({"a": a, "b": 28, "op": "*", "answer": str(a * 28)} for a in range(10, 99)
            if task.uses_tool({"a": a, "b": 28, "op": "*"}))
  pieces = task.completion_segments(ex, tok, "chat")
  observation = envs.renderer("chatml", tok).observation(ex["answer"], ended_with_eos=False)
  assert pieces == [(f"<tool_call>{ex['a']}*28</tool_call>", True), (observation, False),
                    (f"<answer>{ex['answer']}</answer>", True)]
  prompt = task.prompt(ex, tok, "chat")
  tokens, attn, loss = sft.tokenize_pairs([prompt], [pieces], tok)
  n = int(attn[0].sum())
  row, trained = tokens[0, :n].tolist(), loss[0, :n]
  p, call, obs = (len(tok.encode(t)) for t in (prompt, pieces[0][0], observation))
  assert row[:p] == tok.encode(prompt) and not trained[:p].any()
  assert trained[p:p + call].all() and tok.decode(row[p:p + call]) == pieces[0][0]
  assert not trained[p + call:p + call + obs].any() and tok.decode(row[p + call:p + call + obs]) == observation
  assert trained[p + call + obs:].all() and row[-1] == tok.eos_id
  # Direct answers, and the plain format, are the whole `completion`, trained.
  assert task.completion_segments(ex, tok, "plain") == [(task.completion(ex), True)]
  direct = next({"a": a, "b": 28, "op": "*", "answer": str(a * 28)} for a in range(10, 99)
                if not task.uses_tool({"a": a, "b": 28, "op": "*"}))
  assert task.completion_segments(direct, tok, "chat") == [(f"<answer>{direct['answer']}</answer>", True)]


def test_sft_from_pretrained_fine_tunes_the_loaded_model_and_caches_it(tmp_path, monkeypatch):
  """`sft.from_pretrained` with model.init='hf': SFT starts from the checkpoint's weights (not a random init),
  the warm start is cached (a second load is bitwise the first), and without it RL gets the checkpoint as is."""
  from rollouts_jax import tasks
  from rollouts_jax.training import policy
  from rollouts_jax.training.config import DataConfig, ModelSectionConfig, SFTConfig, TokenizerConfig
  sizes = dict(hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2)
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  task, data = tasks.get("arithmetic"), DataConfig(difficulty=2, num_train=16, num_test=8)
  train, _, _ = task.load(data)
  base = ModelSectionConfig(**sizes)
  cfg, params, _ = policy.load_policy(task, [], data=data, tok=TokenizerConfig(), m=dataclasses_replace(base, init="random"),
                                      sft=SFTConfig(cache_dir=str(tmp_path)), seed=5)
  models.save_hf_checkpoint(tmp_path / "ckpt", cfg, params)
  m = dataclasses_replace(base, init="hf", path=str(tmp_path / "ckpt"))
  tuned = SFTConfig(cache_dir=str(tmp_path / "ws"), steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0,
                    from_pretrained=True)
  as_loaded = policy.load_policy(task, train, data=data, tok=TokenizerConfig(), m=m, sft=SFTConfig(), seed=0)[1]
  first = policy.load_policy(task, train, data=data, tok=TokenizerConfig(), m=m, sft=tuned, seed=0)[1]
  again = policy.load_policy(task, train, data=data, tok=TokenizerConfig(), m=m, sft=tuned, seed=0)[1]
  for a, b in zip(jax.tree.leaves(as_loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(first),
                                                                             jax.tree.leaves(params))]
  # Fine-tuned from the checkpoint, not re-initialised: 3 Adam steps move a weight by at most ~3 x lr.
  assert 0 < max(moved) <= 3 * tuned.learning_rate * 1.01
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert len(list((tmp_path / "ws").glob("arithmetic-*/done.json"))) == 1


def dataclasses_replace(obj, **kw):
  import dataclasses
  return dataclasses.replace(obj, **kw)
