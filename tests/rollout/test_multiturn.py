"""Multi-turn rollouts: KV continuation, byte-exact trajectories, observation tokens out of the loss.

A tiny random policy over the char vocabulary decodes 3+ turns against scripted environments
(rows finishing at different turns); every property is checked on the real sampler, the real
update and the real pipeline.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import data, envs, models, sampling
from rollouts_jax.advantages import turns as turns_lib
from rollouts_jax.rollout import multiturn as mt_gen
from rollouts_jax.sampling import multiturn as mt
from rollouts_jax.training import config as config_lib
from rollouts_jax.rollout import stats as rollout_stats
from rollouts_jax.training import loop, rl_step
from rollouts_jax.types import teacher_forced_rows

TOK = data.CharTokenizer.default()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, eos_token_ids=(TOK.eos_id,), pad_token_id=TOK.pad_id)
PARAMS = models.init_params(CFG, jax.random.key(0))


class ScriptEnv(envs.Env):
  """Ends after `example["turns"]` turns; observation k of a row is a tag with the turn and a number."""
  name = "script"
  plain_wrap = ("<r>", "</r>\n")

  def __init__(self):
    self.seen = []          # (turn text, observation) per call, in order

  def prompt(self, example):
    return f"go {example['turns']}\n"

  def reset(self, example):
    return {"turn": 0, "turns": int(example["turns"])}

  def step(self, state, completion_text):
    state = dict(state, turn=state["turn"] + 1)
    done = state["turn"] >= state["turns"]
    obs = "" if done else f"t{state['turn']} n{len(completion_text) * 7}"
    self.seen.append((completion_text, obs))
    return envs.StepResult(obs, 1.0 if done else 0.25, done, state)

  def solved(self, state):
    return state["turn"] >= state["turns"]


def _prompts(examples, env):
  ids, mask = data.pad_left([TOK.encode(env.prompt(ex)) for ex in examples], (16,), pad_id=TOK.pad_id)
  return np.asarray(ids, np.int32), np.asarray(mask, bool)


def _run(examples, *, mode="kv", N=3, T=64, turn_tokens=6, max_turns=4, key=1, record=None, env=None):
  env = env or ScriptEnv()
  conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
                                 prompt_buckets=(16,))
  settings = envs.EnvSettings(name="script", max_turns=max_turns, turn_tokens=turn_tokens)
  ids, mask = _prompts(examples, env)
  return mt_gen.run_episodes(CFG, PARAMS, ids, mask, examples, env, TOK, conf, jax.random.key(key), settings,
                             mode=mode), env


def test_kv_continuation_equals_reprefilling_the_history_and_the_trainers_logprobs():
  examples = [{"turns": 3}, {"turns": 4}]
  kv, _ = _run(examples, mode="kv")
  re, _ = _run(examples, mode="reprefill")
  np.testing.assert_array_equal(kv.tokens, re.tokens)
  np.testing.assert_array_equal(kv.mask, re.mask)
  np.testing.assert_allclose(kv.logprobs, re.logprobs, atol=1e-5)
  assert kv.recomputed_tokens < re.recomputed_tokens / 3    # only observation tokens ran again
  # The sampler's log-probs of the policy's tokens are the trainer's teacher-forced ones.
  B, N, T = 2, 3, kv.tokens.shape[1]
  lp = rl_step.batch_logprobs(PARAMS, kv.prompt_ids, kv.prompt_mask, kv.tokens.reshape(B, N, T),
                              kv.mask.reshape(B, N, T), cfg=CFG)
  np.testing.assert_allclose(np.asarray(lp).reshape(B * N, T), kv.policy_logprobs, atol=1e-5)


def test_trained_ids_are_the_sampled_ids_plus_the_observation_ids_byte_for_byte(monkeypatch):
  """For every row, across 3+ turns with rows finishing at different turns."""
  decoded, appended = [], []
  real_decode, real_append = mt.decode_turn, mt.append

  def decode(*a, **k):
    before = np.asarray(jax.device_get(a[2].length))
    conv = real_decode(*a, **k)
    toks, after = jax.device_get((conv.tokens, conv.length))
    decoded.append([np.asarray(toks)[r, before[r]:after[r]].tolist() for r in range(len(before))])
    return conv

  def append(cfg, params, conv, ids, lens, **k):
    appended.append([np.asarray(ids)[r, :int(lens[r])].tolist() for r in range(len(lens))])
    return real_append(cfg, params, conv, ids, lens, **k)

  monkeypatch.setattr(mt, "decode_turn", decode)
  monkeypatch.setattr(mt, "append", append)
  examples = [{"turns": 1}, {"turns": 3}, {"turns": 4}]
  ep, env = _run(examples, N=2, T=96, turn_tokens=5)
  batch = mt_gen.to_batch(ep, 3, 2, prompt_index=np.arange(3), version=0)
  # The update's rows, after the pipeline's trim to the last loss position.
  width = max(8, -(-rollout_stats.loss_extent(batch.completion_mask) // 8) * 8)
  trimmed = batch.trim(width)
  rows, _ = teacher_forced_rows(trimmed.prompt_ids, trimmed.prompt_mask, trimmed.completion_ids)
  rows = np.asarray(rows)
  P = trimmed.prompt_ids.shape[1]
  turns_per_row = ep.turn_mask.sum(1)
  assert sorted(set(turns_per_row.tolist())) == [1, 3, 4]          # rows finish at different turns
  observations = iter(obs for _, obs in env.seen)
  for r in range(6):
    expect, policy_pos = [], []
    for k in range(int(turns_per_row[r])):
      policy_pos += range(len(expect), len(expect) + len(decoded[k][r]))
      expect += decoded[k][r]
      if k < len(appended) and appended[k][r]:
        expect += appended[k][r]
    assert rows[r, P:P + len(expect)].tolist() == expect, r
    assert (rows[r, P + len(expect):] == TOK.pad_id).all()
    m = np.asarray(trimmed.completion_mask).reshape(6, -1)[r]
    assert np.flatnonzero(m).tolist() == policy_pos             # loss mask 1 exactly at the policy's tokens
    lp = np.asarray(trimmed.behaviour_logprobs).reshape(6, -1)[r]
    assert (lp[~m] == 0).all() and (lp[m] < 0).all()
  # Each observation's ids are the tokenizer's encoding of its rendered text, once.
  renderer = envs.renderer("plain", TOK, env)
  obs_texts = [obs for _, obs in env.seen if obs]
  obs_ids = [ids for turn in appended for ids in turn if ids]
  assert sorted(map(tuple, obs_ids)) == sorted(tuple(TOK.encode(renderer.observation(t, False))) for t in obs_texts)
  # Rewards: the sum of the turn rewards (0.25 per continuing turn, 1 at the end).
  np.testing.assert_allclose(np.asarray(batch.rewards).ravel(), 0.25 * (turns_per_row - 1) + 1.0)
  del observations


def test_stop_strings_and_turn_budget_end_a_turn():
  """A turn stops right after a stop sequence; no turn is longer than turn_tokens."""
  conf = sampling.SamplingConfig(num_samples=8, max_new_tokens=40, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
                                 prompt_buckets=(16,))
  ids, mask = _prompts([{"turns": 1}], ScriptEnv())
  conv = mt.start(CFG, PARAMS, ids, mask, conf)
  # Every single char is a "stop sequence" here except a few: turns end after their first stop char.
  stops = [[t] for t in range(4, 40)]
  out = jax.device_get(mt.decode_turn(CFG, PARAMS, conv, jax.random.key(0), conf, turn_tokens=7, stop_ids=stops))
  for r in range(8):
    turn = out.tokens[r, :out.length[r]].tolist()
    assert 1 <= len(turn) <= 7
    hits = [i for i, t in enumerate(turn) if 4 <= t < 40]
    assert not hits or hits[0] == len(turn) - 1        # stopped at the first stop token
    ended = turn[-1] == TOK.eos_id or hits or len(turn) == 7
    assert ended


def test_no_recompile_across_turn_counts_and_observation_lengths():
  _run([{"turns": 2}, {"turns": 3}])
  sizes = (mt._decode_turn_jit._cache_size(), mt._append_jit._cache_size())   # pylint: disable=protected-access
  _run([{"turns": 4}, {"turns": 1}], key=5)
  _run([{"turns": 3}, {"turns": 3}], key=7, max_turns=3)
  assert (mt._decode_turn_jit._cache_size(), mt._append_jit._cache_size()) == sizes   # pylint: disable=protected-access


def test_observation_tokens_get_zero_loss_and_zero_kl():
  examples = [{"turns": 3}, {"turns": 4}]
  ep, _ = _run(examples, N=4, T=64)
  batch = mt_gen.to_batch(ep, 2, 4, prompt_index=np.arange(2), version=0, credit="turn", gamma=0.9)
  batch = batch.replace(rewards=batch.rewards + np.arange(8, dtype=np.float32).reshape(2, 4) * 0.1)
  m = np.asarray(batch.completion_mask)
  obs = (np.asarray(batch.completion_ids) != TOK.pad_id) & ~m
  # Observation tokens inside the rows (not only padding after them).
  inside = obs & (np.arange(m.shape[-1]) < ep.length.reshape(2, 4)[..., None])
  assert inside.sum() > 10
  rl = config_lib.RLConfig(kl_coef=0.2, kl_kind="k3", learning_rate=1e-2)
  ref = models.init_params(CFG, jax.random.key(9))

  def step(b):
    state = rl_step.init_train_state(PARAMS, rl_step.rl_optimizer(rl))
    new, metrics = rl_step.rl_step(state, jax.tree.map(jnp.asarray, b), ref, cfg=CFG, rl=rl)
    return jax.device_get(new.params), {k: float(v) for k, v in jax.device_get(metrics).items()}

  p0, m0 = step(batch)
  garbage = lambda x: np.where(inside, 17.0, np.asarray(x)).astype(np.float32)
  p1, m1 = step(batch.replace(behaviour_logprobs=garbage(batch.behaviour_logprobs),
                              token_advantages=garbage(batch.token_advantages),
                              old_logprobs=garbage(batch.behaviour_logprobs)))
  for k in ("loss", "pg_loss", "kl", "policy_entropy", "tokens_in_loss"):
    assert m0[k] == pytest.approx(m1[k], rel=1e-6, abs=1e-7), k
  assert m0["tokens_in_loss"] == m.sum()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p0, p1)
  # The observation tokens are context: another observation changes the policy tokens' loss.
  ids = np.asarray(batch.completion_ids).copy()
  ids[inside] = TOK.token_to_id("7")
  _, m2 = step(batch.replace(completion_ids=ids))
  assert m2["kl"] != pytest.approx(m0["kl"], rel=1e-4)
  # Per token: the gradient of the policy loss and of the KL penalty at observation positions is 0.
  from rollouts_jax import losses
  m = m.reshape(8, -1)
  lp0 = jnp.asarray(np.where(m, np.asarray(batch.behaviour_logprobs).reshape(8, -1), -1.0))
  adv = jnp.where(jnp.asarray(m), 1.0, 5.0)
  g_pg = jax.grad(lambda lp: losses.policy_loss(lp, lp0, adv, jnp.asarray(m), kind="ppo_clip", clip_low=0.2,
                                                clip_high=0.2, agg="token-mean")[0])(lp0 + 0.1)
  g_kl = jax.grad(lambda lp: losses.kl_penalty(lp, lp0 - 0.3, kind="k3", mask=jnp.asarray(m), agg="token-mean"))(lp0)
  assert (np.asarray(g_pg)[~m] == 0).all() and (np.asarray(g_kl)[~m] == 0).all()
  assert np.abs(np.asarray(g_kl)[m]).sum() > 0 and np.abs(np.asarray(g_pg)[m]).sum() > 0


def test_turn_credit_discounts_turn_rewards_and_normalizes_per_turn():
  r = np.array([[[0.0, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, 1.0, 0.0]]])
  mask = np.array([[[True, True, True], [True, False, False], [True, True, False]]])
  G = turns_lib.discounted_returns(r, mask, 0.5)
  np.testing.assert_allclose(G, [[[0.25, 0.5, 1.0], [0.5, 0, 0], [0.5, 1.0, 0]]])
  A = turns_lib.turn_advantages(r, mask, 0.5)
  g0 = np.array([0.25, 0.5, 0.5])
  np.testing.assert_allclose(A[0, :, 0], (g0 - g0.mean()) / g0.std(ddof=1), rtol=1e-5)
  g1 = np.array([0.5, 1.0])
  np.testing.assert_allclose(A[0, [0, 2], 1], (g1 - g1.mean()) / g1.std(ddof=1), rtol=1e-5)
  assert A[0, 1, 1] == 0 and A[0, 0, 2] == 0            # a turn reached by one sample: centred, alone
  ids = np.array([[[0, 0, -1, 1, 2], [0, -1, -1, -1, -1], [0, -1, 1, 1, -1]]])
  tok = turns_lib.credit("turn", r, mask, ids, gamma=0.5)
  assert tok[0, 0, 2] == 0 and tok[0, 0, 3] == A[0, 0, 1] and tok[0, 2, 2] == A[0, 2, 1]
  assert turns_lib.credit("trajectory", r, mask, ids) is None
  np.testing.assert_allclose(turns_lib.trajectory_rewards(r, mask), [[1.0, 0.5, 1.0]])


def _exp(**rollout):
  base = {"data": {"task": "multiply_tool", "difficulty": 2, "ops": "*"},
          "rollout": {"num_samples": 4, "max_new_tokens": 48, "generator": "multiturn", "env": "calculator",
                      "max_turns": 3, "turn_tokens": 16},
          "control": {"prompts_per_step": 3}, "reward": {"num_workers": 0}, "rl": {"steps": 2}}
  base["rollout"].update(rollout)
  return config_lib.from_config_dict(base)


def test_config_keys_are_checked_with_their_names():
  assert _exp().rollout.env == "calculator"
  with pytest.raises(ValueError, match=r"rollout.env='calculator' and rollout.generator='sample'"):
    _exp(generator="sample")
  with pytest.raises(ValueError, match=r"rollout.env='' and rollout.generator='multiturn'"):
    _exp(env="")
  with pytest.raises(ValueError, match=r"rollout.turn_tokens must be in \[0, rollout.max_new_tokens=48\]"):
    _exp(turn_tokens=64)
  with pytest.raises(ValueError, match=r"rollout.env_kwargs: environment 'calculator' has no setting 'calls'"):
    _exp(env_kwargs="calls=2")
  with pytest.raises(ValueError, match=r"rollout.turn_credit must be one of trajectory, turn"):
    _exp(turn_credit="step")
  with pytest.raises(ValueError, match=r"reward.name='format_answer_tag'.*the environment's rewards are the rewards"):
    config_lib.from_config_dict(dict(
        {k: v for k, v in dataclasses.asdict(_exp()).items() if k in ("data", "rollout", "control", "rl")},
        reward={"name": "format_answer_tag", "num_workers": 0}))


def test_pipeline_keeps_the_environments_rewards_and_the_later_turns():
  """FILTER does not re-score an environment's batch, and the update's trim keeps every turn."""
  from rollouts_jax.envs import guess
  exp = config_lib.from_config_dict({
      "data": {"task": "guess"}, "control": {"prompts_per_step": 3}, "reward": {"num_workers": 0},
      "rollout": {"num_samples": 4, "max_new_tokens": 64, "generator": "multiturn", "env": "guess",
                  "max_turns": 3, "turn_tokens": 8, "turn_credit": "turn"}})
  examples = guess.examples(12, 16, 0)
  pipe = loop.build_pipeline(exp, CFG, TOK, examples)

  class Refuse:
    def __init__(self, scorer):
      self.scorer = scorer

    def __getattr__(self, name):
      return getattr(self.scorer, name)

    def __call__(self, *a, **k):
      raise AssertionError("FILTER scored an environment's batch")

  pipe.scorer = Refuse(pipe.scorer)
  state = pipe.init_state()
  batch, _, info = pipe.collect(state, PARAMS, 0, jax.random.key(3))
  assert batch.token_advantages is not None and "env/tool_use_frac" in info and "env/accuracy" in info
  m = np.asarray(batch.completion_mask)
  assert batch.completion_ids.shape[-1] >= rollout_stats.loss_extent(m) > m.sum(-1).max()  # holes kept


@pytest.mark.slow
def test_smollm2_calculator_episode_in_its_chat_template():
  """The real model: turns end at <|im_end|> or </tool_call>, observations are ChatML tool messages, and the
  sampler's log-probs of its tokens are the trainer's on the whole conversation."""
  from rollouts_jax.envs import calculator
  path = models.smollm2_path()
  cfg, params = models.load_gguf(path, dtype=jnp.float32)
  tok = data.load_tokenizer(path)
  env = calculator.CalculatorEnv(instruction=True)
  examples = [{"a": 47, "b": 28, "op": "*", "answer": "1316"}]
  text = tok.apply_chat_template([{"role": "user", "content": env.prompt(examples[0]).strip()}],
                                 add_generation_prompt=True)
  ids, mask = data.pad_left([tok.encode(text)], (64, 128), pad_id=tok.pad_id)
  stop = tok.end_of_turn_ids
  conf = sampling.SamplingConfig(num_samples=2, max_new_tokens=96, eos_id=stop[0] if len(stop) == 1 else stop,
                                 pad_id=tok.pad_id)
  settings = envs.EnvSettings(name="calculator", max_turns=3, turn_tokens=32, render="chatml")
  ep = mt_gen.run_episodes(cfg, params, np.asarray(ids), np.asarray(mask), examples, env, tok, conf,
                           jax.random.key(0), settings)
  renderer = envs.renderer("chatml", tok)
  for r in range(2):
    for obs in ep.obs_ids[r]:
      assert tok.decode(obs).endswith("<|im_end|>\n<|im_start|>assistant\n") and "<|im_start|>tool\n" in tok.decode(obs)
  lp = rl_step.batch_logprobs(params, ep.prompt_ids, ep.prompt_mask, ep.tokens.reshape(1, 2, -1),
                              ep.mask.reshape(1, 2, -1), cfg=cfg)
  np.testing.assert_allclose(np.asarray(lp).reshape(2, -1), ep.policy_logprobs, atol=2e-3)
  del renderer


def test_turn_credit_is_normalised_among_the_budgets_samples_only():
  """A selector's budget of 2 of N = 4: samples 3 and 4 are masked and leave the live ones' credit unchanged."""
  ep, _ = _run([{"turns": 3}, {"turns": 2}], N=4, T=64)
  full = mt_gen.to_batch(ep, 2, 4, prompt_index=np.arange(2), version=0, credit="turn", budget=np.array([4, 4]))
  cut = mt_gen.to_batch(ep, 2, 4, prompt_index=np.arange(2), version=0, credit="turn", budget=np.array([2, 4]))
  np.testing.assert_array_equal(np.asarray(cut.sample_mask), [[1, 1, 0, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(cut.token_advantages[1], full.token_advantages[1])   # group 2: its whole budget
  # Group 1's two live samples are normalised between themselves, as if the others were never decoded.
  two = dataclasses.replace(ep, **{f: getattr(ep, f).reshape((2, 4) + getattr(ep, f).shape[1:])[:1, :2].reshape(
      (2,) + getattr(ep, f).shape[1:]) for f in ("tokens", "mask", "logprobs", "entropy", "turn_rewards", "turn_mask",
                                                 "turn_ids")}, prompt_ids=ep.prompt_ids[:1], prompt_mask=ep.prompt_mask[:1])
  alone = mt_gen.to_batch(two, 1, 2, prompt_index=np.arange(1), version=0, credit="turn")
  np.testing.assert_allclose(cut.token_advantages[0, :2], alone.token_advantages[0], rtol=1e-6, atol=1e-7)
