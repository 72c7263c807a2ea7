"""FP4 policies: the decoder's linear weights as NVFP4 / MXFP4 tensors for cheap rollouts.

`quantize_params` turns each stacked linear weight of `params["layers"]` (q, k, v, o, gate,
up, down; `[L, in, out]`) into one `FP4Weight` whose arrays keep the leading `L` axis, so
`lax.scan` over layers slices a per-layer `[in, out]` FP4 tensor and `models.dense` runs it
through `fp4.matmul`. Norms, biases and the embedding table are left as they are (the
embedding is a table lookup, and the sampler reads its dtype for the KV cache), so
`sampling.sample` takes the quantized pytree unchanged.

Choosing the matmul: `FP4Weight` is an `fp4.FP4Tensor` with one more static field,
`implementation` (`"xla"`: dequantize then dot; `"pallas"`: the dequant-in-tile kernel).
Being static, it is part of the pytree structure, so switching it recompiles instead of
silently reusing a trace. `models.dense` has to pass it on:
`fp4.matmul(x, w, implementation=getattr(w, "implementation", "pallas"))`; a plain
`FP4Tensor` keeps the `fp4.matmul` default.

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916) samples its rollout pool with an
NVFP4 copy of the policy (embedders and the final layer kept in high precision) and trains
in full precision.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import flax.struct
import jax
import jax.numpy as jnp

from rollouts_jax.kernels import fp4
from rollouts_jax.models.config import ModelConfig
from rollouts_jax.models import lora
from rollouts_jax.models.transformer import Params, param_shapes

LINEAR_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")
TOP_LEVEL_WEIGHTS = ("embed", "lm_head")
DEFAULT_SKIP = ("embed", "lm_head")


@flax.struct.dataclass
class FP4Weight(fp4.FP4Tensor):
  """An `fp4.FP4Tensor` that also names the matmul implementation to run it with.

  Attributes:
    implementation: `"xla"` (dequantize, then a float32 dot) or `"pallas"` (the kernel;
      interpret mode on CPU). Static: part of the pytree structure.

  Stacked layer weights hold arrays with a leading `L` axis and the per-layer `shape`.

  >>> w = FP4Weight(**vars(fp4.quantize(jnp.ones((16, 8)))), implementation="xla")
  >>> isinstance(w, fp4.FP4Tensor), w.implementation
  (True, 'xla')
  """
  implementation: str = flax.struct.field(pytree_node=False, default="xla")


def default_implementation() -> str:
  """`"xla"` on CPU (the Pallas kernel only runs interpreted there), `"pallas"` elsewhere."""
  return "xla" if jax.default_backend() == "cpu" else "pallas"


def _check_args(cfg: ModelConfig, params: Params, fmt: str, skip: tuple[str, ...],
                implementation: str) -> None:
  if fmt not in fp4.FORMATS:
    raise ValueError(f"Unknown FP4 format {fmt!r}; expected one of {fp4.FORMATS}.")
  if implementation not in fp4.IMPLEMENTATIONS:
    raise ValueError(f"Unknown matmul implementation {implementation!r}; expected one of "
                     f"{fp4.IMPLEMENTATIONS}.")
  unknown = [s for s in skip if s not in LINEAR_WEIGHTS + TOP_LEVEL_WEIGHTS]
  if unknown:
    raise ValueError(f"skip names unknown weights {unknown}; known: "
                     f"{LINEAR_WEIGHTS + TOP_LEVEL_WEIGHTS}.")
  if not isinstance(params, dict) or "layers" not in params or "embed" not in params:
    raise ValueError("params must be a decoder params dict with 'embed' and 'layers'.")
  shapes = param_shapes(cfg)
  candidates = [(params["layers"].get(n), shapes["layers"][n], f"layers/{n}") for n in LINEAR_WEIGHTS]
  if "lm_head" in shapes:
    candidates.append((params.get("lm_head"), shapes["lm_head"], "lm_head"))
  for w, shape, name in candidates:
    if isinstance(w, fp4.FP4Tensor):
      raise ValueError(f"{name} is already quantized; quantize the full-precision params.")
    if w is None or tuple(w.shape) != tuple(shape):
      got = None if w is None else tuple(w.shape)
      raise ValueError(f"{name} has shape {got}, expected {tuple(shape)} for this ModelConfig.")


def _as_weight(q: fp4.FP4Tensor, implementation: str) -> FP4Weight:
  return FP4Weight(codes=q.codes, block_scales=q.block_scales, tensor_scale=q.tensor_scale,
                   fmt=q.fmt, shape=q.shape, dtype=q.dtype, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("fmt", "scale_rounding", "implementation"))
def _quantize_jit(layer_weights: dict[str, jax.Array], head: jax.Array | None, *, fmt: str,
                  scale_rounding: str, implementation: str):
  """Quantizes stacked `[L, K, N]` layer weights (vmapped over L) and an optional `[K, N]` head."""
  kwargs = {"scale_rounding": scale_rounding} if fmt == "mxfp4" else {}
  quantize_1 = lambda w: fp4.quantize(w, fmt, **kwargs)
  layers = {n: _as_weight(jax.vmap(quantize_1)(w), implementation) for n, w in layer_weights.items()}
  return layers, None if head is None else _as_weight(quantize_1(head), implementation)


def quantize_params(cfg: ModelConfig, params: Params, fmt: str = "nvfp4",
                    skip: Iterable[str] = DEFAULT_SKIP, implementation: str | None = None,
                    *, scale_rounding: str = "floor") -> Params:
  """An FP4 copy of a policy: its linear weights become `FP4Weight`s, the rest is shared.

  Args:
    cfg: the model configuration.
    params: full-precision params (see `models.param_shapes`).
    fmt: `"nvfp4"` (16-element blocks, E4M3 scales; ~0.56 bytes/weight) or `"mxfp4"`
      (32-element blocks, power-of-two scales; ~0.53 bytes/weight).
    skip: weights kept in full precision: any of `q, k, v, o, gate, up, down` (all layers)
      and `lm_head`. `embed` is never quantized (a table lookup); naming it is allowed.
      With tied embeddings the output head is the embedding, so it stays full precision.
    implementation: `"xla"` or `"pallas"` for every quantized weight; default
      `default_implementation()` (`"xla"` on CPU, `"pallas"` on accelerators).
    scale_rounding: MXFP4 only, `"floor"` (OCP) or `"ceil"`.

  Returns:
    A params pytree of the same structure in which the quantized entries are `FP4Weight`s
    (stacked over layers: arrays `[L, ...]`, static `shape` the per-layer `(in, out)`).
    Leaves that are not quantized are the input arrays themselves. Jitted: re-quantizing
    updated params of the same shapes does not recompile.

  Raises:
    ValueError: unknown format, implementation or skip name; params that do not match
      `cfg`; params that are already quantized.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
  ...                   num_layers=2, num_heads=4, num_kv_heads=2)
  >>> params = init_params(cfg, jax.random.key(0))  # doctest: +SKIP
  >>> qparams = quantize_params(cfg, params, "nvfp4", skip=("embed", "lm_head"))  # doctest: +SKIP
  >>> qparams["layers"]["q"].codes.shape  # [L, in / 2, out]  # doctest: +SKIP
  (2, 16, 32)

  Paper: Sol-RL (arXiv 2604.06916): NVFP4 rollouts, full-precision training.
  """
  skip = tuple(skip)
  params = lora.merged(params)   # a LoRA policy quantizes as base + adapters
  implementation = default_implementation() if implementation is None else implementation
  _check_args(cfg, params, fmt, skip, implementation)
  if fmt == "nvfp4" and scale_rounding != "floor":
    raise ValueError("scale_rounding applies to mxfp4 only (nvfp4 scales are E4M3).")
  names = tuple(n for n in LINEAR_WEIGHTS if n not in skip)
  quantize_head = "lm_head" in params and "lm_head" not in skip
  # Only the weights to quantize enter the jitted function, so every other leaf of the
  # result is the very same array as in `params` (no copies).
  layers_q, head_q = _quantize_jit({n: params["layers"][n] for n in names},
                                   params["lm_head"] if quantize_head else None, fmt=fmt,
                                   scale_rounding=scale_rounding, implementation=implementation)
  out = dict(params)
  out["layers"] = {**params["layers"], **layers_q}
  if quantize_head:
    out["lm_head"] = head_q
  return out


def dequantize_params(params: Params, dtype: Any = None) -> Params:
  """Replaces every FP4 tensor of a params pytree by its dequantized array.

  Stacked tensors dequantize layer by layer. Useful as the numerical reference of a
  quantized policy (same values, plain matmuls).

  dequantize_params(quantize_params(cfg, params))["layers"]["q"].shape
  # (2, 32, 32)
  """
  def leaf(x):
    if not isinstance(x, fp4.FP4Tensor):
      return x
    if x.codes.ndim == 2:
      return fp4.dequantize(x, dtype)
    plain = fp4.FP4Tensor(codes=x.codes, block_scales=x.block_scales, tensor_scale=x.tensor_scale,
                          fmt=x.fmt, shape=x.shape, dtype=x.dtype)
    return jax.vmap(lambda t: fp4.dequantize(t, dtype))(plain)
  return jax.tree_util.tree_map(leaf, params, is_leaf=lambda x: isinstance(x, fp4.FP4Tensor))


def param_bytes(params: Any) -> int:
  """Bytes held by the arrays of a pytree (FP4 tensors count codes and scales)."""
  return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(params)))


__all__ = ["DEFAULT_SKIP", "FP4Weight", "LINEAR_WEIGHTS", "default_implementation",
           "dequantize_params", "param_bytes", "quantize_params"]
