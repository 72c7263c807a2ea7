"""One process of a two-process CPU run of `loop.train` (see test_two_process_train.py).

Usage: python two_process_train_worker.py PROCESS_ID PORT WORKDIR CACHE_DIR OUT_NPZ
Trains the default config's smoke variant (plus an entropy bonus) for one RL step on a (2, 1, 1) mesh (one CPU device
per process, data parallel over the two processes); process 0 writes the final params to OUT_NPZ.
"""
import os
import pathlib
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def main():
  pid, port, workdir, cache, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
  os.environ["ROLLOUTS_JAX_CACHE"] = cache
  jax.config.update("jax_default_matmul_precision", "highest")
  from rollouts_jax import sharding  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top
  assert sharding.initialize_distributed(f"localhost:{port}", 2, pid)
  assert jax.process_count() == 2 and jax.device_count() == 2
  cd = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
  cd.rl.entropy_coef = 0.01  # a gradient even when every sample of the tiny warm start scores 0
  cd.mesh.shape = (2, 1, 1)
  exp = config_lib.from_config_dict(cd)
  summary = loop.train(exp, workdir, progress=False)
  params = multihost_utils.process_allgather(summary["params"], tiled=True)
  if pid == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(out, **flat)
  print(f"OK {summary['final_step']} {summary['after']['eval/pass@1']:.6f}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
