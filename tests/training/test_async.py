"""Asynchronous rollouts: the staleness bound, the synchronous limit, resume, old log-probs, capacity."""

import dataclasses
import json
import pathlib
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import moved_from_warm_start
from rollouts_jax import models, sampling
from rollouts_jax.models import batch_logprobs
from rollouts_jax.rollout import source as source_lib
from rollouts_jax.rollout.source import ParamsHub, RolloutProducer, batch_version, capacity, ewma_update
from rollouts_jax.training import config as config_lib, loop

REPO = pathlib.Path(__file__).resolve().parents[2]


def _exp(steps=2, **overrides):
  c = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
  c.rl.steps = steps
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return config_lib.from_config_dict(c)


def _same(a, b):
  return jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
                                                       a, b))


def _rows(workdir):
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


# The smoke model's rewards are all zero; the entropy bonus gives every update a gradient, so comparing
# params compares updates (`moved_from_warm_start` checks it).
MOVES = {"rl.entropy_coef": 0.01}


# -- the producer and the bound -------------------------------------------------------------------

@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("slow", ["producer", "trainer", "both"])
def test_staleness_never_exceeds_the_bound(eta, slow):
  """A producer and a trainer with random delays: every batch is made by version max(0, s - eta)
  exactly, the producer is never more than eta batches ahead of the params it may use, and
  every step arrives once, in order."""
  rng = random.Random(eta * 10 + len(slow))
  steps = 12
  hub = ParamsHub(keep=eta)
  hub.publish(0, {"version": 0})
  trainer_version = [0]
  seen = []

  def collect(pstate, params, s, v):
    # What the producer holds must be the version it asked for, published already.
    assert params["version"] == v and v <= trainer_version[0]
    if slow in ("producer", "both"):
      time.sleep(rng.uniform(0, 0.02))
    return {"step": s}, pstate + 1, {"v": v}

  producer = RolloutProducer(collect, hub, 0, start=0, stop=steps, max_staleness=eta).start()
  try:
    for s in range(steps):
      item = producer.get(s)
      assert item.step == s and item.batch == {"step": s} and item.pipeline_state == s + 1
      assert s - item.version <= eta
      assert item.version == batch_version(s, eta)
      # At most eta + 1 batches wait, and none of them needs a version not yet published.
      assert producer.queued() <= eta + 1
      seen.append(item.version)
      if slow in ("trainer", "both"):
        time.sleep(rng.uniform(0, 0.02))
      trainer_version[0] = s + 1
      hub.publish(s + 1, {"version": s + 1})
  finally:
    producer.close()
  assert seen == [max(0, s - eta) for s in range(steps)]


def test_producer_errors_reach_the_trainer():
  hub = ParamsHub(keep=1)
  hub.publish(0, {})

  def collect(pstate, params, s, v):
    raise ValueError("broken grader")

  producer = RolloutProducer(collect, hub, None, start=0, stop=3, max_staleness=1).start()
  with pytest.raises(RuntimeError, match="broken grader"):
    producer.get(0)
  producer.close()


def test_hub_drops_old_versions_and_wakes_waiters():
  hub = ParamsHub(keep=1)
  got = []
  t = threading.Thread(target=lambda: got.append(hub.wait(2)))
  t.start()
  for v in range(4):
    hub.publish(v, v * 10)
  t.join(5)
  assert got == [20] and hub.versions() == [2, 3]
  with pytest.raises(KeyError):
    hub.get(1)
  hub.close()
  with pytest.raises(source_lib.HubClosed):
    hub.wait(9)


# -- the loop ------------------------------------------------------------------------------------

def test_threaded_loop_at_staleness_0_is_the_synchronous_loop_bitwise(tmp_path):
  sync = loop.train(_exp(**MOVES), tmp_path / "sync", progress=False)
  threaded = loop.train(_exp(**MOVES), tmp_path / "threaded", progress=False, threaded=True)
  assert _same(sync["params"], threaded["params"]) and moved_from_warm_start(_exp(**MOVES), sync["params"]) > 1e-6
  a, b = _rows(tmp_path / "sync"), _rows(tmp_path / "threaded")
  for key in ("reward_mean", "loss", "generated_tokens", "grad_norm"):
    assert [r.get(key) for r in a] == [r.get(key) for r in b], key


def test_async_run_resumes_to_the_uninterrupted_result(tmp_path):
  """Killed after step 2 of 4 at staleness 1: the resumed run ends with the same params and the
  same per-step rows as a run never stopped (the producer regenerates the batches that were in
  flight from the saved versions), and every step is logged once."""
  kw = {"async_rl.max_staleness": 1, "rl.tis_cap": 2.0, **MOVES}
  whole = loop.train(_exp(steps=4, **kw), tmp_path / "whole", progress=False)
  cut = loop.train(dataclasses.replace(_exp(steps=4, **kw), stop_after_step=2), tmp_path / "cut", progress=False)
  assert cut["stopped_at"] == 2
  resumed = loop.train(_exp(steps=4, **kw), tmp_path / "cut", progress=False)
  assert _same(whole["params"], resumed["params"]) and moved_from_warm_start(_exp(steps=4, **kw), whole["params"]) > 1e-6
  a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "cut")
  assert [r["step"] for r in a] == [r["step"] for r in b]
  for key in ("reward_mean", "loss", "async/batch_version", "async/staleness_max"):
    assert [r.get(key) for r in a] == [r.get(key) for r in b], key
  assert [r["async/batch_version"] for r in a if "loss" in r] == [0, 0, 1, 2]


# -- the old log-probs -----------------------------------------------------------------------------

def _tiny_model():
  cfg = models.ModelConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, eos_token_ids=(1,))
  return cfg, models.init_params(cfg, jax.random.key(0))


def test_snapshot_old_logprobs_are_the_generating_versions_and_ewma_the_average():
  """A batch sampled by version 0 and trained at step 2: "snapshot" scores it with version 0's
  params (equal to the sampler's own log-probs), "recompute" leaves it to the current params,
  "ewma" scores it with the moving average's params."""
  cfg, p0 = _tiny_model()
  p1 = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), p0)
  p2 = jax.tree_util.tree_map(lambda x: x - 0.3 * jax.random.normal(jax.random.key(2), x.shape), p0)
  ids = jnp.array([[2, 3, 4], [0, 5, 6]], jnp.int32)
  mask = jnp.array([[True, True, True], [False, True, True]])
  conf = sampling.SamplingConfig(num_samples=3, max_new_tokens=6, temperature=1.0, eos_id=1, pad_id=0)
  out = sampling.sample(cfg, p0, ids, mask, jax.random.key(3), conf)
  batch = sampling.from_samples(ids, mask, out, prompt_index=np.arange(2), policy_version=0)
  hub = ParamsHub(keep=2)
  for v, p in enumerate((p0, p1, p2)):
    hub.publish(v, p)
  m = np.asarray(batch.completion_mask)
  score = source_lib.scorer(cfg, temperature=1.0)
  snap = source_lib.old_logprobs("snapshot", score, batch, 2, p2, hub, None)
  np.testing.assert_allclose(snap[m], np.asarray(batch.behaviour_logprobs)[m], atol=2e-5)
  assert source_lib.old_logprobs("recompute", score, batch, 2, p2, hub, None) is None
  # A token of version 1 in the same row is scored by version 1.
  mixed = batch.replace(policy_version=np.where(np.arange(6) >= 2, 1, 0)[None, None].repeat(2, 0).repeat(3, 1))
  got = source_lib.old_logprobs("snapshot", score, mixed, 2, p2, hub, None)
  lp1 = np.asarray(batch_logprobs(p1, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                  batch.completion_mask, cfg=cfg))
  late = m & (np.asarray(mixed.policy_version) == 1)
  np.testing.assert_allclose(got[late], lp1[late], atol=1e-6)
  np.testing.assert_allclose(got[m & ~late], snap[m & ~late], atol=1e-6)
  # EWMA: the proximal policy is the average's.
  avg, total = ewma_update(p0, jnp.zeros(()), p1, 0.5)
  avg, total = ewma_update(avg, total, p2, 0.5)
  got = source_lib.old_logprobs("ewma", score, batch, 2, p2, hub, {"params": avg, "total": total})
  want = np.asarray(batch_logprobs(avg, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, cfg=cfg))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert not np.allclose(got[m], snap[m], atol=1e-3)


@pytest.mark.parametrize("beta", [0.3, 0.7, 0.9])
def test_ewma_is_the_normalized_geometric_average(beta):
  """After updates with params x_1..x_k: sum_i beta^(k-i) x_i / sum_i beta^(k-i) (no pull toward the start)."""
  xs = [np.float32(v) for v in (5.0, -1.0, 2.0, 7.0)]
  avg, total = {"w": jnp.zeros(())}, jnp.zeros(())
  for k, x in enumerate(xs, 1):
    avg, total = ewma_update(avg, total, {"w": jnp.asarray(x)}, beta)
    w = np.array([beta ** (k - i) for i in range(1, k + 1)])
    np.testing.assert_allclose(float(avg["w"]), (w * np.array(xs[:k])).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(total), w.sum(), rtol=1e-6)


# -- ECHO-2's capacity model -------------------------------------------------------------------------

@pytest.mark.parametrize("train_s,handoff_s,rate,B", [(2.0, 0.5, 32.0, 64), (0.3, 0.05, 100.0, 128),
                                                      (5.0, 0.0, 1000.0, 64)])
def test_capacity_rules(train_s, handoff_s, rate, B):
  gen = B / rate
  c = capacity(train_s, handoff_s, rate, B, staleness=1, producer_share=0.5)
  # The smallest S with T_diss + B/X <= S T_train.
  s = c.min_staleness
  assert handoff_s + gen <= s * train_s + 1e-9 and (s == 1 or handoff_s + gen > (s - 1) * train_s)
  # At the required throughput the learner is exactly busy at S = 1.
  assert handoff_s + B / c.required_rollouts_per_s == pytest.approx(train_s)
  assert c.learner_idle_s == pytest.approx(max(0.0, handoff_s + gen - train_s))
  assert capacity(train_s, handoff_s, rate, B, staleness=0).learner_idle_s == pytest.approx(handoff_s + gen)
  # At the balanced share, producing a batch (scaled throughput) takes one (scaled) update.
  f = c.balanced_producer_share
  assert 0 < f < 1
  assert handoff_s + gen * 0.5 / f == pytest.approx(train_s * 0.5 / (1 - f), rel=1e-6)


def test_capacity_when_no_throughput_suffices():
  c = capacity(train_s=1.0, handoff_s=2.0, rollouts_per_s=10.0, batch_rollouts=8, staleness=1)
  assert c.required_rollouts_per_s == float("inf") and c.min_staleness == 3


# -- configuration ---------------------------------------------------------------------------------

def test_async_section_is_reachable_and_checked():
  c = config_lib.base_config_dict()
  c["async_rl"].max_staleness = 2
  c["async_rl"].old_logprobs = "ewma"
  c.rl.tis_cap = 2.0
  exp = config_lib.from_config_dict(c)
  assert exp.async_rl.max_staleness == 2 and exp.async_rl.old_logprobs == "ewma"
  with pytest.raises(ValueError, match="async_rl.max_staleness"):
    config_lib.from_config_dict({"async_rl": {"max_staleness": -1}})
  with pytest.raises(ValueError, match="rl.tis_cap"):
    config_lib.from_config_dict({"async_rl": {"max_staleness": 1}})
  with pytest.raises(ValueError, match="async_rl.old_logprobs"):
    config_lib.from_config_dict({"async_rl": {"old_logprobs": "newest"}})
  with pytest.raises(ValueError, match="rollout.generator='april'"):
    config_lib.from_config_dict({"async_rl": {"max_staleness": 1, "old_logprobs": "snapshot"},
                                 "rollout": {"generator": "april"}})
  with pytest.raises(ValueError, match=r"async_rl\.stalenes"):
    config_lib.from_config_dict({"async_rl": {"stalenes": 1}})


def test_async_keys_from_the_command_line(monkeypatch):
  from absl import flags
  from ml_collections import config_flags
  argv = ["prog", f"--config={REPO / 'configs' / 'default.py'}", "--config.async_rl.max_staleness=2",
          "--config.async_rl.old_logprobs=snapshot", "--config.rl.tis_cap=2.0"]
  monkeypatch.setattr("sys.argv", argv)   # config_flags reads its overrides from sys.argv
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv)
  fv(argv)
  exp = config_lib.from_config_dict(fv.config)
  assert exp.async_rl.max_staleness == 2 and exp.async_rl.old_logprobs == "snapshot"


@pytest.mark.slow
def test_partial_rollouts_continue_under_newer_weights(tmp_path):
  """APRIL inside the async loop: rows cut at a batch boundary are resumed by the producer under
  the next version, so trained batches mix tokens of two versions (older prefix, newer rest)."""
  kw = {"async_rl.max_staleness": 1, "rl.tis_cap": 2.0, "rollout.generator": "april",
        "rollout.generator_kwargs": "over_provision=0.5", "rollout.max_new_tokens": 24}
  loop.train(_exp(steps=4, **kw), tmp_path / "april", progress=False)
  rows = [r for r in _rows(tmp_path / "april") if "loss" in r]
  assert sum(r["april/resumed_groups"] for r in rows) > 0
  late = [r for r in rows if r["async/batch_version"] >= 1]
  assert any(r["april/off_policy_token_frac"] > 0 for r in late)
  # New tokens respect the bound; only resumed prefixes are older.
  assert all(r["step"] - 1 - r["async/batch_version"] <= 1 for r in rows)
  assert max(r["async/staleness_max"] for r in rows) > 1
