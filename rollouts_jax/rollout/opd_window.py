"""`esr` and `adwin`: on-policy distillation's early-stopped rollouts (ESR) and their adaptive window (ADWIN).

With on-policy distillation (`rollout.distill`) the teacher scores every token of the
student's rollouts, so a short prefix already carries most of the signal. `esr` generates and
trains only the first `window` tokens of each rollout. `adwin` adapts that window: every
`every` steps, once the step's groups are scored, it samples a full-length probe of the same
prompts, measures (cosine over the probe's sequences) how well each sequence's mean
distillation advantage on its first `window` tokens agrees with the whole rollout's, and grows
the window by `gamma` when that alignment is below `tau`, else shrinks it by `gamma` (ours: the
paper's exact rule is not public). The window stays in [4, max_new_tokens], a multiple of 4 (few
shapes compile); it is the generator's state, so it checkpoints with the run. The probe is a
cost (its tokens are counted), not training data.

  rollout.distill = "opd"; rollout.generator = "adwin"; rollout.generator_kwargs = "window=12,every=5"

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("adwin", {"window": 12, "every": 5})
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import sampling
from rollouts_jax.rollout import generators
from rollouts_jax.rollout.extras import teacher_advantages


def _check_window(name: str, window, T: int) -> int:
  if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= T:
    raise generators.setting_error(name, "window", f"must be an integer in [1, rollout.max_new_tokens={T}], "
                                                   f"got {window!r}")
  return window


def _check_teacher(name: str, ctx) -> None:
  if ctx.teacher is None:
    raise ValueError(f"Config key rollout.generator={name!r} shortens on-policy distillation's rollouts: it needs "
                     f"rollout.distill ('opd' or 'opd_full') and its teacher.")


def _windowed(ctx, params, prompts: generators.Prompts, key, window: int, version: int):
  out = jax.device_get(sampling.sample(ctx.cfg, params, prompts.ids, prompts.mask, key,
                                       ctx.sampling.replace(max_new_tokens=int(window))))
  batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=version)
  stats = generators.decode_stats(batch)
  stats["distill/window"] = float(window)
  return batch, stats


@generators.register("esr")
def esr(ctx: generators.GeneratorContext, *, window: int = 16) -> generators.Generator:
  """ESR: only the first `window` tokens of each rollout are generated (and trained).

  Returns:
    A `Generator` with no state. Stats: `distill/window`, `generated_tokens`, `rollout/decode_steps`.
  """
  _check_teacher("esr", ctx)
  window = _check_window("esr", window, ctx.sampling.max_new_tokens)

  def init():
    return None

  def generate(state, params, prompts, key, *, version: int):
    batch, stats = _windowed(ctx, params, prompts, key, window, version)
    return batch, state, stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update)


@generators.register("adwin")
def adwin(ctx: generators.GeneratorContext, *, window: int = 16, every: int = 5, gamma: float = 0.25,
          tau: float = 0.9) -> generators.Generator:
  """ADWIN: ESR whose window adapts every `every` steps from a full-length probe.

  Args:
    ctx: the build context; `ctx.teacher` (the distillation teacher) scores the probe.
    window: the first step's window, in [1, rollout.max_new_tokens].
    every: probe period in steps (>= 1; a probe runs at versions 0, every, 2 every ...).
    gamma: the window's relative change per probe, in (0, 1).
    tau: the alignment below which the window grows, in [-1, 1].

  Returns:
    A `Generator` whose state is the window (int32 scalar). Stats: `distill/window`,
    `distill/probe_tokens`, `distill/probe_alignment`, `generated_tokens` (the probe's included).
  """
  name, T = "adwin", ctx.sampling.max_new_tokens
  _check_teacher(name, ctx)
  window = _check_window(name, window, T)
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise generators.setting_error(name, "every", f"must be an integer >= 1, got {every!r}")
  if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < 1:
    raise generators.setting_error(name, "gamma", f"must be in (0, 1), got {gamma!r}")
  if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not -1 <= tau <= 1:
    raise generators.setting_error(name, "tau", f"must be in [-1, 1], got {tau!r}")

  def init():
    return jnp.asarray(window, jnp.int32)

  def generate(state, params, prompts, key, *, version: int):
    batch, stats = _windowed(ctx, params, prompts, key, int(state), version)
    return batch, state, stats

  def finish(state, params, batch, key, *, version: int):
    if version % every:
      return batch, state, {}
    w = int(state)
    ids, mask = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask)
    out = jax.device_get(sampling.sample(ctx.cfg, params, ids, mask, jax.random.fold_in(key, 6), ctx.sampling))
    probe = sampling.from_samples(ids, mask, out, prompt_index=batch.prompt_index, policy_version=0)
    adv = teacher_advantages(ctx.teacher, probe, ctx.sampling.temperature)
    m = np.asarray(probe.completion_mask)
    pre = m & (np.arange(m.shape[-1]) < w)
    full_mean = (adv * m).sum(-1) / np.maximum(m.sum(-1), 1)
    pre_mean = (adv * pre).sum(-1) / np.maximum(pre.sum(-1), 1)
    cos = float((full_mean * pre_mean).sum() / max(np.linalg.norm(full_mean) * np.linalg.norm(pre_mean), 1e-12))
    if cos < tau:   # grow (rounded up to a multiple of 4) ...
      new = int(math.ceil(w * (1 + gamma) / 4) * 4)
    else:           # ... or shrink (rounded down)
      new = int(math.floor(w * (1 - gamma) / 4) * 4)
    tokens = float(np.asarray(out.lengths).sum())
    stats = {"distill/probe_tokens": tokens, "generated_tokens": tokens,
             "distill/probe_alignment": generators.Mean(cos)}
    return batch, jnp.asarray(min(T, max(4, new)), jnp.int32), stats

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update, finish=finish)
