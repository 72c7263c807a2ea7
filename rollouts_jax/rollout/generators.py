"""The GENERATE contract: a `Generator` is `(init, generate, update)` over its own state pytree.

A generator turns a step's prompts into a `RolloutBatch` of N completions each. Like a prompt
selector it is a factory returning a NamedTuple of pure functions; its settings are closed
over and anything it carries from step to step (SPEC-RL's drafts, a quality head ...) lives in
its state, which the pipeline threads through the step and checkpoints with the rest of the
pipeline state::

    gen = rollout.generators.build("spec_rl", ctx, lenience=1.6)
    gs = gen.init()
    batch, gs, stats = gen.generate(gs, params, prompts, key, version=step)
    gs = gen.update(gs, scored_batch, version=step)

`generate` returns the batch unscored (rewards zero; FILTER runs after it), its tokens tagged
with `version`, and `stats`, a dict of numbers summed into the step's metrics (counts such as
`generated_tokens`: tokens actually decoded, and `rollouts`: completions started; without them
the batch's completion tokens and N per prompt are counted). A generator that needs the
rewards to finish its batch has `finish`: it runs once FILTER has scored the groups and may
choose which of them are kept (Sol-RL's subset of an FP4 pool, so a group may hold more than N
samples until then) and set fields the update reads (`old_logprobs`, `token_advantages`),
which it lists in `fields`. `update` sees the final groups (rewards set, budget applied to
`sample_mask`) and returns the next state; it accepts and ignores extras by keyword.

A generator that chooses its own groups has `wants`: `wants(state)` is how many fresh prompts
the step's selector picks for it (APRIL: its requests less the unfinished groups it stored),
and its batch holds whichever groups it finished, stored or fresh, each named by its
`prompt_index`; FILTER scores them and the selector learns from them as from its own plan.

A config chooses one by name (`rollout.generator`, settings in `rollout.generator_kwargs`).
A new one is a module with a factory under `@generators.register("name")` (imported by
`rollouts_jax.rollout`, or by the code that runs the experiment); nothing else changes:

>>> from rollouts_jax.rollout import generators
>>> {"sample", "spec_rl", "self_spec", "tree", "sol_rl", "arrol", "esr", "adwin", "april"} <= set(generators.names())
True
>>> generators.check_kwargs("spec_rl", {"lenient": 2.0})
Traceback (most recent call last):
...
ValueError: Config key rollout.generator_kwargs: generator 'spec_rl' has no setting 'lenient'; its settings: lenience.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import flax
import jax

from rollouts_jax import models, sampling

KWARGS_KEY = "rollout.generator_kwargs"
NAME_KEY = "rollout.generator"


@dataclasses.dataclass(frozen=True)
class GeneratorContext:
  """What every generator is built from (the experiment config stays out of this stage).

  Attributes:
    cfg: the policy's model configuration.
    sampling: the sampler's settings (N = `num_samples`, T = `max_new_tokens`, EOS, pad ...).
    num_prompts: the size of the training prompt pool (`Prompts.index` ranges over it).
    seed: the run's seed.
    batch_size: the prompts of one `generate` call (B; state that holds per-row data is
      sized by it).
    teacher: (ModelConfig, params) of a stronger policy, when the run has one (on-policy
      distillation's teacher; None otherwise).
    env: the multi-turn environment's settings (`envs.EnvSettings`, from `rollout.env*`), when
      the run has one (None otherwise).
    tokenizer: the policy's tokenizer (None under `check`), for generators that read or write
      text between decoding steps (multi-turn observations).
    examples: the prompt pool's examples (`Prompts.index` indexes them; None under `check`).
    prompt_len: the width every prompt of the pool fits in (its length bucket), for generators
      that store groups across steps.
  """
  cfg: models.ModelConfig
  sampling: sampling.SamplingConfig
  num_prompts: int
  seed: int = 0
  batch_size: int = 0
  teacher: Any = None
  env: Any = None
  tokenizer: Any = None
  examples: Any = None
  prompt_len: int = 0


@flax.struct.dataclass
class Prompts:
  """One step's prompts, as the pipeline hands them to `generate`.

  Attributes:
    ids: int32 [B, P], left-padded (the `sampling.sample` contract).
    mask: bool [B, P], True at real prompt tokens.
    index: int32 [B], each prompt's index in the pool (-1: not from the pool).
    budget: None, or int32 [B] (host values in [0, N]): the selector's rollouts per prompt.
      A generator that honours it decodes only those samples (`sample` does, through
      `sampling.sample(..., budget=)`); one that does not decodes N and the pipeline masks the
      samples past the budget.
  """
  ids: jax.Array
  mask: jax.Array
  index: jax.Array
  budget: Any = None


class Generator(NamedTuple):
  """A rollout generator: three functions over its own state pytree.

  Attributes:
    init: `() -> state` (None when it keeps nothing).
    generate: `(state, params, prompts, key, *, version) -> (RolloutBatch, state, stats)`:
      N completions of each of the B `Prompts` by the policy `params` (after `version`
      updates: the tag of every token), unscored; `stats` a dict of numbers (summed per step).
    update: `(state, scored_batch, *, version, **extra) -> state`: learns from the groups it
      generated once FILTER has scored them.
    finish: None, or `(state, params, scored_batch, key, *, version) -> (batch, state, stats)`:
      the generator's last step once FILTER has scored its groups (which samples each group
      keeps, N of them; fields the update reads).
    fields: the optional `RolloutBatch` fields its batches carry to the update (e.g.
      "old_logprobs"), so a replay buffer stores them too.
    scores: its batches come with their rewards set (an environment's, multi-turn rollouts), so
      FILTER does not score their text.
    wants: None (it generates the B prompts it is given), or `state -> int`: the fresh prompts
      (at least one) the step selects for it; its batch then holds the groups it chose
      (`prompt_index`).
  """
  init: Callable[[], Any]
  generate: Callable[..., tuple[sampling.RolloutBatch, Any, dict[str, float]]]
  update: Callable[..., Any]
  finish: Callable[..., tuple[sampling.RolloutBatch, Any, dict[str, float]]] | None = None
  fields: tuple[str, ...] = ()
  scores: bool = False
  wants: Callable[[Any], int] | None = None


class Mean(float):
  """A stat averaged over a step's calls (a plain number is summed): `stats["x"] = Mean(0.25)`.

  >>> Mean(0.25) + 1
  1.25
  """


#: name -> factory `(ctx: GeneratorContext, **settings) -> Generator`.
REGISTRY: dict[str, Callable[..., Generator]] = {}


def register(name: str, factory: Callable[..., Generator] | None = None, *, overwrite: bool = False):
  """Registers a generator factory under `name`; without `factory`, a decorator.

  A factory takes the `GeneratorContext` first and its settings as keyword arguments, checks
  them (`setting_error`; before it touches `ctx.cfg`, which `check` leaves None) and returns a
  `Generator`. Building one does no work on arrays beyond allocating its state's shape.
  """
  def add(f):
    if name in REGISTRY and not overwrite:
      raise ValueError(f"A generator {name!r} is already registered; pass overwrite=True.")
    REGISTRY[name] = f
    return f
  return add if factory is None else add(factory)


def names() -> list[str]:
  """The generator names a config may use (`rollout.generator`), the default first."""
  return ["sample"] + sorted(n for n in REGISTRY if n != "sample")


def get(name: str, key: str = NAME_KEY) -> Callable[..., Generator]:
  """The factory registered under `name`; an unknown name is an error naming `key` and the names."""
  if name not in REGISTRY:
    raise ValueError(f"Config key {key}: unknown generator {name!r}; known: {', '.join(names())}.")
  return REGISTRY[name]


def setting_error(name: str, setting: str, problem: str, key: str = KWARGS_KEY) -> ValueError:
  """The error a factory raises for a bad setting (it names the config key and the setting).

  >>> str(setting_error("spec_rl", "lenience", "must be > 0, got 0"))
  "Config key rollout.generator_kwargs: generator 'spec_rl' setting 'lenience' must be > 0, got 0."
  """
  return ValueError(f"Config key {key}: generator {name!r} setting {setting!r} {problem}.")


def check_kwargs(name: str, kwargs: dict[str, Any], key: str = KWARGS_KEY) -> None:
  """Raises ValueError naming `key` and the setting when `kwargs` holds one the factory does not take.

  Needs no context, so the config validator calls it before anything is built; the factory
  checks the values when it is built. Factories that take `**settings` check names themselves.
  """
  params = list(inspect.signature(get(name)).parameters.values())[1:]   # after the context
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return
  allowed = sorted(p.name for p in params)
  for k in kwargs:
    if k not in allowed:
      raise ValueError(f"Config key {key}: generator {name!r} has no setting {k!r}; its settings: "
                       f"{', '.join(allowed) or 'none'}.")


def check(name: str, kwargs: dict[str, Any], *, num_samples: int, max_new_tokens: int, batch_size: int,
          has_teacher: bool = False, env: Any = None) -> Generator:
  """Builds the named generator on a context of the config's shapes only, to check its settings.

  The config validator calls this before any model is loaded: the factory sees no model
  (`cfg` None) and, when the run has a teacher, a placeholder for it, so every check a factory
  makes of its settings (names and values) fails here, naming `rollout.generator_kwargs`.
  The result is for reading `fields`, not for generating.
  """
  get(name)
  check_kwargs(name, kwargs)
  ctx = GeneratorContext(cfg=None, sampling=sampling.SamplingConfig(num_samples=num_samples,
                                                                    max_new_tokens=max_new_tokens),
                         num_prompts=1, batch_size=batch_size, teacher=(None, None) if has_teacher else None,
                         env=env)
  return get(name)(ctx, **kwargs)


def build(name: str, ctx: GeneratorContext, **kwargs: Any) -> Generator:
  """Builds the named generator (its settings checked here, before anything compiles)."""
  check_kwargs(name, kwargs)
  gen = get(name)(ctx, **kwargs)
  if not isinstance(gen, Generator):
    raise TypeError(f"Generator factory {name!r} returned {type(gen).__name__}, not a rollout.Generator.")
  return gen


def decode_stats(batch: sampling.RolloutBatch) -> dict[str, float]:
  """The stats of a batch decoded from scratch: every completion token decoded, its longest row's steps."""
  lengths = jax.device_get(batch.lengths)
  return {"generated_tokens": float(lengths.sum()), "rollout/decode_steps": float(lengths.max(initial=0))}
