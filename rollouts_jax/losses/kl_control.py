"""KL coefficient controllers: the coefficient of the KL penalty as a small, checkpointable state.

A controller is a pair of pure functions, as an optax transformation is:

    state = ctrl.init()                                  # KLControllerState(kl_coef=...)
    state = ctrl.update(state, current_kl, n_steps)      # after each RL step

`state.kl_coef` is the coefficient to use for the next step. The training update keeps the
state inside the optimizer state (`kl_coef_state`), so it is saved and restored with the train
state and a resumed run continues bitwise.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

Array = jax.Array

KL_CONTROLLERS = ("fixed", "adaptive")


class KLControllerState(NamedTuple):
  """The current KL coefficient (float32 scalar)."""
  kl_coef: Array


class KLController(NamedTuple):
  """`init() -> state` and `update(state, current_kl, n_steps) -> state`."""
  init: Callable[[], KLControllerState]
  update: Callable[[KLControllerState, Any, Any], KLControllerState]


def fixed_kl_controller(kl_coef: float) -> KLController:
  """A constant coefficient (verl's `FixedKLController`).

  >>> c = fixed_kl_controller(0.05)
  >>> round(float(c.update(c.init(), 3.0, 256).kl_coef), 6)
  0.05
  """
  if kl_coef < 0:
    raise ValueError(f"fixed_kl_controller: kl_coef must be >= 0, got {kl_coef}.")

  def init():
    return KLControllerState(jnp.asarray(kl_coef, jnp.float32))

  def update(state, current_kl, n_steps):
    del current_kl, n_steps
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_kl_coef: float, target_kl: float, horizon: float) -> KLController:
  """The adaptive coefficient of Ziegler et al., 2019 (arXiv 1909.08593, section 2.2).

  After each step, with e = clip(KL / target_kl - 1, -0.2, 0.2) the proportional error of the
  observed KL, `kl_coef <- kl_coef * (1 + e * n_steps / horizon)`: the coefficient grows while
  the policy drifts past the target and shrinks while it stays inside it. This is verl's
  `AdaptiveKLController` (and TRL's), which verl calls with n_steps = the batch's number of
  sequences. A non-finite KL leaves the coefficient unchanged.

  Args:
    init_kl_coef: the coefficient before the first update (> 0).
    target_kl: the KL the controller steers toward (> 0; verl's default 0.1).
    horizon: how many samples the error takes to change the coefficient by its own size
      (> 0; verl's default 10000).

  Returns:
    A `KLController`.

  Example:
    >>> c = adaptive_kl_controller(0.1, target_kl=0.1, horizon=10000)
    >>> s = c.update(c.init(), 0.3, 1000)      # KL 3x the target: e = 0.2, x(1 + 0.02)
    >>> round(float(s.kl_coef), 6)
    0.102
  """
  if not init_kl_coef > 0:
    raise ValueError(f"adaptive_kl_controller: init_kl_coef must be > 0, got {init_kl_coef}.")
  if not target_kl > 0 or not horizon > 0:
    raise ValueError(f"adaptive_kl_controller: target_kl and horizon must be > 0, got {target_kl}, {horizon}.")

  def init():
    return KLControllerState(jnp.asarray(init_kl_coef, jnp.float32))

  def update(state, current_kl, n_steps):
    kl = jnp.asarray(current_kl, jnp.float32)
    error = jnp.clip(kl / target_kl - 1.0, -0.2, 0.2)
    mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon
    return KLControllerState(jnp.where(jnp.isfinite(kl), state.kl_coef * mult, state.kl_coef))

  return KLController(init, update)


def build_kl_controller(name: str, kl_coef: float, target_kl: float = 0.1, horizon: float = 10000.0,
                        key: str = "rl.kl_ctrl") -> KLController:
  """The controller `name` ("fixed" or "adaptive"); errors name the config key `key`.

  >>> build_kl_controller("pid", 0.1)
  Traceback (most recent call last):
  ...
  ValueError: Config key rl.kl_ctrl must be one of 'fixed', 'adaptive'; got 'pid'.
  """
  if name not in KL_CONTROLLERS:
    raise ValueError(f"Config key {key} must be one of {', '.join(map(repr, KL_CONTROLLERS))}; got {name!r}.")
  if name == "fixed":
    return fixed_kl_controller(kl_coef)
  return adaptive_kl_controller(kl_coef, target_kl, horizon)


def kl_coef_state(controller: KLController) -> optax.GradientTransformation:
  """An optax transformation that only carries `controller`'s state in the optimizer state.

  Its `update` passes the updates through and leaves the state as it is; the training update
  reads the coefficient from it and writes the controller's next state after each step. Put
  last in an `optax.chain`, the state is `opt_state[-1]`, saved and restored with the rest of
  the optimizer state.

  >>> tx = optax.chain(optax.sgd(0.1), kl_coef_state(adaptive_kl_controller(0.1, 0.1, 100)))
  >>> state = tx.init({"w": jnp.zeros(2)})
  >>> round(float(state[-1].kl_coef), 6)
  0.1
  """

  def init(params):
    del params
    return controller.init()

  def update(updates, state, params=None):
    del params
    return updates, state

  return optax.GradientTransformation(init, update)
