"""The environment contract of multi-turn rollouts, its registry and the turn renderers.

An environment turns one training example into a conversation: `reset(example)` gives the
state of a fresh episode, `step(state, completion_text)` reads the policy's turn and answers
with an observation (a tool's output, the game's reply), the turn's reward and whether the
episode is over. Environments are plain Python (a tool may run a subprocess); everything a
rollout carries between turns lives in its `state`, so nothing leaks from one rollout to
another and the same example and turns give the same rewards::

    env = envs.build("guess", max_value=16)
    state = env.reset({"secret": 11})
    obs, reward, done, state = env.step(state, "<guess>8</guess>")   # "higher" ...

A renderer places an observation in the token stream the way the policy sees it: `plain`
for the small char models (the observation text as it is), `chatml` for a chat model (the
policy's turn is closed and the observation is a `tool` message, then the assistant's turn
opens again, all as the tokenizer's own chat template renders them).

>>> from rollouts_jax import envs
>>> {"calculator", "guess"} <= set(envs.names())
True
>>> envs.build("guess", max_value=0)
Traceback (most recent call last):
...
ValueError: Config key rollout.env_kwargs: environment 'guess' setting 'max_value' must be >= 2, got 0.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Sequence

NAME_KEY = "rollout.env"
KWARGS_KEY = "rollout.env_kwargs"


class StepResult(NamedTuple):
  """What `Env.step` returns: (observation, reward, done, state)."""
  observation: str
  reward: float
  done: bool
  state: Any


class Env:
  """A multi-turn environment (subclass and register with `@envs.register("name")`).

  Attributes:
    name: the registry name.
    stop_strings: strings that end a policy turn besides EOS (e.g. "</tool_call>"); the
      sampler stops a row once its turn ends with one.
    plain_wrap: (before, after) an observation in the plain format (`PlainRenderer`).
  """
  name: str = ""
  stop_strings: tuple[str, ...] = ()
  plain_wrap: tuple[str, str] = ("", "")

  def reset(self, example: Mapping[str, Any]) -> Any:
    """The state of a fresh episode on `example` (plain Python values; never shared)."""
    raise NotImplementedError

  def step(self, state: Any, completion_text: str) -> StepResult:
    """Reads one policy turn; returns (observation, reward, done, new state)."""
    raise NotImplementedError

  def prompt(self, example: Mapping[str, Any]) -> str:
    """The first user message of an episode (what a task's prompt shows)."""
    raise NotImplementedError

  def used_tool(self, state: Any) -> bool:
    """Whether the episode called a tool (for the tool-use rate; False for tool-free games)."""
    del state
    return False

  def solved(self, state: Any) -> bool:
    """Whether the episode ended with the task solved (the accuracy statistic)."""
    del state
    return False


#: name -> factory `(**settings) -> Env`.
REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str, factory: Callable[..., Env] | None = None, *, overwrite: bool = False):
  """Registers an environment factory under `name`; without `factory`, a decorator."""
  def add(f):
    if name in REGISTRY and not overwrite:
      raise ValueError(f"An environment {name!r} is already registered; pass overwrite=True.")
    REGISTRY[name] = f
    return f
  return add if factory is None else add(factory)


def names() -> list[str]:
  """The environment names a config may use (`rollout.env`)."""
  return sorted(REGISTRY)


def setting_error(name: str, setting: str, problem: str) -> ValueError:
  """The error a factory raises for a bad setting (it names the config key and the setting)."""
  return ValueError(f"Config key {KWARGS_KEY}: environment {name!r} setting {setting!r} {problem}.")


def build(name: str, **kwargs: Any) -> Env:
  """The environment `name` built with its settings; unknown names and settings name the config key."""
  if name not in REGISTRY:
    raise ValueError(f"Config key {NAME_KEY}: unknown environment {name!r}; known: {', '.join(names())}.")
  factory = REGISTRY[name]
  allowed = sorted(p.name for p in inspect.signature(factory).parameters.values())
  for k in kwargs:
    if k not in allowed:
      raise ValueError(f"Config key {KWARGS_KEY}: environment {name!r} has no setting {k!r}; its settings: "
                       f"{', '.join(allowed) or 'none'}.")
  env = factory(**kwargs)
  if not isinstance(env, Env):
    raise TypeError(f"Environment factory {name!r} returned {type(env).__name__}, not an envs.Env.")
  return env


# ------------------------------------------------------------------------------------------------
# Settings of a multi-turn rollout (what the `multiturn` generator reads from the config)
# ------------------------------------------------------------------------------------------------

#: Turn renderers (`EnvSettings.render`).
RENDERS = ("plain", "chatml")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """A multi-turn rollout's settings (the `rollout.env*` keys, one definition each).

  Attributes:
    name: the environment (`rollout.env`).
    kwargs: its settings (`rollout.env_kwargs`, parsed).
    max_turns: policy turns per trajectory at most (`rollout.max_turns`).
    turn_tokens: policy tokens per turn at most (`rollout.turn_tokens`; 0: the total budget,
      `rollout.max_new_tokens`, which bounds policy and observation tokens together).
    stop_strings: extra strings that end a turn (`rollout.stop_strings`, "|"-separated in the
      config), besides EOS and the environment's own.
    render: how an observation enters the token stream, "plain" or "chatml"
      (`rollout.env_render`; "chatml" uses the tokenizer's chat template).
    credit: "trajectory" (one reward per trajectory, the `rl.advantage` recipe) or "turn"
      (discounted per-turn rewards, group-normalized per turn; `advantages.turn_credit`).
    gamma: the per-turn discount of `credit="turn"`.
  """
  name: str
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  max_turns: int = 4
  turn_tokens: int = 0
  stop_strings: tuple[str, ...] = ()
  render: str = "plain"
  credit: str = "trajectory"
  gamma: float = 1.0

  def __hash__(self):
    return hash((self.name, tuple(sorted(self.kwargs.items())), self.max_turns, self.turn_tokens,
                 self.stop_strings, self.render, self.credit, self.gamma))

  def check(self, max_new_tokens: int) -> Env:
    """Raises ValueError naming the config key for a bad setting; returns the built environment."""
    from rollouts_jax.advantages import turns  # pylint: disable=g-import-not-at-top
    env = build(self.name, **dict(self.kwargs))
    if int(self.max_turns) < 1:
      raise ValueError(f"Config key rollout.max_turns must be >= 1, got {self.max_turns}.")
    if not 0 <= int(self.turn_tokens) <= int(max_new_tokens):
      raise ValueError(f"Config key rollout.turn_tokens must be in [0, rollout.max_new_tokens={max_new_tokens}] "
                       f"(0: no per-turn limit), got {self.turn_tokens}.")
    if any(not s for s in self.stop_strings):
      raise ValueError(f"Config key rollout.stop_strings holds an empty string: {self.stop_strings!r}.")
    if self.render not in RENDERS:
      raise ValueError(f"Config key rollout.env_render must be one of {', '.join(RENDERS)}, got {self.render!r}.")
    if self.credit not in turns.CREDIT:
      raise ValueError(f"Config key rollout.turn_credit must be one of {', '.join(turns.CREDIT)}, "
                       f"got {self.credit!r}.")
    if not 0.0 < float(self.gamma) <= 1.0:
      raise ValueError(f"Config key rollout.turn_gamma must be in (0, 1], got {self.gamma}.")
    return env


# ------------------------------------------------------------------------------------------------
# Renderers: the observation's text as the policy sees it
# ------------------------------------------------------------------------------------------------

class Renderer:
  """How an observation enters the token stream after a policy turn.

  `observation(obs, ended_with_eos)` is the text that follows the policy's last token; it is
  encoded once by the tokenizer and appended (earlier turns are never re-encoded).
  """

  def observation(self, obs: str, ended_with_eos: bool) -> str:
    raise NotImplementedError


class PlainRenderer(Renderer):
  """The small models' format: the observation between the environment's tags (`Env.plain_wrap`).

  >>> PlainRenderer(("<tool_result>", "</tool_result>")).observation("12", False)
  '<tool_result>12</tool_result>'
  """

  def __init__(self, wrap: tuple[str, str] = ("", "")):
    self.wrap = tuple(wrap)

  def observation(self, obs: str, ended_with_eos: bool) -> str:
    del ended_with_eos
    return self.wrap[0] + obs + self.wrap[1]


class ChatRenderer(Renderer):
  """A chat model's format from its own chat template: close the assistant turn, a `tool` message, reopen.

  The pieces are cut from the template's rendering of a short conversation, so any template
  that renders each message on its own (ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n`)
  works: the assistant turn's closing (`<|im_end|>\\n`; without its end-of-turn token when
  the policy already wrote it), then the tool message, then the generation prompt.

  >>> from rollouts_jax import data
  >>> tok = data.CharTokenizer.default(chat_template=(
  ...     "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\\n{% endfor %}"
  ...     "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
  >>> ChatRenderer(tok).observation("12", ended_with_eos=False)
  '<|end|>\\n<|tool|>12<|end|>\\n<|assistant|>'
  """

  def __init__(self, tokenizer, role: str = "tool"):
    self.tokenizer = tokenizer
    self.role = role
    mark = "\x00MARK\x00"
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with_reply = tokenizer.apply_chat_template(base + [{"role": "assistant", "content": mark}],
                                               add_generation_prompt=False)
    reply_tail = with_reply[with_reply.index(mark) + len(mark):]     # the assistant turn's closing
    with_tool = tokenizer.apply_chat_template(base + [{"role": "assistant", "content": mark},
                                                      {"role": role, "content": mark}],
                                              add_generation_prompt=True)
    tail = with_tool[with_tool.index(mark) + len(mark):]
    tool_start = tail[len(reply_tail):]                               # "<|im_start|>tool\n"
    i = tool_start.index(mark)
    self._close = reply_tail
    self._open_tool = tool_start[:i]
    self._after = tool_start[i + len(mark):]                          # tool closing + generation prompt
    eot = tokenizer.id_to_token(tokenizer.eos_id) if hasattr(tokenizer, "id_to_token") else ""
    self._close_after_eos = reply_tail[len(eot):] if eot and reply_tail.startswith(eot) else reply_tail

  def observation(self, obs: str, ended_with_eos: bool) -> str:
    close = self._close_after_eos if ended_with_eos else self._close
    return close + self._open_tool + obs + self._after


def renderer(kind: str, tokenizer, env: Env | None = None) -> Renderer:
  """The renderer `kind` ("plain" or "chatml") for `tokenizer` (plain: with `env`'s tags)."""
  if kind == "plain":
    return PlainRenderer(getattr(env, "plain_wrap", ("", "")))
  if kind == "chatml":
    return ChatRenderer(tokenizer)
  raise ValueError(f"Config key rollout.env_render must be one of {', '.join(RENDERS)}, got {kind!r}.")


def stop_sequences(tokenizer, strings: Sequence[str]) -> list[list[int]]:
  """Each stop string as the tokenizer encodes it (the sampler matches these id sequences)."""
  return [list(tokenizer.encode(s)) for s in strings if s]
