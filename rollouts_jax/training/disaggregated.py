"""Rollout processes apart from trainer processes, with bounded staleness (AReaL, slime, verl style).

All R + T processes join one `jax.distributed` runtime (CPU: gloo collectives). Processes
0 .. T-1 train, T .. T+R-1 run the rollout pipeline (GENERATE -> FILTER -> CONTROL -> REPLAY)
on their own devices. Everything moves with JAX's multi-controller collectives, no transport
of our own: the newest weights go from trainer 0 to every process with
`multihost_utils.broadcast_one_to_all` (one psum over all devices); a batch goes from the lead
rollout process to the trainers as pickled host arrays broadcast the same way (variable shapes:
a size, then the bytes); with R > 1 each rollout process decodes its slice of every generation's
prompts and the slices are all-gathered among the rollout processes (a jit over a mesh of their
devices), so CONTROL, FILTER and REPLAY run replicated and identical on each.

Schedule (lockstep, deterministic). Round q generates batch q with the params of version
`batch_version(q, S)` while the trainers update on batch q - S (`S = async_rl.max_staleness`);
then the batch moves to the trainers and, before the next round, the version the rollouts need.
So every batch is trained exactly `batch_version`'s gap after it was sampled, timings decide only
when things happen, and S = 0 is the synchronous loop (bitwise: same batches, same update).
With exact versions a free-running rollout side could not start earlier than this schedule
does (batch q needs version q - S, made by the update of round q - 1), so lockstep loses only
jitter absorption.

Trainers: with T > 1 the update is data parallel over a mesh of the trainers' devices
(`mesh.preset` "pure_dp": params and optimizer state replicated, each batch's groups split
evenly, gradients all-reduced by the compiled step); weights leave from trainer 0's local copy,
and trainer 0 alone evaluates and logs.

Checkpoints: the trainers save the train state, the in-flight versions and the EWMA
(`rollout.source.init_state`) and the rollout side's pipeline state after the last trained
batch (sent to it at each save) through `io.checkpoint.Checkpointer`; a restarted cluster
regenerates the in-flight batches from those versions, so nothing is lost or repeated.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import pickle
import signal
import socket
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rollouts_jax import rewards, sharding
from rollouts_jax.io.checkpoint import Checkpointer
from rollouts_jax.io.metrics import MetricsLogger, NullLogger
from rollouts_jax.io.plots import plot_curves
from rollouts_jax.rollout import generators
from rollouts_jax.rollout import source as source_lib
from rollouts_jax.rollout.source import ParamsHub, batch_version, copy_tree
from rollouts_jax.training import placement as placement_lib, workdir as workdir_lib
from rollouts_jax.training.build import build_pipeline, evaluator, load_policy, load_task
from rollouts_jax.training.config import ExperimentConfig
from rollouts_jax.training.loop import (TrainingStopped, make_train_step, state_from_disk, state_on_disk,
                                        with_adapters)
from rollouts_jax.training.rl_step import train_state_init
from rollouts_jax.types import concat

log = logging.getLogger(__name__)

#: Printed by every process once the runtime is joined (the launcher's "joined" signal).
JOINED_MARK = "DISAGG_JOINED"


class CoordinatorAddressInUseError(OSError):
  """The coordinator's port is taken (`--coordinator_address`)."""


class ProcessNeverJoinedError(TimeoutError):
  """A process did not join the runtime within `--join_timeout_s`."""


class ConfigMismatchAcrossProcessesError(ValueError):
  """The processes of one run were given different configs."""


class ProcessLostError(RuntimeError):
  """A process of the run died mid-run (a collective lost its peer); restart the cluster to resume."""


@dataclasses.dataclass(frozen=True)
class Roles:
  """Which processes train and which roll out: trainers 0 .. T-1, rollouts T .. T+R-1."""
  num_trainers: int
  num_rollouts: int

  @property
  def trainers(self) -> tuple[int, ...]:
    return tuple(range(self.num_trainers))

  @property
  def rollouts(self) -> tuple[int, ...]:
    return tuple(range(self.num_trainers, self.num_trainers + self.num_rollouts))

  @property
  def lead_rollout(self) -> int:
    return self.num_trainers

  def is_trainer(self, pid: int) -> bool:
    return pid < self.num_trainers


# ----------------------------------------------------------------------------------------------
# Joining the runtime
# ----------------------------------------------------------------------------------------------

def check_port_free(coordinator_address: str) -> None:
  """Raises CoordinatorAddressInUseError when process 0 cannot bind the coordinator's port.

  JAX aborts the process (no Python exception) when the port is taken, so this runs first.
  """
  host, _, port = coordinator_address.rpartition(":")
  with socket.socket() as s:
    try:
      s.bind(("" if host in ("localhost", "0.0.0.0", "[::]") else host, int(port)))
    except OSError as e:
      raise CoordinatorAddressInUseError(
          e.errno, f"--coordinator_address={coordinator_address}: port {port} is in use on this host ({e.strerror}); "
          "pick a free port or stop the process holding it.") from None


def join(coordinator_address: str, num_processes: int, process_id: int, *, join_timeout_s: int = 300,
         heartbeat_timeout_s: int = 100) -> None:
  """Joins the run's `jax.distributed` runtime (process 0 hosts the coordinator).

  A process that never joins makes JAX abort every other one after `join_timeout_s` (no Python
  exception reaches here); the launcher reports it as `ProcessNeverJoinedError`.
  """
  if process_id == 0:
    check_port_free(coordinator_address)
  sharding.initialize_distributed(coordinator_address, num_processes, process_id,
                                  initialization_timeout=join_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
  print(f"{JOINED_MARK} {jax.process_index()}/{jax.process_count()}", flush=True)


def config_hash(exp: ExperimentConfig) -> int:
  """A 31-bit hash of the config's JSON (stable across processes and machines)."""
  text = json.dumps(dataclasses.asdict(exp), sort_keys=True, default=str)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_same_config(exp: ExperimentConfig) -> None:
  """Raises ConfigMismatchAcrossProcessesError (on every process) unless all hold the same config."""
  if jax.process_count() == 1:
    return
  got = np.asarray(multihost_utils.process_allgather(np.array([config_hash(exp)], np.int32), tiled=True))
  if len(set(got.tolist())) > 1:
    groups = {}
    for p, h in enumerate(got.tolist()):
      groups.setdefault(h, []).append(p)
    raise ConfigMismatchAcrossProcessesError(
        "The processes were given different configs (--config and its overrides must be the same on every "
        f"process): processes {' vs '.join(str(g) for g in groups.values())} (config hashes "
        f"{', '.join(f'{h:08x}' for h in groups)}).")


# ----------------------------------------------------------------------------------------------
# Transport: JAX collectives only
# ----------------------------------------------------------------------------------------------

def _first_devices(procs: Sequence[int]) -> list:
  first = {}
  for d in jax.devices():
    first.setdefault(d.process_index, d)
  return [first[p] for p in procs]


@functools.lru_cache(maxsize=None)
def _group(procs: tuple[int, ...]):
  mesh = jax.sharding.Mesh(np.array(_first_devices(procs)), ("p",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
  gather = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return rows, gather


def allgather_bytes(data: bytes, procs: Sequence[int]) -> list[bytes]:
  """Every process of `procs` (sorted, this one among them) gets each one's `data`, in order.

  A jit over a mesh of one device per process of `procs`; only they call it.
  """
  procs = tuple(procs)
  rows, gather = _group(procs)
  me = _first_devices([jax.process_index()])[0]

  def run(row):
    arr = jax.make_array_from_single_device_arrays((len(procs),) + row.shape[1:], rows, [jax.device_put(row, me)])
    return np.asarray(gather(arr).addressable_data(0))

  sizes = run(np.array([[len(data)]], np.int32))[:, 0]
  buf = np.zeros((1, max(1, int(sizes.max()))), np.uint8)
  buf[0, :len(data)] = np.frombuffer(data, np.uint8)
  out = run(buf)
  return [out[i, :sizes[i]].tobytes() for i in range(len(procs))]


def send(obj: Any, src: int) -> Any:
  """`obj` of process `src`, on every process (pickled host arrays; every process calls it)."""
  is_src = jax.process_index() == src
  data = pickle.dumps(_host(obj), protocol=pickle.HIGHEST_PROTOCOL) if is_src else b""
  n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32), is_source=is_src))
  buf = np.frombuffer(data, np.uint8) if is_src else np.zeros((n,), np.uint8)
  got = multihost_utils.broadcast_one_to_all(buf, is_source=is_src)
  return pickle.loads(np.asarray(got).tobytes())


def broadcast_params(params, src: int = 0):
  """Trainer `src`'s params on every process (device arrays; a psum of the others' zeros)."""
  out = multihost_utils.broadcast_one_to_all(params, is_source=jax.process_index() == src)
  return jax.tree_util.tree_map(jnp.asarray, out)


def _host(tree):
  """Host copies (typed PRNG keys as `_Key`), picklable."""
  def leaf(x):
    if isinstance(x, jax.Array):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _Key(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
      return np.asarray(x)
    return x
  return jax.tree_util.tree_map(leaf, tree)


@dataclasses.dataclass
class _Key:
  data: np.ndarray
  impl: str


def _device(tree):
  """The inverse of `_host` for state the pipeline keeps on device."""
  def leaf(x):
    if isinstance(x, _Key):
      return jax.random.wrap_key_data(jnp.asarray(x.data), impl=x.impl)
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x
  return jax.tree_util.tree_map(leaf, tree, is_leaf=lambda x: isinstance(x, _Key))


# ----------------------------------------------------------------------------------------------
# GENERATE split over the rollout processes
# ----------------------------------------------------------------------------------------------

def split_generator(gen: generators.Generator, rank: int, procs: Sequence[int]) -> generators.Generator:
  """`gen` whose `generate` decodes this process's slice of the prompts, then all-gathers the slices.

  Slice r holds rows `np.array_split(range(B), R)[r]` and decodes on `fold_in(key, r)`; the
  result is the concatenated batch on every rollout process (counts summed). Only generators
  that keep no state (`init()` is None) can be split.
  """
  if gen.init() is not None:
    raise ValueError("rollout.generator keeps state across steps, which cannot be split over "
                     "--num_rollout_processes > 1; use a stateless generator (e.g. 'sample') or one rollout process.")
  R = len(procs)

  def generate(state, params, prompts, key, *, version):
    rows = np.array_split(np.arange(np.shape(prompts.ids)[0]), R)[rank]
    part = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], prompts)
    batch, _, stats = gen.generate(state, params, part, jax.random.fold_in(key, rank), version=version)
    got = [pickle.loads(b) for b in allgather_bytes(pickle.dumps((jax.device_get(batch), dict(stats))), procs)]
    merged = {}
    for _, s in got:
      for k, v in s.items():
        if isinstance(v, generators.Mean):
          merged[k] = generators.Mean(merged.get(k, 0.0) + v / R)
        elif k.endswith("decode_steps"):
          merged[k] = max(merged.get(k, 0.0), float(v))
        else:
          merged[k] = merged.get(k, 0.0) + v
    return concat([b for b, _ in got]), state, merged

  return gen._replace(generate=generate)


def check_supported(exp: ExperimentConfig, roles: Roles) -> None:
  """Named errors for settings this module does not run."""
  if roles.num_rollouts < 1:
    raise ValueError(f"--num_rollout_processes must be >= 1, got {roles.num_rollouts}.")
  if roles.num_trainers < 1:
    raise ValueError(f"--num_trainer_processes must be >= 1, got {roles.num_trainers}.")
  if roles.num_trainers > 1:   # pure data parallelism over the trainers: the batch's groups split evenly
    if exp.control.prompts_per_step % roles.num_trainers:
      raise ValueError(f"--num_trainer_processes={roles.num_trainers} does not divide control.prompts_per_step="
                       f"{exp.control.prompts_per_step}: the trainers split each batch's groups evenly.")
  if tuple(exp.mesh.rollout_shape):
    raise ValueError("mesh.rollout_shape: the rollout processes are the rollout devices here; leave it empty.")
  if int(np.prod(exp.mesh.shape)) != 1:
    raise ValueError(f"mesh.shape={tuple(exp.mesh.shape)}: a disaggregated run trains on one device per trainer "
                     "process for now; leave mesh.shape=(1, 1, 1).")
  if roles.num_rollouts > exp.control.prompts_per_step:
    raise ValueError(f"--num_rollout_processes={roles.num_rollouts} exceeds control.prompts_per_step="
                     f"{exp.control.prompts_per_step}: every rollout process needs prompts.")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def train(exp: ExperimentConfig, workdir: str | os.PathLike, *, num_trainers: int = 1,
          progress: bool = False, kill_at_round: int | None = None,
          kill_in_update: int | None = None) -> dict[str, Any]:
  """One process's part of a disaggregated run; every process of the runtime calls it.

  Fault drills: `kill_at_round`: this process SIGKILLs itself when that round begins;
  `kill_in_update` (a trainer): it SIGKILLs itself in the middle of that step, after the
  update and its metrics row, before the step's checkpoint.
  Returns the summary and final params on trainer 0 (as `loop.train`), `{"role": "rollout"}` elsewhere.
  """
  pid, P = jax.process_index(), jax.process_count()
  roles = Roles(num_trainers, P - num_trainers)
  check_supported(exp, roles)
  check_same_config(exp)
  trainer, lead = roles.is_trainer(pid), pid == 0
  S = exp.async_rl.max_staleness
  workdir = pathlib.Path(workdir)
  if lead:
    workdir.mkdir(parents=True, exist_ok=True)
    workdir_lib.check_workdir_config(workdir, dataclasses.asdict(exp), write=True)
  if lead:   # process 0 builds (or reads) the data and the warm start first; the others then read its cache
    train_examples, test_examples = load_task(exp)
    with MetricsLogger(workdir / "sft", total_steps=None, desc="sft") as sft_logger:
      cfg, params, tokenizer = load_policy(exp, train_examples, log_fn=sft_logger.log)
  multihost_utils.sync_global_devices("rollouts_jax_disagg_warm_start")
  if not lead:
    train_examples, test_examples = load_task(exp)
    cfg, params, tokenizer = load_policy(exp, train_examples)
  anchor = any(t == "cat" for t, _ in rewards.parse_reward_spec(exp.reward.name))
  ref_params = params if exp.rl.kl_coef > 0 or exp.reward.ref_samples > 0 or anchor else None
  policy = with_adapters(exp, cfg, params)
  side = (_Trainer if trainer else _Rollout)(exp, cfg, tokenizer, policy, ref_params, roles, workdir,
                                             train_examples, test_examples, progress)
  side.kill_in_update = kill_in_update
  # Start-up: the pipeline state's template to the trainers, the resume point to everyone.
  template = send(side.pipeline_state_host() if pid == roles.lead_rollout else None, src=roles.lead_rollout)
  mine = side.restore(template) if trainer else None   # every trainer reads its copy (orbax syncs them)
  resume = send(mine if lead else None, src=0)
  start = resume["start"]
  side.resumed(resume)
  if start == 0:
    side.before(send(side.presample() if pid == roles.lead_rollout else None, src=roles.lead_rollout))
  held = None    # the version the rollout processes hold
  try:
    for q in range(start, exp.rl.steps + S):
      if q == kill_at_round:
        os.kill(os.getpid(), signal.SIGKILL)
      if q < exp.rl.steps:
        need = batch_version(q, S)
        if need != held:
          side.take_params(broadcast_params(side.version_params(need)), need)
          held = need
      t = q - S
      overlap = S > 0 and t >= start
      if trainer and overlap:
        side.train(t)
      produced = side.generate(q) if (not trainer and q < exp.rl.steps) else None
      if q < exp.rl.steps:
        side.received(q, send(produced if pid == roles.lead_rollout else None, src=roles.lead_rollout))
      if trainer and t >= start and not overlap:
        side.train(t)
      if t >= start:
        flags = send(side.flags(t) if lead else None, src=0)
        if flags["save"]:
          side.save(t, send(side.pipeline_after(t) if pid == roles.lead_rollout else None, src=roles.lead_rollout))
        side.forget(t)
        if flags["stop"]:
          return side.stopped(t, flags)
    return side.finish()
  except jax.errors.JaxRuntimeError as e:
    if "Gloo" not in str(e) and "peer" not in str(e).lower():
      raise
    raise ProcessLostError(f"Process {pid} lost a peer in round {q} ({str(e).splitlines()[0][:200]}); the run "
                           "resumes from its last checkpoint when the cluster is started again.") from e
  finally:
    side.close()


class _Side:
  """What both roles share: the built config pieces."""

  def __init__(self, exp, cfg, tokenizer, policy, ref_params, roles, workdir, train_examples, test_examples, progress):
    self.kill_in_update = None   # fault drills (`train`'s kill_in_update)
    self.exp, self.cfg, self.tokenizer, self.policy, self.ref_params = exp, cfg, tokenizer, policy, ref_params
    self.roles, self.workdir, self.progress = roles, workdir, progress
    self.train_examples, self.test_examples = train_examples, test_examples
    self.S = exp.async_rl.max_staleness

  def pipeline_state_host(self):
    return None

  def restore(self, template):
    raise NotImplementedError

  def resumed(self, resume):
    pass

  def presample(self):
    return None

  def before(self, presampled):
    pass

  def close(self):
    pass


class _Rollout(_Side):
  """A rollout process: the pipeline, fed the version the schedule names."""

  def __init__(self, *args):
    super().__init__(*args)
    exp = self.exp
    self.pipeline = build_pipeline(exp, self.cfg, self.tokenizer, self.train_examples)
    rollouts = self.roles.rollouts
    if len(rollouts) > 1:
      self.pipeline.generator = split_generator(self.pipeline.generator, rollouts.index(jax.process_index()), rollouts)
    self.pstate = self.pipeline.init_state()
    self.params = None
    self.history = {}      # step -> pipeline state after that step's batch (for the trainer's checkpoints)
    self.base_key = jax.random.key(exp.seed)

  def pipeline_state_host(self):
    return self.pstate

  def resumed(self, resume):
    if resume["pipeline"] is not None:
      self.pstate = _device(resume["pipeline"])

  def presample(self):
    key = jax.random.fold_in(jax.random.key(self.exp.seed), 1 << 20)
    self.pstate, info = self.pipeline.presample_state(self.pstate, self.ref_params, key)
    return info

  def version_params(self, version):
    return self.policy   # a same-shaped placeholder: trainer 0's values arrive

  def take_params(self, params, version):
    self.params, self.version = params, version

  def generate(self, step):
    t0 = time.perf_counter()
    batch, self.pstate, info = self.pipeline.collect(self.pstate, self.params, step,
                                                     jax.random.fold_in(self.base_key, step),
                                                     ref_params=self.ref_params, version=self.version)
    self.history[step] = self.pstate
    return {"batch": jax.device_get(batch), "info": info, "version": self.version,
            "collect_s": time.perf_counter() - t0}

  def received(self, step, produced):
    pass

  def flags(self, step):
    return None

  def pipeline_after(self, step):
    return self.history[step]

  def save(self, step, pstate):
    pass

  def forget(self, step):
    for s in [s for s in self.history if s <= step]:
      del self.history[s]

  def stopped(self, step, flags):
    if flags.get("error"):
      raise TrainingStopped(flags["error"])
    return {"role": "rollout", "stopped_at": step + 1}

  def finish(self):
    return {"role": "rollout"}


class _Trainer(_Side):
  """A trainer: the update (data parallel over the trainers when T > 1), the versions in flight, the
  old log-probs and checkpoints; trainer 0 also evaluates and logs."""

  def __init__(self, *args):
    super().__init__(*args)
    exp = self.exp
    self.lead = jax.process_index() == 0
    self.logger = (MetricsLogger(self.workdir, total_steps=exp.rl.steps if self.progress else None, desc="rl")
                   if self.lead else NullLogger())
    self.evaluate_fn = evaluator(exp, self.cfg, self.tokenizer)
    self.eval_key = jax.random.key(exp.seed + 1)
    self.eval_examples = list(self.test_examples[:exp.eval.num_examples])
    self.mesh = self.param_shardings = state_shardings = None
    if self.roles.num_trainers > 1:   # one device per trainer, params replicated, batches split
      meshes = sharding.RolloutTrainMeshes.create(sharding.MeshConfig(shape=(self.roles.num_trainers, 1, 1),
                                                                      preset="pure_dp"),
                                                  devices=_first_devices(self.roles.trainers))
      self.mesh, base_shardings = meshes.train_mesh, meshes.train_shardings(self.cfg)
      self.param_shardings = sharding.policy_shardings(base_shardings, self.policy)   # LoRA: base and adapters
      self.policy = sharding.shard_params(self.policy, self.param_shardings)
      if self.ref_params is not None:
        self.ref_params = sharding.shard_params(self.ref_params, base_shardings)
    train_state, state_shardings = sharding.init_sharded_state(train_state_init(exp.rl), self.policy,
                                                               self.param_shardings)
    self.state_shardings = state_shardings
    self.state = {"train": train_state}
    async_state = source_lib.init_state(exp.async_rl, self._local(train_state.params), disaggregated=True)
    self.score = source_lib.scorer(self.cfg, temperature=exp.rollout.temperature, micro_rows=exp.rl.micro_batch_size,
                                   chunk=exp.rl.logprob_chunk, shared_prompt=exp.rl.shared_prompt)
    if async_state is not None:
      self.state["async"] = async_state
    self.ckpt = Checkpointer(self.workdir / "checkpoints", save_every=exp.checkpoint.every, keep=exp.checkpoint.keep,
                             active_processes=set(self.roles.trainers))
    self.train_step = make_train_step(dict(cfg=self.cfg, rl=exp.rl, temperature=exp.rollout.temperature,
                                           max_len=exp.rollout.max_new_tokens), state_shardings, self.mesh)
    self.pending, self.timing, self.summary = {}, {}, {}
    self.nonfinite_run, self.last_save_pipeline = 0, None
    self.t_send = self.t_wait = 0.0
    self.mark = time.perf_counter()

  def restore(self, template):
    self.start, pipeline = 0, None
    if self.ckpt.latest_step() is not None:
      state = dict(self.state, pipeline=_device(template))
      abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state_on_disk(state))
      restored, meta, _ = self.ckpt.restore_latest_intact(abstract, quarantine=True)
      self.state = state_from_disk(restored, dict(state, pipeline=restored["pipeline"]))
      pipeline = self.state.pop("pipeline")
      if self.mesh is not None:   # each trainer read a local copy: the train state back onto the trainers' mesh
        self.state["train"] = placement_lib.to_global(self.state["train"], self.state_shardings)
      self.start, self.nonfinite_run, self.summary = meta["rl_step"], meta["nonfinite_run"], meta["summary"]
      log.info("Resumed from step %d", self.start)
    self.logger.truncate_after(self.start if self.start else -1)
    return {"start": self.start, "pipeline": pipeline}

  def resumed(self, resume):
    start, S = self.start, self.S
    self.version = start
    self.ewma = self.state.get("async", {}).get("ewma")
    self.hub = ParamsHub(keep=S)
    for i, snap in enumerate(self.state["async"]["snapshots"] if S > 0 else []):
      if start - S + i >= 0:
        self.hub.publish(start - S + i, snap)
    self.hub.publish(start, copy_tree(self._local(self.state["train"].params)))

  def _local(self, tree):
    """This trainer's copy of replicated arrays, as local ones: what trainer 0 evaluates and sends, and the
    versions (the hub), the EWMA and old log-probs, which each trainer keeps and computes alone."""
    if self.mesh is None:
      return tree
    return jax.tree_util.tree_map(
        lambda x: x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x, tree)

  def _evaluate(self, greedy=True):
    """Trainer 0's evaluation of the current params (on its local copy; the others skip it)."""
    if not self.lead:
      return {}
    params = self._local(self.state["train"].params)
    return self.evaluate_fn(params, self.eval_examples, self.eval_key, **({} if greedy else {"greedy": False}))

  def before(self, presampled):
    self.summary["before"] = self._evaluate()
    self.logger.log(0, {**self.summary["before"], **(presampled or {})})

  def version_params(self, version):
    t0 = time.perf_counter()
    params = self._local(self.state["train"].params) if version == self.version else self.hub.get(version)
    self._send_start = t0
    return params

  def take_params(self, params, version):
    self.t_send += time.perf_counter() - self._send_start

  def generate(self, step):
    return None

  def received(self, step, produced):
    self.pending[step] = produced

  def train(self, step):
    exp = self.exp
    t0 = time.perf_counter()
    got = self.pending.pop(step)
    host, info, version = got["batch"], dict(got["info"]), got["version"]
    if step - version > self.S:
      raise RuntimeError(f"Step {step}: a batch of version {version} exceeds async_rl.max_staleness={self.S}.")
    params = self.state["train"].params
    old = source_lib.old_logprobs(exp.async_rl.old_logprobs, self.score, host, step, self._local(params), self.hub,
                                  self.ewma)
    if old is not None:
      host = host.replace(old_logprobs=old)
    batch = host
    if self.mesh is not None:   # every trainer holds the whole batch; each device takes its groups
      batch = placement_lib.to_global(host, sharding.data_sharding(self.mesh))
    t1 = time.perf_counter()
    train_state, m = self.train_step(self.state["train"], batch, self.ref_params)
    if self.ewma is not None:
      avg, total = source_lib.ewma_update(self.ewma["params"], self.ewma["total"], self._local(train_state.params),
                                          exp.async_rl.ewma_beta)
      self.ewma = {"params": avg, "total": total}
    self.hub.publish(step + 1, copy_tree(self._local(train_state.params)))
    self.version = step + 1
    self.state = dict(self.state, train=train_state)
    m = {k: float(v) for k, v in jax.device_get(self._local(m)).items()}
    t2 = time.perf_counter()
    now = time.perf_counter()
    info.update(m, **{"time/update": t2 - t1, "time/step": now - self.mark, "async/collect_s": got["collect_s"],
                      "async/handoff_s": self.t_send, "disagg/old_logprobs_s": t1 - t0,
                      "disagg/version_gap": float(step - version)})
    self.mark, self.t_send = now, 0.0
    if self.S > 0:
      # The producer's share is the rollout processes' share of all processes (one device each).
      r, t = self.roles.num_rollouts, self.roles.num_trainers
      source_lib.step_metrics(info, host, step, version, 0.0, self.timing, max_staleness=self.S,
                              batch_rollouts=exp.control.prompts_per_step * exp.rollout.num_samples,
                              producer_share=r / (r + t))
    info["tokens_per_s"] = info["generated_tokens"] / max(info.get("time/sample", 0.0), 1e-9)
    info["tokens_per_wall_s"] = info["generated_tokens"] / max(info["time/step"], 1e-9)
    self.nonfinite_run = self.nonfinite_run + 1 if m["nonfinite"] > 0 else 0
    if m["nonfinite"] > 0:
      log.warning("Step %d: non-finite loss or gradient; update skipped (%d in a row).", step + 1, self.nonfinite_run)
    if exp.eval.every and (step + 1) % exp.eval.every == 0 and step + 1 < exp.rl.steps:
      info.update(self._evaluate(greedy=False))
    self.logger.log(step + 1, info)
    if step == self.kill_in_update:   # fault drill: the update done, its checkpoint not
      os.kill(os.getpid(), signal.SIGKILL)
    if step + 1 == exp.rl.steps:
      self.summary["after"] = self._evaluate()
      self.logger.log(step + 1, self.summary["after"])

  def flags(self, step):
    exp = self.exp
    done = step + 1 == exp.rl.steps
    stop = self.nonfinite_run >= exp.max_nonfinite_steps
    halt = exp.stop_after_step >= 0 and step + 1 >= exp.stop_after_step and not done
    save = done or stop or halt or self.ckpt.should_save(step + 1)
    error = (f"{self.nonfinite_run} consecutive non-finite updates (max_nonfinite_steps={exp.max_nonfinite_steps}); "
             f"stopping at step {step + 1}.") if stop else ""
    return {"save": save, "stop": stop or halt, "error": error}

  def save(self, step, pstate):
    state = dict(self.state, pipeline=_device(pstate))
    if "async" in state:
      out = {}
      if self.S > 0:
        out["snapshots"] = [self.hub.get(max(0, v)) for v in range(step + 1 - self.S, step + 1)]
      if self.ewma is not None:
        out["ewma"] = self.ewma
      state["async"] = out
      self.state["async"] = out
    meta = {"rl_step": step + 1, "nonfinite_run": self.nonfinite_run, "summary": self.summary}
    self.ckpt.save(step + 1, state_on_disk(self._local(state)), meta, force=True)

  def forget(self, step):
    pass

  def stopped(self, step, flags):
    self.logger.close()
    if flags.get("error"):
      raise TrainingStopped(flags["error"])
    return {"stopped_at": step + 1, "params": self.state["train"].params}

  def finish(self):
    self.logger.close()
    if not self.lead:
      return {"role": "trainer", "final_step": self.exp.rl.steps}
    plots = plot_curves(self.workdir / "metrics.jsonl", self.workdir / "plots")
    self.summary.update(final_step=self.exp.rl.steps, plots=[str(p) for p in plots])
    (self.workdir / "summary.json").write_text(json.dumps(self.summary, indent=2))
    return dict(self.summary, params=self.state["train"].params)

  def close(self):
    self.ckpt.close()
