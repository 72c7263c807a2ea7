"""ModelConfig: the static description of a Llama / Qwen2 / Qwen3 decoder."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
COMPUTE_DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Frozen, hashable configuration of a decoder-only transformer.

  Covers the Llama 3, Qwen2 / Qwen2.5 and Qwen3 families: RMSNorm, rotary
  embeddings (optionally Llama-3 or linear scaled), grouped-query attention,
  SwiGLU MLP, optional QKV bias (Qwen2), optional per-head q/k RMSNorm (Qwen3),
  tied or untied embeddings.

  >>> cfg = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64,
  ...                   intermediate_size=128, num_layers=2, num_heads=4,
  ...                   num_kv_heads=2)
  >>> cfg.head_dim
  16
  """

  model_type: str = "llama"
  vocab_size: int = 32000
  hidden_size: int = 256
  intermediate_size: int = 512
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None  # None: hidden_size // num_heads.
  rope_theta: float = 10000.0
  # Scaling as sorted (key, value) pairs so the config stays hashable; None = none.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  # Checkpoint activations of each layer in the backward pass (saves memory when training).
  remat: bool = False
  # The dtype the model computes in: "" = the parameters' own; "bfloat16" = every floating
  # parameter is cast to bf16 where the model reads it (`models.compute_params`), so the
  # activations and the KV cache are bf16 while stored parameters, their gradients and the
  # optimizer state keep the parameters' dtype (fp32 master weights). Logits stay float32.
  compute_dtype: str = ""
  # The residual stream's dtype: "" = the (compute) parameters' dtype; "float32" = the residual
  # stream, norms, attention and elementwise math in float32 while each matmul takes its
  # operands in the weight's dtype and accumulates in float32 (with bf16 weights: bf16 matmuls,
  # fp32 residual, the usual mixed-precision sampler; it keeps the sampler/trainer gap small).
  activation_dtype: str = ""
  # Ids at or past this are never produced (their logits are -inf everywhere the model is
  # scored or sampled): a padded embedding's rows the tokenizer cannot decode. 0: every row.
  vocab_limit: int = 0

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"Unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}.")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}.")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}.")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if self.rope_scaling is not None:
      rope_type = self.rope_scaling_dict.get("rope_type", self.rope_scaling_dict.get("type", "default"))
      if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"Unsupported compute_dtype {self.compute_dtype!r}; supported: "
                       f"{', '.join(map(repr, COMPUTE_DTYPES))}.")
    if self.activation_dtype not in ("", "float32"):
      raise ValueError(f"Unsupported activation_dtype {self.activation_dtype!r}; supported: '', 'float32'.")
    if not 0 <= self.vocab_limit <= self.vocab_size:
      raise ValueError(f"vocab_limit {self.vocab_limit} must be in [0, vocab_size={self.vocab_size}].")

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  @property
  def num_groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    """Number of parameters (embeddings included)."""
    d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += hd * (self.num_heads + 2 * self.num_kv_heads)
    if self.o_bias:
      attn += d
    if self.qk_norm:
      attn += 2 * hd
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * layer + d + head

  def inv_freq(self) -> np.ndarray:
    """Rotary inverse frequencies [head_dim // 2], with the checkpoint's scaling applied."""
    hd = self.head_dim
    inv = 1.0 / (self.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = self.rope_scaling_dict
    rope_type = s.get("rope_type", s.get("type", "default"))
    if rope_type == "linear":
      inv = inv / float(s["factor"])
    elif rope_type == "llama3":
      factor = float(s["factor"])
      low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
      old_len = float(s["original_max_position_embeddings"])
      wavelen = 2 * math.pi / inv
      low_wavelen, high_wavelen = old_len / low, old_len / high
      scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
      smooth = (old_len / wavelen - low) / (high - low)
      smoothed = (1 - smooth) * scaled / factor + smooth * scaled
      medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
  """Reads rope theta and scaling from either the legacy or the `rope_parameters` layout."""
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  theta = hf.get("rope_theta")
  if isinstance(params, Mapping):
    theta = params.get("rope_theta", theta)
    if params.get("rope_type", "default") != "default":
      scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  if isinstance(scaling, Mapping):
    scaling = dict(scaling)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
      scaling = None
  else:
    scaling = None
  return float(theta if theta is not None else 10000.0), scaling


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face `config.json` dict."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"Unsupported model_type {model_type!r} in config.json; supported: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
  if hf.get("use_sliding_window"):
    raise ValueError("Sliding-window attention (use_sliding_window=true) is not supported.")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=true is not supported.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"Unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported.")
  theta, scaling = _rope_from_hf(hf)
  eos = hf.get("eos_token_id")
  eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
  attention_bias = bool(hf.get("attention_bias", False))
  num_heads = int(hf["num_attention_heads"])
  return ModelConfig(
      model_type=model_type,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=hf.get("head_dim"),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type != "llama")),
      qkv_bias=(model_type == "qwen2") or attention_bias,
      o_bias=(model_type in ("llama", "qwen3")) and attention_bias,
      qk_norm=(model_type == "qwen3"),
      max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos,
      pad_token_id=hf.get("pad_token_id"),
  )


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """The Hugging Face `config.json` dict for `cfg`."""
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
  hf = {
      "architectures": [arch[cfg.model_type]],
      "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "torch_dtype": torch_dtype,
      "dtype": torch_dtype,
  }
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = cfg.rope_scaling_dict
  if cfg.model_type in ("llama", "qwen3"):
    if cfg.qkv_bias != cfg.o_bias:
      raise ValueError(f"{cfg.model_type} checkpoints have either all attention biases or none.")
    hf["attention_bias"] = cfg.qkv_bias
  elif cfg.o_bias or not cfg.qkv_bias:
    raise ValueError("qwen2 checkpoints have q/k/v biases and no output-projection bias.")
  if cfg.model_type == "llama":
    hf["mlp_bias"] = False
  else:
    hf["use_sliding_window"] = False
  if cfg.bos_token_id is not None:
    hf["bos_token_id"] = cfg.bos_token_id
  if cfg.eos_token_ids:
    hf["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
  if cfg.pad_token_id is not None:
    hf["pad_token_id"] = cfg.pad_token_id
  return hf
