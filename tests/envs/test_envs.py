"""Environments: the registry, the guessing game, the calculator environment and the turn renderers."""

import pytest

from rollouts_jax import data, envs, tasks
from rollouts_jax.envs import tools


def test_registry_names_and_settings_are_checked_with_their_config_keys():
  assert {"calculator", "guess"} <= set(envs.names())
  with pytest.raises(ValueError, match=r"Config key rollout.env: unknown environment 'chess'"):
    envs.build("chess")
  with pytest.raises(ValueError, match=r"Config key rollout.env_kwargs: environment 'calculator' has no setting "
                     r"'calls'; its settings: instruction, max_calls, timeout_s, tool, tool_penalty"):
    envs.build("calculator", calls=3)
  with pytest.raises(ValueError, match=r"rollout.env_kwargs: environment 'calculator' setting 'max_calls' must be >= 1"):
    envs.build("calculator", max_calls=0)
  s = envs.EnvSettings(name="guess", max_turns=0)
  with pytest.raises(ValueError, match=r"rollout.max_turns must be >= 1"):
    s.check(32)
  with pytest.raises(ValueError, match=r"rollout.turn_tokens must be in \[0, rollout.max_new_tokens=32\]"):
    envs.EnvSettings(name="guess", turn_tokens=40).check(32)
  with pytest.raises(ValueError, match=r"rollout.turn_credit must be one of trajectory, turn"):
    envs.EnvSettings(name="guess", credit="step").check(32)
  with pytest.raises(ValueError, match=r"rollout.env_render must be one of plain, chatml"):
    envs.EnvSettings(name="guess", render="html").check(32)


def test_guess_game_answers_higher_lower_and_ends_on_the_secret():
  env = envs.build("guess", max_value=16, consistent_reward=0.1)
  s0 = env.reset({"secret": 11})
  obs, r, done, s = env.step(s0, "<guess>8</guess>")
  assert (obs, r, done) == ("higher", pytest.approx(0.1), False)
  obs, r, done, s = env.step(s, "I say 14")
  assert (obs, done) == ("lower", False) and s["low"] == 9 and s["high"] == 13
  obs, r, done, s2 = env.step(s, "3")          # outside the interval the replies allow: no bonus
  assert (obs, r) == ("higher", 0.0)
  obs, r, done, _ = env.step(s, "no idea")     # no number: an error observation, the game goes on
  assert obs.startswith("error: bad_arguments") and not done
  assert env.step(s, "<guess>11</guess>")[1:3] == (1.0, True)
  assert s0 == {"secret": 11, "low": 1, "high": 16, "guesses": 0, "solved": False}   # states are never mutated


def test_calculator_env_runs_the_tool_and_grades_the_final_answer():
  env = envs.build("calculator", max_calls=1, tool_penalty=0.05)
  s = env.reset({"a": 47, "b": 28, "op": "*", "answer": "1316"})
  obs, r, done, s = env.step(s, "<tool_call>47*28</tool_call>")
  assert (obs, r, done) == ("1316", -0.05, False) and env.used_tool(s)
  obs, r, done, s = env.step(s, "<tool_call>1+1</tool_call>")          # past max_calls
  assert obs == "error: bad_arguments: at most 1 calculator calls" and not done
  obs, r, done, s = env.step(s, "<tool_call>47*")                      # cut off before the closing tag
  assert obs.startswith("error: bad_arguments: a tool call needs </tool_call>") and not done
  assert env.step(s, "<answer>1316</answer>")[1:3] == (1.0, True)
  assert env.step(s, "<answer>1310</answer>")[1:3] == (0.0, True)
  assert env.stop_strings == ("</tool_call>",)
  s = env.reset({"a": 2, "b": 3, "answer": "6"})
  assert env.step(s, "<tool_call>__import__('os')</tool_call>").observation == (
      "error: bad_arguments: unsupported expression: Call")


def test_plain_renderer_wraps_with_the_environments_tags():
  tok = data.CharTokenizer.default()
  r = envs.renderer("plain", tok, envs.build("calculator"))
  assert r.observation("84", ended_with_eos=False) == "<tool_result>84</tool_result>"


def test_chatml_renderer_follows_the_models_own_template():
  """SmolLM2's ChatML template: close the assistant turn (not twice after <|im_end|>), a tool message, reopen."""
  from rollouts_jax import models
  tok = data.load_tokenizer(models.smollm2_path())
  r = envs.renderer("chatml", tok)
  assert r.observation("1316", ended_with_eos=True) == "\n<|im_start|>tool\n1316<|im_end|>\n<|im_start|>assistant\n"
  assert r.observation("1316", ended_with_eos=False) == (
      "<|im_end|>\n<|im_start|>tool\n1316<|im_end|>\n<|im_start|>assistant\n")
  # The conversation's text, rendered by the template as a whole, is the turns plus the observations.
  msgs = [{"role": "user", "content": "What is 47 * 28?"}, {"role": "assistant", "content": "<tool_call>47*28</tool_call>"},
          {"role": "tool", "content": "1316"}]
  whole = tok.apply_chat_template(msgs, add_generation_prompt=True)
  prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
  assert whole == prompt + "<tool_call>47*28</tool_call>" + r.observation("1316", ended_with_eos=False)
  ids = tok.encode(r.observation("1316", ended_with_eos=True))
  assert tok.encode("<|im_start|>")[0] in ids       # special tokens are single ids, not text


def test_multiturn_tasks_prompt_with_the_environments_words():
  t = tasks.get("multiply_tool")
  assert t.prompt({"a": 47, "b": 28, "op": "*"}, None) == "What is 47 * 28?\n"
  shares = [t.uses_tool({"a": a, "b": 13, "op": "*"}) for a in range(400)]
  assert 0.4 < sum(shares) / len(shares) < 0.6
  tool_target = next(t.completion({"a": a, "b": 13, "op": "*", "answer": str(13 * a)})
                     for a, use in enumerate(shares) if use)
  assert tool_target.startswith("<tool_call>") and t.reward(tool_target, tool_target.split("<answer>")[1][:-9]) == 1.0
  g = tasks.get("guess")
  train, test, from_test = g.load(type("D", (), {"num_train": 5, "num_test": 3, "seed": 0})())
  assert len(train) == 5 and len(test) == 3 and not from_test
  assert g.reward("<guess>7</guess>", "7") == 1.0 and g.reward("", "7") == 0.0
  assert tools.is_error(tools.calculate("1/0"))
