"""Multi-turn environments: the `Env` contract, its registry, turn renderers and sandboxed tools.

>>> from rollouts_jax import envs
>>> env = envs.build("calculator")
>>> state = env.reset({"a": 12, "b": 7, "answer": "84"})
>>> env.step(state, "<tool_call>12*7</tool_call>").observation
'84'
"""

from rollouts_jax.envs import base, tools
from rollouts_jax.envs.base import (EnvSettings, Env, Renderer, StepResult, build, names, register, renderer,
                                    setting_error, stop_sequences)
# The registered environments (each module registers itself on import).
from rollouts_jax.envs import calculator, guess  # noqa: F401  pylint: disable=unused-import

__all__ = ["Env", "EnvSettings", "Renderer", "StepResult", "base", "build", "calculator", "guess", "names",
           "register", "renderer", "setting_error", "stop_sequences", "tools"]
