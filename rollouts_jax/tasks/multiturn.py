"""Tasks whose episodes run in a multi-turn environment (`rollout.env`): their prompts are the
environment's first message; their examples come from an existing builder or are drawn here.

* `multiply_tool`: the `arithmetic` builder's problems (`data.ops="*"` for multiplication) in the
  calculator environment's words; the SFT target calls the calculator on a `tool_frac` share of
  the examples and answers directly on the others, so RL can move the share.
* `guess`: the number-guessing game (no tool), secrets drawn here from `data.seed`.

>>> from rollouts_jax import tasks
>>> t = tasks.get("multiply_tool")
>>> t.prompt({"a": 47, "b": 28, "op": "*"}, None)
'What is 47 * 28?\\n'
>>> t.completion({"a": 47, "b": 28, "op": "*", "answer": "1316"})
'<tool_call>47*28</tool_call><tool_result>1316</tool_result><answer>1316</answer>'
"""

from __future__ import annotations

import dataclasses
import zlib

from rollouts_jax.envs import calculator as calculator_env
from rollouts_jax.envs import guess as guess_env
from rollouts_jax.tasks import base


@dataclasses.dataclass(frozen=True)
class MultiplyTool(base.Arithmetic):
  """Arithmetic with a calculator tool (the `calculator` environment's task)."""
  name: str = "multiply_tool"
  dataset: str = "arithmetic"
  can_rewrite: bool = False
  tool_frac: float = 0.5

  def prompt(self, example, tokenizer, template="plain", *, instruction=True):
    env = calculator_env.CalculatorEnv(instruction=bool(instruction) and template == "chat")
    text = env.prompt(example)
    if template == "plain":
      return text
    if template != "chat":
      raise ValueError(f"template must be 'plain' or 'chat', got {template!r}")
    return tokenizer.apply_chat_template([{"role": "user", "content": text.strip()}], add_generation_prompt=True)

  def uses_tool(self, example) -> bool:
    """Whether the example's SFT target calls the calculator (a fixed `tool_frac` share of problems)."""
    return (zlib.crc32(_expression(example).encode()) % 1000) < 1000 * self.tool_frac

  def completion(self, example):
    answer = str(example["answer"])
    if not self.uses_tool(example):
      return _answer_tag(answer)
    return (f"{_tool_call(example)}{calculator_env.RESULT_OPEN}{answer}{calculator_env.RESULT_CLOSE}"
            f"{_answer_tag(answer)}")

  def completion_segments(self, example, tokenizer, template="plain"):
    """In the chat format: the call (trained), the calculator's `tool` message as the episode renders it
    (`envs.ChatRenderer`, untrained), the answer (trained). The plain format keeps `completion` whole,
    the target its published warm start was trained on (the result text trained too)."""
    if template != "chat" or not self.uses_tool(example):
      return [(self.completion(example), True)]
    from rollouts_jax.envs import base as env_base  # pylint: disable=g-import-not-at-top
    answer = str(example["answer"])
    observation = env_base.ChatRenderer(tokenizer).observation(answer, ended_with_eos=False)
    return [(_tool_call(example), True), (observation, False), (_answer_tag(answer), True)]


def _expression(example) -> str:
  """The problem as the calculator reads it, e.g. "47*28"."""
  return f"{int(example['a'])}{example.get('op', '*')}{int(example['b'])}"


def _tool_call(example) -> str:
  return f"{calculator_env.TOOL_OPEN}{_expression(example)}{calculator_env.TOOL_CLOSE}"


def _answer_tag(answer: str) -> str:
  return f"<answer>{answer}</answer>"


@dataclasses.dataclass(frozen=True)
class Guess(base.Task):
  """The guessing game (the `guess` environment's task); the answer is the secret."""
  name: str = "guess"
  synthetic: bool = True
  answer_format: str = "number"
  max_value: int = 16

  def load(self, data_cfg):
    train = guess_env.examples(data_cfg.num_train, self.max_value, data_cfg.seed)
    test = guess_env.examples(data_cfg.num_test, self.max_value, data_cfg.seed + 1)
    return train, test, False

  def prompt(self, example, tokenizer, template="plain", *, instruction=True):
    text = guess_env.GuessEnv(max_value=self.max_value).prompt(example)
    if template == "plain":
      return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text.strip()}], add_generation_prompt=True)

  def completion(self, example):
    return f"<guess>{(1 + int(example.get('max_value', self.max_value))) // 2}</guess>"

  def reference(self, example):
    return str(example["secret"])

  def extract(self, text):
    found = guess_env._INT.findall(str(text))  # pylint: disable=protected-access
    return found[-1] if found else None

  def grade(self, answer, reference):
    return float(answer is not None and int(answer) == int(reference))


TASKS = (MultiplyTool(), Guess())
