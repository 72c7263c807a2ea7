"""Items 3 and 4 of issue 18: a workdir belongs to one config and one process.

3: rerunning a workdir with a config that changes results is refused before any work, the
   differing keys named and config.json left byte for byte; loop-only settings may change;
   the explicit override continues and keeps the old config.
4: a second process on a locked workdir is refused with the holder named; the lock of a
   process killed with SIGKILL is taken over.
Also the cross-process build helper used for TFDS datasets and warm starts.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollouts_jax.training import workdir as wd

REPO = pathlib.Path(__file__).resolve().parents[2]


BASE = {  # the shape of dataclasses.asdict(ExperimentConfig()): nested plain dicts
    "seed": 0, "stop_after_step": -1,
    "data": {"task": "arithmetic", "data_dir": "", "manual_dir": "", "num_train": 20000},
    "model": {"hidden_size": 128, "num_layers": 3, "remat": False},
    "sft": {"steps": 300, "cache_dir": "", "log_every": 50},
    "rl": {"steps": 350, "learning_rate": 0.00015, "micro_batch_size": 0, "logprob_chunk": 0, "kl_coef": 0.0},
    "reward": {"name": "arithmetic", "timeout_s": 5.0, "num_workers": 0},
    "eval": {"every": 0, "num_examples": 500, "k": 4, "batch_size": 100},
    "checkpoint": {"every": 10, "keep": 2},
    "mesh": {"shape": (1, 1, 1), "preset": "fsdp"},
}


def _exp(**changes):
  """A config as the loop sees it, with dotted changes."""
  d = json.loads(json.dumps(BASE))
  for key, value in changes.items():
    node = d
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    assert leaf in node, key
    node[leaf] = value
  return d


def test_result_changing_rerun_is_refused_before_any_work(tmp_path):
  first = _exp(**{"rl.learning_rate": 0.00015})
  assert wd.check_workdir_config(tmp_path, first)["status"] == "new"
  saved = (tmp_path / "config.json").read_bytes()
  cases = {
      "rl.learning_rate": (0.001, "rl.learning_rate: 0.00015 -> 0.001"),
      "data.task": ("countdown", 'data.task: "arithmetic" -> "countdown"'),
      "model.hidden_size": (512, "model.hidden_size: 128 -> 512"),
  }
  for key, (value, line) in cases.items():
    with pytest.raises(wd.ConfigMismatchError) as info:
      wd.check_workdir_config(tmp_path, {**_exp(**{"rl.learning_rate": 0.00015, key: value})})
    assert info.value.changes == [line]
    assert line in str(info.value) and str(tmp_path) in str(info.value)
    assert (tmp_path / "config.json").read_bytes() == saved  # a refused run writes nothing
  # Several differences are all named.
  with pytest.raises(wd.ConfigMismatchError) as info:
    wd.check_workdir_config(tmp_path, _exp(**{"rl.learning_rate": 0.001, "seed": 3}))
  assert info.value.changes == ["rl.learning_rate: 0.00015 -> 0.001", "seed: 0 -> 3"]


def test_loop_only_settings_may_change(tmp_path):
  wd.check_workdir_config(tmp_path, _exp())
  rerun = _exp(**{"eval.every": 7, "checkpoint.every": 3, "checkpoint.keep": 9, "stop_after_step": 4,
                  "reward.num_workers": 6, "reward.timeout_s": 30.0, "sft.log_every": 1,
                  "mesh.shape": [2, 1, 1], "rl.micro_batch_size": 4, "rl.logprob_chunk": 8})
  assert wd.config_fingerprint(rerun)[0] == wd.config_fingerprint(_exp())[0]
  result = wd.check_workdir_config(tmp_path, rerun)
  assert result["status"] == "same" and result["changes"] == []
  assert json.loads((tmp_path / "config.json").read_text())["eval"]["every"] == 7


def test_override_continues_and_keeps_the_old_config(tmp_path):
  wd.check_workdir_config(tmp_path, _exp(**{"rl.learning_rate": 0.00015}))
  old = (tmp_path / "config.json").read_text()
  result = wd.check_workdir_config(tmp_path, _exp(**{"rl.learning_rate": 0.001}), allow_change=True)
  assert result["status"] == "changed" and result["changes"] == ["rl.learning_rate: 0.00015 -> 0.001"]
  kept = list(tmp_path.glob("config.*.json"))
  assert len(kept) == 1 and kept[0].read_text() == old
  assert json.loads((tmp_path / "config.json").read_text())["rl"]["learning_rate"] == 0.001
  assert "0.00015 -> 0.001" in (tmp_path / "config_changes.jsonl").read_text()
  # The new config is now the workdir's: the same rerun passes, the old one is refused.
  assert wd.check_workdir_config(tmp_path, _exp(**{"rl.learning_rate": 0.001}))["status"] == "same"
  with pytest.raises(wd.ConfigMismatchError):
    wd.check_workdir_config(tmp_path, _exp(**{"rl.learning_rate": 0.00015}))


def test_a_key_missing_from_the_saved_config_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"rl": {"learning_rate": 0.1}}))
  with pytest.raises(wd.ConfigMismatchError) as info:
    wd.check_workdir_config(tmp_path, {"rl": {"learning_rate": 0.1, "kl_coef": 0.5}})
  assert info.value.changes == ["rl.kl_coef: <absent> -> 0.5"]
  (tmp_path / "config.json").write_text('{"rl": {"learn')  # torn by a crash of an old version
  with pytest.raises(wd.ConfigMismatchError, match="unreadable"):
    wd.check_workdir_config(tmp_path, {"rl": {"learning_rate": 0.1}})


_HOLDER = textwrap.dedent("""
    import sys, time
    from rollouts_jax.training import workdir
    lock = workdir.lock_workdir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
""")


def _start_holder(path):
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_process_on_a_workdir_is_refused_and_a_dead_holder_is_taken_over(tmp_path):
  holder = _start_holder(tmp_path)
  try:
    with pytest.raises(wd.WorkdirLockedError) as info:
      wd.lock_workdir(tmp_path)
    msg = str(info.value)
    assert f"process {holder.pid}" in msg and str(tmp_path) in msg
    # A waiting acquire gives up after its timeout, with the same message.
    t0 = time.monotonic()
    with pytest.raises(wd.WorkdirLockedError):
      wd.lock_workdir(tmp_path, timeout_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The kernel released the dead process's lock: the next run takes the workdir.
  with wd.lock_workdir(tmp_path) as lock:
    assert lock.held
    assert json.loads((tmp_path / wd.LOCK_FILE).read_text())["pid"] == os.getpid()
  with wd.lock_workdir(tmp_path):  # released on exit of the block
    pass


_BUILDER = textwrap.dedent("""
    import os, sys, time
    from rollouts_jax.io import filelock  # = rollouts_jax.training.workdir.atomic_build, without JAX
    def build(tmp):
      (tmp / "part1").write_text(str(os.getpid()))
      time.sleep(1.0)  # a slow build: the other process arrives meanwhile
      (tmp / "done").write_text("ok")
    built = filelock.atomic_build(sys.argv[1], build, done_file="done")
    print("built" if built else "reused", open(os.path.join(sys.argv[1], "part1")).read(), flush=True)
""")


def test_concurrent_builds_build_once_and_both_succeed(tmp_path):
  target = tmp_path / "cache" / "warmstart-abc"
  procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
           for _ in range(2)]
  outs = [p.communicate(timeout=60) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
  words = sorted(o.split()[0] for o, _ in outs)
  assert words == ["built", "reused"]
  assert len({o.split()[1] for o, _ in outs}) == 1  # both see the one complete build
  assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == ["warmstart-abc"]


def test_a_build_that_dies_leaves_nothing_half_done(tmp_path):
  target = tmp_path / "out"

  def broken(tmp):
    (tmp / "half").write_text("x")
    raise RuntimeError("disk full")

  with pytest.raises(RuntimeError, match="disk full"):
    wd.atomic_build(target, broken, done_file="done")
  assert not target.exists() and not list(tmp_path.glob(".out.tmp-*"))
  assert wd.atomic_build(target, lambda tmp: (tmp / "done").write_text("1"), done_file="done")


def test_train_py_refuses_before_any_work(tmp_path):
  """The launcher takes the lock and checks the config before loading data or compiling."""
  train = [sys.executable, "-m", "experiments.launch.train", f"--config={REPO / 'configs' / 'default.py'}:smoke",
           f"--workdir={tmp_path}", "--progress=false"]
  env = {**os.environ, "PYTHONPATH": str(REPO), "ROLLOUTS_JAX_CACHE": str(tmp_path / "cache")}
  saved = {"rl": {"learning_rate": 0.123}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  out = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Refused" in out.stderr and "rl.learning_rate: 0.123 ->" in out.stderr
  assert json.loads((tmp_path / "config.json").read_text()) == saved
  assert not (tmp_path / "cache").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_train_py_refuses_a_locked_workdir(tmp_path):
  train = [sys.executable, "-m", "experiments.launch.train", f"--config={REPO / 'configs' / 'default.py'}:smoke",
           f"--workdir={tmp_path}", "--progress=false", "--allow_config_change"]
  env = {**os.environ, "PYTHONPATH": str(REPO), "ROLLOUTS_JAX_CACHE": str(tmp_path / "cache")}
  saved = {"rl": {"learning_rate": 0.123}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  holder = _start_holder(tmp_path)
  try:
    out = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert out.returncode == 2 and f"in use by process {holder.pid}" in out.stderr, out.stderr[-3000:]
  assert json.loads((tmp_path / "config.json").read_text()) == saved
