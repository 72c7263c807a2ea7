"""LoRA in the loop: rollouts use base + adapters, checkpoints hold the adapters, resume is bitwise, export merges."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from rollouts_jax.io.checkpoint import Checkpointer
from rollouts_jax.models import lora
from rollouts_jax.rollout import source as source_lib
from rollouts_jax.training import loop
from rollouts_jax.training import config as config_lib
from rollouts_jax.training.rl_step import batch_logprobs

REPO = pathlib.Path(__file__).resolve().parents[2]


def _lora_smoke(**overrides):
  """configs/lora.py:smoke with overrides like `rl__steps=3`; a large step so one update shows."""
  cd = config_lib.load_config_file(REPO / "configs" / "lora.py", "smoke")
  cd.rl.learning_rate, cd.rl.warmup_steps = 1e-2, 0
  for k, v in overrides.items():
    section, key = k.split("__")
    setattr(getattr(cd, section), key, v)
  return config_lib.from_config_dict(cd)


def _record_batches(monkeypatch):
  batches = []
  orig = source_lib.BatchSource.next

  def next_(self, step, *args, **kwargs):
    out = orig(self, step, *args, **kwargs)
    batches.append((step, jax.device_get(out[0]), out[3]))
    return out

  monkeypatch.setattr(source_lib.BatchSource, "next", next_)
  return batches


def _logprobs(cfg, params, batch, temperature):
  return np.asarray(batch_logprobs(params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, cfg=cfg, temperature=temperature))


@pytest.mark.parametrize("staleness", [0, 1])
def test_adapters_reach_the_rollouts(staleness, cache, tmp_path, monkeypatch):
  """The batch sampled after one update has the log-probs of merge(base, adapters after it), not the base's.

  With `async_rl.max_staleness=1` (a producer thread, the recompute route) the batch of step 2 is
  sampled by the policy after one update too.
  """
  over = dict(rl__steps=2 + staleness, rl__kl_coef=0.05, checkpoint__keep=5)
  if staleness:
    over.update(async_rl__max_staleness=1, rl__tis_cap=2.0)
  exp = _lora_smoke(**over)
  batches = _record_batches(monkeypatch)
  summary = loop.train(exp, tmp_path / "run", progress=False, threaded=bool(staleness))
  step, batch, version = [b for b in batches if b[0] == 1 + staleness][0]
  assert version == 1   # sampled by the policy after one update
  with Checkpointer(tmp_path / "run" / "checkpoints", save_every=1, keep=5) as ckpt:
    tree, _, _ = ckpt.read(step=1)
  adapters = tree["train"]["params"]
  assert set(adapters) == set(lora.PROJECTIONS)   # the checkpoint holds the adapters, no base
  cfg, base, _ = loop.load_policy(exp, loop.load_task(exp)[0])
  assert float(np.max(np.abs(np.asarray(adapters["q"]["b"])))) > 0   # the update moved them
  # The run's final policy kept the base as it was loaded.
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(lora.base_of(summary["params"])),
                         jax.device_get(base))
  t = exp.rollout.temperature
  m = np.asarray(batch.completion_mask)
  sampler = np.asarray(batch.behaviour_logprobs)
  merged = _logprobs(cfg, lora.merge(base, adapters, exp.lora.alpha, exp.lora.rank), batch, t)
  from_base = _logprobs(cfg, base, batch, t)
  gap_merged = np.abs(sampler - merged)[m].max()
  gap_base = np.abs(sampler - from_base)[m].max()
  assert gap_merged < 1e-4, gap_merged
  assert gap_base > 100 * max(gap_merged, 1e-6), (gap_base, gap_merged)


# The snapshot variant (async_rl old log-probs from a stored copy) runs with -m slow; sync covers the adapters' resume.
@pytest.mark.parametrize("mode", ["sync", pytest.param("snapshot", marks=pytest.mark.slow)])
def test_a_resumed_lora_run_ends_with_the_same_adapters(mode, cache, tmp_path):
  """Stopped after 2 of 3 steps and resumed: the adapters and base of an uninterrupted run, bitwise.

  "snapshot": an async run (staleness 1) whose checkpoint also holds the in-flight versions' policies.
  """
  over = dict(async_rl__max_staleness=1, async_rl__old_logprobs="snapshot", rl__tis_cap=2.0) if mode != "sync" else {}
  exp = _lora_smoke(rl__steps=3, rl__entropy_coef=0.01, **over)   # a gradient though every reward is 0
  threaded = mode != "sync"
  full = loop.train(exp, tmp_path / "full", progress=False, threaded=threaded)
  stopped = loop.train(dataclasses.replace(exp, stop_after_step=2), tmp_path / "killed", progress=False,
                       threaded=threaded)
  assert stopped["stopped_at"] == 2
  resumed = loop.train(exp, tmp_path / "killed", progress=False, threaded=threaded)
  assert lora.is_lora(resumed["params"])
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(lora.adapters_of(full["params"])),
                         jax.device_get(lora.adapters_of(resumed["params"])))
  assert float(np.max(np.abs(np.asarray(lora.adapters_of(full["params"])["q"]["b"])))) > 0   # B starts at zero
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(lora.base_of(full["params"])),
                         jax.device_get(lora.base_of(resumed["params"])))
  with Checkpointer(tmp_path / "killed" / "checkpoints", save_every=1, keep=5) as ckpt:
    tree, _, _ = ckpt.read()
  # Adapters and their optimizer state only: nothing of the base's size (the embedding) was written.
  assert "embed" not in str(jax.tree_util.tree_structure(tree))
  sizes = [np.size(x) for x in jax.tree_util.tree_leaves(tree["train"])]
  adapters = sum(np.size(x) for x in jax.tree_util.tree_leaves(lora.adapters_of(full["params"])))
  assert sum(sizes) <= 3 * adapters + 8


def test_export_writes_the_merged_policy_and_the_adapters_alone(cache, tmp_path):
  from rollouts_jax import models
  exp = _lora_smoke(rl__steps=1)
  summary = loop.train(exp, tmp_path / "run", progress=False)
  out = tmp_path / "hf"
  env = dict(os.environ, JAX_PLATFORMS="cpu", ROLLOUTS_JAX_CACHE=str(cache))
  proc = subprocess.run([sys.executable, "-m", "experiments.launch.evaluate", f"--workdir={tmp_path / 'run'}",
                         f"--export_hf={out}"], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  cfg, params = models.load_hf_checkpoint(out)
  policy = jax.device_get(summary["params"])
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), params,
                         jax.device_get(lora.merged(policy)))
  adapters, rank, alpha = lora.load_adapters(out / "lora_adapter")
  assert (rank, alpha) == (exp.lora.rank, exp.lora.alpha)
  jax.tree_util.tree_map(np.testing.assert_array_equal, adapters, lora.adapters_of(policy))
  # The adapters alone over the base give the exported model back.
  base = lora.base_of(policy)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), params,
                         jax.device_get(lora.merge(base, adapters, alpha, rank)))


@pytest.mark.parametrize("override, message", [
    (dict(lora__targets="q,qkv_proj"), "lora.targets: unknown projection 'qkv_proj'; the model's projections: q, k"),
    (dict(lora__targets=" , "), "lora.targets names no projection"),
    (dict(lora__rank=-1), "lora.rank must be >= 0"),
    (dict(lora__alpha=0.0), "lora.alpha must be > 0"),
    (dict(lora__rank=64), "lora.rank=64 exceeds the model's smallest projection side"),
])
def test_lora_settings_are_checked_before_anything_builds(override, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    _lora_smoke(**override)


def test_every_policy_in_the_state_is_checkpointed_as_its_adapters():
  """The train state's params and the async snapshots / moving average: adapters on disk, base + them back."""
  import jax.numpy as jnp
  from rollouts_jax import models
  from rollouts_jax.training.rl_step import init_train_state, rl_optimizer
  cfg = models.ModelConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1)
  base = models.init_params(cfg, jax.random.key(0))
  exp = config_lib.ExperimentConfig(lora=config_lib.LoraConfig(rank=2, alpha=4.0, targets="q,down"))
  policy = loop.with_adapters(exp, cfg, base)
  state = {"train": init_train_state(policy, rl_optimizer(exp.rl)), "pipeline": {"n": jnp.zeros(3)},
           "async": {"snapshots": [policy, policy], "ewma": {"params": policy, "total": jnp.ones(())}}}
  disk = loop.state_on_disk(state)
  assert set(disk["train"].params) == {"q", "down"} and set(disk["async"]["ewma"]["params"]) == {"q", "down"}
  assert "embed" not in str(jax.tree_util.tree_structure(disk))
  trained = jax.tree_util.tree_map(lambda x: x + 1.0, disk)   # as if restored after some updates
  back = loop.state_from_disk(trained, state)
  for p in (back["train"].params, back["async"]["snapshots"][1], back["async"]["ewma"]["params"]):
    jax.tree_util.tree_map(np.testing.assert_array_equal, lora.base_of(p), base)
    np.testing.assert_array_equal(lora.adapters_of(p)["q"]["b"], 1.0)
  no_lora = {"train": init_train_state(base, rl_optimizer(exp.rl))}
  back = loop.state_from_disk(loop.state_on_disk(no_lora), no_lora)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, no_lora)
