"""Multi-process start-up: `jax.distributed.initialize` from flags or the environment."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import jax

_ENV_COORD = ("ROLLOUTS_JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
_ENV_NUM = ("ROLLOUTS_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES")
_ENV_ID = ("ROLLOUTS_JAX_PROCESS_ID", "JAX_PROCESS_ID")
_ENV_AUTO = "ROLLOUTS_JAX_DISTRIBUTED"


def _from_env(names, environ):
  for n in names:
    if environ.get(n) not in (None, ""):
      return environ[n]
  return None


def _distributed_is_initialized() -> bool:
  fn = getattr(jax.distributed, "is_initialized", None)
  if fn is not None:
    return bool(fn())
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client is not None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
                           auto: bool | None = None, environ: Mapping[str, str] | None = None,
                           initialization_timeout: int | None = None,
                           heartbeat_timeout_seconds: int | None = None) -> bool:
  """Starts multi-process JAX (`jax.distributed.initialize`) when asked; else does nothing.

  Settings come from the arguments (e.g. absl flags), else from the environment:
  `ROLLOUTS_JAX_COORDINATOR_ADDRESS` / `JAX_COORDINATOR_ADDRESS`,
  `ROLLOUTS_JAX_NUM_PROCESSES` / `JAX_NUM_PROCESSES`, `ROLLOUTS_JAX_PROCESS_ID` /
  `JAX_PROCESS_ID`. With none of them set it is a no-op (one process) unless `auto`
  (or `ROLLOUTS_JAX_DISTRIBUTED=auto`), which lets JAX detect the cluster itself: a
  Cloud TPU pod, SLURM, Open MPI or Kubernetes. Call it before any other JAX call.

  Args:
    coordinator_address: "host:port" of process 0.
    num_processes: number of processes.
    process_id: this process's index in [0, num_processes).
    local_device_ids: devices this process drives (e.g. one GPU per process).
    auto: let JAX auto-detect the cluster when nothing is given.
    environ: the environment to read (default `os.environ`).
    initialization_timeout: seconds to wait for every process to join (None: JAX's default).
    heartbeat_timeout_seconds: seconds without a heartbeat before a process counts as dead
      (None: JAX's default).
  Returns:
    True when this call initialized the distributed runtime.
  Raises:
    ValueError: an incomplete or inconsistent setting.

  >>> initialize_distributed(environ={})  # one process: nothing to do
  False
  """
  environ = os.environ if environ is None else environ
  if _distributed_is_initialized():
    return False
  coordinator_address = coordinator_address or _from_env(_ENV_COORD, environ)
  num_processes = num_processes if num_processes is not None else _from_env(_ENV_NUM, environ)
  process_id = process_id if process_id is not None else _from_env(_ENV_ID, environ)
  if auto is None:
    auto = environ.get(_ENV_AUTO, "").lower() in ("auto", "1", "true")
  if coordinator_address is None and num_processes is None and process_id is None:
    if not auto:
      return False
    jax.distributed.initialize(local_device_ids=local_device_ids)
    return True
  try:
    num_processes = None if num_processes is None else int(num_processes)
    process_id = None if process_id is None else int(process_id)
  except ValueError as e:
    raise ValueError(f"num_processes and process_id must be integers: {e}") from None
  if num_processes == 1 and not coordinator_address:
    return False
  missing = [n for n, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                            ("process_id", process_id)) if v is None]
  if missing and not auto:
    raise ValueError(f"Multi-process launch is missing {', '.join(missing)} (flags or env "
                     f"{', '.join(_ENV_COORD + _ENV_NUM + _ENV_ID)}); give all three, or use auto detection.")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is outside [0, num_processes={num_processes}).")
  timeouts = {k: v for k, v in (("initialization_timeout", initialization_timeout),
                                 ("heartbeat_timeout_seconds", heartbeat_timeout_seconds)) if v is not None}
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids, **timeouts)
  return True


def define_distributed_flags(flag_values=None) -> None:
  """Defines absl flags --coordinator_address, --num_processes, --process_id, --distributed_auto.

  Pass them on: `initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
  FLAGS.process_id, auto=FLAGS.distributed_auto)`.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process runs).", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "This process's index (multi-process runs).", flag_values=fv)
  flags.DEFINE_bool("distributed_auto", None,
                    "Let JAX detect the cluster (TPU pod, SLURM, Open MPI, Kubernetes).", flag_values=fv)
