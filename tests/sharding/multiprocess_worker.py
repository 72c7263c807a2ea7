"""One process of a two-process CPU run (4 host devices each): see test_sharding.py.

Usage: python multiprocess_worker.py PROCESS_ID PORT CHECKPOINT_DIR
Prints "OK <max forward diff> <max restore diff>" on success.
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rollouts_jax import models  # noqa: E402
from rollouts_jax import sharding as sh  # noqa: E402


def main():
  pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  jax.config.update("jax_default_matmul_precision", "highest")
  assert sh.initialize_distributed(f"localhost:{port}", 2, pid)
  assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
  cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2)
  mesh, rules = sh.make_mesh((2, 2, 2)), sh.get_rules("fsdp_tp")
  params = sh.sharded_init(cfg, jax.random.key(0), mesh, rules)

  rng = np.random.default_rng(0)  # the same global batch on both processes
  tokens = rng.integers(0, cfg.vocab_size, (8, 10)).astype(np.int32)
  rows = sh.process_batch_slice(8)
  assert rows == slice(4 * pid, 4 * pid + 4)
  local = sh.shard_batch(tokens[rows], mesh)  # each process feeds only its rows
  assert local.shape == (8, 10)
  logits = multihost_utils.process_allgather(models.forward(cfg, params, local), tiled=True)

  # Reference: the whole model and batch on this process's first device.
  ref_params = jax.device_put(models.init_params(cfg, jax.random.key(0)), jax.local_devices()[0])
  ref = np.asarray(models.forward(cfg, ref_params, tokens))
  fwd_diff = float(np.max(np.abs(logits - ref)))

  sh.save_sharded(ckpt, params)
  other = sh.abstract_params(cfg, sh.make_mesh((1, 8, 1)), sh.get_rules("fsdp"))
  restored = sh.restore_sharded(ckpt, other)
  assert restored["layers"]["q"].sharding == other["layers"]["q"].sharding
  gathered = multihost_utils.process_allgather(restored, tiled=True)
  restore_diff = max(float(np.max(np.abs(a - np.asarray(b))))
                     for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(ref_params)))
  print(f"OK {fwd_diff:.3e} {restore_diff:.3e}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
