"""The GFCR stage contracts (one property each) and the pipeline that composes them.

Stages are built from config names exactly as `loop.train` builds them, on a tiny random
policy (no warm start), so every test here runs the real sampler, grader and buffers.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax import advantages, control, data, models, replay, rewards, rollout, sampling, tasks
from rollouts_jax.rollout import extras as rollout_extras, filter as filter_lib, pipeline as pipeline_lib
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop

TOK = data.CharTokenizer.default()
EXAMPLES = data.generate_arithmetic(0, "train", 24, digits=2)


def _exp(**sections):
  base = {"data": {"task": "arithmetic", "difficulty": 2}, "rollout": {"num_samples": 4, "max_new_tokens": 8},
          "control": {"prompts_per_step": 4}, "reward": {"num_workers": 0}, "rl": {"steps": 2}}
  for k, v in sections.items():
    base.setdefault(k, {}).update(v)
  return config_lib.from_config_dict(base)


def _pipeline(exp, examples=EXAMPLES):
  cfg = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, eos_token_ids=(TOK.eos_id,), pad_token_id=TOK.pad_id)
  params = models.init_params(cfg, jax.random.key(0))
  return loop.build_pipeline(exp, cfg, TOK, examples), params


# ------------------------------------------------------------------------------ CONTROL: selector

def test_uniform_selector_covers_each_prompt_once_per_epoch_and_resumes():
  sel = control.uniform(10, num_samples=3, seed=5)
  state, seen = sel.init(), []
  for _ in range(5):  # 5 x 4 = 20 prompts = 2 epochs
    plan, state = sel.select(state, jax.random.key(0), 4)
    seen += np.asarray(plan.indices).tolist()
    assert np.asarray(plan.budget).tolist() == [3] * 4
  assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
  assert seen[:10] != seen[10:]  # a new order each epoch
  # The state is a pytree: a restored copy continues the same stream; jit gives the same plan.
  leaves, tree = jax.tree_util.tree_flatten(state)
  restored = jax.tree_util.tree_unflatten(tree, [np.asarray(x) for x in leaves])
  a, _ = sel.select(state, jax.random.key(1), 4)
  b, _ = jax.jit(sel.select, static_argnums=2)(restored, jax.random.key(1), 4)
  np.testing.assert_array_equal(a.indices, b.indices)
  with pytest.raises(ValueError, match="Cannot select 11 prompts"):
    sel.select(state, jax.random.key(0), 11)


# ------------------------------------------------------------------------- CONTROL: group filter

@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=3), min_size=2, max_size=8), st.integers(1, 8))
def test_dynamic_sampling_keeps_informative_groups_first(rows, target):
  r = jnp.asarray(rows, jnp.float32)
  target = min(target, len(rows))
  keep, ok = control.dynamic_sampling(r, target)
  keep, ok = np.asarray(keep), np.asarray(ok)
  informative = [i for i, row in enumerate(rows) if len(set(row)) > 1]
  assert len(set(keep.tolist())) == target
  assert keep[ok].tolist() == informative[:target]           # informative groups, in order, first
  assert ok.sum() == min(len(informative), target)
  assert all(len(set(rows[i])) == 1 for i in keep[~ok])       # padding groups carry no signal


# -------------------------------------------------------------------------- FILTER: group reward

def test_group_rewards_follow_their_definitions():
  answers = [["4", "5", "4", None], ["7", "7", "7", "7"], [None, None, None, None]]
  r = rewards.ttrl(answers)
  assert r.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
  ori, aug = rewards.co_reward(["4", "5", "4"], ["5", "5", None])
  assert ori.tolist() == [0, 1, 0] and aug.tolist() == [0, 0, 0]   # each view graded by the other's vote
  d = rewards.dare_reward(["a", "a", "a", "b"], alpha=0.0, tau=0.0)
  assert d.tolist() == [0.75, 0.75, 0.75, 0.25]


def test_scorer_sums_weighted_terms_and_label_free_terms_need_no_references():
  task = tasks.get("arithmetic")
  texts = [["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>", "4"]]
  both = rewards.build_scorer("task + 0.5*ttrl", task, num_workers=0)
  r, info = both(texts, ["5"])
  r_task, _ = rewards.build_scorer("task", task, num_workers=0)(texts, ["5"])
  r_ttrl, _ = rewards.build_scorer("ttrl", task, num_workers=0)(texts)
  np.testing.assert_allclose(r, r_task + 0.5 * r_ttrl)
  assert r_task.tolist() == [[0, 1, 0, 0]] and r_ttrl.tolist() == [[1, 0, 1, 0]]
  assert info["answers"] == [["4", "5", "4", None]]
  assert both.needs_labels and not rewards.build_scorer("ttrl", task).needs_labels
  with pytest.raises(ValueError, match="needs one reference per prompt"):
    both(texts)


# ------------------------------------------------------------------------------- swap by name

@pytest.mark.parametrize("key,value,check", [
    ("control.name", "uniform", lambda p: isinstance(p.selector, control.PromptSelector)),
    ("replay.name", "fifo", lambda p: isinstance(p.buffer, replay.RolloutBuffer)),
    ("replay.name", "none", lambda p: p.buffer is None),
    ("reward.name", "ttrl", lambda p: p.scorer.terms == [("ttrl", 1.0)] and not p.scorer.needs_labels),
    ("reward.name", "task + 0.1*format_answer_tag",
     lambda p: p.scorer.terms == [("task", 1.0), ("format_answer_tag", 0.1)]),
    ("rl.advantage", "xrpo", lambda p: p.needs_seq_logprobs),
    ("rollout.generator", "sol_rl", lambda p: p.generator.fields == ("old_logprobs",)),
    ("rollout.generator", "tree", lambda p: p.generator.fields == ("token_advantages",)),
    ("data.task", "countdown", lambda p: p.task.name == "countdown"),
])
def test_each_stage_is_swapped_by_config_name(key, value, check):
  section, name = key.split(".")
  exp = _exp(**{section: {name: value}})
  p, _ = _pipeline(exp)
  assert check(p)


@pytest.mark.parametrize("key,value", [
    ("control.name", "vadee"), ("control.kwargs", "nope=1"),
    ("replay.name", "lifo"), ("reward.name", "tttrl"), ("reward.clusters", "judge"),
    ("rl.advantage", "grpoo"), ("rl.advantage_kwargs", "alhpa=2"), ("rl.loss_kind", "ppo"), ("rl.agg", "mean"),
    ("rl.kl_kind", "k4"), ("data.task", "gsm9k"), ("rollout.generator", "fp4"), ("rollout.num_samples", 0),
    ("rollout.temperature", -1.0), ("control.prompts_per_step", -2), ("rl.clip_low", -0.1), ("rl.dual_clip", 0.5),
])
def test_bad_names_sizes_and_signs_are_named_before_anything_is_built(key, value):
  section, name = key.split(".")
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    _exp(**{section: {name: value}})


def test_config_arguments_are_checked():
  import pathlib
  repo = pathlib.Path(__file__).resolve().parents[2]
  with pytest.raises(ValueError, match="Unknown config argument 'smok'"):
    config_lib.load_config_file(repo / "configs" / "default.py", "smok")
  with pytest.raises(ValueError, match="co_reward.*second view"):
    _exp(data={"task": "gsm8k"}, reward={"name": "co_reward"})
  with pytest.raises(ValueError, match="reward.ref_samples"):
    _exp(rl={"advantage": "pvpo"})


# ------------------------------------------------------------------------------ the pipeline

def test_collect_returns_a_scored_batch_and_advances_the_selector():
  exp = _exp()
  p, params = _pipeline(exp)
  state = p.init_state()
  batch, state2, info = p.collect(state, params, 0, jax.random.key(0))
  B, N, T = batch.completion_ids.shape
  assert (B, N) == (4, 4) and T % 8 == 0 and T <= 8
  assert int(state2.control.position) == 4
  texts = [[TOK.decode([int(t) for t in np.asarray(batch.completion_ids)[b, j][np.asarray(batch.completion_mask)[b, j]]
                        if int(t) != TOK.eos_id]) for j in range(N)] for b in range(B)]
  refs = [tasks.get("arithmetic").reference(EXAMPLES[i]) for i in np.asarray(batch.prompt_index)]
  expected = [[tasks.get("arithmetic").reward(t, refs[b]) for t in row] for b, row in enumerate(texts)]
  np.testing.assert_array_equal(batch.rewards, expected)
  assert info["rollouts"] == 16 and np.asarray(batch.policy_version).max() == 0


def test_dynamic_sampling_refills_until_informative_or_gives_up(monkeypatch, caplog):
  exp = _exp(control={"dynamic_sampling": True, "max_refills": 2})
  p, params = _pipeline(exp)
  calls = []

  def flat(self, texts, refs=None, **kw):  # no group is ever informative
    calls.append(1)
    return np.zeros((len(texts), len(texts[0])), np.float32), {"answers": [[None] * len(texts[0])] * len(texts),
                                                               "failures": 0}

  monkeypatch.setattr(rewards.GroupScorer, "__call__", flat)
  with caplog.at_level(logging.INFO):
    batch, state, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(calls) == 3 and info["refills"] == 2 and info["dynamic_sampling_gave_up"] == 1
  assert info["dynamic_sampling/shortfall"] == 4
  assert "stopped after 2 refills with 0 of 4 informative groups (control.max_refills=2)" in caplog.text
  assert not np.asarray(batch.sample_mask).any()  # nothing informative: nothing carries loss
  assert int(state.control.position) == 12  # every refill drew new prompts

  def mixed(self, texts, refs=None, **kw):  # informative on the second generation
    calls.append(1)
    r = np.zeros((len(texts), len(texts[0])), np.float32)
    if len(calls) % 2 == 0:
      r[:, 0] = 1
    return r, {"answers": [[None] * len(texts[0])] * len(texts), "failures": 0}

  calls.clear()
  monkeypatch.setattr(rewards.GroupScorer, "__call__", mixed)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(calls) == 2 and info["refills"] == 1 and np.asarray(batch.sample_mask).all()


def test_dynamic_sampling_by_default_refills_until_the_batch_is_full(monkeypatch, caplog):
  """DAPO's rule (`max_refills=-1`): refill until B informative groups, however many it takes;
  only a run of `STALL_REFILLS` fruitless generations stops it, with a warning and the shortfall."""
  assert config_lib.ControlConfig().max_refills == -1
  p, params = _pipeline(_exp(control={"dynamic_sampling": True}))
  assert p.max_refills == -1                                   # the pipeline's value is the config's
  calls = []

  def one_group_a_call(self, texts, refs=None, **kw):   # one informative group per generation
    calls.append(1)
    r = np.zeros((len(texts), len(texts[0])), np.float32)
    r[0, 0] = 1
    return r, {"answers": [[None] * len(texts[0])] * len(texts), "failures": 0}

  monkeypatch.setattr(rewards.GroupScorer, "__call__", one_group_a_call)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(calls) == 4 and info["refills"] == 3 and "dynamic_sampling_gave_up" not in info
  assert np.asarray(batch.sample_mask).all()                  # B = 4 informative groups

  def flat(self, texts, refs=None, **kw):
    calls.append(1)
    return np.zeros((len(texts), len(texts[0])), np.float32), {"answers": [[None] * len(texts[0])] * len(texts),
                                                               "failures": 0}

  calls.clear()
  monkeypatch.setattr(rewards.GroupScorer, "__call__", flat)
  with caplog.at_level(logging.WARNING):
    _, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(calls) == pipeline_lib.STALL_REFILLS and info["dynamic_sampling/shortfall"] == 4
  assert f"{pipeline_lib.STALL_REFILLS} generations in a row found none" in caplog.text
  with pytest.raises(ValueError, match="control.max_refills must be -1"):
    _exp(control={"max_refills": -2})


def test_label_free_rewards_never_read_references(monkeypatch):
  def no_labels(self, example):
    raise AssertionError("a reference was read")

  exp = _exp(reward={"name": "ttrl"})
  p, params = _pipeline(exp)
  monkeypatch.setattr(tasks.Arithmetic, "reference", no_labels)
  stripped = [{k: v for k, v in ex.items() if k not in ("answer", "solution")} for ex in EXAMPLES]
  p.examples = stripped
  batch, _, _ = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert batch.rewards.shape == (4, 4)
  p2, _ = _pipeline(_exp())  # the same path with a labelled reward does read them (the test can fail)
  with pytest.raises(AssertionError, match="reference was read"):
    p2.collect(p2.init_state(), params, 0, jax.random.key(0))


def test_co_reward_trains_both_views_each_graded_by_the_other():
  exp = _exp(reward={"name": "co_reward"})
  p, params = _pipeline(exp)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert batch.rewards.shape == (8, 4) and info["rollouts"] == 32
  idx = np.asarray(batch.prompt_index)
  np.testing.assert_array_equal(idx[:4], idx[4:])
  prompts = [TOK.decode([int(t) for t in row[m]]) for row, m in zip(np.asarray(batch.prompt_ids),
                                                                    np.asarray(batch.prompt_mask))]
  for a, b in zip(prompts[:4], prompts[4:]):  # the second view swaps the operands
    x, op, y = a.strip().rstrip("?")[len("What is "):].split(" ")
    assert b.strip() == f"What is {y} {op} {x}?"


def test_pvpo_reference_rewards_are_computed_once_per_prompt():
  exp = _exp(rl={"advantage": "pvpo"}, reward={"ref_samples": 3}, data={"num_train": 4})
  p, params = _pipeline(exp, EXAMPLES[:4])
  state = p.init_state()
  batch, state, info = p.collect(state, params, 0, jax.random.key(0), ref_params=params)
  assert batch.ref_rewards.shape == (4, 3) and info["ref/rollouts"] == 12
  batch2, state, info2 = p.collect(state, params, 1, jax.random.key(1), ref_params=params)
  assert info2.get("ref/rollouts", 0.0) == 0.0  # the same 4 prompts: cached
  table = np.asarray(state.ref.rewards)
  np.testing.assert_array_equal(batch2.ref_rewards, table[np.asarray(batch2.prompt_index)])


def test_pvpo_presamples_every_prompt_before_training_and_skips_solved_and_unsolved_ones(monkeypatch):
  """control.name=pvpo: reference rollouts of all K prompts before step 1 (the paper's order), so
  the very first selection already skips prompts the reference always or never solves."""
  with pytest.raises(ValueError, match="control.name='pvpo' .* set reward.ref_samples > 0"):
    _exp(control={"name": "pvpo"})
  exp = _exp(rl={"advantage": "pvpo"}, reward={"ref_samples": 3}, control={"name": "pvpo"})
  ref = lambda ex: str(tasks.get("arithmetic").reference(ex))
  examples = list({ref(ex): ex for ex in data.generate_arithmetic(1, "train", 64, digits=2)}.values())[:12]
  assert len(examples) == 12                                      # 12 distinct answers: the fake scorer's key
  p, params = _pipeline(exp, examples)
  assert p.presample
  kind = {ref(ex): i % 3 for i, ex in enumerate(examples)}
  calls = []

  def by_prompt(self, texts, refs=None, **kw):   # prompt i: always (i%3=0), never (1) or half (2) solved
    calls.append(len(texts))
    rows = []
    for ref, row in zip(refs, texts):
      k = kind[str(ref)]
      rows.append([1.0] * len(row) if k == 0 else [0.0] * len(row) if k == 1 else [float(j % 2) for j in range(len(row))])
    return np.asarray(rows, np.float32), {"answers": [[None] * len(texts[0])] * len(texts), "failures": 0}

  monkeypatch.setattr(rewards.GroupScorer, "__call__", by_prompt)
  state, info = p.presample_state(p.init_state(), params, jax.random.key(0))
  assert calls == [4, 4, 4] and info["ref/presample_rollouts"] == 36          # 12 prompts x 3, B = 4 at a time
  assert 0 < info["ref/presample_generated_tokens"] <= 36 * exp.rollout.max_new_tokens   # counted, as a step's are
  assert info["ref/presample_solved_frac"] == pytest.approx(1 / 3)
  assert info["ref/presample_unsolved_frac"] == pytest.approx(1 / 3)
  assert (np.asarray(state.ref.step) == 0).all() and (np.asarray(state.control.ref_count) == 3).all()
  batch, state, info = p.collect(state, params, 0, jax.random.key(1), ref_params=params)
  assert sorted(i % 3 for i in np.asarray(batch.prompt_index)) == [2, 2, 2, 2]   # only the informative ones
  assert info.get("ref/rollouts", 0.0) == 0.0                                       # anchors are cached
  np.testing.assert_array_equal(batch.ref_rewards, np.asarray(state.ref.rewards)[np.asarray(batch.prompt_index)])
  off = _pipeline(_exp(rl={"advantage": "pvpo"}, reward={"ref_samples": 3}), examples)[0]
  assert off.presample_state(off.init_state(), params, jax.random.key(0))[1] == {}   # lazy without the selector


def test_hive_with_fresh_entropy_scores_its_pool_with_the_current_policy_in_the_loop(monkeypatch):
  exp = _exp(control={"name": "hive", "kwargs": "fresh_entropy=True,entropy_tokens=4,pool_factor=2.0"})
  p, params = _pipeline(exp)
  pools = []
  real = rollout_extras.prompt_entropy

  def spy(cfg, params_, prompter, examples, tokens, conf, stats):
    ent = real(cfg, params_, prompter, examples, tokens, conf, stats)
    assert ent.shape == (len(examples),) and np.isfinite(ent).all() and (ent >= 0).all()
    idx = [next(i for i, e in enumerate(p.examples) if e is ex) for ex in examples]
    pools.append(dict(zip(idx, ent.tolist())))
    return ent

  monkeypatch.setattr(rollout_extras, "prompt_entropy", spy)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(pools) == 1 and len(pools[0]) == 8 and 0 < info["hive/entropy_tokens"] <= 8 * 4
  chosen = np.asarray(batch.prompt_index).tolist()
  ranked = sorted(pools[0], key=pools[0].get, reverse=True)
  assert min(pools[0][i] for i in chosen) >= pools[0][ranked[3]] - 1e-6   # the pool's 4 most uncertain


@pytest.mark.parametrize("buffer", ["fifo", "prioritized"])
def test_replay_keeps_surplus_informative_groups_for_the_next_step(monkeypatch, buffer):
  exp = _exp(control={"dynamic_sampling": True, "max_refills": 1}, replay={"name": buffer, "capacity": 8})
  p, params = _pipeline(exp)

  def all_informative(self, texts, refs=None, **kw):
    r = np.zeros((len(texts), len(texts[0])), np.float32)
    r[:, 0] = 1
    return r, {"answers": [[None] * len(texts[0])] * len(texts), "failures": 0}

  def none_informative(self, texts, refs=None, **kw):
    return np.zeros((len(texts), len(texts[0])), np.float32), {"answers": [[None] * len(texts[0])] * len(texts),
                                                               "failures": 0}

  monkeypatch.setattr(rewards.GroupScorer, "__call__", all_informative)
  state = p.init_state()
  batch, state, info = p.collect(state, params, 0, jax.random.key(0))
  assert info.get("replay/stored", 0.0) == 0.0 and int(state.replay.size) == 0
  real_informative = control.informative
  # Half of each generation is informative, and of the 8 groups after one refill, 6 are: 2 surplus.
  fake = lambda r, m=None: (jnp.arange(r.shape[0]) % 2 == 0) | (jnp.arange(r.shape[0]) >= 4)
  monkeypatch.setattr(control.filters, "informative", fake)
  monkeypatch.setattr(control, "informative", fake)
  batch, state, info = p.collect(state, params, 1, jax.random.key(1))
  assert info["refills"] == 1 and info["replay/stored"] == 2 and int(state.replay.size) == 2
  if buffer == "prioritized":   # a stored group's priority: its mean |normalized advantage| (1 of 4 right)
    live = np.asarray(state.replay.valid)
    np.testing.assert_allclose(np.asarray(state.replay.priority)[live], np.sqrt(3) / 2, atol=1e-5)
  stored = set(np.asarray(state.replay.data.prompt_index)[np.asarray(state.replay.valid)].tolist())
  monkeypatch.setattr(control.filters, "informative", real_informative)
  monkeypatch.setattr(control, "informative", real_informative)
  monkeypatch.setattr(rewards.GroupScorer, "__call__", none_informative)
  batch, state, info = p.collect(state, params, 2, jax.random.key(2))
  assert info["replay/used"] == 2 and stored <= set(np.asarray(batch.prompt_index).tolist())
  assert batch.old_logprobs is not None  # replayed groups are importance-weighted against their behaviour


def test_uniqueness_advantages_differ_from_grpo_on_countdown_groups():
  """Strategy clusters from the task make uniqueness_grpo differ from GRPO (answer clusters cannot:
  on countdown every correct sample reaches the same target)."""
  task = tasks.get("countdown")
  ex = {"numbers": [2, 3, 4], "target": 14}
  texts = [["<answer>(3+4)*2</answer>", "<answer>2*(4+3)</answer>", "<answer>3*4+2</answer>",
            "<answer>2+3+4</answer>"]]
  r, _ = rewards.build_scorer("task", task, num_workers=0)(texts, [task.reference(ex)])
  assert r.tolist() == [[1, 1, 1, 0]]
  strat = advantages.cluster_by_answer([[task.strategy(t) for t in texts[0]]], normalize=lambda x: x)
  ans = advantages.cluster_by_answer([[task.extract(t) for t in texts[0]]])
  uniq, _ = advantages.apply(advantages.uniqueness_grpo(alpha=1.0), r, cluster_ids=strat)
  grpo, _ = advantages.apply(advantages.grpo(), r)
  assert float(uniq[0, 2]) > float(uniq[0, 0]) > 0  # the rare correct strategy earns more
  assert np.abs(np.asarray(uniq) - np.asarray(grpo)).max() > 0.1
  assert len(set(np.asarray(strat)[0, :3].tolist())) == 2 and len(set(np.asarray(ans)[0, :3].tolist())) == 3


def test_selector_updates_see_every_generated_group(monkeypatch):
  seen = []
  real = control.uniform

  def spy(num_prompts, *, num_samples, seed=0):
    sel = real(num_prompts, num_samples=num_samples, seed=seed)

    def update(state, plan, rewards_BxN, mask_BxN=None, **extra):
      seen.append((np.asarray(plan.indices).tolist(), np.asarray(rewards_BxN).shape, sorted(extra)))
      return state
    return control.PromptSelector(sel.init, sel.select, update)

  monkeypatch.setitem(control.REGISTRY, "uniform", spy)
  p, params = _pipeline(_exp(control={"dynamic_sampling": True, "max_refills": 1}))
  p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert len(seen) in (1, 2) and all(s[1] == (4, 4) and s[2] == ["entropy_BxN", "lengths_BxN"] for s in seen)


def test_cat_rewards_agree_with_the_anchors_synthesis(monkeypatch):
  exp = _exp(reward={"name": "cat"})
  p, params = _pipeline(exp)
  seen = {}

  real_anchor = filter_lib.Filter.anchor_syntheses

  def fake_anchor(self, examples, texts, anchor_params):
    if anchor_params is None:
      return real_anchor(self, examples, texts, anchor_params)
    assert anchor_params is params
    seen["texts"] = texts
    # The anchor "writes" the first sample's text for group 0 and nothing parsable elsewhere.
    return [texts[0][0] if b == 0 else "no answer here" for b in range(len(texts))]

  monkeypatch.setattr(filter_lib.Filter, "anchor_syntheses", fake_anchor)
  monkeypatch.setattr(tasks.Arithmetic, "reference", lambda self, ex: pytest.fail("CaT read a reference"))
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0), ref_params=params)
  task = tasks.get("arithmetic")
  answers = [[task.extract(t) for t in row] for row in seen["texts"]]
  ref = answers[0][0]
  expected0 = [float(ref is not None and a is not None and task.same(a, ref)) for a in answers[0]]
  np.testing.assert_array_equal(np.asarray(batch.rewards)[0], expected0)
  np.testing.assert_array_equal(np.asarray(batch.rewards)[1:], 0.0)
  assert info["cat/skipped_groups"] == 3 + (ref is None)
  with pytest.raises(ValueError, match="anchor policy"):
    p.collect(p.init_state(), params, 0, jax.random.key(0))   # no anchor given


def test_cat_anchor_prompt_lists_the_groups_answers():
  exp = _exp(reward={"name": "cat"})
  p, params = _pipeline(exp)
  texts = [["<answer>12</answer>", "<answer>13</answer>", "<answer>12</answer>", "junk"]]
  out = p.filter.anchor_syntheses([EXAMPLES[0]], texts, params)
  assert len(out) == 1 and isinstance(out[0], str)
  prompt = rewards.cat_prompt(tasks.get("arithmetic").prompt(EXAMPLES[0], TOK), ["12", "13", "12", None])
  assert prompt.startswith("Candidate answers: 12; 13.") and prompt.endswith(tasks.get("arithmetic").prompt(EXAMPLES[0], TOK))


# ------------------------------------------------------------- CONTROL's budgets: what is decoded

def _fixed_budget_selector(budget):
  """A uniform stream whose plan gives prompt b `budget[b]` rollouts."""

  def factory(num_prompts, *, num_samples, seed=0):
    sel = control.uniform(num_prompts, num_samples=num_samples, seed=seed)

    def select(state, key, batch_size, **kw):
      plan, state = sel.select(state, key, batch_size)
      return control.Plan(plan.indices, jnp.asarray(budget, jnp.int32)), state
    return control.PromptSelector(sel.init, select, sel.update)
  return factory


def test_a_budget_of_b_decodes_b_samples_in_the_loop(monkeypatch):
  """Budgets [2, 0, 1, 3] of N = 4: 6 rollouts decoded (not 16), and only those carry tokens and loss."""
  budget = [2, 0, 1, 3]
  monkeypatch.setitem(control.REGISTRY, "uniform", _fixed_budget_selector(budget))
  p, params = _pipeline(_exp())
  decoded_rows = []
  real_sample = sampling.sample

  def spy(cfg, params_, ids, mask, key, conf, budget=None):
    out = real_sample(cfg, params_, ids, mask, key, conf, budget=budget)
    decoded_rows.append(int(np.sum(budget)) if budget is not None else ids.shape[0] * conf.num_samples)
    return out

  monkeypatch.setattr(rollout.sample.sampling, "sample", spy)
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  assert decoded_rows == [6]
  lengths = np.asarray(batch.lengths)
  within = np.arange(4)[None, :] < np.asarray(budget)[:, None]
  np.testing.assert_array_equal(np.asarray(batch.sample_mask), within)
  assert (lengths[~within] == 0).all() and (lengths[within] > 0).all()
  assert info["rollouts"] == 6 and info["rollouts_budget"] == 6
  assert info["generated_tokens"] == lengths.sum()


@pytest.mark.parametrize("name,kwargs", [("xrpo", "budget_fraction=0.5"), ("pilot_commit", "")])
def test_a_second_phase_decodes_only_what_it_adds_and_merges_it_into_the_groups(name, kwargs, monkeypatch):
  """XRPO's phases and Pilot-Commit's commit: phase 1 decodes the first budgets, phase 2 only the
  difference, each sample on its own random stream, into the same groups (the refined plan's)."""
  calls = []
  real_sample = sampling.sample

  def spy(cfg, params_, ids, mask, key, conf, budget=None):
    calls.append(np.asarray(budget).tolist())
    return real_sample(cfg, params_, ids, mask, key, conf, budget=budget)

  monkeypatch.setattr(rollout.sample.sampling, "sample", spy)
  exp = _exp(control={"name": name, "kwargs": kwargs}, rollout={"num_samples": 8})
  p, params = _pipeline(exp)
  updates = []
  real_update = p.selector.update
  p.selector = p.selector._replace(update=lambda s, plan, r, m=None, **k: (updates.append(np.asarray(plan.budget)),
                                                                         real_update(s, plan, r, m, **k))[1])
  batch, _, info = p.collect(p.init_state(), params, 0, jax.random.key(0))
  first = np.asarray(calls[0])
  assert first.tolist() == [2, 2, 2, 2]                       # phase 1: the minimum / the pilots
  final = updates[0]
  if len(calls) == 2:
    np.testing.assert_array_equal(np.asarray(calls[1]), final - first)   # phase 2: only the difference
  else:
    np.testing.assert_array_equal(final, first)               # nothing to add this step
  if name == "xrpo":
    assert final.sum() == 4 * 8 // 2 and len(calls) == 2
  within = np.arange(8)[None, :] < final[:, None]
  np.testing.assert_array_equal(np.asarray(batch.sample_mask), within)
  assert (np.asarray(batch.lengths)[within] > 0).all() and (np.asarray(batch.lengths)[~within] == 0).all()
  assert info["rollouts"] == final.sum()
  # The merged samples are the ones an unbudgeted call draws on each sample's stream.
  full = real_sample(p.cfg, params, batch.prompt_ids, batch.prompt_mask, jax.random.fold_in(jax.random.key(0), 0),
                     p.sampling_config)   # the key `collect` hands the first generation
  np.testing.assert_array_equal(np.asarray(full.completion_ids)[:, :2], np.asarray(batch.completion_ids)[:, :2])


def test_a_two_phase_selector_needs_the_plain_generator():
  with pytest.raises(ValueError, match="control.name='xrpo'.*rollout.generator='sample'"):
    _exp(control={"name": "xrpo"}, rollout={"generator": "spec_rl"})
  _exp(control={"name": "xrpo", "kwargs": "phases=1"}, rollout={"generator": "spec_rl"})
  with pytest.raises(ValueError, match="control.kwargs"):
    _exp(control={"name": "pilot_commit", "kwargs": "pilot_samples=9"})
