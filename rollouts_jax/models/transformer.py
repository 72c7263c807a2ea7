"""The decoder: a pure function of (config, params pytree, tokens).

Parameters of all layers are stacked along a leading `layers` axis and the layers
run under `lax.scan`, so compile time does not grow with depth. Linear weights are
stored as `[in, out]`. A weight may also be an FP4-quantized tensor (see
`models.quantize_params`); `dense` dispatches on its type.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.models.config import ModelConfig

Params = dict[str, Any]
_NEG_INF = -1e30  # finite, so rows with no visible key give a uniform softmax instead of NaN


def param_shapes(cfg: ModelConfig) -> Params:
  """The shape of every parameter, as a pytree of tuples (same structure as params)."""
  L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers = {
      "input_norm": (L, D), "q": (L, D, qd), "k": (L, D, kvd), "v": (L, D, kvd), "o": (L, qd, D),
      "post_norm": (L, D), "gate": (L, D, F), "up": (L, D, F), "down": (L, F, D),
  }
  if cfg.qkv_bias:
    layers.update(q_bias=(L, qd), k_bias=(L, kvd), v_bias=(L, kvd))
  if cfg.o_bias:
    layers["o_bias"] = (L, D)
  if cfg.qk_norm:
    layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
  shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def param_axes(cfg: ModelConfig) -> Params:
  """Logical axis names of every parameter (same structure as params).

  Names: `layers`, `vocab`, `embed`, `mlp`, `heads` (query heads x head_dim, flattened),
  `kv_heads` (key/value heads x head_dim), `norm` (a normalized feature, never sharded).
  """
  names = {
      "input_norm": ("layers", "norm"), "post_norm": ("layers", "norm"),
      "q": ("layers", "embed", "heads"), "k": ("layers", "embed", "kv_heads"),
      "v": ("layers", "embed", "kv_heads"), "o": ("layers", "heads", "embed"),
      "gate": ("layers", "embed", "mlp"), "up": ("layers", "embed", "mlp"),
      "down": ("layers", "mlp", "embed"),
      "q_bias": ("layers", "heads"), "k_bias": ("layers", "kv_heads"), "v_bias": ("layers", "kv_heads"),
      "o_bias": ("layers", "norm"), "q_norm": ("layers", "norm"), "k_norm": ("layers", "norm"),
  }
  top = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}
  shapes = param_shapes(cfg)
  axes = {k: top[k] for k in shapes if k != "layers"}
  axes["layers"] = {k: names[k] for k in shapes["layers"]}
  return axes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
  """Random parameters (normal, std 0.02; norms at 1; biases at 0).

  Args:
    cfg: the model configuration.
    key: a PRNG key.
    dtype: parameter dtype.
  Returns:
    A params pytree; see `param_shapes` for its structure.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
  ...                   num_layers=2, num_heads=4, num_kv_heads=2)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> params["layers"]["q"].shape
  (2, 32, 32)
  """
  shapes = param_shapes(cfg)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if name.endswith("norm"):
      leaves.append(jnp.ones(shape, dtype))
    elif name.endswith("bias"):
      leaves.append(jnp.zeros(shape, dtype))
    else:
      leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_quantized(x: Any) -> bool:
  return hasattr(x, "fmt")  # an FP4 tensor (rollouts_jax.kernels.fp4 / models.quantize)


def compute_params(cfg: ModelConfig, params: Params) -> Params:
  """The parameters as the model computes with them: cast to `cfg.compute_dtype`.

  Every floating array is cast; FP4-quantized weights (and any non-floating leaf) are left
  as they are. With `compute_dtype=""`, or when every array already has that dtype, the
  same pytree comes back untouched, so calling it again on cast parameters (inside a
  decode loop, or in `forward` after the sampler cast once) adds nothing. Gradients flow
  through the cast: a loss of the cast parameters has gradients of the stored dtype.

  XLA:CPU computes a bf16 matmul in float32 (it converts both operands), so on the CPU bf16
  compute saves neither memory nor time; it is meant for accelerators with bf16 matmuls.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
  ...                   num_heads=4, num_kv_heads=2, compute_dtype="bfloat16")
  >>> p = compute_params(cfg, init_params(cfg, jax.random.key(0)))
  >>> p["embed"].dtype, p["layers"]["q"].dtype
  (dtype(bfloat16), dtype(bfloat16))
  >>> compute_params(cfg, p) is p
  True
  """
  if not cfg.compute_dtype:
    return params
  dtype = jnp.dtype(cfg.compute_dtype)
  needs_cast = lambda x: (not _is_quantized(x) and hasattr(x, "dtype")
                          and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype)
  leaves = jax.tree_util.tree_leaves(params, is_leaf=_is_quantized)
  if not any(needs_cast(x) for x in leaves):
    return params
  return jax.tree_util.tree_map(lambda x: x.astype(dtype) if needs_cast(x) else x, params,
                                is_leaf=_is_quantized)


def dense(x: jax.Array, w: Any) -> jax.Array:
  """`x[..., K] @ w[K, N]` for a plain weight, an FP4-quantized one or one with LoRA adapters."""
  if getattr(w, "is_lora", False):   # models.lora.LoraWeight: x W + scale (x A) B, adapters unmerged
    return dense(x, w.w) + (w.scale * dense(dense(x, w.a), w.b)).astype(x.dtype)
  if _is_quantized(w):  # a quantized tensor from rollouts_jax.kernels.fp4
    from rollouts_jax.kernels import fp4  # pylint: disable=g-import-not-at-top
    return fp4.matmul(x, w, implementation=getattr(w, "implementation", "pallas")).astype(x.dtype)
  # As a 2-D matmul: the weight gradient is then one [K, M] x [M, N] product. Left as a
  # [..., K] contraction, XLA:CPU computes it with several contracting dimensions on a slow
  # path (3x slower backward for [B, T, K] activations); elsewhere the reshape is free.
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  if jnp.dtype(w.dtype).itemsize < jnp.dtype(x.dtype).itemsize:   # e.g. bf16 weights, fp32 residual:
    y = jnp.dot(x2.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)  # bf16 operands
  else:
    y = jnp.dot(x2, w.astype(x.dtype))
  return y.reshape(lead + (w.shape[-1],))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def _rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angles_BxTxD = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
  x32 = x_BxTxHxD.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * jnp.cos(angles_BxTxD) + rotated * jnp.sin(angles_BxTxD)
  return out.astype(x_BxTxHxD.dtype)


def attend(cfg: ModelConfig, q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS) -> jax.Array:
  """Grouped-query attention of T queries over S keys where `mask` [B, T, S] is True; returns [B, T, H * D]."""
  B, T, H, D = q_BxTxHxD.shape
  K, G = cfg.num_kv_heads, cfg.num_groups
  q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, G, D)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                      preferred_element_type=jnp.float32) * (D ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxD.dtype)
  out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD)
  return out_BxTxKxGxD.reshape(B, T, H * D)


def qkv(cfg: ModelConfig, lp: Params, x_BxTxD, positions_BxT):
  """One layer's input norm and projections: rotary q [B, T, H, D], rotary k and v [B, T, K, D]."""
  B, T, _ = x_BxTxD.shape
  h = rms_norm(x_BxTxD, lp["input_norm"], cfg.rms_norm_eps)
  q, k, v = dense(h, lp["q"]), dense(h, lp["k"]), dense(h, lp["v"])
  if cfg.qkv_bias:
    q, k, v = q + lp["q_bias"].astype(q.dtype), k + lp["k_bias"].astype(k.dtype), v + lp["v_bias"].astype(v.dtype)
  q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
  k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  inv_freq = cfg.inv_freq()
  return _rope(q, positions_BxT, inv_freq), _rope(k, positions_BxT, inv_freq), v


def finish_layer(cfg: ModelConfig, lp: Params, x_BxTxD, attn_BxTxHD):
  """The rest of a layer after attention: output projection, residual, post-norm MLP, residual."""
  out = dense(attn_BxTxHD, lp["o"])
  if cfg.o_bias:
    out = out + lp["o_bias"].astype(out.dtype)
  x_BxTxD = x_BxTxD + out
  h = rms_norm(x_BxTxD, lp["post_norm"], cfg.rms_norm_eps)
  mlp = dense(jax.nn.silu(dense(h, lp["gate"])) * dense(h, lp["up"]), lp["down"])
  return x_BxTxD + mlp


def embed(params: Params, tokens_BxT, dtype):
  """Token embeddings [B, T, D] in `dtype`."""
  return jnp.take(params["embed"], tokens_BxT, axis=0).astype(dtype)


def activation_dtype(cfg: ModelConfig, params: Params):
  """The residual stream's dtype: `cfg.activation_dtype`, else the embedding's."""
  return jnp.dtype(cfg.activation_dtype) if cfg.activation_dtype else params["embed"].dtype


def unembed(cfg: ModelConfig, params: Params, x_BxTxD: jax.Array) -> jax.Array:
  """Final norm and output head: hidden states -> float32 logits."""
  h = rms_norm(x_BxTxD, params["final_norm"], cfg.rms_norm_eps)
  h2 = h.reshape(-1, h.shape[-1])  # 2-D for the same reason as in `dense`
  head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
  if cfg.tie_word_embeddings:
    logits = jnp.einsum("md,vd->mv", h2, head.astype(h.dtype), preferred_element_type=jnp.float32)
  elif hasattr(head, "fmt"):
    logits = dense(h2.astype(jnp.float32), head)
  else:
    logits = jnp.einsum("md,dv->mv", h2, head.astype(h.dtype), preferred_element_type=jnp.float32)
  if 0 < cfg.vocab_limit < cfg.vocab_size:   # padded rows no tokenizer id maps to: never produced
    logits = jnp.where(jnp.arange(logits.shape[-1]) < cfg.vocab_limit, logits, _NEG_INF)
  return logits.reshape(h.shape[:-1] + (logits.shape[-1],))


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """Rotary positions for left-padded rows: 0 at the first real token."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1, 0)


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden"))
def forward(cfg: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array | None = None,
            positions: jax.Array | None = None, *, return_hidden: bool = False) -> jax.Array:
  """Full causal forward pass.

  Args:
    cfg: model configuration (static).
    params: params pytree (cast to `cfg.compute_dtype` first, see `compute_params`).
    tokens: int32 [B, L].
    attention_mask: bool [B, L], True at real tokens; left padding is supported. Default: all True.
    positions: int32 [B, L] rotary positions. Default: counted from the first real token.
    return_hidden: return the final hidden states [B, L, D] (before the final norm) instead of logits.
  Returns:
    float32 logits [B, L, V] (or hidden states).

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
  ...                   num_layers=2, num_heads=4, num_kv_heads=2)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> forward(cfg, params, jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 64)
  """
  params = compute_params(cfg, params)
  B, L = tokens.shape
  mask_BxL = jnp.ones((B, L), bool) if attention_mask is None else attention_mask.astype(bool)
  if positions is None:
    positions = positions_from_mask(mask_BxL)
  causal_LxL = jnp.tril(jnp.ones((L, L), bool))
  attn_mask_BxLxL = causal_LxL[None] & mask_BxL[:, None, :]
  x = embed(params, tokens, activation_dtype(cfg, params))

  def layer(x_BxLxD, lp):
    q, k, v = qkv(cfg, lp, x_BxLxD, positions)
    return finish_layer(cfg, lp, x_BxLxD, attend(cfg, q, k, v, attn_mask_BxLxL)), None

  if cfg.remat:
    layer = jax.checkpoint(layer)
  x, _ = jax.lax.scan(layer, x, params["layers"])
  if return_hidden:
    return x
  return unembed(cfg, params, x)


def attend_shared_prompt(cfg: ModelConfig, q_GxSxTxHxD, k_GxPxKxD, v_GxPxKxD, prompt_mask_GxP,
                         k_GxSxTxKxD, v_GxSxTxKxD) -> jax.Array:
  """Attention of S completions per prompt over their one prompt's keys and their own (causal) keys.

  The values of `attend` over each row's prompt + completion, without repeating the prompt's keys
  and values S times. Returns [G * S, T, H * D].
  """
  G, S, T, H, D = q_GxSxTxHxD.shape
  K, Gq = cfg.num_kv_heads, cfg.num_groups
  P = k_GxPxKxD.shape[1]
  q = q_GxSxTxHxD.reshape(G, S, T, K, Gq, D)
  scale = D ** -0.5
  s_prompt = jnp.einsum("gstkhd,gpkd->gskhtp", q, k_GxPxKxD, preferred_element_type=jnp.float32) * scale
  s_prompt = jnp.where(prompt_mask_GxP[:, None, None, None, None, :], s_prompt, _NEG_INF)
  s_own = jnp.einsum("gstkhd,gsukd->gskhtu", q, k_GxSxTxKxD, preferred_element_type=jnp.float32) * scale
  s_own = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_own, _NEG_INF)
  probs = jax.nn.softmax(jnp.concatenate([s_prompt, s_own], axis=-1), axis=-1).astype(v_GxPxKxD.dtype)
  out = (jnp.einsum("gskhtp,gpkd->gstkhd", probs[..., :P], v_GxPxKxD)
         + jnp.einsum("gskhtu,gsukd->gstkhd", probs[..., P:], v_GxSxTxKxD))
  return out.reshape(G * S, T, H * D)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_shared_prompt(cfg: ModelConfig, params: Params, prompt_GxP: jax.Array, prompt_mask_GxP: jax.Array,
                          completion_GxSxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The final hidden states of S completions of each prompt, the prompt run once for all S.

  The same values (up to float rounding) as `forward(..., return_hidden=True)` on the rows
  prompt + completion (`types.teacher_forced_rows`: the prompt's mask, every completion slot
  visible), at (S - 1) / S fewer prompt-token passes through the layers: the update's groups share
  their prompt, so its projections and MLPs run once per group, and every completion attends to
  the one copy of its keys and values. Gradients reach the prompt's positions from all S rows.

  Args:
    cfg: model configuration (static).
    params: params pytree.
    prompt_GxP: int32 [G, P], left-padded prompts (the last position is a real token).
    prompt_mask_GxP: bool [G, P].
    completion_GxSxT: int32 [G, S, T], S completions of each prompt.
  Returns:
    (hidden [G, P, D] of the prompts, hidden [G, S, T, D] of the completions), before the final norm.
    A padding position of a prompt attends to nothing real; its hidden state (read by nothing) is
    not the row form's.

  >>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
  ...                   num_layers=2, num_heads=4, num_kv_heads=2)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> prompt, mask = jnp.array([[0, 5, 6]]), jnp.array([[False, True, True]])
  >>> comp = jnp.array([[[7, 8], [9, 10]]])
  >>> hp, hc = forward_shared_prompt(cfg, params, prompt, mask, comp)
  >>> rows = forward(cfg, params, jnp.array([[0, 5, 6, 7, 8], [0, 5, 6, 9, 10]]),
  ...                jnp.array([[False, True, True, True, True]] * 2), return_hidden=True)
  >>> bool(jnp.allclose(hc[0], rows[:, 3:], atol=1e-5)) and bool(jnp.allclose(hp[0, 1:], rows[0, 1:3], atol=1e-5))
  True
  """
  params = compute_params(cfg, params)
  G, P = prompt_GxP.shape
  _, S, T = completion_GxSxT.shape
  pmask_GxP = prompt_mask_GxP.astype(bool)
  pos_GxP = positions_from_mask(pmask_GxP)
  # A completion token continues its row's count of real tokens (as `positions_from_mask` on the row).
  pos_RxT = jnp.repeat(jnp.sum(pmask_GxP, axis=1, dtype=jnp.int32)[:, None] + jnp.arange(T)[None], S, axis=0)
  mask_GxPxP = jnp.tril(jnp.ones((P, P), bool))[None] & pmask_GxP[:, None, :]
  dtype = activation_dtype(cfg, params)
  xp = embed(params, prompt_GxP, dtype)
  xc = embed(params, completion_GxSxT.reshape(G * S, T), dtype)

  def layer(carry, lp):
    xp_GxPxD, xc_RxTxD = carry
    qp, kp, vp = qkv(cfg, lp, xp_GxPxD, pos_GxP)
    qc, kc, vc = qkv(cfg, lp, xc_RxTxD, pos_RxT)
    attn_p = attend(cfg, qp, kp, vp, mask_GxPxP)
    attn_c = attend_shared_prompt(cfg, qc.reshape(G, S, T, cfg.num_heads, cfg.head_dim), kp, vp, pmask_GxP,
                                  kc.reshape(G, S, T, cfg.num_kv_heads, cfg.head_dim),
                                  vc.reshape(G, S, T, cfg.num_kv_heads, cfg.head_dim))
    return (finish_layer(cfg, lp, xp_GxPxD, attn_p), finish_layer(cfg, lp, xc_RxTxD, attn_c)), None

  if cfg.remat:
    layer = jax.checkpoint(layer)
  (xp, xc), _ = jax.lax.scan(layer, (xp, xc), params["layers"])
  return xp, xc.reshape(G, S, T, -1)


@flax.struct.dataclass
class KVCache:
  """A fixed-length key/value cache for all layers.

  Attributes:
    k, v: [L, B, S, K, D] keys / values (post-rotary keys).
    mask: bool [B, S], True at slots that hold a real token.
    next_pos: int32 [B], rotary position of each row's next token.
    index: int32 scalar, the next slot to write (the same for all rows).
  """
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  next_pos: jax.Array
  index: jax.Array

  @property
  def length(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch_size: int, cache_len: int, dtype=jnp.float32) -> KVCache:
  """An empty cache of `cache_len` slots per row."""
  shape = (cfg.num_layers, batch_size, cache_len, cfg.num_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 mask=jnp.zeros((batch_size, cache_len), bool),
                 next_pos=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32))


def forward_with_cache(cfg: ModelConfig, params: Params, tokens: jax.Array, cache: KVCache,
                       token_mask: jax.Array | None = None, *, last_only: bool = False
                       ) -> tuple[jax.Array, KVCache]:
  """Runs `tokens` [B, T] through the model, appending them to the cache.

  Used for both prefill (T = prompt length, `token_mask` = the left-padded prompt mask)
  and decoding (T = 1). Slots `[index, index + T)` are written; the caller guarantees
  `index + T <= cache.length` (the sampler checks this before compiling).

  Args:
    cfg: model configuration (static).
    params: params pytree (cast to `cfg.compute_dtype` first, see `compute_params`).
    tokens: int32 [B, T].
    cache: the KV cache.
    token_mask: bool [B, T], False at padding. Default: all True.
    last_only: compute logits for the last position only (returns [B, 1, V]).
  Returns:
    (float32 logits [B, T, V] or [B, 1, V], updated cache).
  """
  params = compute_params(cfg, params)
  B, T = tokens.shape
  S = cache.length
  tmask_BxT = jnp.ones((B, T), bool) if token_mask is None else token_mask.astype(bool)
  positions_BxT = cache.next_pos[:, None] + jnp.cumsum(tmask_BxT.astype(jnp.int32), axis=1) - 1
  positions_BxT = jnp.maximum(positions_BxT, 0)
  slot_mask_BxS = jax.lax.dynamic_update_slice(cache.mask, tmask_BxT, (0, cache.index))
  slots_S = jnp.arange(S)
  visible_TxS = slots_S[None, :] <= (cache.index + jnp.arange(T))[:, None]
  attn_mask_BxTxS = visible_TxS[None] & slot_mask_BxS[:, None, :]
  x = embed(params, tokens, activation_dtype(cfg, params))

  def layer(carry, inputs):
    x_BxTxD, k_all, v_all = carry
    lp, l = inputs
    q, k, v = qkv(cfg, lp, x_BxTxD, positions_BxT)
    k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), (l, 0, cache.index, 0, 0))
    v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), (l, 0, cache.index, 0, 0))
    k_BxSxKxD = jax.lax.dynamic_index_in_dim(k_all, l, 0, keepdims=False).astype(q.dtype)
    v_BxSxKxD = jax.lax.dynamic_index_in_dim(v_all, l, 0, keepdims=False).astype(q.dtype)
    attn = attend(cfg, q, k_BxSxKxD, v_BxSxKxD, attn_mask_BxTxS)
    return (finish_layer(cfg, lp, x_BxTxD, attn), k_all, v_all), None

  (x, k_all, v_all), _ = jax.lax.scan(
      layer, (x, cache.k, cache.v), (params["layers"], jnp.arange(cfg.num_layers)))
  if last_only:
    x = x[:, -1:]
  logits = unembed(cfg, params, x)
  new_cache = KVCache(k=k_all, v=v_all, mask=slot_mask_BxS,
                      next_pos=cache.next_pos + jnp.sum(tmask_BxT, axis=1, dtype=jnp.int32),
                      index=cache.index + T)
  return logits, new_cache
