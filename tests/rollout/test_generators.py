"""GENERATE's registry: names and settings checked with their config keys, each generator's property,
and a generator defined here, in the test, training through the real loop with no library edit."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import data, models, rollout, sampling
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop
from rollouts_jax.io.metrics import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[2]
TOK = data.CharTokenizer.default()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, eos_token_ids=(TOK.eos_id,), pad_token_id=TOK.pad_id)
PARAMS = models.init_params(CFG, jax.random.key(0))
CONF = sampling.SamplingConfig(num_samples=4, max_new_tokens=12, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
CTX = rollout.GeneratorContext(cfg=CFG, sampling=CONF, num_prompts=6)


def _prompts(index):
  ids, mask = data.pad_left([TOK.encode(f"{i}+{i}=") for i in index], (8,), pad_id=TOK.pad_id)
  return rollout.Prompts(ids=np.asarray(ids, np.int32), mask=np.asarray(mask, bool), index=np.asarray(index, np.int32))


def _exp(**rollout_section):
  return config_lib.from_config_dict({"data": {"task": "arithmetic", "difficulty": 2},
                                      "rollout": {"num_samples": 4, "max_new_tokens": 8, **rollout_section},
                                      "control": {"prompts_per_step": 4}, "reward": {"num_workers": 0}})


# ------------------------------------------------------------------------------------ registry

def test_names_and_settings_are_checked_with_their_config_keys():
  assert rollout.names()[0] == "sample" and {"spec_rl", "tree"} <= set(rollout.names())
  with pytest.raises(ValueError, match=r"rollout\.generator.*'beam'.*sample, adwin, april, arrol, esr, multiturn, self_spec, sol_rl, spec_rl, tree"):
    _exp(generator="beam")
  with pytest.raises(ValueError, match=r"rollout\.generator.*'beam'"):
    rollout.build("beam", CTX)
  # A setting the generator does not take: at validation (before any warm start) and at build.
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'spec_rl'.*'lenient'.*lenience"):
    _exp(generator="spec_rl", generator_kwargs="lenient=2.0")
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'sample'.*'temperature'"):
    rollout.build("sample", CTX, temperature=0.5)
  # A bad value: the factory's own check, when built (before anything compiles).
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'spec_rl'.*'lenience'.*> 0"):
    rollout.build("spec_rl", CTX, lenience=-1.0)
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'tree'.*branch_tokens"):
    rollout.build("tree", CTX, branch_tokens="widest")
  assert _exp(generator="spec_rl", generator_kwargs="lenience=1.0").rollout.generator == "spec_rl"
  with pytest.raises(ValueError, match="already registered"):
    rollout.register("sample", lambda ctx: None)
  # A replaced key says what replaced it.
  with pytest.raises(ValueError, match=r"rollout\.speculative is now rollout\.generator='spec_rl'"):
    _exp(speculative="spec_rl")
  with pytest.raises(ValueError, match=r"rollout\.fp4 is now rollout\.generator='sol_rl'"):
    _exp(fp4="nvfp4")
  with pytest.raises(ValueError, match=r"rollout.distill='esr' is now rollout.distill='opd' with rollout.generator='esr'"):
    _exp(distill="esr", teacher_sft_steps=5)


# -------------------------------------------------------------------------------- generators

def test_april_chooses_its_groups_and_stores_the_rest():
  """APRIL alone: it asks for requests - stored fresh prompts, returns B finished groups and keeps the
  others (finished or not) in its state, so every group started is returned once or still stored."""
  ctx = dataclasses.replace(CTX, batch_size=2, prompt_len=8)
  gen = rollout.build("april", ctx, over_provision=1.0)
  state, seen, started = gen.init(), [], 0
  assert gen.wants(state) == 4   # ceil(2 * (1 + 1.0)), nothing stored yet
  for step in range(3):
    fresh = list(range(started, started + gen.wants(state)))
    started += len(fresh)
    batch, state, stats = gen.generate(state, PARAMS, _prompts([i % 6 for i in fresh]), jax.random.key(step),
                                       version=step)
    assert batch.prompt_ids.shape[0] == 2 and stats["rollouts"] == 4 * len(fresh)
    assert np.asarray(sampling.finished_rows(batch.completion_ids, batch.completion_mask, CONF)).all()
    seen += [int(i) for i in np.asarray(batch.prompt_index)]
    stored = int(np.asarray(state.valid).sum())
    assert stats["april/stored_groups"] == stored and gen.wants(state) == 4 - stored
  assert started == len(seen) + int(np.asarray(state.valid).sum())
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'april'.*'over_provision'.*> 0"):
    rollout.build("april", ctx, over_provision=0)


def test_sample_generator_is_sampling_sample_on_the_same_key():
  gen = rollout.build("sample", CTX)
  prompts = _prompts([0, 3, 5])
  batch, state, stats = gen.generate(gen.init(), PARAMS, prompts, jax.random.key(7), version=3)
  out = sampling.sample(CFG, PARAMS, prompts.ids, prompts.mask, jax.random.key(7), CONF)
  np.testing.assert_array_equal(batch.completion_ids, out.completion_ids)
  np.testing.assert_array_equal(batch.completion_mask, out.completion_mask)
  np.testing.assert_array_equal(batch.behaviour_logprobs, out.logprobs)
  assert (batch.policy_version == 3).all() and batch.prompt_index.tolist() == [0, 3, 5]
  assert stats["generated_tokens"] == np.asarray(out.lengths).sum() and state is None
  assert gen.update(state, batch, version=3) is None


def test_spec_rl_second_visit_accepts_its_drafts_and_decodes_less():
  gen = rollout.build("spec_rl", CTX)
  prompts = _prompts([1, 4])
  state = gen.init()
  first, state, s1 = gen.generate(state, PARAMS, prompts, jax.random.key(0), version=0)
  assert "spec/draft_tokens" not in s1 and s1["generated_tokens"] == np.asarray(first.lengths).sum() > 0
  state = gen.update(state, first.replace(rewards=np.ones((2, 4), np.float32)), version=0)
  assert np.asarray(state.valid).tolist() == [False, True, False, False, True, False]
  # Unchanged params: the drafts are (nearly) all accepted and far fewer tokens are decoded.
  second, _, s2 = gen.generate(state, PARAMS, prompts, jax.random.key(1), version=1)
  assert s2["spec/draft_tokens"] == np.asarray(first.lengths).sum()
  assert s2["spec/accepted_tokens"] >= 0.9 * s2["spec/draft_tokens"]
  assert s2["generated_tokens"] < 0.5 * s1["generated_tokens"]
  assert (second.policy_version == 1).all()
  # A prompt never seen before is sampled afresh.
  _, _, s3 = gen.generate(state, PARAMS, _prompts([2, 3]), jax.random.key(2), version=1)
  assert "spec/draft_tokens" not in s3


def test_self_spec_generator_is_efficient_rollout_with_its_acceptance_ema_as_state():
  """EfficientRollout (`rollout.generator=self_spec`): the FP4 drafter's rounds, the EMA carried
  from step to step; with speculation switched off it is plain sampling on the same key."""
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'self_spec'.*'fmt'.*nvfp4, mxfp4"):
    rollout.build("self_spec", CTX, fmt="int4")
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'self_spec'.*'gamma_max'"):
    rollout.build("self_spec", CTX, gamma_max=0)
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'self_spec'.*'draft'"):
    _exp(generator="self_spec", generator_kwargs="draft=2")
  prompts = _prompts([0, 3, 5])
  gen = rollout.build("self_spec", CTX, fmt="mxfp4", gamma_max=3)
  state = gen.init()
  assert float(state) == pytest.approx(0.7)
  batch, state2, stats = gen.generate(state, PARAMS, prompts, jax.random.key(7), version=2)
  assert batch.completion_ids.shape[:2] == (3, 4) and (batch.policy_version == 2).all()
  assert stats["spec/speculated"] == 1.0 and stats["spec/draft_tokens"] > 0
  assert 0 <= stats["spec/accepted_tokens"] <= stats["spec/tested_tokens"] <= stats["spec/draft_tokens"]
  assert float(state2) == pytest.approx(stats["spec/acceptance_ema"]) and float(state2) != pytest.approx(0.7)
  assert stats["generated_tokens"] == np.asarray(batch.lengths).sum()
  # Behaviour log-probs are the full-precision policy's, as the trainer computes them.
  lp, _ = models.token_logprobs(CFG, PARAMS, *_teacher_forced(batch), temperature=CONF.temperature)
  np.testing.assert_allclose(np.asarray(batch.behaviour_logprobs)[np.asarray(batch.completion_mask)],
                             np.asarray(lp).reshape(batch.completion_ids.shape)[np.asarray(batch.completion_mask)],
                             atol=2e-5)
  plain = rollout.build("self_spec", CTX, max_spec_rows=0)   # never speculates: plain sampling
  pb, _, pstats = plain.generate(plain.init(), PARAMS, prompts, jax.random.key(7), version=2)
  sb, _, _ = rollout.build("sample", CTX).generate(None, PARAMS, prompts, jax.random.key(7), version=2)
  assert pstats["spec/speculated"] == 0.0
  np.testing.assert_array_equal(pb.completion_ids, sb.completion_ids)
  np.testing.assert_array_equal(pb.behaviour_logprobs, sb.behaviour_logprobs)


def _teacher_forced(batch):
  """(tokens [R, P+T], mask [R, P+T], P) of a batch's rows, for `models.token_logprobs`."""
  B, N, T = batch.completion_ids.shape
  P = batch.prompt_ids.shape[1]
  prompt = np.repeat(np.asarray(batch.prompt_ids), N, axis=0)
  pmask = np.repeat(np.asarray(batch.prompt_mask), N, axis=0)
  tokens = np.concatenate([prompt, np.asarray(batch.completion_ids).reshape(B * N, T)], axis=1)
  mask = np.concatenate([pmask, np.asarray(batch.completion_mask).reshape(B * N, T)], axis=1)
  return tokens, mask, P


def test_tree_generator_samples_the_leaves_of_tree_sample():
  kw = dict(init_rows=1, entropy_min=0.3, min_depth=1, min_gap=2, width_h_low=0.1, width_h_high=1.0, width_beta=0.0,
            branch_tokens="sample", prune=False, delta_entropy_min=-10.0)
  gen = rollout.build("tree", CTX, **kw)
  prompts = _prompts([0, 1])
  batch, _, stats = gen.generate(gen.init(), PARAMS, prompts, jax.random.key(3), version=0)
  out, info = sampling.tree_sample(CFG, PARAMS, prompts.ids, prompts.mask, jax.random.key(3), CONF,
                                   sampling.TreeConfig(**kw))
  np.testing.assert_array_equal(batch.completion_ids, out.completion_ids)
  np.testing.assert_array_equal(batch.sample_mask, info.leaf_mask)
  assert stats["tree/leaves"] == np.asarray(info.leaf_mask).sum() and batch.confidence.shape == (2, 4)


# ------------------------------------------------------- a new generator, with no library edit

SEEN = []


def greedy_marked(ctx, *, marker: float = 1.0):
  """A toy generator: greedy completions (one per group, repeated N times), counting its updates."""
  if marker <= 0:
    raise rollout.setting_error("greedy_marked", "marker", f"must be > 0, got {marker}")
  gen = rollout.build("sample", rollout.GeneratorContext(ctx.cfg, ctx.sampling.replace(greedy=True),
                                                         ctx.num_prompts, ctx.seed))

  def init():
    return np.zeros((), np.int32)   # scored batches seen

  def generate(state, params, prompts, key, *, version):
    batch, _, stats = gen.generate(None, params, prompts, key, version=version)
    return batch, state, dict(stats, **{"toy/marker": marker})

  def update(state, batch, *, version, **extra):
    SEEN.append((version, np.asarray(batch.rewards).shape, np.asarray(batch.completion_ids)))
    return state + 1

  return rollout.Generator(init, generate, update)


def test_a_generator_registered_in_a_test_trains_through_the_loop(tmp_path, monkeypatch):
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  rollout.register("greedy_marked", greedy_marked, overwrite=True)
  try:
    cd = config_lib.load_config_file(REPO / "configs" / "default.py", "smoke")
    cd.rollout.generator = "greedy_marked"
    cd.rollout.generator_kwargs = "marker=2.5"
    exp = config_lib.from_config_dict(cd)
    SEEN.clear()
    summary = loop.train(exp, tmp_path / "run", progress=False)
  finally:
    rollout.generators.REGISTRY.pop("greedy_marked")
  assert summary["final_step"] == 1
  rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
  assert len(rows) == 1 and rows[0]["toy/marker"] == 2.5 and rows[0]["generated_tokens"] > 0
  # Its update saw the step's scored groups (version 0), all N samples of each greedy and alike.
  (version, shape, ids), = SEEN
  B, N = exp.control.prompts_per_step, exp.rollout.num_samples
  assert version == 0 and shape == (B, N) and (ids == ids[:, :1]).all()


def test_sol_rl_generator_pools_fp4_samples_and_finishes_with_a_subset_in_full_precision():
  """Sol-RL (`rollout.generator=sol_rl`): a pool of M FP4 samples per prompt; once scored, `finish`
  keeps N (the best and worst halves) and sets old_logprobs to the full-precision policy's."""
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'sol_rl'.*'pool'.*>= rollout.num_samples=4"):
    rollout.build("sol_rl", CTX, pool=3)
  with pytest.raises(ValueError, match=r"rollout\.generator_kwargs.*'sol_rl'.*'subset'"):
    _exp(generator="sol_rl", generator_kwargs="subset=best")
  gen = rollout.build("sol_rl", CTX, fmt="nvfp4", pool=8)
  assert gen.fields == ("old_logprobs",)
  prompts = _prompts([0, 3, 5])
  pool, state, stats = gen.generate(gen.init(), PARAMS, prompts, jax.random.key(7), version=1)
  assert pool.completion_ids.shape[:2] == (3, 8) and stats["rollouts"] == 24
  assert stats["generated_tokens"] == np.asarray(pool.lengths).sum()
  r = np.tile(np.arange(8, dtype=np.float32), (3, 1))   # sample j of every prompt scores j
  kept, state, fstats = gen.finish(state, PARAMS, pool.replace(rewards=r), jax.random.key(7), version=1)
  assert kept.completion_ids.shape[:2] == (3, 4)
  assert sorted(np.asarray(kept.rewards)[0].tolist()) == [0.0, 1.0, 6.0, 7.0]   # worst two and best two
  lp, _ = models.token_logprobs(CFG, PARAMS, *_teacher_forced(kept), temperature=CONF.temperature)
  m = np.asarray(kept.completion_mask)
  np.testing.assert_allclose(np.asarray(kept.old_logprobs)[m], np.asarray(lp).reshape(m.shape)[m], atol=2e-5)
  gap = np.abs(np.asarray(kept.old_logprobs) - np.asarray(kept.behaviour_logprobs))[m].mean()
  assert float(fstats["sol/fp4_logprob_gap"]) == pytest.approx(gap, rel=1e-4) and gap > 0   # FP4 sampled them
  assert float(fstats["sol/pool_reward_mean"]) == pytest.approx(3.5)
  assert isinstance(fstats["sol/pool_reward_mean"], rollout.Mean)


def test_tree_generator_finishes_with_treerl_node_advantages():
  from rollouts_jax import advantages
  gen = rollout.build("tree", dataclasses.replace(CTX, batch_size=2), max_width=4, entropy_min=0.0, min_depth=1)
  assert gen.init().shape == (2, 4, 4) and gen.fields == ("token_advantages",)
  prompts = _prompts([1, 2])
  batch, state, _ = gen.generate(gen.init(), PARAMS, prompts, jax.random.key(3), version=0)
  r = np.asarray(batch.sample_mask, np.float32) * np.array([[1, 0, 1, 0]], np.float32)
  done, _, _ = gen.finish(state, PARAMS, batch.replace(rewards=r), jax.random.key(3), version=0)
  want = advantages.tree_node_advantages(jnp.asarray(r), state, jnp.asarray(batch.sample_mask),
                                         jnp.asarray(batch.completion_mask))
  np.testing.assert_array_equal(np.asarray(done.token_advantages), np.asarray(want, np.float32))


def test_a_workdir_of_the_flag_era_resumes_under_the_generator_keys(tmp_path):
  """A config.json written when Sol-RL, ARRoL and ESR / ADWIN were flags (`rollout.fp4`, `control.prune`,
  `rollout.distill="adwin"`) is the same experiment as today's generator config: the run resumes."""
  import dataclasses as dc
  from rollouts_jax.training import workdir as workdir_lib
  for legacy, today in [
      ({"rollout": {"fp4": "nvfp4", "fp4_pool_size": 8}, "control": {"subset": "contrastive"}},
       {"generator": "sol_rl", "generator_kwargs": "fmt=nvfp4,pool=8,subset=contrastive"}),
      ({"control": {"prune": "arrol", "prune_oversample": 1.0, "prune_at": 4, "prune_target": 0.5,
                    "prune_min_examples": 64}},
       {"generator": "arrol", "generator_kwargs": "oversample=1.0,at=4,target=0.5,min_examples=64"}),
      ({"rollout": {"distill": "adwin_full", "distill_window": 4, "adwin_every": 5, "adwin_gamma": 0.25,
                    "adwin_tau": 0.9, "teacher_sft_steps": 5}},
       {"distill": "opd_full", "generator": "adwin", "generator_kwargs": "window=4,every=5,gamma=0.25,tau=0.9",
        "teacher_sft_steps": 5}),
  ]:
    exp = _exp(**today)
    old = dc.asdict(exp)
    old["rollout"].update({"fp4": "", "fp4_pool_size": 0, "distill_window": 16, "adwin_every": 5, "adwin_gamma": 0.25,
                           "adwin_tau": 0.9, "distill": "", "generator": "sample", "generator_kwargs": ""})
    old["control"].update({"subset": "contrastive", "prune": "", "prune_oversample": 0.5, "prune_at": 8,
                           "prune_target": 0.5, "prune_min_examples": 64})
    old["rollout"]["teacher_sft_steps"] = exp.rollout.teacher_sft_steps
    for section, values in legacy.items():
      old[section].update(values)
    folder = tmp_path / today["generator"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(old, default=str))
    got = workdir_lib.check_workdir_config(folder, dc.asdict(exp), write=False)
    assert got["status"] == "same", (today, got)
    assert config_lib.from_config_dict(config_lib.upgrade(old)) == exp
