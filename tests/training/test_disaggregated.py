"""Rollout processes apart from trainer processes (`training.disaggregated`, `experiments/launch/cluster.py`).

Each cluster test starts real processes (one CPU device each, gloo collectives) on the smoke config.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import moved_from_warm_start
from rollouts_jax.rollout import source as source_lib
from rollouts_jax.training import config as config_lib, disaggregated, loop

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "default.py") + ":smoke"
# The smoke model's rewards are all zero, so the entropy bonus is what moves the params: without it every
# update is zero and a params comparison could not fail.
MOVES = "--config.rl.entropy_coef=0.01"
ASYNC = ["--config.async_rl.max_staleness=1", "--config.rl.tis_cap=2.0", "--config.async_rl.old_logprobs=snapshot",
         "--config.rl.steps=4", MOVES]


def _exp(*overrides):
  cd = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
  for o in overrides:
    key, value = o[len("--config."):].split("=")
    section, name = key.split(".")
    cur = getattr(getattr(cd, section), name)
    setattr(getattr(cd, section), name, type(cur)(value) if not isinstance(cur, str) else value)
  return config_lib.from_config_dict(cd)


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)   # one CPU device per process
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
  return env


def _launch(workdir, *args, timeout=600):
  cmd = [sys.executable, "-m", "experiments.launch.cluster", f"--config={SMOKE}", f"--workdir={workdir}", *args]
  return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _latest(exp, workdir):
  """The params of the run's latest checkpoint (a tree)."""
  return loop.latest_params(exp, workdir, loop.load_policy(exp, loop.load_task(exp)[0])[1])


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _params(exp, workdir):
  return _flat(_latest(exp, workdir))


def _rows(workdir):
  rows = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if "disagg/version_gap" in r]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_config_hash_is_stable_and_sensitive():
  a, b = _exp(), _exp("--config.rl.learning_rate=0.001")
  assert disaggregated.config_hash(a) == disaggregated.config_hash(_exp())
  assert disaggregated.config_hash(a) != disaggregated.config_hash(b)


def test_roles_and_unsupported_settings_are_named():
  roles = disaggregated.Roles(1, 3)
  assert roles.trainers == (0,) and roles.rollouts == (1, 2, 3) and roles.lead_rollout == 1
  disaggregated.check_supported(_exp(), disaggregated.Roles(2, 1))   # data parallel over 2 trainers
  with pytest.raises(ValueError, match="--num_trainer_processes=3 does not divide control.prompts_per_step=4"):
    disaggregated.check_supported(_exp(), disaggregated.Roles(3, 1))
  with pytest.raises(ValueError, match="--num_rollout_processes=5 exceeds control.prompts_per_step=4"):
    disaggregated.check_supported(_exp(), disaggregated.Roles(1, 5))


def test_coordinator_address_in_use_is_named(tmp_path):
  with socket.socket() as s:
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    out = _launch(tmp_path / "w", "--process_id=0", f"--coordinator_address=localhost:{port}",
                  "--num_rollout_processes=1", timeout=300)
  assert out.returncode != 0
  assert "CoordinatorAddressInUseError" in out.stderr and f"--coordinator_address=localhost:{port}" in out.stderr


@pytest.mark.slow
def test_process_that_never_joins_is_named(tmp_path, cache):
  out = _launch(tmp_path / "w", "--skip_process_ids=1", "--join_timeout_s=5")
  assert out.returncode != 0
  assert "ProcessNeverJoinedError" in out.stderr and "Process(es) [1]" in out.stderr
  assert "--join_timeout_s=5" in out.stderr


@pytest.mark.slow
def test_mismatched_configs_are_named(tmp_path, cache):
  port = _free_port()
  common = [sys.executable, "-m", "experiments.launch.cluster", f"--config={SMOKE}", f"--workdir={tmp_path / 'w'}",
            f"--coordinator_address=localhost:{port}", "--join_timeout_s=60"]
  procs = [subprocess.Popen(common + [f"--process_id={i}"] + (["--config.rl.learning_rate=0.001"] if i else []),
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for p, text in zip(procs, outs):
    assert p.returncode != 0
    assert "ConfigMismatchAcrossProcessesError" in text and "processes [0] vs [1]" in text, text[-2000:]


@pytest.mark.slow
def test_one_rollout_one_trainer_synchronous_equals_one_process(tmp_path, cache):
  """max_staleness=0: the same batches and the same update, so the same params bit for bit."""
  exp = _exp("--config.rl.steps=2", MOVES)
  ref = loop.train(exp, tmp_path / "one", progress=False)
  out = _launch(tmp_path / "two", "--config.rl.steps=2", MOVES)
  assert out.returncode == 0, out.stderr[-3000:]
  got = _params(exp, tmp_path / "two")
  flat = _flat(ref["params"])
  assert set(got) == set(flat) and moved_from_warm_start(exp, ref["params"]) > 1e-5
  for k in flat:
    np.testing.assert_array_equal(got[k], flat[k], err_msg=k)
  assert [r["disagg/version_gap"] for r in _rows(tmp_path / "two")] == [0.0, 0.0]
  one = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
  two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
  for a, b in zip(one[1:3], two[1:3]):
    assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, cache):
  """1 trainer + 2 rollout processes, max_staleness=1, snapshot old log-probs, 4 steps, uninterrupted."""
  workdir = tmp_path_factory.mktemp("async")
  out = _launch(workdir, "--num_rollout_processes=2", *ASYNC)
  assert out.returncode == 0, out.stderr[-3000:]
  assert moved_from_warm_start(_exp(*ASYNC), _latest(_exp(*ASYNC), workdir)) > 1e-5
  return workdir


@pytest.mark.slow
def test_staleness_one_gap_is_batch_versions(async_run):
  rows = _rows(async_run)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  gaps = [r["disagg/version_gap"] for r in rows]
  assert gaps == [s - source_lib.batch_version(s, 1) for s in range(4)] == [0, 1, 1, 1]
  assert max(r["async/staleness_max"] for r in rows) <= 1
  assert all(r["rollouts"] == 20 for r in rows)   # 4 prompts x 5 samples, split over the two rollout processes


@pytest.mark.slow
def test_killed_rollout_process_restarts_from_checkpoint_with_nothing_lost(tmp_path, async_run):
  """A rollout process SIGKILLed in round 3: the launcher stops the cluster and resumes from step 2's checkpoint;
  the final params are the uninterrupted run's bit for bit (the in-flight batch is regenerated from its version)."""
  out = _launch(tmp_path / "w", "--num_rollout_processes=2", *ASYNC, "--fault_kill=2:3", "--max_restarts=1")
  assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
  assert "Attempt 0: process 2 exited with code -9" in out.stdout
  assert "Restarting from the last checkpoint" in out.stdout
  exp = _exp(*ASYNC)
  want, got = _params(exp, async_run), _params(exp, tmp_path / "w")
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert [r["step"] for r in _rows(tmp_path / "w")] == [1, 2, 3, 4]   # no step lost or logged twice


@pytest.mark.slow
def test_trainer_killed_mid_step_resumes_bitwise(tmp_path, async_run):
  """The trainer SIGKILLed in the middle of step 3 (its update done and logged, its checkpoint not written):
  the launcher restarts the cluster from step 2's checkpoint; the final params are the uninterrupted run's
  bit for bit and the metrics hold each step once (the row logged before the kill is replaced, not repeated)."""
  out = _launch(tmp_path / "w", "--num_rollout_processes=2", *ASYNC, "--fault_kill=0:2:update", "--max_restarts=1")
  assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
  assert "Attempt 0: process 0 exited with code -9" in out.stdout
  assert "Restarting from the last checkpoint" in out.stdout
  exp = _exp(*ASYNC)
  want, got = _params(exp, async_run), _params(exp, tmp_path / "w")
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert [r["step"] for r in _rows(tmp_path / "w")] == [1, 2, 3, 4]
  whole, cut = _rows(async_run), _rows(tmp_path / "w")
  assert [r["loss"] for r in cut] == [r["loss"] for r in whole]


@pytest.mark.slow
def test_two_trainers_are_data_parallel_and_equal_one_process(tmp_path, cache):
  """T = 2 trainers (params replicated on a mesh of their devices, each batch's groups split between them)
  at max_staleness = 0: the one-process run's params to float tolerance (the gradient's sum is reduced over
  two devices, in another order), trainer 0 alone logging each step once."""
  exp = _exp("--config.rl.steps=2", MOVES)
  ref = loop.train(exp, tmp_path / "one", progress=False)
  out = _launch(tmp_path / "two", "--num_trainer_processes=2", "--config.rl.steps=2", MOVES)
  assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
  got = _params(exp, tmp_path / "two")
  flat = _flat(ref["params"])
  assert set(got) == set(flat) and moved_from_warm_start(exp, ref["params"]) > 1e-5
  for k in flat:
    np.testing.assert_allclose(got[k], flat[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert [r["step"] for r in _rows(tmp_path / "two")] == [1, 2]
  assert json.loads((tmp_path / "two" / "summary.json").read_text())["final_step"] == 2


@pytest.mark.slow
def test_two_trainers_async_resume_after_a_trainer_is_killed_mid_step(tmp_path, cache):
  """2 trainers + 1 rollout process, max_staleness = 1: the version gap stays within 1, and trainer 1 SIGKILLed
  in the middle of step 3 resumes (every trainer reads the checkpoint) to the uninterrupted run's params bit
  for bit, each step logged once."""
  whole = _launch(tmp_path / "whole", "--num_trainer_processes=2", *ASYNC)
  assert whole.returncode == 0, whole.stderr[-3000:] + whole.stdout[-2000:]
  assert max(r["disagg/version_gap"] for r in _rows(tmp_path / "whole")) <= 1
  out = _launch(tmp_path / "cut", "--num_trainer_processes=2", *ASYNC, "--fault_kill=1:2:update", "--max_restarts=1")
  assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
  assert "Attempt 0: process 1 exited with code -9" in out.stdout
  exp = _exp(*ASYNC)
  want, got = _params(exp, tmp_path / "whole"), _params(exp, tmp_path / "cut")
  assert moved_from_warm_start(exp, _latest(exp, tmp_path / "whole")) > 1e-5
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert [r["step"] for r in _rows(tmp_path / "cut")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_two_trainers_train_lora_adapters_and_resume_after_a_trainer_is_killed(tmp_path, cache):
  """LoRA over T = 2 trainers: the adapters (and the frozen base) replicated on the trainers' mesh, each
  batch's groups split; trainer 1 SIGKILLed in the middle of step 2 restarts from step 1's checkpoint (the
  adapters read back onto the mesh over the base already there) and ends at the one-process run's adapters
  to float tolerance, each step logged once."""
  from rollouts_jax.models import lora
  lora_args = ["--config.lora.rank=4", "--config.lora.alpha=8.0", "--config.lora.targets=q,v,down",
               "--config.rl.steps=3", "--config.rl.learning_rate=0.01", MOVES]
  exp = _exp(*lora_args)
  ref = loop.train(exp, tmp_path / "one", progress=False)["params"]
  out = _launch(tmp_path / "two", "--num_trainer_processes=2", *lora_args, "--fault_kill=1:2:update",
                "--max_restarts=1")
  assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
  assert "Attempt 0: process 1 exited with code -9" in out.stdout
  got = _latest(exp, tmp_path / "two")
  assert max(float(np.max(np.abs(ab["b"]))) for ab in lora.adapters_of(ref).values()) > 1e-4   # B starts at 0
  want = _flat(lora.adapters_of(ref))
  have = _flat(lora.adapters_of(got))
  assert set(have) == set(want)
  for k in want:
    np.testing.assert_allclose(have[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert [r["step"] for r in _rows(tmp_path / "two")] == [1, 2, 3]


def test_fault_kill_flag_is_checked_before_the_runtime_is_joined(tmp_path):
  cmd = [sys.executable, "-m", "experiments.launch.cluster", f"--config={SMOKE}", f"--workdir={tmp_path}",
         "--process_id=0", "--coordinator_address=localhost:1", "--fault_kill=0:2:later"]
  out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "expected 'PROCESS:STEP' or 'PROCESS:STEP:update'" in out.stderr + out.stdout
