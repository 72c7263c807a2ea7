"""Tests of rollouts_jax.sharding.

Single-device properties run here. Multi-device checks need 8 host devices, and
XLA_FLAGS must be set before JAX starts (tests/conftest.py has already imported it),
so `test_multidevice_suite` runs multidevice_suite.py in a fresh `python -m pytest`.

Golden sharding snapshots live in tests/sharding/golden/<preset>.json; after an
intended change of the rules, regenerate them with

  UPDATE_GOLDEN=1 python -m pytest -q tests/sharding -k golden
"""
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from rollouts_jax import models
from rollouts_jax import sharding as sh

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
GOLDEN = HERE / "golden"

# Every optional parameter switched on, so the snapshot covers every parameter kind.
GOLDEN_CFG = models.ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True, o_bias=True,
                                qk_norm=True, tie_word_embeddings=False)
ACTIVATIONS = {"tokens": ("batch", "seq"), "kv_cache": (None, "batch", "seq", "kv_heads", "head_dim")}


# ------------------------------------------------------------------ rules


def test_logical_to_spec_follows_rules():
  rules = sh.get_rules("fsdp_tp")
  assert sh.logical_to_spec(("layers", "embed", "heads"), rules) == P(None, "fsdp", "tensor")
  assert sh.logical_to_spec(("vocab", "embed"), rules) == P("tensor", "fsdp")
  assert sh.logical_to_spec(("batch", None), rules) == P(("data", "fsdp"), None)
  assert sh.logical_to_spec(("layers", "norm"), sh.get_rules("fsdp")) == P(None, None)
  assert sh.logical_to_spec(("embed", "mlp"), sh.get_rules("pure_dp")) == P(None, None)


def test_logical_to_spec_uses_each_mesh_axis_once_and_first_free_rule_wins():
  rules = (("a", "x"), ("b", "x"), ("b", "y"), ("c", ("x", "y")))
  assert sh.logical_to_spec(("a", "b"), rules) == P("x", "y")
  assert sh.logical_to_spec(("b", "a"), rules) == P("x", None)
  assert sh.logical_to_spec(("c", "b"), rules) == P(("x", "y"), None)
  # Custom rules go in front of a preset and override it.
  custom = (("mlp", None),) + sh.get_rules("fsdp_tp")
  assert sh.logical_to_spec(("embed", "mlp"), custom) == P("fsdp", None)


def test_unknown_logical_name_and_preset_raise():
  with pytest.raises(ValueError, match="Logical axis 'hiddden' has no sharding rule"):
    sh.logical_to_spec(("hiddden",), sh.get_rules("fsdp"))
  with pytest.raises(ValueError, match="Unknown sharding preset 'tp'.*pure_dp, fsdp, fsdp_tp"):
    sh.get_rules("tp")
  with pytest.raises(ValueError, match="Unknown sharding preset"):
    sh.RolloutTrainMeshes.create(sh.MeshConfig(preset="fsdp2"))
  with pytest.raises(ValueError, match=r"Config key mesh.rollout_preset: unknown sharding preset 'fsdp2'"):
    sh.MeshConfig(rollout_shape=(1, 1, 1), rollout_preset="fsdp2").check()
  with pytest.raises(ValueError, match=r"Config key mesh.shape=\(1, -1, -1\): one size per axis"):
    sh.MeshConfig(shape=(1, -1, -1)).check()
  with pytest.raises(ValueError, match=r"Config key mesh.rollout_shape=\(2, 1\)"):
    sh.MeshConfig(rollout_shape=(2, 1)).check()
  sh.MeshConfig(shape=(1, -1, 1), rollout_shape=(1, 1, 2), rollout_preset="fsdp_tp").check()


def test_every_param_axis_name_has_a_rule_in_every_preset():
  names = {n for axes in jax.tree.leaves(models.param_axes(GOLDEN_CFG), is_leaf=lambda x: isinstance(x, tuple))
           for n in axes}
  assert names == {"layers", "vocab", "embed", "mlp", "heads", "kv_heads", "norm"}
  for preset in sh.PRESETS:
    assert names <= {name for name, _ in sh.get_rules(preset)}, preset


# ------------------------------------------------------------------ golden snapshots


def _spec_json(spec):
  return [list(e) if isinstance(e, tuple) else e for e in spec]


def snapshot(preset: str) -> dict:
  rules = sh.get_rules(preset)
  specs = sh.param_specs(GOLDEN_CFG, rules)
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {
      "preset": preset,
      "config": {k: getattr(GOLDEN_CFG, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_layers", "num_heads", "num_kv_heads")},
      "params": {"/".join(k.key for k in path): _spec_json(spec) for path, spec in flat},
      "activations": {k: _spec_json(sh.logical_to_spec(v, rules)) for k, v in ACTIVATIONS.items()},
  }


def _dump(obj) -> str:
  """JSON with one parameter per line (lists kept on one line)."""
  text = json.dumps(obj, indent=1, sort_keys=True)
  for _ in range(2):  # inner lists, then outer ones
    text = re.sub(r"\[\s+([^\[\]]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
  return text + "\n"


@pytest.mark.parametrize("preset", sorted(sh.PRESETS))
def test_golden_sharding_snapshot(preset):
  path = GOLDEN / f"{preset}.json"
  got = snapshot(preset)
  if os.environ.get("UPDATE_GOLDEN") == "1":
    path.parent.mkdir(exist_ok=True)
    path.write_text(_dump(got))
  want = json.loads(path.read_text())
  changed = {k: (want["params"].get(k), v) for k, v in got["params"].items() if want["params"].get(k) != v}
  missing = sorted(set(want["params"]) - set(got["params"]))
  assert got == want, (f"Sharding of preset {preset!r} changed: {changed}, missing {missing}, activations "
                       f"{got['activations']} vs {want['activations']}. If intended, rerun with UPDATE_GOLDEN=1.")


def test_golden_snapshots_say_what_the_presets_promise():
  snaps = {p: json.loads((GOLDEN / f"{p}.json").read_text()) for p in sh.PRESETS}
  assert all(all(e is None for e in spec) for spec in snaps["pure_dp"]["params"].values())
  fsdp = snaps["fsdp"]["params"]
  assert fsdp["embed"] == [None, "fsdp"] and fsdp["lm_head"] == ["fsdp", None]
  assert fsdp["layers/q"] == [None, "fsdp", None] and fsdp["layers/down"] == [None, None, "fsdp"]
  assert fsdp["layers/o_bias"] == [None, None] and fsdp["final_norm"] == [None]
  tp = snaps["fsdp_tp"]["params"]
  assert tp["layers/down"] == [None, "tensor", "fsdp"] and tp["lm_head"] == ["fsdp", "tensor"]
  assert tp["layers/k_bias"] == [None, "tensor"] and tp["layers/q_norm"] == [None, None]
  for s in snaps.values():
    assert s["activations"]["tokens"] == [["data", "fsdp"], None]


# ------------------------------------------------------------------ single-device behaviour


def test_make_mesh_on_one_device_and_errors():
  mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match=r"mesh_shape \(2, 1, 1\) needs 2 devices.*device count 1"):
    sh.make_mesh((2, 1, 1), devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="at most one -1"):
    sh.make_mesh((-1, -1, 1))
  with pytest.raises(ValueError, match="positive"):
    sh.make_mesh((0, 1, 1))


def test_constrain_is_identity_without_rules():
  x = jnp.ones((4, 3))
  assert sh.current_context() is None
  assert sh.constrain(x, ("batch", None)) is x
  mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with sh.use_rules(mesh, sh.get_rules("fsdp")) as ctx:
    assert sh.current_context() is ctx and ctx.mesh is mesh
    y = jax.jit(lambda a: sh.constrain(a, ("batch", None)))(x)
    assert (y == x).all()
  assert sh.current_context() is None


def test_abstract_params_carry_shardings_without_memory():
  mesh, rules = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]), sh.get_rules("fsdp_tp")
  abstract = sh.abstract_params(GOLDEN_CFG, mesh, rules, dtype=jnp.bfloat16)
  shapes = models.param_shapes(GOLDEN_CFG)
  assert jax.tree.structure(abstract) == jax.tree.structure(shapes, is_leaf=lambda x: isinstance(x, tuple))
  assert abstract["layers"]["q"].shape == shapes["layers"]["q"] and abstract["embed"].dtype == jnp.bfloat16
  assert abstract["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor")
  assert abstract["lm_head"].sharding.spec == P("fsdp", "tensor")


def test_process_batch_slice_single_process():
  assert sh.process_batch_slice(16) == slice(0, 16)


class _Recorder:
  def __init__(self):
    self.calls = []

  def __call__(self, *args, **kwargs):
    self.calls.append(kwargs)


def test_initialize_distributed_reads_args_and_env(monkeypatch):
  rec = _Recorder()
  monkeypatch.setattr(jax.distributed, "initialize", rec)
  monkeypatch.setattr(sh.distributed, "_distributed_is_initialized", lambda: False)
  assert sh.initialize_distributed(environ={}) is False and not rec.calls  # one process: no-op
  assert sh.initialize_distributed(environ={"JAX_NUM_PROCESSES": "1"}) is False and not rec.calls
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "ROLLOUTS_JAX_PROCESS_ID": "3"}
  assert sh.initialize_distributed(environ=env) is True
  assert rec.calls[-1] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                           "local_device_ids": None}
  # Arguments (flags) win over the environment.
  sh.initialize_distributed("h:1", 2, 0, environ=env)
  assert rec.calls[-1]["coordinator_address"] == "h:1" and rec.calls[-1]["num_processes"] == 2
  assert sh.initialize_distributed(environ={"ROLLOUTS_JAX_DISTRIBUTED": "auto"}) is True
  assert rec.calls[-1] == {"local_device_ids": None}  # JAX detects the TPU pod / SLURM / MPI cluster
  n = len(rec.calls)
  with pytest.raises(ValueError, match="missing process_id"):
    sh.initialize_distributed("h:1", 2, environ={})
  with pytest.raises(ValueError, match=r"process_id 2 is outside \[0, num_processes=2\)"):
    sh.initialize_distributed("h:1", 2, 2, environ={})
  with pytest.raises(ValueError, match="must be integers"):
    sh.initialize_distributed(environ={"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0",
                                       "JAX_COORDINATOR_ADDRESS": "h:1"})
  assert len(rec.calls) == n


def test_initialize_distributed_noop_when_already_initialized(monkeypatch):
  rec = _Recorder()
  monkeypatch.setattr(jax.distributed, "initialize", rec)
  monkeypatch.setattr(sh.distributed, "_distributed_is_initialized", lambda: True)
  assert sh.initialize_distributed("h:1", 2, 0) is False and not rec.calls


def test_distributed_flags_are_defined_and_default_to_single_process():
  from absl import flags
  fv = flags.FlagValues()
  sh.define_distributed_flags(fv)
  fv(["prog", "--coordinator_address=h:9", "--num_processes=4", "--process_id=2"])
  assert (fv.coordinator_address, fv.num_processes, fv.process_id, fv.distributed_auto) == ("h:9", 4, 2, None)
  fresh = flags.FlagValues()
  sh.define_distributed_flags(fresh)
  fresh(["prog"])
  assert sh.initialize_distributed(fresh.coordinator_address, fresh.num_processes, fresh.process_id,
                                   auto=fresh.distributed_auto, environ={}) is False


# ------------------------------------------------------------------ 8 devices, in a subprocess


def _env(device_count: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={device_count}"
                      # Compile faster; the checks compare results, which do not depend on this.
                      " --xla_backend_optimization_level=0").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
  return env


@pytest.mark.parametrize("marks, min_tests", [
    ("not slow", 24), pytest.param("slow", 4, marks=pytest.mark.slow)])
def test_multidevice_suite(tmp_path, marks, min_tests):
  """Forward / greedy sampler / RL step equal on meshes (8,1,1), (2,4,1), (2,2,2), (1,1,1); shardings;
  checkpoint restore on another mesh; errors. Slow part: other presets, sharded init, rollout/train
  hand-off on disjoint meshes (see multidevice_suite.py)."""
  report = tmp_path / "report.xml"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, f"--junitxml={report}",
       f"--basetemp={tmp_path / 'tmp'}", str(HERE / "multidevice_suite.py")],
      cwd=REPO, env=_env(8), capture_output=True, text=True, timeout=900)
  out = proc.stdout[-6000:] + proc.stderr[-3000:]
  assert report.exists(), out
  suite = ET.parse(report).getroot()
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
  assert proc.returncode == 0 and counts["failures"] == counts["errors"] == 0, out
  assert counts["skipped"] == 0 and counts["tests"] >= min_tests, (counts, out)


@pytest.mark.slow
def test_two_processes_shard_batch_forward_and_checkpoint(tmp_path):
  """Two processes x 4 CPU devices via jax.distributed: per-host batches, forward, orbax save/restore."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  worker = str(HERE / "multiprocess_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), port, str(tmp_path / "ckpt")], cwd=REPO,
                            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
    line = [ln for ln in out.splitlines() if ln.startswith("OK ")][-1]
    fwd_diff, restore_diff = map(float, line.split()[1:])
    assert fwd_diff <= 1e-5 and restore_diff <= 1e-6, line
