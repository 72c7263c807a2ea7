"""LoRA adapters on the decoder's projections: a small pure module over the params dict.

qwix's LoRA (the library Tunix uses) intercepts `dot_general` inside flax linen / nnx modules and
creates its adapters through their scopes; our decoder is a pure function over a params dict with
its layers stacked under `lax.scan`, so qwix would need a flax wrapper around it. Here a
`LoraWeight` node (base weight, A, B) stands where a projection's weight stands, and
`models.dense` applies it, so every forward, sampler and evaluator sees base + adapters.

    policy = lora.apply(base, lora.init_adapters(cfg, key, rank=8, targets=("q", "v")), alpha=16, rank=8)
    trainable, combine = lora.partition(policy)   # the adapters alone; combine(adapters) -> policy
    plain = lora.merged(policy)                   # W + (alpha / rank) A B, plain arrays (sampler, export)

The update (`training.rl_step`) differentiates and optimizes `trainable` only; the sampler merges
float32 weights once per call (`sampling_params`; bf16 weights keep the adapters applied);
`save_hf_checkpoint` and `quantize_params` merge first. Adapters keep float32 (the optimizer's
master copy) whatever the base's dtype.

Paper: LoRA, Hu et al. 2021 (arXiv 2106.09685); targets on every projection follow "LoRA Without
Regret" (Schulman et al., Thinking Machines 2025), which finds LoRA matches full RL fine-tuning.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.models.config import ModelConfig
from rollouts_jax.models.transformer import Params, param_shapes

#: The projections that can carry adapters (their names in `params["layers"]`).
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Our projection -> its module in a Hugging Face Llama / Qwen decoder layer (PEFT's adapter names).
_HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}

Adapters = dict[str, dict[str, jax.Array]]   # {"q": {"a": [L, in, r], "b": [L, r, out]}, ...}


@flax.struct.dataclass
class LoraWeight:
  """A projection's weight with its adapters: `x @ w + scale * (x @ a) @ b`.

  Attributes:
    w: the frozen base weight [..., in, out] (stacked layers lead).
    a: the down adapter [..., in, r] (random at init).
    b: the up adapter [..., r, out] (zeros at init, so the policy starts at the base).
    scale: alpha / rank (static).
  """
  w: Any
  a: jax.Array
  b: jax.Array
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  is_lora = True   # what `models.dense` dispatches on (no import of this module there)

  @property
  def shape(self):
    return self.w.shape

  @property
  def dtype(self):
    return self.w.dtype


def is_lora_weight(x) -> bool:
  """Whether `x` is a projection's weight with adapters (a `LoraWeight` node)."""
  return isinstance(x, LoraWeight)



def parse_targets(text: str | Sequence[str]) -> tuple[str, ...]:
  """The target projections of a comma string ("q,v") or a sequence, in order, without repeats.

  >>> parse_targets(" q, v,q ")
  ('q', 'v')
  """
  names = text.split(",") if isinstance(text, str) else list(text)
  return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


def check_targets(targets: str | Sequence[str], key: str = "lora.targets") -> tuple[str, ...]:
  """The parsed targets; a ValueError naming `key` for an empty list or an unknown name.

  >>> check_targets("q,qkv")
  Traceback (most recent call last):
  ...
  ValueError: Config key lora.targets: unknown projection 'qkv'; the model's projections: q, k, v, o, gate, up, down.
  """
  names = parse_targets(targets)
  if not names:
    raise ValueError(f"Config key {key} names no projection; choose from {', '.join(PROJECTIONS)}.")
  for n in names:
    if n not in PROJECTIONS:
      raise ValueError(f"Config key {key}: unknown projection {n!r}; the model's projections: "
                       f"{', '.join(PROJECTIONS)}.")
  return names


def scale_of(alpha: float, rank: int) -> float:
  """The adapters' scale alpha / rank (LoRA's convention, PEFT's without rsLoRA)."""
  return float(alpha) / int(rank)


def init_adapters(cfg: ModelConfig, key: jax.Array, rank: int, targets: str | Sequence[str] = PROJECTIONS,
                  dtype=jnp.float32) -> Adapters:
  """Fresh adapters for `targets`: A ~ N(0, 1 / in_features), B = 0 (the start equals the base).

  Args:
    cfg: the model configuration.
    key: a PRNG key (one split per target).
    rank: r > 0.
    targets: projection names (see `PROJECTIONS`), a sequence or a comma string.
    dtype: the adapters' dtype (float32: they are the trained master copy).
  Returns:
    {name: {"a": [L, in, r], "b": [L, r, out]}}.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
  ...                   num_heads=4, num_kv_heads=2)
  >>> ad = init_adapters(cfg, jax.random.key(0), rank=4, targets="q,down")
  >>> ad["q"]["a"].shape, ad["down"]["b"].shape
  ((2, 32, 4), (2, 4, 32))
  """
  if rank <= 0:
    raise ValueError(f"LoRA rank must be > 0, got {rank}.")
  names = check_targets(targets)
  shapes = param_shapes(cfg)["layers"]
  out: Adapters = {}
  for name, k in zip(names, jax.random.split(key, len(names))):
    L, fan_in, fan_out = shapes[name]
    a = jax.random.normal(k, (L, fan_in, rank), jnp.float32) / np.sqrt(fan_in)
    out[name] = {"a": a.astype(dtype), "b": jnp.zeros((L, rank, fan_out), dtype)}
  return out


def _delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale * A @ B over the stacked layers, in float32."""
  return scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))


def merge(base: Params, adapters: Adapters, alpha: float, rank: int) -> Params:
  """Plain params: each target's weight W + (alpha / rank) A B (in float32, cast to W's dtype).

  Args:
    base: the base params (plain arrays).
    adapters: from `init_adapters` (or trained).
    alpha, rank: the adapters' scale is alpha / rank.
  Returns:
    A params pytree of the base's structure and dtypes; leaves other than the targets are the
    base's own arrays.
  """
  s = scale_of(alpha, rank)
  layers = dict(base["layers"])
  for name, ab in adapters.items():
    w = layers[name]
    layers[name] = (w.astype(jnp.float32) + _delta(ab["a"], ab["b"], s)).astype(w.dtype)
  return dict(base, layers=layers)


def apply(base: Params, adapters: Adapters, alpha: float, rank: int) -> Params:
  """The policy params: each target's weight becomes a `LoraWeight(W, A, B, alpha / rank)`.

  Every function of the package that takes params (forward, the samplers, the evaluator, the
  update) takes this tree and computes with base + adapters.
  """
  if is_lora(base):
    raise ValueError("base already carries LoRA adapters; apply adapters to plain params.")
  s = scale_of(alpha, rank)
  layers = dict(base["layers"])
  for name, ab in adapters.items():
    if name not in layers:
      raise ValueError(f"Adapter target {name!r} is not a projection of these params ({', '.join(layers)}).")
    if tuple(ab["a"].shape[:2]) != tuple(layers[name].shape[:2]) or ab["b"].shape[-1] != layers[name].shape[-1]:
      raise ValueError(f"Adapters of {name!r} ({ab['a'].shape}, {ab['b'].shape}) do not fit its weight "
                       f"{layers[name].shape}.")
    layers[name] = LoraWeight(w=layers[name], a=ab["a"], b=ab["b"], scale=s)
  return dict(base, layers=layers)


def is_lora(params: Any) -> bool:
  """Whether a params tree carries adapters (`LoraWeight` nodes)."""
  return isinstance(params, Mapping) and isinstance(params.get("layers"), Mapping) and any(
      is_lora_weight(w) for w in params["layers"].values())


def adapters_of(params: Params) -> Adapters:
  """The adapters of a policy tree ({} without LoRA)."""
  if not is_lora(params):
    return {}
  return {n: {"a": w.a, "b": w.b} for n, w in params["layers"].items() if is_lora_weight(w)}


def base_of(params: Params) -> Params:
  """The base params of a policy tree (the tree itself without LoRA)."""
  if not is_lora(params):
    return params
  return dict(params, layers={n: w.w if is_lora_weight(w) else w for n, w in params["layers"].items()})


def merged(params: Params) -> Params:
  """Plain params of a policy tree (adapters merged into their weights); the same tree without LoRA.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
  ...                   num_heads=4, num_kv_heads=2)
  >>> from rollouts_jax.models.transformer import init_params
  >>> base = init_params(cfg, jax.random.key(0))
  >>> policy = apply(base, init_adapters(cfg, jax.random.key(1), rank=4), alpha=8.0, rank=4)
  >>> bool(jnp.array_equal(merged(policy)["layers"]["q"], base["layers"]["q"]))   # B = 0 at init
  True
  >>> merged(base) is base
  True
  """
  if not is_lora(params):
    return params
  layers = {}
  for n, w in params["layers"].items():
    if is_lora_weight(w):
      w = (w.w.astype(jnp.float32) + _delta(w.a, w.b, w.scale)).astype(w.w.dtype)
    layers[n] = w
  return dict(params, layers=layers)


def sampling_params(params: Params) -> Params:
  """The policy as a sampler computes it: adapters merged into float32 weights once per call.

  A weight stored in a narrower dtype (bf16) keeps its adapters applied (`x W + s (x A) B`):
  rounding W + s A B to bf16 would swallow updates below the weight's precision, so the sampler
  would not see small adapters at all. Identity without LoRA.
  """
  if not is_lora(params):
    return params
  layers = {}
  for n, w in params["layers"].items():
    if is_lora_weight(w) and getattr(w.w, "dtype", None) == jnp.float32:
      w = w.w + _delta(w.a, w.b, w.scale)
    layers[n] = w
  return dict(params, layers=layers)


def partition(params: Params) -> tuple[Any, Callable[[Any], Params]]:
  """(trainable, combine): the adapters and `combine(adapters) -> policy` over the same base.

  Without LoRA the trainable part is the whole tree and `combine` is the identity, so the update
  reads the same either way: it differentiates, clips and optimizes `trainable` only, and the
  frozen base never enters the optimizer state or a gradient.
  """
  if not is_lora(params):
    return params, lambda t: t
  layers = params["layers"]

  def combine(adapters: Adapters) -> Params:
    new = dict(layers)
    for n, ab in adapters.items():
      new[n] = layers[n].replace(a=ab["a"], b=ab["b"])
    return dict(params, layers=new)

  return adapters_of(params), combine


# ----------------------------------------------------------------------------------------------
# Adapters alone on disk: PEFT's layout (adapter_model.safetensors + adapter_config.json)
# ----------------------------------------------------------------------------------------------

def save_adapters(path: str | os.PathLike, adapters: Adapters, *, rank: int, alpha: float,
                  base_model: str = "") -> pathlib.Path:
  """Writes the adapters alone as a PEFT LoRA folder (`adapter_model.safetensors`, `adapter_config.json`).

  Tensor names follow PEFT over a Hugging Face Llama / Qwen decoder:
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
  [out, r] (torch's Linear layout, our A and B transposed), so `load_adapters` and PEFT read it.

  Returns:
    The folder.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  host = jax.device_get(adapters)
  tensors = {}
  for name, ab in host.items():
    a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
    for i in range(a.shape[0]):
      prefix = f"base_model.model.model.layers.{i}.{_HF_MODULES[name]}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
            "target_modules": [_HF_MODULES[n].split(".")[-1] for n in host], "lora_dropout": 0.0,
            "bias": "none", "base_model_name_or_path": base_model, "rollouts_jax_targets": list(host)}
  (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
  return path


def load_adapters(path: str | os.PathLike) -> tuple[Adapters, int, float]:
  """(adapters, rank, alpha) of a folder written by `save_adapters` (float32 arrays)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  config = json.loads((path / ADAPTER_CONFIG).read_text())
  tensors = load_file(str(path / ADAPTER_FILE))
  names = config.get("rollouts_jax_targets") or [n for n, m in _HF_MODULES.items()
                                                  if m.split(".")[-1] in config["target_modules"]]
  out: Adapters = {}
  for name in names:
    a, b, i = [], [], 0
    while f"base_model.model.model.layers.{i}.{_HF_MODULES[name]}.lora_A.weight" in tensors:
      prefix = f"base_model.model.model.layers.{i}.{_HF_MODULES[name]}"
      a.append(tensors[f"{prefix}.lora_A.weight"].T)
      b.append(tensors[f"{prefix}.lora_B.weight"].T)
      i += 1
    if not a:
      raise ValueError(f"{path / ADAPTER_FILE} has no adapters for {name!r} ({_HF_MODULES[name]}).")
    out[name] = {"a": jnp.asarray(np.stack(a)), "b": jnp.asarray(np.stack(b))}
  return out, int(config["r"]), float(config["lora_alpha"])
