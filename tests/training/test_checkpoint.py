"""Checkpointer: retention, bitwise round trips (optax state, PRNG keys), meta, clear errors,
and crash safety (a run killed mid-save leaves no visible step; one killed after save() keeps it)."""

import doctest
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax.io import checkpoint
from rollouts_jax.io.checkpoint import Checkpointer, load_params, save_params

REPO = pathlib.Path(__file__).resolve().parents[2]


@jax.jit  # one compile (seed is traced) instead of many op-by-op ones
def _jit_state(seed):
  """A train-state-like pytree: params, an adamw state after two updates, counters, keys."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {"embed": jax.random.normal(k1, (5, 4)),
            "layer": {"w": jax.random.normal(k2, (4, 4)).astype(jnp.bfloat16),
                      "b": jnp.zeros((4,))}}
  opt = optax.adamw(1e-2, weight_decay=0.1)
  opt_state = opt.init(params)
  for i in range(2):
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1 * (i + 1), p.dtype), params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return {"params": params, "opt_state": opt_state, "step": (seed + 2).astype(jnp.int32),
          "key": k3, "raw_key": jax.random.PRNGKey(seed + 7)}


def _state(seed: int = 0):
  return _jit_state(jnp.int32(seed))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _assert_bitwise_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_doctests():
  result = doctest.testmod(checkpoint, raise_on_error=False, verbose=False)
  assert result.attempted >= 2 and result.failed == 0


def test_keep_latest_two(tmp_path):
  with Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    for step in range(1, 7):
      assert ckpt.should_save(step) == (step % 2 == 0)
      assert ckpt.save(step, {"x": jnp.full((3,), step)}, {"pos": step}) == (step % 2 == 0)
    assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "6"]
  # A fresh Checkpointer sees the same steps; older steps stay restorable.
  with Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    assert ckpt.latest_step() == 6
    state, meta, step = ckpt.restore({"x": jax.ShapeDtypeStruct((3,), jnp.int32)}, step=4)
    assert step == 4 and meta == {"pos": 4} and state["x"].tolist() == [4, 4, 4]


def test_force_and_existing_step(tmp_path):
  with Checkpointer(tmp_path, save_every=0, keep=3) as ckpt:
    assert not ckpt.should_save(5) and not ckpt.save(5, {"x": jnp.ones(2)})
    assert ckpt.save(5, {"x": jnp.ones(2)}, {"v": 1}, force=True)
    # The same step again is skipped and the stored checkpoint is untouched.
    assert not ckpt.save(5, {"x": jnp.zeros(2)}, {"v": 2}, force=True)
    state, meta, _ = ckpt.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert state["x"].tolist() == [1.0, 1.0] and meta == {"v": 1}


def test_round_trip_is_bitwise(tmp_path):
  state = _state(0)
  meta = {"stream": {"epoch": 1, "index": 1234, "shard_order": [3, 1, 2]}, "rollouts": 640,
          "lr": 3e-6, "name": "run-a"}
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.save(3, state, meta)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    restored, restored_meta, step = ckpt.restore(_abstract(state))
  assert step == 3 and restored_meta == meta
  _assert_bitwise_equal(restored, state)
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
  assert int(restored["opt_state"][0].count) == 2
  # The typed key comes back typed and draws the same numbers.
  assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.normal(restored["key"], (4,)), jax.random.normal(state["key"], (4,)))
  # Concrete arrays work as the abstract state too.
  restored2, _, _ = Checkpointer(tmp_path, save_every=1).restore(_state(5))
  _assert_bitwise_equal(restored2, state)


def test_restore_uses_requested_sharding(tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  state = {"w": jnp.arange(8.0), "key": jax.random.split(jax.random.key(0), 4)}
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
    restored, meta, _ = ckpt.restore(abstract)
  assert meta == {}
  assert restored["w"].sharding == sharding and restored["key"].shape == (4,)
  _assert_bitwise_equal(restored, state)


@pytest.mark.parametrize("change, names", [
    (lambda s: {**s, "extra": jnp.zeros(2)}, ["in abstract_state but not in the checkpoint: extra"]),
    (lambda s: {**s, "params": {"embed": s["params"]["embed"]}},
     ["in the checkpoint but not in abstract_state", "params/layer/b", "params/layer/w"]),
    (lambda s: {**s, "step": jnp.zeros((3,), jnp.int32)}, ["shape mismatch: step (saved (), wanted (3,))"]),
])
def test_mismatching_structure_names_keys(tmp_path, change, names):
  state = _state(0)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, state)
    with pytest.raises(ValueError, match="does not match checkpoint step 1") as info:
      ckpt.restore(_abstract(change(state)))
  for name in names:
    assert name in str(info.value)


def test_missing_checkpoint_errors(tmp_path):
  with Checkpointer(tmp_path / "empty", save_every=1) as ckpt:
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
      ckpt.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32)})
    ckpt.save(2, {"x": jnp.ones(1)})
    with pytest.raises(FileNotFoundError, match=r"step 3 .* have \[2\]"):
      ckpt.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32)}, step=3)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="keep"):
    Checkpointer(tmp_path, save_every=1, keep=0)
  with pytest.raises(ValueError, match="save_every"):
    Checkpointer(tmp_path, save_every=-1)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    with pytest.raises(ValueError, match="JSON-serializable"):
      ckpt.save(1, {"x": jnp.ones(1)}, {"bad": object()})
    assert ckpt.latest_step() is None


def test_leftover_temporary_directory_is_ignored(tmp_path):
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(6, {"x": jnp.ones(2)})
  # What orbax leaves when a process dies before renaming the step into place.
  tmp = tmp_path / "8.orbax-checkpoint-tmp-1700000000000000"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "junk").write_bytes(b"\0" * 10)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.latest_step() == 6 and ckpt.all_steps() == [6]
    assert ckpt.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})[2] == 6
  assert not tmp.exists()  # cleaned up on start


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp
    from rollouts_jax.io.checkpoint import Checkpointer

    directory, mode = sys.argv[1], sys.argv[2]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    ckpt = Checkpointer(directory, save_every=2)
    state = {"w": jax.device_put(jnp.arange(16.0), sharded), "step": jnp.int32(2)}
    if mode == "after_save":
      assert len(state["w"].sharding.device_set) == 4
      assert ckpt.save(2, state, {"pos": 2})
      os._exit(0)  # killed right after save() returned: no close(), no cleanup
    def die(*args, **kwargs):
      os._exit(3)  # killed while the step is being written
    for name in ("save", "async_save"):
      setattr(ocp.JsonCheckpointHandler, name, die)
    ckpt.save(4, {"w": state["w"] + 1, "step": jnp.int32(4)}, {"pos": 4})
    os._exit(1)  # not reached
""")


def test_killed_runs(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  run = lambda mode: subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(tmp_path), mode],
                                    env=env, capture_output=True, text=True, timeout=120)
  done = run("after_save")
  assert done.returncode == 0, done.stderr[-2000:]
  crashed = run("mid_save")
  assert crashed.returncode == 3, crashed.stderr[-2000:]
  leftovers = [p.name for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]
  assert leftovers and leftovers[0].startswith("4.")       # the half-written step 4
  abstract = {"w": jax.ShapeDtypeStruct((16,), jnp.float32), "step": jax.ShapeDtypeStruct((), jnp.int32)}
  with Checkpointer(tmp_path, save_every=2) as ckpt:
    assert ckpt.latest_step() == 2
    state, meta, step = ckpt.restore(abstract)
    assert step == 2 and meta == {"pos": 2} and int(state["step"]) == 2
    np.testing.assert_array_equal(state["w"], np.arange(16.0))
    # The resumed run can write step 4 for real.
    assert ckpt.save(4, {"w": jnp.ones(16), "step": jnp.int32(4)}, {"pos": 4})
    assert ckpt.all_steps() == [2, 4]


def test_save_and_load_params(tmp_path):
  params = _state(1)["params"]
  save_params(tmp_path / "p", params)
  _assert_bitwise_equal(load_params(tmp_path / "p", _abstract(params)), params)
  _assert_bitwise_equal(load_params(tmp_path / "p"), params)
  with pytest.raises(ValueError, match="exists"):
    save_params(tmp_path / "p", params)
  other = _state(2)["params"]
  save_params(tmp_path / "p", other, force=True)
  _assert_bitwise_equal(load_params(tmp_path / "p", _abstract(other)), other)
  with pytest.raises(ValueError, match="in the checkpoint but not in abstract: layer/b"):
    load_params(tmp_path / "p", {"embed": other["embed"], "layer": {"w": other["layer"]["w"]}})
  with pytest.raises(ValueError, match=r"shape mismatch: embed \(saved \(5, 4\), wanted \(4, 5\)\)"):
    load_params(tmp_path / "p", {**other, "embed": jnp.zeros((4, 5))})
  with pytest.raises(FileNotFoundError):
    load_params(tmp_path / "nothing", _abstract(other))


def test_a_full_disk_is_one_named_error_and_the_half_written_step_is_removed(tmp_path, monkeypatch):
  """orbax reports ENOSPC as a ValueError from tensorstore (measured on a 3 MB tmpfs)."""
  ckpt = Checkpointer(tmp_path, save_every=1)
  assert ckpt.save(1, {"w": jnp.ones((4,))})
  real_save = ckpt._manager.save

  def full(step, **kw):
    (tmp_path / f"{step}.orbax-checkpoint-tmp").mkdir()
    raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "{tmp_path}": '
                     "Failed to write 4096000 bytes to file 7: No space left on device [os_error_code='28']")

  monkeypatch.setattr(ckpt._manager, "save", full)
  with pytest.raises(checkpoint.CheckpointDiskFullError) as info:
    ckpt.save(2, {"w": jnp.ones((1000,), jnp.float32)})
  message = str(info.value.strerror)
  assert str(tmp_path) in message and "step 2 needs about 4,000 bytes" in message
  assert "last good checkpoint is step 1" in message and info.value.errno == 28
  assert sorted(os.listdir(tmp_path)) == ["1"]                 # the half-written step is gone

  def other(step, **kw):
    raise ValueError("a different failure")

  monkeypatch.setattr(ckpt._manager, "save", other)
  with pytest.raises(ValueError, match="a different failure"):
    ckpt.save(3, {"w": jnp.ones((4,))})
  monkeypatch.setattr(ckpt._manager, "save", real_save)
  assert ckpt.save(3, {"w": jnp.ones((4,))}) and ckpt.all_steps() == [1, 3]


def test_orbax_info_records_are_quiet_unless_debugging(tmp_path):
  import logging
  from absl import logging as absl_logging
  orbax_file = os.path.join("x", "site-packages", "orbax", "checkpoint", "checkpoint_manager.py")

  def record(level, msg, path=orbax_file):
    return logging.LogRecord("absl", level, path, 1, msg, None, None)

  quiet = checkpoint._QUIET_ORBAX
  assert not quiet.filter(record(logging.INFO, "Saving checkpoint at step 4"))
  assert quiet.filter(record(logging.WARNING, "something odd"))
  assert not quiet.filter(record(logging.ERROR, "_SignalingThread.run() raised: No space left on device"))
  assert quiet.filter(record(logging.INFO, "our own line", path=os.path.join("rollouts_jax", "training", "loop.py")))
  before = absl_logging.get_verbosity()
  try:
    absl_logging.set_verbosity(absl_logging.DEBUG)
    assert quiet.filter(record(logging.INFO, "Saving checkpoint at step 4"))
  finally:
    absl_logging.set_verbosity(before)
  Checkpointer(tmp_path, save_every=1)                        # installs the filter (once)
  Checkpointer(tmp_path, save_every=1)
  assert logging.getLogger("absl").filters.count(quiet) == 1
