"""Every config's `smoke` variant runs a warm start (or checkpoint load) and one RL step (default suite)."""

import json
import pathlib

import jax
import numpy as np
import pytest

from rollouts_jax import models
from rollouts_jax.training import config as config_lib
from rollouts_jax.training import loop

REPO = pathlib.Path(__file__).resolve().parents[2]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tiny_qwen_folder(folder: pathlib.Path, corpus):
  """A random Qwen2 checkpoint with a byte-level BPE tokenizer trained here (no download)."""
  from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
  tok = Tokenizer(tok_models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(corpus, trainer)
  folder.mkdir(parents=True)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
  cfg = models.ModelConfig(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=32,
                           intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, qkv_bias=True,
                           tie_word_embeddings=True, eos_token_ids=(tok.token_to_id("<|im_end|>"),))
  models.save_hf_checkpoint(folder, cfg, models.init_params(cfg, jax.random.key(0)))
  return folder


CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py") if "def get_config" in p.read_text())
# The real model's smoke steps take 1-2 minutes each on two cores. The default suite runs the
# real-LM job's own config (smollm2_addition); the study arms built on it and its LoRA variant
# (whose methods the small model's configs drive in the default suite) and its multi-turn
# calculator run (an SFT of the real model first) run with `-m slow`.
REAL_MODEL_ARMS = {"smollm2_lora", "repro_real_base", "repro_real_brorl", "repro_real_mc_grpo", "repro_real_opd",
                   "repro_real_sol_rl", "repro_real_ttrl", "smollm2_calculator"}
# Study arms whose method a default-suite config already drives through the loop (april_parity's
# APRIL arm is countdown_april's generator on the miniature) also run with `-m slow`.
STUDY_ARMS = {"april_parity"}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
  """One dataset / warm-start cache for every config: configs with the same data and smoke model share it."""
  return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in REAL_MODEL_ARMS | STUDY_ARMS else n
                                  for n in CONFIGS])
def test_smoke_config_runs_one_step(name, tmp_path, shared_cache, monkeypatch):
  """Every config's `smoke` variant, in its cheapest form: a warm start (or checkpoint), one RL step, eval.

  The cheapest form shares the dataset and warm-start cache across configs (the first config of a
  kind builds, the others reuse the cached folder) and draws no PNG curves (tests/training/test_loop.py
  checks those); everything else is the config's own smoke variant.
  """
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(shared_cache))
  monkeypatch.setattr(loop, "plot_curves", lambda *a, **k: [])
  arg = "smoke"
  if name == "gsm8k_qwen":
    from rollouts_jax import data
    corpus = [ex["question"] for ex in data.load_benchmark("gsm8k", split="test")[:200]]
    arg = str(_tiny_qwen_folder(tmp_path / "qwen", corpus)) + ",smoke"
  exp = config_lib.from_config_dict(config_lib.load_config_file(REPO / "configs" / f"{name}.py", arg))
  summary = loop.train(exp, tmp_path / "run", progress=False)
  assert summary["final_step"] == exp.rl.steps
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step_rows = [r for r in rows if "grad_norm" in r]
  assert len(step_rows) == exp.rl.steps
  assert np.isfinite(step_rows[0]["grad_norm"]) and step_rows[0]["nonfinite"] == 0.0
  # The evaluation before and after RL ran on the config's task and gave probabilities.
  for when in ("before", "after"):
    assert 0.0 <= summary[when]["eval/pass@1"] <= 1.0
  if exp.rollout.generator == "sol_rl":
    assert "sol/fp4_logprob_gap" in step_rows[0] and "sol/pool_reward_mean" in step_rows[0]


def test_no_config_trains_on_a_test_split_unless_its_reward_is_label_free():
  """Every config file (each arm of those with arms), read as written (no validation)."""
  import runpy
  from rollouts_jax import rewards, tasks
  checked = 0
  for name in CONFIGS:
    path = REPO / "configs" / f"{name}.py"
    arms = list(runpy.run_path(str(path)).get("ARMS", [None]))
    for arm in arms:
      config = config_lib.load_config_file(path, arm if name != "gsm8k_qwen" else "/nowhere")
      checked += 1
      if not tasks.get(config.data.task).has_train_split:
        terms = [t for t, _ in rewards.parse_reward_spec(config.reward.name)]
        assert all(t in rewards.GROUP_TERMS for t in terms), (name, arm, config.reward.name)
        assert config.model.init != "sft", (name, arm)
  assert checked > len(CONFIGS)


@pytest.mark.parametrize("task", ["math500", "aime24", "amc23"])
def test_test_set_only_tasks_refuse_rewards_that_read_answers(task):
  from rollouts_jax import tasks
  assert not tasks.get(task).has_train_split
  assert tasks.get("gsm8k").has_train_split and tasks.get("arithmetic").has_train_split
  pretrained = {"model": {"init": "gguf", "path": "smollm2"}, "tokenizer": {"kind": "gguf"}}
  for reward in ("task", "ttrl+0.5*task", "format"):
    with pytest.raises(ValueError, match=f"data.task='{task}' has only a test split.*reward.name='"):
      config_lib.from_config_dict(dict(pretrained, data={"task": task}, reward={"name": reward}))
  with pytest.raises(ValueError, match="model.init='sft' would fine-tune on its reference solutions"):
    config_lib.from_config_dict({"data": {"task": task}, "reward": {"name": "ttrl"}})
  for reward in ("ttrl", "dare"):   # test-time RL: label-free
    assert config_lib.from_config_dict(dict(pretrained, data={"task": task}, reward={"name": reward}))
