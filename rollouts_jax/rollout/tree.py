"""`tree`: tree rollouts (ECHO arXiv 2602.02150 / TreeRL arXiv 2506.11902), one tree of N leaves per prompt.

Decoding forks a row (copying its KV cache) where the policy's entropy passes the branching
rule, so shared prefixes are decoded once; the leaves are the samples (rows that end as no
leaf carry `sample_mask` False) and each carries its mean token confidence. The settings are
`sampling.TreeConfig`'s fields, in `rollout.generator_kwargs`.

TreeRL's per-token node advantages need the leaves' rewards and the tree's shape together:
`generate` keeps the tree's shape (`TreeInfo.split`) in the generator's state and `finish`, once
FILTER has scored the leaves, sets them as the batch's `token_advantages` (the update uses them
in place of rl.advantage's).

>>> from rollouts_jax.rollout import generators
>>> generators.check_kwargs("tree", {"branches": 3})
Traceback (most recent call last):
...
ValueError: Config key rollout.generator_kwargs: generator 'tree' has no setting 'branches'; its settings: ...
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import advantages, sampling
from rollouts_jax.rollout import generators


def tree_config(**settings) -> sampling.TreeConfig:
  """The `sampling.TreeConfig` of these settings; a bad one is an error naming `rollout.generator_kwargs`."""
  generators.check_kwargs("tree", settings)
  try:
    return sampling.TreeConfig(**settings)
  except (TypeError, ValueError) as e:
    raise ValueError(f"Config key {generators.KWARGS_KEY}: generator 'tree': {e}") from None


def tree_rollouts(ctx: generators.GeneratorContext, tree: sampling.TreeConfig, params, prompts: generators.Prompts,
                  key, *, version: int):
  """(batch, TreeInfo, stats) of one tree per prompt; the batch's samples are the leaves."""
  out, info = jax.device_get(sampling.tree_sample(ctx.cfg, params, prompts.ids, prompts.mask, key, ctx.sampling,
                                                  tree))
  batch = sampling.from_samples(prompts.ids, prompts.mask, out, prompt_index=prompts.index, policy_version=version)
  leaves = np.asarray(info.leaf_mask, bool)
  conf = advantages.mean_token_confidence(jnp.asarray(info.confidence), jnp.asarray(batch.completion_mask))
  batch = batch.replace(sample_mask=leaves, confidence=np.asarray(conf, np.float32))
  stats = {"generated_tokens": float(np.asarray(info.generated_tokens).sum()),
           "tree/branches": float(np.asarray(info.num_branches).sum()), "tree/leaves": float(leaves.sum()),
           "tree/pruned": float(np.asarray(info.num_pruned).sum())}
  return batch, info, stats


def tree(ctx: generators.GeneratorContext, **settings) -> generators.Generator:
  """Tree rollouts with `sampling.TreeConfig(**settings)`.

  The state is the last call's `TreeInfo.split` (int32 [B, N, N]; zeros of that shape when
  `ctx.batch_size` is set, so it checkpoints with a fixed structure, else None until the first
  call); `finish` turns it and the leaves' rewards into TreeRL's node advantages.
  """
  conf = tree_config(**settings)
  N, B = ctx.sampling.num_samples, ctx.batch_size

  def init():
    return jnp.zeros((B, N, N), jnp.int32) if B else None

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    del state
    batch, info, stats = tree_rollouts(ctx, conf, params, prompts, key, version=version)
    return batch, jnp.asarray(info.split, jnp.int32), stats

  def finish(state, params, batch, key, *, version: int):
    del params, key, version
    adv = advantages.tree_node_advantages(jnp.asarray(batch.rewards), state, jnp.asarray(batch.sample_mask),
                                          jnp.asarray(batch.completion_mask))
    return batch.replace(token_advantages=np.asarray(adv, np.float32)), state, {}

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update, finish=finish, fields=("token_advantages",))


# The settings are TreeConfig's fields: the signature says so, for `generators.check_kwargs`.
tree.__signature__ = inspect.Signature(
    [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
       for f in dataclasses.fields(sampling.TreeConfig)])
generators.register("tree", tree)
