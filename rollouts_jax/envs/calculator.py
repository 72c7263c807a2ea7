"""`calculator`: arithmetic with a calculator tool (multi-digit multiplication, countdown-style sums).

The policy may call the calculator any number of times (up to `max_calls`) by writing
`<tool_call>EXPR</tool_call>`; the environment answers with the calculator's output (an
error observation for a malformed expression) and the episode goes on. A turn without a
tool call ends the episode: its `<answer>N</answer>` is graded against the example's answer
(reward 1 when equal, else 0; `tool_penalty` per call may be subtracted).

In the plain format (small models) the observation reads `<tool_result>84</tool_result>`;
in the chat format it is the content of a `tool` message.

>>> env = CalculatorEnv()
>>> s = env.reset({"a": 12, "b": 7, "op": "*", "answer": "84"})
>>> obs, r, done, s = env.step(s, "<tool_call>12*7</tool_call>")
>>> obs, r, done
('84', 0.0, False)
>>> env.step(s, "<answer>84</answer>")[1:3]
(1.0, True)
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rollouts_jax.envs import base, tools
from rollouts_jax.rewards import extract as extract_lib

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)


def question(example: Mapping[str, Any]) -> str:
  """The example's question ("What is 47 * 28?"), from its fields."""
  if "question" in example:
    return str(example["question"])
  return f"What is {int(example['a'])} {example.get('op', '*')} {int(example['b'])}?"


class CalculatorEnv(base.Env):
  """Answer an arithmetic question; a calculator is available as a tool (see the module docstring)."""
  name = "calculator"
  stop_strings = (TOOL_CLOSE,)
  plain_wrap = (RESULT_OPEN, RESULT_CLOSE)

  def __init__(self, max_calls: int = 2, tool_penalty: float = 0.0, instruction: bool = False,
               tool: str = "calculator", timeout_s: float = 5.0):
    self.max_calls = int(max_calls)
    self.tool_penalty = float(tool_penalty)
    self.instruction = bool(instruction)
    self.tool = tool
    self.limits = tools.SandboxLimits(timeout_s=float(timeout_s), cpu_s=max(int(timeout_s), 1))
    self.concurrent = tool == "python"    # sandboxed subprocesses: rows' calls may run side by side

  def _cost(self) -> float:
    """A call's reward: minus the penalty (0.0, not -0.0, when calls are free)."""
    return -self.tool_penalty if self.tool_penalty else 0.0

  def run_tool(self, arguments: str) -> str:
    """The tool's observation for a call's arguments (never raises)."""
    if self.tool == "python":
      return tools.run_python(arguments, self.limits)
    return tools.calculate(arguments)

  def prompt(self, example):
    text = question(example)
    if self.instruction:
      text += (f" You may call a calculator with {TOOL_OPEN}expression{TOOL_CLOSE}. "
               f"Put the final answer in <answer></answer>.")
    return text + "\n"

  def reset(self, example):
    return {"answer": str(example["answer"]), "calls": 0, "solved": False, "answered": False}

  def step(self, state, completion_text):
    state = dict(state)
    text = str(completion_text)
    call = _CALL.search(text)
    answer_at = text.find("<answer>")
    if call is not None and (answer_at < 0 or call.start() < answer_at):
      if state["calls"] >= self.max_calls:
        state["calls"] += 1
        return base.StepResult(tools.error("bad_arguments", f"at most {self.max_calls} calculator calls"),
                               self._cost(), False, state)
      state["calls"] += 1
      return base.StepResult(self.run_tool(call.group(1)), self._cost(), False, state)
    if TOOL_OPEN in text and answer_at < 0:   # an unclosed call (the turn ran out of tokens)
      state["calls"] += 1
      return base.StepResult(tools.error("bad_arguments", f"a tool call needs {TOOL_CLOSE}"), self._cost(),
                             False, state)
    tag = extract_lib.find_answer_tag(text)
    value = None if tag is None else extract_lib.parse_number(tag)
    gold = extract_lib.parse_number(state["answer"])
    state["answered"] = True
    state["solved"] = value is not None and gold is not None and value == gold
    return base.StepResult("", float(state["solved"]), True, state)

  def used_tool(self, state):
    return state["calls"] > 0

  def solved(self, state):
    return bool(state["solved"])


@base.register("calculator")
def calculator(max_calls: int = 2, tool_penalty: float = 0.0, instruction: bool = False, tool: str = "calculator",
               timeout_s: float = 5.0) -> CalculatorEnv:
  """The calculator environment.

  Args:
    max_calls: calculator calls per episode; a call beyond it is answered with an error.
    tool_penalty: reward subtracted per call (0: calls are free).
    instruction: the prompt explains the tool format (for chat models; the small models learn
      it from their warm start).
    tool: "calculator" (the safe evaluator, in this process) or "python" (the call's text runs
      as a program in the sandbox, `tools.run_python`; its output is the observation).
    timeout_s: the python tool's wall-clock limit per call.
  """
  if tool not in ("calculator", "python"):
    raise base.setting_error("calculator", "tool", f"must be 'calculator' or 'python', got {tool!r}")
  if not float(timeout_s) > 0:
    raise base.setting_error("calculator", "timeout_s", f"must be > 0, got {timeout_s}")
  if int(max_calls) < 1:
    raise base.setting_error("calculator", "max_calls", f"must be >= 1, got {max_calls}")
  if float(tool_penalty) < 0:
    raise base.setting_error("calculator", "tool_penalty", f"must be >= 0, got {tool_penalty}")
  return CalculatorEnv(max_calls=max_calls, tool_penalty=tool_penalty, instruction=instruction, tool=tool,
                       timeout_s=timeout_s)
