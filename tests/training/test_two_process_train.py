"""One RL step of `loop.train` across two JAX processes (jax.distributed on CPU, one device each)."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _env() -> dict:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).strip(os.pathsep)
  return env


@pytest.mark.slow
def test_two_processes_train_one_step_like_one_process(tmp_path, monkeypatch):
  """Two processes on a (2, 1, 1) data-parallel mesh finish loop.train's step with the one-process params."""
  cache = tmp_path / "cache"
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(cache))
  cd = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
  cd.rl.entropy_coef = 0.01  # as in the worker: a gradient even when every sample scores 0
  exp = config_lib.from_config_dict(cd)
  # The dataset and warm start are built once here; both processes then read the same cache.
  ref = loop.train(exp, tmp_path / "one", progress=False)

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  out = tmp_path / "params.npz"
  worker = str(HERE / "two_process_train_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), port, str(tmp_path / "two"), str(cache), str(out)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  for p, text in zip(procs, outs):
    assert p.returncode == 0, text[-4000:]
    final_step, pass1 = [ln for ln in text.splitlines() if ln.startswith("OK ")][-1].split()[1:]
    assert int(final_step) == exp.rl.steps == 1
  got = np.load(out)
  flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(ref["params"])[0]}
  assert set(got.files) == set(flat)
  # Same rollouts (the pipeline is deterministic in the step's key), gradients averaged over the two
  # processes' rows: the one-process update up to float rounding.
  for k, v in flat.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
  # The update moved the params (so the comparison is not between two copies of the warm start).
  start = loop.load_policy(exp, loop.load_task(exp)[0])[1]
  moved = max(float(np.max(np.abs(np.asarray(x) - flat[jax.tree_util.keystr(p)])))
              for p, x in jax.tree_util.tree_flatten_with_path(start)[0])
  assert moved > 1e-6
  # One process wrote the logs and the summary; both wrote one checkpoint.
  assert (tmp_path / "two" / "summary.json").exists()
  assert len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 3  # before, step 1, after
  assert float(pass1) == pytest.approx(ref["after"]["eval/pass@1"])
