"""The RL loop end to end on the smoke config: resume equality, NaN stop, clear config errors."""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest

from conftest import moved_from_warm_start
from rollouts_jax import rewards
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop
from rollouts_jax.io.metrics import read_jsonl
from rollouts_jax.training.rl_step import advantage_transform

REPO = pathlib.Path(__file__).resolve().parents[2]


def _smoke(name="default", **overrides):
  """The smoke variant of a config; overrides like `rl__steps=3` or `control__name="uniform"`."""
  cd = config_lib.load_config_file(REPO / "configs" / f"{name}.py", "smoke")
  for k, v in overrides.items():
    section, key = k.split("__")
    setattr(getattr(cd, section), key, v)
  return config_lib.from_config_dict(cd)


def _text_hash_rewards(self, texts, refs=None, **kw):
  """Rewards that are a fixed function of each completion's text (so groups of a random policy
  differ, dynamic sampling keeps a surplus and the replay buffer fills)."""
  import zlib
  h = lambda t: zlib.crc32(t.encode()) % 2
  # About half of the groups are informative, so dynamic sampling refills and keeps a surplus.
  r = np.asarray([[h(row[0]) * h(t + "!") for t in row] for row in texts], np.float32)
  return r, {"answers": [[None] * len(row) for row in texts], "failures": 0}


@pytest.mark.parametrize("name", ["default", "countdown_dapo_replay"])
def test_killed_run_resumes_to_the_same_params(name, cache, tmp_path, monkeypatch):
  # countdown_dapo_replay: the checkpoint also holds the selector's position and a non-empty
  # replay buffer, which decide the batches after the restart.
  # The default smoke model's rewards are all zero: the entropy bonus gives its updates a gradient, so the
  # params comparison compares updates (the replay config's text-hash rewards do that for it).
  exp = _smoke(name, rl__steps=3, **({"rl__entropy_coef": 0.01} if name == "default" else {}))
  if name != "default":
    exp = dataclasses.replace(exp, control=dataclasses.replace(exp.control, max_refills=1))
    monkeypatch.setattr(rewards.GroupScorer, "__call__", _text_hash_rewards)
  full = loop.train(exp, tmp_path / "full", progress=False)
  stopped = loop.train(dataclasses.replace(exp, stop_after_step=2), tmp_path / "killed", progress=False)
  assert stopped["stopped_at"] == 2
  resumed = loop.train(exp, tmp_path / "killed", progress=False)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(full["params"]),
                         jax.device_get(resumed["params"]))
  assert moved_from_warm_start(exp, full["params"]) > 1e-6   # three updates that change the params
  rows = read_jsonl(tmp_path / "killed" / "metrics.jsonl")
  rl_steps = [r["step"] for r in rows if "reward_mean" in r]
  assert rl_steps == [1, 2, 3]  # each step logged once despite the restart
  assert {"before", "after"} <= set(resumed)
  if name != "default":
    assert any(r.get("replay/used", 0) > 0 for r in rows)  # the buffer was carried across the kill
    return
  assert (tmp_path / "full" / "plots").is_dir() and list((tmp_path / "full" / "plots").glob("*.png"))
  assert list((tmp_path / "full" / "tb").glob("events.out.tfevents.*"))
  for key in ("reward_mean", "accuracy", "response_length", "entropy", "grad_norm", "clip_frac_low",
              "tokens_per_s", "time/sample", "time/update", "mismatch_mean", "mismatch_max",
              "mismatch_frac_gt_0.1"):
    assert key in rows[1], key


def test_nonfinite_updates_stop_the_run(cache, tmp_path, monkeypatch):
  exp = dataclasses.replace(_smoke(rl__steps=5), max_nonfinite_steps=2)
  real = rewards.GroupScorer.__call__

  def nan_scores(self, texts, refs=None, **kw):
    r, info = real(self, texts, refs, **kw)
    return np.full_like(r, np.nan), info

  monkeypatch.setattr(rewards.GroupScorer, "__call__", nan_scores)
  with pytest.raises(loop.TrainingStopped, match="2 consecutive non-finite"):
    loop.train(exp, tmp_path, progress=False)
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "nonfinite" in r]
  assert [r["nonfinite"] for r in rows] == [1.0, 1.0]


def test_unknown_config_key_is_named():
  cd = config_lib.load_config_file(REPO / "configs" / "default.py").to_dict()
  cd["rl"]["stpes"] = 3
  with pytest.raises(ValueError, match=r"rl\.stpes"):
    config_lib.from_config_dict(cd)
  with pytest.raises(AttributeError):
    config_lib.load_config_file(REPO / "configs" / "default.py").rl.stpes = 3  # locked ConfigDict


def test_unsupported_model_and_missing_folders_fail_early(tmp_path):
  cd = config_lib.load_config_file(REPO / "configs" / "default.py")
  cd.model.model_type = "gpt2"
  with pytest.raises(ValueError, match="Unsupported model.model_type 'gpt2'.*llama, qwen2, qwen3"):
    config_lib.from_config_dict(cd)
  cd = config_lib.load_config_file(REPO / "configs" / "gsm8k_qwen.py", str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="no config.json"):
    config_lib.from_config_dict(cd)
  cd = config_lib.load_config_file(REPO / "configs" / "default.py")
  cd.data.task = "gsm8k"
  cd.data.manual_dir = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="gsm8k"):
    config_lib.from_config_dict(cd)


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.py")))
def test_every_config_loads_and_validates(name, tmp_path):
  arg = "smoke" if name != "gsm8k_qwen" else None
  cd = config_lib.load_config_file(REPO / "configs" / f"{name}.py", arg)
  if name == "gsm8k_qwen":
    assert cd.model.init == "hf"
    return
  exp = config_lib.from_config_dict(cd)
  assert exp.rl.steps >= 1
  advantage_transform(exp.rl)  # the named recipe exists


def test_restart_before_the_first_checkpoint_logs_each_row_once(cache, tmp_path):
  exp = _smoke(rl__steps=3, checkpoint__every=10)
  stopped = loop.train(dataclasses.replace(exp, stop_after_step=1), tmp_path, progress=False)
  assert stopped["stopped_at"] == 1 and not list((tmp_path / "checkpoints").glob("[0-9]*"))
  loop.train(exp, tmp_path, progress=False)
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows if "eval/pass@1" in r and r["step"] == 0] == [0]
  assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]


def test_a_grader_that_fails_on_most_samples_stops_the_run(cache, tmp_path, monkeypatch):
  from rollouts_jax import tasks

  def broken(self, answer, reference):
    raise RuntimeError("grader exploded")

  monkeypatch.setattr(tasks.Arithmetic, "grade", broken)
  with pytest.raises(rewards.GraderFailureError, match="grader exploded|failed"):
    loop.train(_smoke(rl__steps=2), tmp_path, progress=False)


def test_rerunning_a_workdir_with_another_config_is_refused_before_any_work(cache, tmp_path):
  from rollouts_jax.training import workdir as workdir_lib
  loop.train(_smoke(rl__steps=1), tmp_path, progress=False)
  saved = (tmp_path / "config.json").read_text()
  with pytest.raises(workdir_lib.ConfigMismatchError, match=r"rl\.learning_rate"):
    loop.train(_smoke(rl__steps=1, rl__learning_rate=0.01), tmp_path, progress=False)
  assert (tmp_path / "config.json").read_text() == saved
