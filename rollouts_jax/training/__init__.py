"""Training: the RL step, the loop, SFT warm start, checkpoints, metrics and evaluation.

>>> from rollouts_jax.training import config, loop
>>> exp = config.from_config_dict(config.load_config_file("configs/default.py", "smoke"))  # doctest: +SKIP
>>> summary = loop.train(exp, "/tmp/workdir")  # doctest: +SKIP
"""

from rollouts_jax.io.checkpoint import Checkpointer, load_params, save_params
from rollouts_jax.training.config import (ExperimentConfig, RLConfig, apply_smoke, base_config_dict,
                                          from_config_dict, load_config_file)
from rollouts_jax.training.eval_metrics import maj_at_k, mean_pass_at_k, pass_at_k
from rollouts_jax.io.metrics import MetricsLogger, read_jsonl
from rollouts_jax.io.plots import plot_curves
# The step function stays at rollouts_jax.training.rl_step.rl_step (not re-exported here, so that
# `rollouts_jax.training.rl_step` keeps naming the module).
from rollouts_jax.training.rl_step import (Rollouts, TrainState, completion_logprobs, init_train_state,
                                          make_optimizer, rl_optimizer)

__all__ = [
    "Checkpointer", "load_params", "save_params", "ExperimentConfig", "RLConfig", "apply_smoke",
    "base_config_dict", "from_config_dict", "load_config_file", "maj_at_k", "mean_pass_at_k", "pass_at_k",
    "MetricsLogger", "plot_curves", "read_jsonl", "Rollouts", "TrainState", "completion_logprobs",
    "init_train_state", "make_optimizer", "rl_optimizer",
]
