"""Hugging Face checkpoints: `config.json` + one or many `*.safetensors` shards."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rollouts_jax.models.config import ModelConfig, config_from_hf, config_to_hf
from rollouts_jax.models import lora
from rollouts_jax.models.transformer import Params, param_shapes

_LAYER = "model.layers.{i}."
# our per-layer name -> (HF suffix, transpose?)
_LAYER_NAMES = {
    "input_norm": ("input_layernorm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def _np_dtype(dtype) -> np.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"Unsupported checkpoint dtype {dtype}; use float32, bfloat16 or float16.")
  return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


class _TensorIndex:
  """Which shard holds each tensor; opens shards lazily."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
      weight_map = json.loads(index_file.read_text())["weight_map"]
      self.where = {name: path / fname for name, fname in weight_map.items()}
    else:
      files = sorted(path.glob("*.safetensors"))
      if not files:
        raise FileNotFoundError(f"No *.safetensors files in checkpoint folder {path}.")
      self.where = {}
      for f in files:
        with safe_open(f, framework="np") as h:
          for name in h.keys():
            self.where[name] = f
    self._open: dict[pathlib.Path, Any] = {}

  def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.where:
      raise KeyError(f"Checkpoint {self.path} is missing tensor {name!r}.")
    f = self.where[name]
    if f not in self._open:
      if not f.exists():
        raise FileNotFoundError(f"Shard {f.name} listed for tensor {name!r} does not exist in {self.path}.")
      self._open[f] = safe_open(f, framework="np")
    h = self._open[f]
    shape = tuple(h.get_slice(name).get_shape())
    if shape != tuple(expected_shape):
      raise ValueError(
          f"Tensor {name!r} has shape {shape} in the checkpoint, but config.json implies {tuple(expected_shape)}.")
    return h.get_tensor(name)


def _hf_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], str, bool, int | None]]:
  """Yields (our path, HF name, transpose, layer index) for every tensor."""
  shapes = param_shapes(cfg)
  for key in shapes:
    if key != "layers":
      hf_name, t = _TOP_NAMES[key]
      yield (key,), hf_name, t, None
  for key in shapes["layers"]:
    suffix, t = _LAYER_NAMES[key]
    for i in range(cfg.num_layers):
      yield ("layers", key), _LAYER.format(i=i) + suffix, t, i


def load_hf_checkpoint(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
  """Loads a Hugging Face Llama / Qwen2 / Qwen3 checkpoint from a local folder.

  Args:
    path: folder with `config.json` and `model.safetensors` (or shards with
      `model.safetensors.index.json`).
    dtype: parameter dtype (float32 or bfloat16).
  Returns:
    (cfg, params).
  Raises:
    ValueError: unsupported `model_type`, or a tensor whose shape disagrees with config.json.
    KeyError: a tensor missing from the checkpoint (named in the message).

  cfg, params = load_hf_checkpoint("path/to/Qwen2.5-0.5B", jnp.bfloat16)
  """
  path = pathlib.Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"No config.json in checkpoint folder {path}.")
  cfg = config_from_hf(json.loads(cfg_file.read_text()))
  index = _TensorIndex(path)
  np_dtype = _np_dtype(dtype)
  shapes = param_shapes(cfg)
  stacks: dict[str, list] = {k: [None] * cfg.num_layers for k in shapes["layers"]}
  params: Params = {"layers": {}}
  for our, hf_name, transpose, layer in _hf_names(cfg):
    shape = shapes["layers"][our[1]][1:] if layer is not None else shapes[our[0]]
    hf_shape = shape[::-1] if transpose else shape
    t = index.get(hf_name, hf_shape)
    t = (t.T if transpose else t).astype(np_dtype)
    if layer is None:
      params[our[0]] = jnp.asarray(t)
    else:
      stacks[our[1]][layer] = t
  for k, ts in stacks.items():
    params["layers"][k] = jnp.asarray(np.stack(ts))
  return cfg, params


def save_hf_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: Params,
                       max_shard_bytes: int | None = None) -> None:
  """Writes `cfg` and `params` as a Hugging Face folder that `transformers` loads.

  Args:
    path: output folder (created).
    cfg: model configuration.
    params: params pytree (plain arrays, or a LoRA policy, whose adapters are merged first;
      quantized params cannot be saved this way).
    max_shard_bytes: split into several shards plus an index file past this size.

  save_hf_checkpoint("/tmp/ckpt", cfg, params)
  """
  params = lora.merged(params)   # a LoRA policy is written as base + adapters
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  shapes = param_shapes(cfg)
  got = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
  if got != shapes:
    raise ValueError(f"params do not match the config: expected shapes {shapes}, got {got}.")
  dtype = jnp.dtype(params["embed"].dtype)
  np_dtype = _np_dtype(dtype)
  host = jax.device_get(params)
  tensors: dict[str, np.ndarray] = {}
  for our, hf_name, transpose, layer in _hf_names(cfg):
    t = host[our[0]] if layer is None else host["layers"][our[1]][layer]
    t = np.asarray(t).astype(np_dtype)
    tensors[hf_name] = np.ascontiguousarray(t.T if transpose else t)
  hf_cfg = config_to_hf(cfg, torch_dtype={"float32": "float32", "bfloat16": "bfloat16",
                                          "float16": "float16"}[dtype.name])
  (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return
  shards, current, size = [], {}, 0
  for name, t in tensors.items():
    if current and size + t.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = t
    size += t.nbytes
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(path / fname), metadata={"format": "pt"})
    weight_map.update({name: fname for name in shard})
  (path / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
