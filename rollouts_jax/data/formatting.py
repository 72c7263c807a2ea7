"""Prompt formatting and the answer conventions.

Answer conventions (what reward code extracts):

* ``countdown`` and ``arithmetic``: the final answer is inside ``<answer>...</answer>``,
  the last such pair in the completion counts. Countdown's answer is an expression
  (``<answer>(12+7)*3</answer>``), arithmetic's a number (``<answer>936</answer>``).
  :func:`parse_answer` extracts it.
* ``gsm8k``, ``math500``, ``aime24``, ``amc23``: the final answer is in ``\\boxed{...}``, the
  convention of the MATH solutions and of math-tuned checkpoints (math-verify reads it).

:data:`ANSWER_FORMATS` records which task uses which (``"tags"`` or ``"boxed"``).

Templates: ``"plain"`` gives ``question + "\\n" + instruction + "\\n"`` (the instruction,
which states the answer convention, can be dropped with ``instruction=False``: a tiny model
SFT'd on arithmetic then sees just ``"What is 347 + 589?\\n"``); ``"chat"`` renders the same
text as one user turn (after an optional system turn) with the tokenizer's chat template.

>>> format_prompt({"question": "What is 2 + 3?", "answer": "5"}, "arithmetic",
...               instruction=False)
'What is 2 + 3?\\n'
>>> parse_answer("7+9+0=16 ... <answer>936</answer>")
'936'
"""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["TASKS", "ANSWER_FORMATS", "ANSWER_OPEN", "ANSWER_CLOSE", "wrap_answer",
           "parse_answer", "question_text", "answer_instruction", "format_prompt",
           "format_completion"]

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

#: task -> where its final answer goes: "tags" (<answer>...</answer>) or "boxed" (\boxed{...}).
ANSWER_FORMATS = {"countdown": "tags", "arithmetic": "tags", "gsm8k": "boxed",
                  "math500": "boxed", "aime24": "boxed", "amc23": "boxed"}
TASKS = tuple(ANSWER_FORMATS)

_INSTRUCTIONS = {
    "tags": "Put the final answer in <answer></answer>.",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
}
_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def wrap_answer(answer: str) -> str:
  """``<answer>{answer}</answer>``."""
  return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def parse_answer(text: str) -> str | None:
  """The stripped content of the last ``<answer>...</answer>`` in ``text``, or None.

  >>> parse_answer("<answer>1</answer> then <answer> 2 </answer>"), parse_answer("none")
  ('2', None)
  """
  found = _ANSWER_RE.findall(text)
  return found[-1].strip() if found else None


def _check_task(task: str):
  if task not in ANSWER_FORMATS:
    raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")


def _field(example: Mapping[str, Any], key: str, task: str):
  if key not in example:
    raise ValueError(f"a {task} example needs the field {key!r}; it has {sorted(example)}")
  return example[key]


def question_text(example: Mapping[str, Any], task: str) -> str:
  """The question of an example, without the answer instruction.

  >>> question_text({"numbers": [3, 7, 25], "target": 46}, "countdown")
  'Using the numbers [3, 7, 25], create an expression that equals 46. Use + - * / and each number exactly once.'
  """
  _check_task(task)
  if task == "countdown":
    numbers = [int(n) for n in _field(example, "numbers", task)]
    target = int(_field(example, "target", task))
    return (f"Using the numbers {numbers}, create an expression that equals {target}. "
            "Use + - * / and each number exactly once.")
  return str(_field(example, "question", task)).strip()


def answer_instruction(task: str) -> str:
  """The sentence that tells the model where to put its final answer."""
  _check_task(task)
  return _INSTRUCTIONS[ANSWER_FORMATS[task]]


def format_prompt(example: Mapping[str, Any], task: str, template: str = "plain",
                  tokenizer=None, *, instruction: bool | str = True,
                  system_prompt: str | None = None, **template_kwargs: Any) -> str:
  """Formats an example as a prompt string.

  Args:
    example: a dataset record (countdown: ``numbers``, ``target``; others: ``question``).
    task: one of :data:`TASKS`.
    template: ``"plain"`` or ``"chat"``.
    tokenizer: needed for ``"chat"`` (its ``apply_chat_template``).
    instruction: ``True`` appends :func:`answer_instruction`, ``False`` nothing, a string
      appends that string.
    system_prompt: chat only, an optional system turn.
    **template_kwargs: chat only, extra chat-template variables (``enable_thinking=False``).

  Returns:
    The prompt text (chat prompts end with the assistant header).

  >>> format_prompt({"question": "What is 1 + 1?"}, "arithmetic")
  'What is 1 + 1?\\nPut the final answer in <answer></answer>.\\n'
  """
  question = question_text(example, task)
  if instruction is True:
    suffix = answer_instruction(task)
  elif instruction is False or instruction is None:
    suffix = ""
  elif isinstance(instruction, str):
    suffix = instruction
  else:
    raise ValueError(f"instruction must be a bool or a str, got {instruction!r}")
  if template == "plain":
    if system_prompt is not None or template_kwargs:
      raise ValueError("system_prompt and chat-template arguments need template='chat'")
    return f"{question}\n{suffix}\n" if suffix else f"{question}\n"
  if template == "chat":
    if tokenizer is None:
      raise ValueError("template='chat' needs a tokenizer (for its chat template)")
    content = f"{question} {suffix}" if suffix else question
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         **template_kwargs)
  raise ValueError(f"template must be 'plain' or 'chat', got {template!r}")


def format_completion(example: Mapping[str, Any], task: str) -> str:
  """The reference completion of an example, for SFT (no EOS: the tokenizing code adds it).

  * arithmetic: the worked ``solution`` (ends with ``<answer>N</answer>``);
  * countdown: ``<answer>{solution}</answer>``;
  * gsm8k: the solution without ``<<...>>`` calculator notes, its ``#### N`` line replaced
    by ``\\boxed{N}``;
  * math500, aime24: the file's solution (which has the ``\\boxed`` answer).

  >>> format_completion({"numbers": [3, 7], "target": 10, "solution": "3+7"}, "countdown")
  '<answer>3+7</answer>'
  """
  _check_task(task)
  if task == "arithmetic":
    return str(_field(example, "solution", task))
  if task == "countdown":
    return wrap_answer(_field(example, "solution", task))
  solution = str(example.get("solution") or "")
  if task == "gsm8k":
    text = re.sub(r"<<[^>]*>>", "", solution)
    body, _, _ = text.rpartition("####")
    answer = str(_field(example, "answer", task))
    return f"{body.rstrip()}\n\\boxed{{{answer}}}".lstrip()
  if not solution:
    raise ValueError(f"this {task} example has no solution to train on")
  return solution
