"""Multi-turn decoding: conversations continue from their KV cache across turns.

B prompts, N conversations each (R = B * N rows), T = `max_new_tokens` completion slots per
row shared by every turn: the policy's tokens and the observations between its turns sit in
one row, in order, as the trainer will see them. The primitives (each jitted once per shape;
a turn count never changes a shape):

    conv = start(cfg, params, prompt_ids, prompt_mask, config)        # each prompt prefilled once
    conv = decode_turn(cfg, params, conv, key, config, turn_tokens=32, stop_ids=...)
    conv = append(cfg, params, conv, obs_ids_RxO, obs_len_R)          # only the new tokens run

`decode_turn` decodes every running row until its turn ends: an EOS, a stop sequence (the
tokenizer's ids of e.g. `</tool_call>`) ending inside this turn, `turn_tokens` tokens, or a
full row. `append` writes each row's observation ids into the row after its last token and
runs only those tokens through the model, against the prompt's keys (stored once per
prompt) and the row's own cache, so nothing earlier is recomputed and nothing is re-encoded.
Observation positions keep `mask` False and log-prob 0: they are context, not actions.

`append(..., mode="reprefill")` is the baseline that the KV continuation saves: it re-runs
the prompt and the whole history of every row through the model after each observation
(`experiments/benchmarks/bench_multiturn.py` times one against the other). Both modes sample the same
tokens from the same key (each row draws its uniform by completion position).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.kernels import decode_attention
from rollouts_jax.models import transformer
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.config import SamplingConfig, bucket_length, check_prompts, left_pad_to

MODES = ("kv", "reprefill")


@flax.struct.dataclass
class Conversations:
  """R = B * N conversations between turns (a pytree of device arrays).

  Attributes:
    prompt_ids, prompt_mask: int32 / bool [B, P], the bucketed, left-padded prompts.
    prompt_k, prompt_v: per layer [B, K, P, Dh], each prompt's keys and values (once per prompt).
    next_pos: int32 [B], the rotary position of each prompt's first completion token.
    kt, v: per layer [R, K, Dh, T] / [R, K, T, Dh], each row's completion keys and values.
    logits: float32 [R, V], the next-token logits after each row's last token.
    tokens: int32 [R, T], the completion so far (policy and observation tokens; pad after).
    mask: bool [R, T], True at the policy's tokens only.
    logprobs, policy_logprobs, entropy: float32 [R, T], the sampler's values at policy tokens.
    length: int32 [R], tokens in each row so far.
    done: bool [R], rows whose episode is over (they decode nothing more).
  """
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  prompt_k: tuple
  prompt_v: tuple
  next_pos: jax.Array
  kt: tuple
  v: tuple
  logits: jax.Array
  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  policy_logprobs: jax.Array
  entropy: jax.Array
  length: jax.Array
  done: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1))
def _start_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids, prompt_mask):
  prompt_k, prompt_v, first_BxV, next_pos = engine.prefill(cfg, config, params, prompt_ids, prompt_mask)
  B, N, T = prompt_ids.shape[0], config.num_samples, config.max_new_tokens
  R, K, Dh = B * N, cfg.num_kv_heads, cfg.head_dim
  dtype = prompt_k[0].dtype
  zeros = jnp.zeros((R, T), jnp.float32)
  return Conversations(
      prompt_ids=prompt_ids, prompt_mask=prompt_mask, prompt_k=prompt_k, prompt_v=prompt_v, next_pos=next_pos,
      kt=tuple(jnp.zeros((R, K, Dh, T), dtype) for _ in range(cfg.num_layers)),
      v=tuple(jnp.zeros((R, K, T, Dh), dtype) for _ in range(cfg.num_layers)),
      logits=jnp.repeat(first_BxV, N, axis=0), tokens=jnp.full((R, T), config.pad_id, jnp.int32),
      mask=jnp.zeros((R, T), bool), logprobs=zeros, policy_logprobs=zeros, entropy=zeros,
      length=jnp.zeros((R,), jnp.int32), done=jnp.zeros((R,), bool))


def start(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, config: SamplingConfig) -> Conversations:
  """N empty conversations per prompt: each prompt bucketed, left-padded and prefilled once.

  Args:
    cfg, params: the policy.
    prompt_ids, prompt_mask: int32 / bool [B, P], left-padded (the `sampling.sample` contract).
    config: the sampler's settings (N = num_samples, T = max_new_tokens for all turns together).

  Returns:
    `Conversations` with no completion tokens yet.
  """
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  ids, mask = left_pad_to(prompt_ids, prompt_mask, bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets),
                          config.pad_id)
  return _start_jit(cfg, config, params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode_turn_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, conv: Conversations, key,
                     turn_tokens, stop_ids_SxL, stop_len_S):
  params = models.compute_params(cfg, params)
  B = conv.prompt_mask.shape[0]
  R, T = conv.tokens.shape
  N = R // B
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(R, dtype=jnp.int32))
  prefix = engine.Prefix(layers=engine.layer_params(cfg, params), k=conv.prompt_k, v=conv.prompt_v,
                         mask=conv.prompt_mask, positions_R=jnp.repeat(conv.next_pos, N), offset_R=conv.length)
  state = engine.DecodeState(
      step=jnp.zeros((), jnp.int32), kt=conv.kt, v=conv.v, logits_RxV=conv.logits, tokens_RxT=conv.tokens,
      logprobs_RxT=conv.logprobs, policy_logprobs_RxT=conv.policy_logprobs, entropy_RxT=conv.entropy,
      mask_RxT=conv.mask, done_R=conv.done | (conv.length >= T))
  S, L = stop_ids_SxL.shape

  def body(s):
    nxt = engine.resume_step(cfg, config, params, prefix, row_keys, s)
    done = nxt.done_R | (nxt.step >= turn_tokens)
    if S:   # a stop sequence that ends at the position just written and starts inside this turn
      pos = conv.length + s.step
      idx = pos[:, None] - L + 1 + jnp.arange(L)[None, :]
      window = jnp.take_along_axis(nxt.tokens_RxT, jnp.clip(idx, 0, T - 1), axis=1)            # [R, L]
      same = (stop_ids_SxL[None] == window[:, None]) | (stop_ids_SxL[None] < 0)                # [R, S, L]
      hit = jnp.all(same, axis=-1) & (nxt.step >= stop_len_S)[None, :]
      done = done | jnp.any(hit, axis=-1)
    return nxt.replace(done_R=done)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_R), body, state)
  new = state.mask_RxT & (jnp.arange(T)[None, :] >= conv.length[:, None])
  return conv.replace(kt=state.kt, v=state.v, logits=state.logits_RxV, tokens=state.tokens_RxT, mask=state.mask_RxT,
                      logprobs=state.logprobs_RxT, policy_logprobs=state.policy_logprobs_RxT,
                      entropy=state.entropy_RxT, length=conv.length + jnp.sum(new, axis=1, dtype=jnp.int32))


def stop_array(stop_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Stop sequences as (int32 [S, L] right-aligned, -1 on the left; int32 [S] lengths).

  >>> a, n = stop_array([[5, 6], [7]])
  >>> a.tolist(), n.tolist()
  ([[5, 6], [-1, 7]], [2, 1])
  """
  stop_ids = [list(s) for s in stop_ids if len(s)]
  L = max((len(s) for s in stop_ids), default=1)
  arr = np.full((len(stop_ids), L), -1, np.int32)
  for i, s in enumerate(stop_ids):
    arr[i, L - len(s):] = s
  return arr, np.asarray([len(s) for s in stop_ids], np.int32)


def decode_turn(cfg: ModelConfig, params: Params, conv: Conversations, key: jax.Array, config: SamplingConfig, *,
                turn_tokens: int = 0, stop_ids: list[list[int]] | None = None) -> Conversations:
  """One policy turn of every row not `done`: decode until EOS, a stop sequence, `turn_tokens` or a full row.

  Row r writes completion positions length_r, length_r + 1, ...; its uniform at position t is
  a function of (key, r, t) only, so a row draws the same tokens whatever the other rows do
  and whichever mode appended the observations before.

  Args:
    cfg, params: the policy.
    conv: the conversations.
    key: PRNG key (the same one for every turn of an episode is fine: positions differ).
    config: the sampler's settings (EOS ids end a turn).
    turn_tokens: policy tokens per turn at most (0: no limit but the row's T slots).
    stop_ids: token-id sequences that end a turn when the turn's tokens end with one.

  Returns:
    The conversations with each running row's turn appended (`mask` True at the new tokens).
  """
  arr, lens = stop_array(stop_ids or [])
  T = config.max_new_tokens
  return _decode_turn_jit(cfg, config, params, conv, key, jnp.asarray(turn_tokens or T, jnp.int32),
                          jnp.asarray(arr), jnp.asarray(lens))


def _write_obs(conv: Conversations, obs_ids_RxO, obs_len_R):
  """The observation ids written after each row's last token (mask False, log-probs 0); their slots."""
  R, T = conv.tokens.shape
  O = obs_ids_RxO.shape[1]
  j = jnp.arange(O)[None, :]
  slot = conv.length[:, None] + j
  slot_w = jnp.where(j < obs_len_R[:, None], slot, T)          # T: dropped
  rows = jnp.arange(R)[:, None]
  put = lambda buf, val: buf.at[rows, slot_w].set(val, mode="drop")
  zero = jnp.zeros((R, O), jnp.float32)
  conv = conv.replace(tokens=put(conv.tokens, obs_ids_RxO.astype(jnp.int32)), mask=put(conv.mask, zero > 0),
                      logprobs=put(conv.logprobs, zero), policy_logprobs=put(conv.policy_logprobs, zero),
                      entropy=put(conv.entropy, zero))
  return conv, slot, slot_w


@functools.partial(jax.jit, static_argnums=(0,))
def _append_jit(cfg: ModelConfig, params: Params, conv: Conversations, obs_ids_RxO, obs_len_R):
  params = models.compute_params(cfg, params)
  B = conv.prompt_mask.shape[0]
  R, T = conv.tokens.shape
  N, O = R // B, obs_ids_RxO.shape[1]
  K, G, Dh = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  conv, slot, slot_w = _write_obs(conv, obs_ids_RxO, obs_len_R)
  rows = jnp.arange(R)[:, None]
  positions = jnp.repeat(conv.next_pos, N)[:, None] + slot
  x = transformer.embed(params, jnp.where(slot_w < T, obs_ids_RxO, 0), transformer.activation_dtype(cfg, params))
  visible = (jnp.arange(T)[None, None, :] <= slot[:, :, None])                        # [R, O, S]
  scale = Dh ** -0.5
  kts, vs = list(conv.kt), list(conv.v)
  for l, lp in enumerate(engine.layer_params(cfg, params)):
    q, k, v = transformer.qkv(cfg, lp, x, positions)
    kts[l] = kts[l].at[rows, :, :, slot_w].set(k.astype(kts[l].dtype), mode="drop")
    vs[l] = vs[l].at[rows, :, slot_w, :].set(v.astype(vs[l].dtype), mode="drop")
    qb = q.reshape(B, N, O, K, G, Dh)
    s1 = jnp.einsum("bnokgd,bkpd->bnkogp", qb, conv.prompt_k[l].astype(q.dtype), preferred_element_type=jnp.float32)
    s1 = jnp.where(conv.prompt_mask[:, None, None, None, None, :], s1 * scale, decode_attention.NEG_INF)
    s1 = s1.reshape(R, K, O, G, -1)
    qr = q.reshape(R, O, K, G, Dh)
    s2 = jnp.einsum("rokgd,rkds->rkogs", qr, kts[l].astype(q.dtype), preferred_element_type=jnp.float32)
    s2 = jnp.where(visible[:, None, :, None, :], s2 * scale, decode_attention.NEG_INF)
    p1, p2 = engine.two_part_softmax(s1, s2)
    o1 = jnp.einsum("bnkogp,bkpd->bnokgd", p1.reshape(B, N, K, O, G, -1), conv.prompt_v[l].astype(jnp.float32))
    o2 = jnp.einsum("rkogs,rksd->rokgd", p2, vs[l].astype(jnp.float32))
    o = o1.reshape(R, O, K, G, Dh) + o2
    x = transformer.finish_layer(cfg, lp, x, o.reshape(R, O, K * G * Dh).astype(x.dtype))
  last = jnp.maximum(obs_len_R - 1, 0)
  h = jnp.take_along_axis(x, last[:, None, None], axis=1)
  logits = models.unembed(cfg, params, h)[:, 0]
  has = obs_len_R > 0
  return conv.replace(kt=tuple(kts), v=tuple(vs), logits=jnp.where(has[:, None], logits, conv.logits),
                      length=conv.length + obs_len_R.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("width",))
def _reprefill_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, conv: Conversations, obs_ids_RxO,
                   obs_len_R, *, width: int):
  """The baseline: the observation written, then the prompt and the first `width` slots of every row re-run."""
  conv, _, _ = _write_obs(conv, obs_ids_RxO, obs_len_R)
  length = conv.length + obs_len_R.astype(jnp.int32)
  prompt_k, prompt_v, _, next_pos = engine.prefill(cfg, config, params, conv.prompt_ids, conv.prompt_mask)
  params = models.compute_params(cfg, params)
  B = conv.prompt_mask.shape[0]
  R, T = conv.tokens.shape
  N = R // B
  b = jnp.arange(R) // N
  hist = conv.tokens[:, :width]
  kts, vs, logits = engine.prefix_forward(cfg, params, tuple(x[b] for x in prompt_k), tuple(x[b] for x in prompt_v),
                                          conv.prompt_mask[b], next_pos[b], hist,
                                          jnp.arange(width)[None, :] < length[:, None])
  pad = T - width
  kt = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad))).astype(conv.kt[0].dtype) for x in kts)
  v = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(conv.v[0].dtype) for x in vs)
  has = obs_len_R > 0
  return conv.replace(kt=kt, v=v, logits=jnp.where(has[:, None], logits, conv.logits), length=length)


def append(cfg: ModelConfig, params: Params, conv: Conversations, obs_ids_RxO, obs_len_R, *, mode: str = "kv",
           config: SamplingConfig | None = None) -> Conversations:
  """Appends each row's observation ids after its last token and readies the next turn's logits.

  Args:
    cfg, params: the policy.
    conv: the conversations.
    obs_ids_RxO: int32 [R, O], row r's observation in its first `obs_len_R[r]` entries (pad
      O to a few bucket sizes so that few shapes compile).
    obs_len_R: int32 [R] (0: nothing appended; such a row keeps its logits). A row must have
      room: length + obs_len <= T.
    mode: "kv" (only the new tokens run, against the cache) or "reprefill" (the baseline:
      the prompt and every row's whole history run again; needs `config`).
    config: the sampler's settings (for "reprefill").

  Returns:
    The conversations with the observations in place (mask False) and `length` advanced.
  """
  obs_ids_RxO = jnp.asarray(obs_ids_RxO, jnp.int32)
  obs_len_R = jnp.asarray(obs_len_R, jnp.int32)
  if mode == "kv":
    return _append_jit(cfg, params, conv, obs_ids_RxO, obs_len_R)
  if mode == "reprefill":
    T = conv.tokens.shape[1]
    longest = int(jax.device_get(jnp.max(conv.length + obs_len_R)))
    width = min(T, max(16, -(-longest // 16) * 16))
    return _reprefill_jit(cfg, config, params, conv, obs_ids_RxO, obs_len_R, width=width)
  raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
