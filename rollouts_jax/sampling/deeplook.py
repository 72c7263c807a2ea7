"""DeepLook: confidence-triggered lookahead decoding, then a confidence-weighted vote.

Each of the N samples of a prompt owns a family of `k` decode rows (row 0 is the sample, the
others idle). While decoding, the sample's segment confidence S_t (the mean DeepConf token
confidence C over its last `window` positions) is compared with its recent history (the mean
C over the `history` positions before that segment). When S_t < history - `margin`, the
family expands: the idle rows receive a copy of the sample's KV-cache rows and outputs (a
gather over rows, under `lax.cond`, only on steps where some family starts or ends a
lookahead) and all k rows decode `horizon` tokens from their own random streams. After
`horizon` steps the continuation with the highest average lookahead confidence (mean C over
its lookahead positions) is copied into the sample's row, the others go idle again, and
decoding continues (the winner's lookahead tokens are kept, not recomputed; `rank_by="logprob"`
ranks by the continuations' mean token log-probability instead). At the end the
samples vote on their answers, each weighted by its confidence (`weighted_vote`).

C_t = -mean(log p) over the policy's top-`conf_top_k` tokens (DeepConf, arXiv 2508.15260).
DeepLook itself was not located; "lookahead confidence" is read as DeepConf's group
confidence over a forward window (see the project's method notes). Shapes are static: B x N x k
rows; idle rows run through the model like finished rows of `sampling.sample` and are not
counted in `generated_tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, Sequence

import flax
import jax
import jax.numpy as jnp

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.config import SampleOutput, SamplingConfig, bucket_length, check_prompts, left_pad_to
from rollouts_jax.sampling.tree import token_stats


@dataclasses.dataclass(frozen=True)
class DeepLookConfig:
  """Static DeepLook settings (hashable).

  Attributes:
    k: continuations compared at a lookahead (the sample's own included; 1: plain sampling).
    horizon: tokens decoded per lookahead continuation.
    window: positions in the segment confidence.
    history: positions before the segment that make its recent history.
    margin: trigger when segment confidence < history mean - margin.
    min_depth: no lookahead before this position.
    gap: positions between the end of one lookahead and the start of the next.
    max_lookaheads: lookaheads per sample at most.
    conf_top_k: k of the token confidence C_t.
    rank_by: what ranks the continuations, averaged over their lookahead positions:
      "confidence" (DeepConf's C_t) or "logprob" (the policy log-probability of each drawn
      token, i.e. the continuation's mean token likelihood).
  """
  k: int = 4
  horizon: int = 4
  window: int = 2
  history: int = 6
  margin: float = 0.5
  min_depth: int = 2
  gap: int = 2
  max_lookaheads: int = 4
  conf_top_k: int = 5
  rank_by: str = "confidence"

  def __post_init__(self):
    if self.rank_by not in ("confidence", "logprob"):
      raise ValueError(f"rank_by must be 'confidence' or 'logprob', got {self.rank_by!r}.")
    for name in ("k", "horizon", "window", "history", "gap", "max_lookaheads", "conf_top_k"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")

  def replace(self, **kwargs) -> "DeepLookConfig":
    return dataclasses.replace(self, **kwargs)


@flax.struct.dataclass
class DeepLookInfo:
  """Per-sample decoding statistics.

  Attributes:
    confidence: float32 [B, N]; mean token confidence over the sample's tokens (a vote weight).
    mean_logprob: float32 [B, N]; mean policy log-prob of the sample's tokens (exp of it: a vote weight).
    token_confidence: float32 [B, N, T]; C_t at each generated position (0 where masked).
    lookaheads: int32 [B, N]; lookaheads the sample ran.
    generated_tokens: int32 [B]; tokens decoded for the prompt, losing continuations included.
  """
  confidence: jax.Array
  mean_logprob: jax.Array
  token_confidence: jax.Array
  lookaheads: jax.Array
  generated_tokens: jax.Array


@flax.struct.dataclass
class _LookState:
  dec: Any
  conf_RxT: jax.Array
  look_start_F: jax.Array     # step the family's lookahead began (-1: none running)
  last_end_F: jax.Array
  count_F: jax.Array
  spent_B: jax.Array


def _select_rows(look_start_F, conf_RxT, mask_RxT, t, k):
  """Best family row by mean confidence over its positions [look_start, t)."""
  F = look_start_F.shape[0]
  pos = jnp.arange(conf_RxT.shape[1])
  sel = (pos[None] >= jnp.repeat(look_start_F, k)[:, None]) & (pos[None] < t) & mask_RxT
  score = jnp.sum(jnp.where(sel, conf_RxT, 0.0), axis=1) / jnp.maximum(jnp.sum(sel, axis=1), 1)
  return jnp.argmax(score.reshape(F, k), axis=1).astype(jnp.int32)


def _regather(st: _LookState, src_R, idle_R):
  dec = st.dec
  g = jax.tree_util.tree_map(lambda x: jnp.take(x, src_R, axis=0),
                             dict(kt=dec.kt, v=dec.v, logits=dec.logits_RxV, tokens=dec.tokens_RxT,
                                  lp=dec.logprobs_RxT, plp=dec.policy_logprobs_RxT, ent=dec.entropy_RxT,
                                  mask=dec.mask_RxT, done=dec.done_R, conf=st.conf_RxT))
  dec = dec.replace(kt=g["kt"], v=g["v"], logits_RxV=g["logits"], tokens_RxT=g["tokens"], logprobs_RxT=g["lp"],
                    policy_logprobs_RxT=g["plp"], entropy_RxT=g["ent"], mask_RxT=g["mask"],
                    done_R=g["done"] | idle_R)
  return st.replace(dec=dec, conf_RxT=g["conf"])


def _look_step(cfg, config, look: DeepLookConfig, params, prefix, row_keys_R, view, B, st: _LookState) -> _LookState:
  d = st.dec
  t = d.step
  k, h = look.k, look.horizon
  R = d.done_R.shape[0]
  F = R // k
  main = jnp.arange(F, dtype=jnp.int32) * k
  # ----- a lookahead that has run `horizon` steps ends: the best continuation takes the sample's row
  running = st.look_start_F >= 0
  ending = running & ((t - st.look_start_F >= h) | jnp.all(d.done_R.reshape(F, k), axis=1))
  rank = st.conf_RxT if look.rank_by == "confidence" else d.policy_logprobs_RxT
  best = _select_rows(st.look_start_F, rank, d.mask_RxT, t, k)
  # ----- a new lookahead starts where the sample's segment confidence fell below its history
  H, C = token_stats(d.logits_RxV, look.conf_top_k)
  main_live = ~d.done_R[main]
  conf_main = st.conf_RxT[main]
  pos = jnp.arange(conf_main.shape[1])
  seg_sel = (pos < t) & (pos > t - look.window)
  seg = (jnp.sum(jnp.where(seg_sel[None], conf_main, 0.0), axis=1) + C[main]) / (jnp.sum(seg_sel) + 1)
  hist_sel = (pos <= t - look.window) & (pos > t - look.window - look.history)
  hist = jnp.sum(jnp.where(hist_sel[None], conf_main, 0.0), axis=1) / jnp.maximum(jnp.sum(hist_sel), 1)
  starting = (main_live & ~running & (t >= look.min_depth) & (jnp.sum(hist_sel) >= 1)
              & (t - st.last_end_F >= look.gap) & (st.count_F < look.max_lookaheads) & (seg < hist - look.margin))
  if k == 1:
    starting = jnp.zeros_like(starting)
  fam_row = jnp.tile(jnp.arange(k, dtype=jnp.int32), F)
  rows = jnp.arange(R, dtype=jnp.int32)
  end_R, start_R = jnp.repeat(ending, k), jnp.repeat(starting, k)
  src = jnp.where(end_R, jnp.repeat(main + best, k), jnp.where(start_R, jnp.repeat(main, k), rows))
  idle = end_R & (fam_row > 0)
  st = jax.lax.cond(jnp.any(ending | starting), lambda s: _regather(s, src, idle), lambda s: s, st)
  look_start = jnp.where(ending, -1, jnp.where(starting, t, st.look_start_F))
  last_end = jnp.where(ending, t, st.last_end_F)
  count = st.count_F + starting.astype(jnp.int32)
  d = st.dec
  # ----- the usual sampling step on every live row
  live = ~d.done_R
  conf_RxT = jax.lax.dynamic_update_index_in_dim(st.conf_RxT, jnp.where(live, C[src], 0.0), t, axis=1)
  u = engine.row_uniforms(row_keys_R, t)
  token, lp, plp, ent = engine.choose(d.logits_RxV, u, config)
  token = jnp.where(live, token, config.pad_id)
  zero = jnp.zeros_like(lp)
  put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, t, axis=1)
  done = d.done_R
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  logits, kt, v = engine.decode_forward(cfg, config, params, prefix, d, token, view)
  dec = engine.DecodeState(
      step=t + 1, kt=kt, v=v, logits_RxV=logits, tokens_RxT=put(d.tokens_RxT, token),
      logprobs_RxT=put(d.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(d.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(d.entropy_RxT, jnp.where(live, ent, zero)), mask_RxT=put(d.mask_RxT, live), done_R=done)
  return _LookState(dec=dec, conf_RxT=conf_RxT, look_start_F=look_start, last_end_F=last_end, count_F=count,
                    spent_B=st.spent_B + jnp.sum(live.reshape(B, -1), axis=1, dtype=jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _deeplook_jit(cfg: ModelConfig, config: SamplingConfig, look: DeepLookConfig, params: Params, prompt_ids,
                  prompt_mask, key):
  B, P = prompt_ids.shape
  N, T, k = config.num_samples, config.max_new_tokens, look.k
  R, F = B * N * k, B * N
  L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  prompt_ids = jnp.where(prompt_mask, prompt_ids, 0)
  cache = models.init_cache(cfg, B, P, cache_dtype)
  logits_Bx1xV, cache = models.forward_with_cache(cfg, params, prompt_ids, cache, prompt_mask, last_only=True)
  to_heads = lambda x: tuple(jnp.transpose(x[l], (0, 2, 1, 3)) for l in range(L))
  layer_params = engine.layer_params(cfg, params)
  rep = lambda x: jnp.repeat(x, N * k, axis=0)
  prefix = engine.Prefix(layers=layer_params, k=to_heads(cache.k), v=to_heads(cache.v), mask=prompt_mask,
                         positions_R=rep(cache.next_pos))
  # Row 0 of a family draws from the stream `sampling.sample` gives that sample; the others
  # from streams past every sample's.
  fam = jnp.arange(F)
  j = jnp.arange(k)
  ids = jnp.where(j[None] == 0, fam[:, None], B * N + fam[:, None] * k + j[None]).reshape(-1)
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
  views = engine.cache_views(T, config.length_segments)
  zeros = jnp.zeros((R, T), jnp.float32)
  idle = jnp.tile(j > 0, F)
  dec = engine.DecodeState(
      step=jnp.zeros((), jnp.int32),
      kt=tuple(jnp.zeros((R, K, Dh, views[0]), cache_dtype) for _ in range(L)),
      v=tuple(jnp.zeros((R, K, views[0], Dh), cache_dtype) for _ in range(L)),
      logits_RxV=rep(logits_Bx1xV[:, 0]), tokens_RxT=jnp.full((R, T), config.pad_id, jnp.int32),
      logprobs_RxT=zeros, policy_logprobs_RxT=zeros, entropy_RxT=zeros, mask_RxT=jnp.zeros((R, T), bool),
      done_R=idle)
  st = _LookState(dec=dec, conf_RxT=zeros, look_start_F=jnp.full((F,), -1, jnp.int32),
                  last_end_F=jnp.full((F,), -(2 ** 20), jnp.int32), count_F=jnp.zeros((F,), jnp.int32),
                  spent_B=jnp.zeros((B,), jnp.int32))
  for i, view in enumerate(views):
    if i:
      grow = view - views[i - 1]
      st = st.replace(dec=st.dec.replace(
          kt=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in st.dec.kt),
          v=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in st.dec.v)))
    cond = lambda s, view=view: (s.dec.step < view) & ~jnp.all(s.dec.done_R)
    body = functools.partial(_look_step, cfg, config, look, params, prefix, row_keys, view, B)
    st = jax.lax.while_loop(cond, body, st)
  # Lookaheads still running when decoding stopped: the best continuation so far wins.
  d = st.dec
  running = st.look_start_F >= 0
  rank = st.conf_RxT if look.rank_by == "confidence" else d.policy_logprobs_RxT
  best = _select_rows(st.look_start_F, rank, d.mask_RxT, d.step, k)
  main = fam * k
  src = jnp.where(running, main + best, main)
  take = lambda x: jnp.take(x, src, axis=0).reshape((B, N) + x.shape[1:])
  mask = take(d.mask_RxT)
  out = SampleOutput(completion_ids=take(d.tokens_RxT), completion_mask=mask,
                     logprobs=take(d.logprobs_RxT), policy_logprobs=take(d.policy_logprobs_RxT),
                     entropy=take(d.entropy_RxT), lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32))
  conf = jnp.where(mask, take(st.conf_RxT), 0.0)
  n = jnp.maximum(out.lengths, 1)
  info = DeepLookInfo(confidence=jnp.sum(conf, axis=-1) / n, mean_logprob=jnp.sum(out.policy_logprobs, axis=-1) / n,
                      token_confidence=conf,
                      lookaheads=st.count_F.reshape(B, N), generated_tokens=st.spent_B)
  return out, info


def deeplook_sample(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, key: jax.Array,
                    config: SamplingConfig, look: DeepLookConfig = DeepLookConfig()):
  """N samples per prompt decoded with confidence-triggered lookahead.

  Args:
    cfg, params: the model.
    prompt_ids, prompt_mask: [B, P], left-padded (the contract of `sampling.sample`).
    key: PRNG key.
    config: a SamplingConfig (N = num_samples; `sample_chunk` is ignored).
    look: a DeepLookConfig.
  Returns:
    `(SampleOutput [B, N, T], DeepLookInfo)`. With `look.k == 1` (or a trigger that never
    fires) the samples equal `sampling.sample`'s with the same key.

  out, info = deeplook_sample(cfg, params, ids, mask, jax.random.key(0),
                              SamplingConfig(num_samples=8, max_new_tokens=32, eos_id=2))
  """
  if not isinstance(config, SamplingConfig) or not isinstance(look, DeepLookConfig):
    raise TypeError("config must be a SamplingConfig and look a DeepLookConfig.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} and {prompt_mask.shape}.")
  P_bucket = bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, P_bucket, config.pad_id)
  return _deeplook_jit(cfg, config, look, params, jnp.asarray(prompt_ids, jnp.int32),
                       jnp.asarray(prompt_mask, bool), key)


def weighted_vote(answers: Sequence[Hashable | None], weights: Sequence[float],
                  same: Callable[[Any, Any], bool] | None = None):
  """The answer with the largest total weight (DeepConf's V(a) = sum_t c_t 1[a_t = a]).

  `None` answers do not vote; answers that `same` judges equal are merged (into the first
  seen). Ties go to the answer seen first. Returns None when nothing votes.

  >>> weighted_vote(["3", "4", "4", None], [5.0, 2.0, 2.0, 9.0])
  '3'
  >>> weighted_vote(["3", "4", "4"], [1.0, 1.0, 1.0])
  '4'
  """
  totals: list[list[Any]] = []
  for a, w in zip(answers, weights):
    if a is None:
      continue
    for entry in totals:
      if entry[0] == a or (same is not None and same(entry[0], a)):
        entry[1] += float(w)
        break
    else:
      totals.append([a, float(w)])
  if not totals:
    return None
  return max(totals, key=lambda e: e[1])[0]
