"""Typed experiment configuration.

Launchers hold an `ml_collections.ConfigDict` (from `configs/*.py`); library code only
sees these frozen dataclasses. `from_config_dict` converts one into the other and
rejects keys that no code reads, naming them, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which task feeds the prompts and how they are built.

  task: `arithmetic`, `countdown` (generated locally) or a benchmark (`gsm8k`, `math500`,
  `aime24`, `amc23`, read from `manual_dir`).
  """
  task: str = "arithmetic"
  data_dir: str = ""            # TFDS data folder; "" = <workdir>/../tfds-data? see resolve_data_dir
  manual_dir: str = ""          # folder with benchmark JSONL files (benchmarks only)
  seed: int = 0
  num_train: int = 20000
  num_test: int = 500
  difficulty: int = 2           # digits (arithmetic) or numbers (countdown)
  ops: str = "+"                # arithmetic operators to draw from, e.g. "+*"
  template: str = "plain"       # "plain" or "chat"
  max_prompt_len: int = 64


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  kind: str = "char"            # "char", "sentencepiece", or "hf" (tokenizer.json of a checkpoint)
  path: str = ""                # model file / folder; "" = next to the warm start


@dataclasses.dataclass(frozen=True)
class ModelSectionConfig:
  """The policy: a random init, a local HF checkpoint, or an SFT warm start (built if absent)."""
  init: str = "sft"             # "sft", "hf" or "random"
  hf_path: str = ""             # local folder in Hugging Face layout (init="hf")
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


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The GRPO-family update."""
  steps: int = 100
  prompts_per_step: int = 16
  num_samples: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  sample_chunk: int = 0
  advantage: str = "grpo"       # a recipe name in rollouts_jax.advantages (grpo, dr_grpo, rloo, mc_grpo ...)
  loss_kind: str = "ppo_clip"   # ppo_clip, gspo, cispo
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0        # 0 = off; e.g. 3.0
  agg: str = "token-mean"
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  tis_cap: float = 0.0          # truncated importance sampling cap for rollout/train mismatch (0 = off)
  ppo_epochs: int = 1
  num_minibatches: int = 1
  micro_batch_size: int = 0     # rows per forward/backward; 0 = the whole minibatch
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  # Adam's epsilon. Policy gradients of tokens the policy almost never emits are tiny and
  # noisy; a larger epsilon keeps Adam from scaling them up to full-size steps.
  adam_eps: float = 1e-8
  freeze: str = ""              # comma-separated parameter names kept fixed during RL, e.g. "embed"
  dynamic_sampling: bool = False
  max_refills: int = 2
  max_nonfinite_steps: int = 3  # stop after this many consecutive skipped (NaN/inf) updates
  overlong_buffer: int = 0      # DAPO soft overlong punishment buffer (0 = off)
  # Sol-RL (arXiv 2604.06916): explore with an FP4 copy of the policy, train on a selected subset.
  fp4_rollouts: str = ""        # "" (off), "nvfp4" or "mxfp4"
  sol_pool_size: int = 0        # FP4 samples per prompt; num_samples of them are kept (0: keep all)
  sol_select: str = "contrastive"  # contrastive, deviation or random


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  name: str = "arithmetic"
  timeout_s: float = 5.0
  num_workers: int = 2


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 0                # RL steps between evaluations (0: only at start and end)
  num_examples: int = 200
  k: int = 4                    # samples per prompt for pass@k / maj@k
  temperature: float = 1.0
  batch_size: int = 100


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 10
  keep: int = 2


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh (data, fsdp, tensor) and the logical-axis preset (pure_dp, fsdp, fsdp_tp); see docs/sharding.md."""
  shape: tuple[int, ...] = (1, 1, 1)
  preset: str = "fsdp"
  # A separate rollout mesh on other devices (Tunix-style roles; () = roll out on the training
  # mesh); weights are handed off to it before each generation.
  rollout_shape: tuple[int, ...] = ()
  rollout_preset: str = ""      # "" = preset


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  seed: int = 0
  data: DataConfig = DataConfig()
  tokenizer: TokenizerConfig = TokenizerConfig()
  model: ModelSectionConfig = ModelSectionConfig()
  sft: SFTConfig = SFTConfig()
  rl: RLConfig = RLConfig()
  reward: RewardConfig = RewardConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  # Stop after this RL step (simulates a crash in tests; -1 = off). Not a hyperparameter.
  stop_after_step: int = -1


def _convert(cls, data: Mapping[str, Any], where: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(
        f"Unknown config key(s) {', '.join(where + k for k in unknown)}; known keys under "
        f"'{where or '<root>'}': {', '.join(sorted(fields))}.")
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


def from_config_dict(config: Any) -> ExperimentConfig:
  """Validates and converts a ConfigDict (or dict) into an ExperimentConfig.

  Raises:
    ValueError: naming any key that no code reads, or a value of the wrong type.

  >>> from_config_dict({"rl": {"steps": 3}}).rl.steps
  3
  """
  cfg = _convert(ExperimentConfig, to_plain(config), "")
  validate(cfg)
  return cfg


def validate(cfg: ExperimentConfig) -> None:
  """Checks that can be made before anything is built or compiled."""
  from rollouts_jax.models import SUPPORTED_MODEL_TYPES  # pylint: disable=g-import-not-at-top
  m = cfg.model
  if m.init not in ("sft", "hf", "random"):
    raise ValueError(f"model.init must be 'sft', 'hf' or 'random', got {m.init!r}.")
  if m.init == "hf":
    if not m.hf_path:
      raise ValueError("model.init='hf' needs model.hf_path, a local folder in Hugging Face layout.")
    if not os.path.isfile(os.path.join(m.hf_path, "config.json")):
      raise FileNotFoundError(f"model.hf_path={m.hf_path!r} has no config.json (no download is attempted; "
                              "put the checkpoint folder there).")
  elif m.model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"Unsupported model.model_type {m.model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
  if m.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"model.dtype must be float32 or bfloat16, got {m.dtype!r}.")
  if cfg.rl.prompts_per_step % cfg.rl.num_minibatches:
    raise ValueError(f"rl.prompts_per_step {cfg.rl.prompts_per_step} must be divisible by rl.num_minibatches "
                     f"{cfg.rl.num_minibatches}.")
  rows = cfg.rl.prompts_per_step * cfg.rl.num_samples // cfg.rl.num_minibatches
  if cfg.rl.micro_batch_size and rows % cfg.rl.micro_batch_size:
    raise ValueError(f"Minibatch rows {rows} (prompts_per_step * num_samples / num_minibatches) must be "
                     f"divisible by rl.micro_batch_size {cfg.rl.micro_batch_size}.")
  if cfg.rl.loss_kind not in ("ppo_clip", "gspo", "cispo"):
    raise ValueError(f"rl.loss_kind must be ppo_clip, gspo or cispo, got {cfg.rl.loss_kind!r}.")
  if cfg.data.template not in ("plain", "chat"):
    raise ValueError(f"data.template must be 'plain' or 'chat', got {cfg.data.template!r}.")
  if cfg.rl.fp4_rollouts not in ("", "nvfp4", "mxfp4"):
    raise ValueError(f"rl.fp4_rollouts must be '', 'nvfp4' or 'mxfp4', got {cfg.rl.fp4_rollouts!r}.")
  if cfg.rl.sol_pool_size and cfg.rl.sol_pool_size < cfg.rl.num_samples:
    raise ValueError(f"rl.sol_pool_size {cfg.rl.sol_pool_size} must be >= rl.num_samples {cfg.rl.num_samples}.")
  if cfg.rl.sol_select not in ("contrastive", "deviation", "random"):
    raise ValueError(f"rl.sol_select must be contrastive, deviation or random, got {cfg.rl.sol_select!r}.")
  if cfg.data.task not in ("arithmetic", "countdown"):
    from rollouts_jax.data import benchmarks  # pylint: disable=g-import-not-at-top
    benchmarks.benchmark_file(cfg.data.task, "test", cfg.data.manual_dir or None)  # names the missing file
  if cfg.tokenizer.kind not in ("char", "sentencepiece", "hf"):
    raise ValueError(f"tokenizer.kind must be char, sentencepiece or hf, got {cfg.tokenizer.kind!r}.")


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
  config.rl.prompts_per_step = 4
  config.rl.num_minibatches = 1
  config.rl.micro_batch_size = 0
  config.rl.num_samples = min(config.rl.num_samples, 5)
  config.rl.max_new_tokens = min(config.rl.max_new_tokens, 16)
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
