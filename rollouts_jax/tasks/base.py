"""A `Task` per dataset: loading, prompt format, reference, answer extraction and default reward.

The task's default reward is `grade(extract(text), reference)`, built from the same two
functions that evaluation uses to vote (maj@k), that group rewards use to find a pseudo-label
(TTRL), and that uniqueness clustering falls back to: no stage can vote on an answer the
reward never graded.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
from typing import Any, Hashable, Mapping, Optional, Sequence

from rollouts_jax import data as data_lib
from rollouts_jax.rewards import countdown as countdown_lib
from rollouts_jax.rewards import extract as extract_lib
from rollouts_jax.rewards import gsm8k as gsm8k_lib
from rollouts_jax.rewards import label_free
from rollouts_jax.rewards import math_verifier


def cache_root() -> pathlib.Path:
  """Where built datasets and warm starts are cached (`$ROLLOUTS_JAX_CACHE`, else ~/.cache/rollouts_jax)."""
  return pathlib.Path(os.environ.get("ROLLOUTS_JAX_CACHE", pathlib.Path.home() / ".cache" / "rollouts_jax"))


@dataclasses.dataclass(frozen=True)
class Task:
  """One dataset and its conventions (subclasses fill in the task-specific parts).

  Attributes:
    name: the `data.task` name.
    synthetic: generated locally (the TFDS builder takes seeds and sizes).
    answer_format: "tags" (`<answer>..</answer>`) or "boxed" (`\\boxed{..}`).
    can_rewrite: has a label-preserving rewrite of a question (Co-Reward's second view).
    has_strategies: completions have distinct solution strategies (uniqueness clustering).
    inline_safe: the grader is pure Python over bounded text, so it may run in the training
      process (`reward.num_workers=0`); others always run in grader worker processes.
  """
  name: str = ""
  dataset: str = ""             # the TFDS builder's name ("": the task's name)
  synthetic: bool = False
  answer_format: str = "boxed"
  can_rewrite: bool = False
  has_strategies: bool = False
  inline_safe: bool = True

  # -- data ------------------------------------------------------------------------------------
  def check_config(self, data_cfg) -> None:
    """Raises a clear error for data settings this task cannot use (before anything is built)."""
    if not self.synthetic:
      from rollouts_jax.data import benchmarks  # pylint: disable=g-import-not-at-top
      benchmarks.benchmark_file(self.name, "test", data_cfg.manual_dir or None)  # names a missing file

  def builder_kwargs(self, data_cfg) -> dict[str, Any]:
    return dict(manual_dir=data_cfg.manual_dir or None)

  @property
  def has_train_split(self) -> bool:
    """False for test-set-only benchmarks (MATH-500, AIME 24, AMC 23): training on them is
    test-time RL, which the config allows only with label-free rewards."""
    return self.synthetic or "train" in data_lib.BENCHMARK_FILES.get(self.dataset or self.name, {})

  def load(self, data_cfg) -> tuple[Sequence[dict], Sequence[dict], bool]:
    """(train examples, test examples, whether train is really the test split)."""
    data_dir = data_cfg.data_dir or str(cache_root() / "tfds")
    kw = self.builder_kwargs(data_cfg)
    name = self.dataset or self.name
    test = data_lib.load_dataset(name, "test", data_dir=data_dir, **kw)
    if self.has_train_split:
      return data_lib.load_dataset(name, "train", data_dir=data_dir, **kw), test, False
    return test, test, True

  # -- prompts ---------------------------------------------------------------------------------
  def prompt(self, example: Mapping[str, Any], tokenizer, template: str = "plain", *,
             instruction: bool = True) -> str:
    """The prompt text of an example."""
    return data_lib.format_prompt(example, self.name, template, tokenizer, instruction=instruction)

  def completion(self, example: Mapping[str, Any]) -> str:
    """The reference completion (SFT target) of an example."""
    return data_lib.format_completion(example, self.name)

  def completion_segments(self, example: Mapping[str, Any], tokenizer, template: str = "plain"
                          ) -> list[tuple[str, bool]]:
    """The SFT target as (text, trained) pieces: a multi-turn task's observations are untrained.

    The default is the whole `completion`, trained. A task whose target holds an environment's
    observations (a tool's output) returns them as untrained pieces in the format the episode
    renders them, so SFT teaches the policy's turns only.
    """
    del tokenizer, template
    return [(self.completion(example), True)]

  def reference(self, example: Mapping[str, Any]) -> Any:
    """What `grade` compares an answer with."""
    return str(example["answer"])

  # -- answers ---------------------------------------------------------------------------------
  def extract(self, text: str) -> Optional[str]:
    """The completion's final answer as a canonical string (None: no answer)."""
    raise NotImplementedError

  def grade(self, answer: Optional[str], reference: Any) -> float:
    """1.0 when an extracted answer is correct for `reference`, else 0.0 (None scores 0)."""
    raise NotImplementedError

  def same(self, a: str, b: str) -> bool:
    """Whether two extracted answers agree (label-free rewards grade against a voted answer)."""
    return a == b

  def reward(self, text: str, reference: Any) -> float:
    """The task's default reward: `grade(extract(text), reference)`."""
    return self.grade(self.extract(text), reference)

  # -- second views and strategies -------------------------------------------------------------
  def rewrite(self, example: Mapping[str, Any], seed: int) -> dict:
    """A label-preserving rewrite of the question (Co-Reward's second view)."""
    raise ValueError(f"task {self.name!r} has no label-preserving rewrite.")

  def strategy(self, text: str) -> Optional[Hashable]:
    """The solution strategy of a completion (None: none recognizable)."""
    return None


# ------------------------------------------------------------------------------------------------
# Synthetic tasks
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arithmetic(Task):
  """Worked multi-digit arithmetic: the answer is one number in `<answer>` tags, exact."""
  name: str = "arithmetic"
  synthetic: bool = True
  answer_format: str = "tags"
  can_rewrite: bool = True

  def builder_kwargs(self, data_cfg):
    return dict(seed=data_cfg.seed, num_train=data_cfg.num_train, num_test=data_cfg.num_test,
                digits=data_cfg.difficulty, ops=data_cfg.ops)

  def extract(self, text):
    """Example:

    >>> Arithmetic().extract("3+4=7 <answer>1,000</answer>")
    '1000'
    """
    tag = extract_lib.find_answer_tag(str(text))
    value = None if tag is None else extract_lib.parse_number(tag)
    return None if value is None else extract_lib.format_number(value)

  def grade(self, answer, reference):
    """Example:

    >>> Arithmetic().grade("936", "936.0"), Arithmetic().grade(None, "936")
    (1.0, 0.0)
    """
    if answer is None:
      return 0.0
    gold = extract_lib.parse_number(reference)
    if gold is None:
      raise ValueError(f"arithmetic reference is not a number: {reference!r}")
    return float(extract_lib.parse_number(answer) == gold)

  def rewrite(self, example, seed):
    """`a op b` -> `b op a` (+ and * commute, so the answer stays).

    >>> Arithmetic().rewrite({"question": "What is 12 + 7?", "a": 12, "b": 7, "op": "+", "answer": "19"}, 0)["question"]
    'What is 7 + 12?'
    """
    a, b, op = int(example["a"]), int(example["b"]), str(example["op"])
    if op not in "+*":
      raise ValueError(f"arithmetic rewrite: operator {op!r} does not commute.")
    return dict(example, a=b, b=a, question=f"What is {b} {op} {a}?")


@dataclasses.dataclass(frozen=True)
class ArithmeticChat(Arithmetic):
  """The arithmetic problems as a chat model is asked them: "Calculate a + b. Reply with just the
  result.", and the reply's last number is its answer (no tags: a pretrained instruct model has
  never seen them). The same examples as `arithmetic` (its TFDS builder)."""
  name: str = "arithmetic_chat"
  dataset: str = "arithmetic"
  answer_format: str = "number"
  can_rewrite: bool = False

  def prompt(self, example, tokenizer, template="plain", *, instruction=True):
    """Example:

    >>> ArithmeticChat().prompt({"a": 12, "b": 7, "op": "+"}, None)
    'Calculate 12 + 7. Reply with just the result.\\n'
    """
    text = f"Calculate {int(example['a'])} {example['op']} {int(example['b'])}."
    if instruction:
      text += " Reply with just the result."
    if template == "plain":
      return text + "\n"
    if template != "chat":
      raise ValueError(f"template must be 'plain' or 'chat', got {template!r}")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)

  def completion(self, example):
    return str(example["answer"])

  def extract(self, text):
    """The last number of the reply. Example:

    >>> ArithmeticChat().extract("59 + 63 = 122."), ArithmeticChat().extract("no idea")
    ('122', None)
    """
    found = _NUMBER.findall(str(text))
    value = extract_lib.parse_number(found[-1]) if found else None
    return None if value is None else extract_lib.format_number(value)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_WS = re.compile(r"\s+")


def canonical_expression(tree) -> str:
  """A canonical string of a parsed countdown expression: commutative chains flattened and sorted.

  `(3+5)*2`, `2*(5+3)` and `(5+3)*2` share one form; `3*2+5*2` has another.

  >>> canonical_expression(countdown_lib.parse_expression("2*(5+3)"))
  '((3+5)*2)'
  >>> canonical_expression(countdown_lib.parse_expression("3*2+5*2"))
  '((2*3)+(2*5))'
  """
  if isinstance(tree, int):
    return str(tree)
  if tree[0] == "neg":
    return f"(-{canonical_expression(tree[1])})"
  op = tree[0]
  if op in "+*":
    parts, stack = [], [tree]
    while stack:
      node = stack.pop()
      if isinstance(node, tuple) and node[0] == op:
        stack.extend(node[1:])
      else:
        parts.append(canonical_expression(node))
    return "(" + op.join(sorted(parts)) + ")"
  return f"({canonical_expression(tree[1])}{op}{canonical_expression(tree[2])})"


@dataclasses.dataclass(frozen=True)
class Countdown(Task):
  """Reach a target from given numbers with + - * / (each number once); the answer is an expression."""
  name: str = "countdown"
  synthetic: bool = True
  answer_format: str = "tags"
  can_rewrite: bool = True
  has_strategies: bool = True

  def builder_kwargs(self, data_cfg):
    return dict(seed=data_cfg.seed, num_train=data_cfg.num_train, num_test=data_cfg.num_test,
                difficulty=data_cfg.difficulty)

  def reference(self, example):
    return {"numbers": [int(x) for x in example["numbers"]], "target": int(example["target"])}

  def extract(self, text):
    """Example:

    >>> Countdown().extract("<answer> (3 + 5) * 2 </answer>")
    '(3+5)*2'
    """
    answer = countdown_lib.extract_countdown_answer(str(text))
    return None if answer is None else _WS.sub("", answer) or None

  def grade(self, answer, reference):
    """Example:

    >>> Countdown().grade("(3+5)*2", {"numbers": [2, 3, 5], "target": 16})
    1.0
    """
    if answer is None:
      return 0.0
    return countdown_lib.countdown_reward(data_lib.wrap_answer(answer), reference)

  def same(self, a, b):
    """Two expressions agree when they are the same strategy (canonical form) or the same text."""
    return a == b or self._canonical(a) == self._canonical(b) is not None

  def rewrite(self, example, seed):
    """The numbers in another order (any solution stays a solution)."""
    numbers = [int(x) for x in example["numbers"]]
    rng = random.Random(f"countdown-rewrite/{seed}/{numbers}/{example['target']}")
    order = list(range(len(numbers)))
    for _ in range(8):
      rng.shuffle(order)
      if order != sorted(order) or len(set(numbers)) == 1:
        break
    return dict(example, numbers=[numbers[i] for i in order])

  @staticmethod
  def _canonical(answer: Optional[str]) -> Optional[str]:
    if answer is None:
      return None
    expr = answer.split("=")[0]
    try:
      return canonical_expression(countdown_lib.parse_expression(expr))
    except (ValueError, ZeroDivisionError):
      return None

  def strategy(self, text):
    """The canonical expression structure of the proposed answer (None: no parsable answer).

    >>> Countdown().strategy("<answer>2*(5+3)</answer>") == Countdown().strategy("<answer>(3+5)*2</answer>")
    True
    """
    return self._canonical(self.extract(text))


# ------------------------------------------------------------------------------------------------
# Benchmarks
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gsm8k(Task):
  """GSM8K: the final number of the completion against the reference's number."""
  name: str = "gsm8k"

  def extract(self, text):
    """Example:

    >>> Gsm8k().extract("so $18.00. \\\\boxed{18}")
    '18'
    """
    value = gsm8k_lib.gsm8k_answer(str(text))
    return None if value is None else extract_lib.format_number(value)

  def grade(self, answer, reference):
    if answer is None:
      return 0.0
    return float(extract_lib.parse_number(answer) == gsm8k_lib.gsm8k_reference_number(reference))


@dataclasses.dataclass(frozen=True)
class MathBoxed(Task):
  """MATH-style benchmarks: the last `\\boxed{}` graded by math-verify against the reference."""
  name: str = "math500"
  inline_safe: bool = False  # math-verify (sympy) can block in C code

  def extract(self, text):
    r"""Example:

    >>> MathBoxed().extract(r"so $\boxed{\dfrac{14}{3}}$")
    '\\frac{14}{3}'
    """
    return extract_lib.normalize_answer(extract_lib.find_boxed(str(text)))

  def grade(self, answer, reference):
    if answer is None:
      return 0.0
    return math_verifier.math_reward("\\boxed{" + answer + "}", reference)

  def same(self, a, b):
    return a == b or math_verifier.math_equal(a, b)


_TASKS: dict[str, Task] = {t.name: t for t in (
    Arithmetic(), ArithmeticChat(), Countdown(), Gsm8k(), MathBoxed(name="math500"), MathBoxed(name="aime24"),
    MathBoxed(name="amc23"))}


def register(task: Task, *, overwrite: bool = False) -> Task:
  """Adds a task under `task.name` (the multi-turn tasks of `tasks.multiturn` register this way)."""
  if task.name in _TASKS and not overwrite:
    raise ValueError(f"A task {task.name!r} is already registered; pass overwrite=True.")
  _TASKS[task.name] = task
  return task


def get(name: str, key: str = "data.task") -> Task:
  """The task registered under `name`; an unknown name is an error naming the config `key`.

  >>> get("countdown").has_strategies
  True
  """
  if name not in _TASKS:
    raise ValueError(f"Config key {key}: unknown task {name!r}; known: {', '.join(_TASKS)}.")
  return _TASKS[name]


def names() -> list[str]:
  return list(_TASKS)


def task_reward(task_name: str, text: str, reference: Any) -> float:
  """The task's default reward as a picklable function (`functools.partial(task_reward, name)`)."""
  return get(task_name).reward(text, reference)


def majority_answer(task: Task, answers: Sequence[Optional[str]]) -> tuple[Optional[str], int]:
  """The most frequent answer (ties: first seen), merging answers the task judges the `same`.

  The one majority vote (:func:`rollouts_jax.rewards.majority_vote`) over the answers mapped
  to their first equal representative (:func:`rollouts_jax.rewards.canonicalize_answers`).

  >>> majority_answer(get("arithmetic"), ["5", None, "4", "5"])
  ('5', 2)
  """
  return label_free.majority_vote(label_free.canonicalize_answers(answers, task.same))

