"""Config checks by section (each section's `check()` alone) and the few rules between sections."""

import dataclasses
import re
import typing

import pytest

from rollouts_jax.training import config as config_lib
from rollouts_jax.training.config import (AsyncConfig, CheckpointConfig, ControlConfig, DataConfig, EvalConfig,
                                          LoraConfig, ModelSectionConfig, ReplayConfig, RewardConfig, RLConfig,
                                          RolloutConfig, SFTConfig, TokenizerConfig)


def _cfg(**keys):
  """An ExperimentConfig (unchecked) from `base_config_dict()` with {"section.key": value} overrides."""
  plain = config_lib.to_plain(config_lib.base_config_dict())
  for key, value in keys.items():
    node = plain
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    assert leaf in node, key
    node[leaf] = value
  return config_lib.from_config_dict(plain, check=False)


def test_every_section_has_a_check_that_its_defaults_pass():
  hints = typing.get_type_hints(config_lib.ExperimentConfig)
  sections = {name for name, hint in hints.items() if dataclasses.is_dataclass(hint)}
  assert set(config_lib.SECTIONS) == sections
  default = config_lib.ExperimentConfig()
  for name in config_lib.SECTIONS:
    assert getattr(default, name).check() is None
  config_lib.validate(default)


@pytest.mark.parametrize("section, match", [
    (DataConfig(template="html"), "data.template"),
    (DataConfig(task="nope"), "data.task: unknown task 'nope'"),
    (DataConfig(max_prompt_len=0), r"data.max_prompt_len must be > 0, got 0\."),
    (TokenizerConfig(kind="bpe"), "tokenizer.kind"),
    (ModelSectionConfig(num_heads=3), "model.num_heads 3 must be a multiple of model.num_kv_heads 2"),
    (ModelSectionConfig(init="hf"), "model.init='hf' needs model.path"),
    (ModelSectionConfig(dtype="float16"), "model.dtype"),
    (SFTConfig(batch_size=0), r"sft.batch_size must be > 0, got 0\."),
    (RolloutConfig(top_p=0), r"rollout.top_p must be in \(0, 1\], got 0"),
    (RolloutConfig(top_k=-1), r"rollout.top_k must be >= 0, got -1\."),
    (RolloutConfig(distill="opd"), "rollout.teacher_sft_steps must be > 0 .* with rollout.distill"),
    (RolloutConfig(distill="esr"), "rollout.distill='esr' is now rollout.distill='opd' with rollout.generator='esr'"),
    (RolloutConfig(generator="nope"), "rollout.generator: unknown generator 'nope'"),
    (RolloutConfig(generator="april", external_samples=2, teacher_sft_steps=2),
     "rollout.external_samples does not combine with rollout.generator='april'"),
    (RolloutConfig(env="calculator"), "an environment needs rollout.generator='multiturn'"),
    (RolloutConfig(generator="april", generator_kwargs="over_provision_=1"),
     "generator 'april' has no setting 'over_provision_'; its settings: over_provision"),
    (RewardConfig(dare_alpha=2.0), r"reward.dare_alpha must be in \[0, 1\], got 2.0"),
    (RewardConfig(name="nope"), "reward.name"),
    (RewardConfig(name="cat", ref_samples=2), "reward term 'cat' does not combine with reward.ref_samples"),
    (ControlConfig(name="nope"), "control.name"),
    (ControlConfig(max_refills=-2), "control.max_refills must be -1"),
    (ReplayConfig(capacity=0), r"replay.capacity must be > 0, got 0\."),
    (ReplayConfig(name="lifo"), "replay.name"),
    (RLConfig(dual_clip=0.5), r"rl.dual_clip must be 0 \(off\) or > 1"),
    (RLConfig(loss_kind="nope"), "rl.loss_kind"),
    (RLConfig(advantage="gae", critic_warmup=100), "rl.critic_warmup=100 must be < rl.steps=100"),
    (RLConfig(advantage="gae", echo_clip=True), "rl.advantage='gae' .* does not combine with rl.echo_clip"),
    (RLConfig(kl_ctrl="adaptive"), "rl.kl_ctrl='adaptive' adapts rl.kl_coef"),
    (RLConfig(distill_kl="both"), "rl.distill_kl"),
    (EvalConfig(selection="bon,best"), "eval.selection"),
    (EvalConfig(deeplook_kwargs="budget=2"), "eval.deeplook_kwargs is set but eval.deeplook is False"),
    (CheckpointConfig(keep=0), r"checkpoint.keep must be > 0, got 0\."),
    (CheckpointConfig(every=-1), r"checkpoint.every must be >= 0, got -1\."),
    (AsyncConfig(ewma_beta=1.0), r"async_rl.ewma_beta must be in \(0, 1\)"),
    (AsyncConfig(old_logprobs="cached"), "async_rl.old_logprobs"),
    (LoraConfig(rank=-1), r"lora.rank must be >= 0, got -1\."),
    (LoraConfig(rank=4, targets="q,qkv"), "lora.targets: unknown projection 'qkv'"),
], ids=lambda x: type(x).__name__ if dataclasses.is_dataclass(x) else None)
def test_a_section_checks_its_own_keys_alone(section, match):
  with pytest.raises(ValueError, match=match):
    section.check()


def test_a_section_check_reads_no_other_section():
  # Valid alone; only the rules between sections refuse them (truncation without rl.tis_cap,
  # a replay smaller than a step, a LoRA rank larger than the model's projections).
  RolloutConfig(top_k=5).check()
  ReplayConfig(name="fifo", capacity=1).check()
  LoraConfig(rank=10000).check()
  CheckpointConfig(every=0).check()   # no periodic saves, as the Checkpointer takes it


# One config per rule that passes every section's own check and violates that rule.
CROSS_CASES = {
    "_model_tokenizer": ({"tokenizer.kind": "gguf"}, "tokenizer.kind='gguf' needs tokenizer.path"),
    "_sft_pretrained": ({"sft.from_pretrained": True}, "sft.from_pretrained .* needs model.init 'gguf' or 'hf', got 'sft'"),
    "_lora_model": ({"lora.rank": 65}, r"lora.rank=65 exceeds the model's smallest projection side \(64\)"),
    "_truncation_tis": ({"rollout.top_k": 5}, "rollout.top_k=5 samples from a truncated distribution.*rl.tis_cap"),
    "_environment": ({"rollout.env": "calculator", "rollout.generator": "multiturn", "reward.name": "arithmetic"},
                     "reward.name='arithmetic'.*with rollout.env the environment's rewards are the rewards"),
    "_generator_settings": ({"rollout.generator": "spec_rl", "rollout.generator_kwargs": "lenience=0"},
                            "rollout.generator_kwargs: generator 'spec_rl' setting 'lenience'"),
    "_external_samples": ({"rollout.external_samples": 2, "rollout.teacher_sft_steps": 2},
                          "rollout.external_samples needs rl.advantage='erils'"),
    "_cat_reward": ({"reward.name": "cat", "rollout.generator": "april"},
                    "reward term 'cat' does not combine with rollout.generator='april'"),
    "_distill_kl": ({"rl.distill_kl": "forward"}, "rl.distill_kl='forward' needs full-vocabulary distillation"),
    "_distill": ({"rollout.distill": "opd", "rollout.teacher_sft_steps": 2, "control.dynamic_sampling": True},
                 "rollout.distill does not combine with control.dynamic_sampling"),
    "_generator_paths": ({"rollout.generator": "tree", "replay.name": "fifo"},
                         "rollout.generator='tree' does not combine with replay.name"),
    "_april": ({"rollout.generator": "april", "control.dynamic_sampling": True},
               "rollout.generator='april' does not combine with control.dynamic_sampling"),
    "_task_reward": ({"data.task": "math500", "reward.name": "ttrl"},
                     "data.task='math500' has only a test split: model.init='sft'"),
    "_overlong_buffer": ({"reward.overlong_buffer": 64},
                         "reward.overlong_buffer 64 must be < rollout.max_new_tokens 64"),
    "_selector": ({"control.name": "pvpo"}, r"control.name='pvpo' .*set reward.ref_samples > 0"),
    "_replay_capacity": ({"replay.name": "fifo", "replay.capacity": 8},
                         "replay.capacity 8 must be >= control.prompts_per_step 16"),
    "_kl_horizon": ({"rl.kl_ctrl": "adaptive", "rl.kl_coef": 0.1, "rl.kl_horizon": 10.0},
                    r"rl.kl_horizon=10.0 must be > 0.2 x the samples of a step \(128\)"),
    "_echo_tree": ({"rl.echo_clip": True}, "rl.echo_clip / rl.echo_shaping need rollout.generator='tree'"),
    "_minibatches": ({"rl.num_minibatches": 3},
                     "control.prompts_per_step 16 must be divisible by rl.num_minibatches 3"),
    "_critic": ({"rl.advantage": "gae", "rollout.generator": "tree"},
                "rl.advantage='gae' .* does not combine with rollout.generator='tree'"),
    "_uniqueness_clusters": ({"rl.advantage": "uniqueness_grpo"},
                             "reward.clusters='strategy' needs a task with solution strategies.*'arithmetic'"),
    "_reference_rewards": ({"rl.advantage": "pvpo"}, r"rl.advantage='pvpo' needs reference rewards"),
    "_async_old_logprobs": ({"async_rl.max_staleness": 1}, r"async_rl.max_staleness=1 .*set rl.tis_cap > 0"),
}


def test_the_cross_section_rules_are_listed_and_documented():
  names = [rule.__name__ for rule in config_lib.CROSS_SECTION_RULES]
  assert len(set(names)) == len(names)
  assert set(names) == set(CROSS_CASES)
  for rule in config_lib.CROSS_SECTION_RULES:
    assert rule.__doc__ and rule.__doc__.strip(), rule.__name__
    assert re.search(rf"`{rule.__name__}`", config_lib.__doc__), f"{rule.__name__} missing from the module docstring"


@pytest.mark.parametrize("rule", config_lib.CROSS_SECTION_RULES, ids=lambda r: r.__name__)
def test_each_cross_section_rule_fires_on_a_config_that_violates_it(rule):
  keys, match = CROSS_CASES[rule.__name__]
  cfg = _cfg(**keys)
  for name in config_lib.SECTIONS:   # every section alone is fine: the rule between them refuses it
    getattr(cfg, name).check()
  with pytest.raises(ValueError, match=match):
    rule(cfg)
  plain = config_lib.to_plain(config_lib.base_config_dict())
  for key, value in keys.items():
    section, leaf = key.split(".")
    plain[section][leaf] = value
  with pytest.raises(ValueError, match=match):
    config_lib.from_config_dict(plain)
