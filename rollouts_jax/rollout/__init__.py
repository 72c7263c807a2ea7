"""The rollout step: GENERATE's registry, the side steps, and the step itself (`rollout.pipeline`).

    from rollouts_jax import rollout
    gen = rollout.build("spec_rl", rollout.GeneratorContext(cfg, sampling_config, num_prompts), lenience=1.6)
    gs = gen.init()
    batch, gs, stats = gen.generate(gs, params, rollout.Prompts(ids, mask, index), key, version=step)
    gs = gen.update(gs, scored_batch, version=step)

Each generator is one module here, registered by name (`generators.register`):

>>> from rollouts_jax import rollout
>>> rollout.names()
['sample', 'adwin', 'april', 'arrol', 'esr', 'multiturn', 'self_spec', 'sol_rl', 'spec_rl', 'tree']
"""

from rollouts_jax.rollout import generators
from rollouts_jax.rollout.generators import (Generator, GeneratorContext, Mean, Prompts, build, check, check_kwargs, get,
                                             names, register, setting_error)
from rollouts_jax.rollout.pipeline import STALL_REFILLS, PipelineState, RolloutPipeline
from rollouts_jax.rollout.stats import StepStats, loss_extent
# The registered generators (each module registers itself on import).
from rollouts_jax.rollout import arrol, multiturn, opd_window, partial, sample, self_spec, sol_rl, spec_rl, tree  # noqa: F401  pylint: disable=unused-import

__all__ = ["STALL_REFILLS", "PipelineState", "RolloutPipeline", "StepStats", "loss_extent",
           "Generator", "GeneratorContext", "Mean", "Prompts", "build", "check", "check_kwargs", "generators", "get",
           "names", "register", "setting_error"]
