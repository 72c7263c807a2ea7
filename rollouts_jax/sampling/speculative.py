"""Speculative rollouts: reuse last epoch's rollouts as drafts (SPEC-RL), or draft with an FP4 self-copy.

Both verify drafted tokens with the policy in one forward pass and keep the longest accepted
prefix, so most of a rollout can come from a cheap source while the result still follows the
policy's sampling distribution.

SPEC-RL (`speculative_sample`). The drafts are a previous epoch's rollouts of the same prompts
with the behaviour log-probs they were sampled with. All draft tokens of all rows are scored in
ONE teacher-forced pass of the current policy (each prompt prefilled once, then every draft
through a copy of its cache: the logits of `sampling.batch.teacher_forced_rows`' layout); token t is accepted with probability `min(1, lenience * p_new(x_t) / p_old(x_t))`, where both
are the *sampling* distributions (temperature / top-k / top-p / min-p applied, as in
`sampling.process_logits`); a token the new filters exclude (`p_new = 0`) or the old ones gave
no mass (`p_old = 0`) is rejected. At the first rejection a replacement is drawn, and the row is
continued with `sampling.continue_from`. Rows whose whole draft is accepted and which ended (EOS,
or `max_new_tokens` tokens) are reused as they are.

The replacement needs the drafter's whole distribution q at the cut, which drafts do not carry
(only the log-prob of the drafted token). Two forms:

* exact (`residual=True`, `draft_params=` the policy that sampled the drafts): the same jitted
  verification also runs the drafter, so q is known at every position; acceptance uses that q
  and the replacement is drawn from `max(0, p_new - q)` normalised (Leviathan et al. 2023;
  Chen et al. 2023). With `lenience=1` the output is distributed exactly as
  `sampling.sample(params)`'s (tested). Drafts sampled by `params` itself are all accepted.
* SPEC-RL's (`residual=False`): the replacement is drawn from p_new; no drafter is needed. Not
  exact (it over-weights tokens with q > p_new), nor is any `lenience != 1`; that is the
  trade-off the paper makes for reuse (its default lenience is e^0.5 for GRPO).

`residual=True` without `draft_params` is an error rather than a silent fall back to the
inexact form.

EfficientRollout (`self_speculative_sample`). The drafter is the FP4 copy of the policy
(`models.quantize_params`, as Sol-RL's explorer); each round it drafts gamma tokens
autoregressively, the full-precision policy scores them in one forward of gamma_max + 1
tokens, and the exact rule above (with the residual; a bonus token from p when all gamma are
accepted) commits between 1 and gamma + 1 tokens per row. gamma is chosen each round from an
EMA of the per-token acceptance rate (`choose_gamma`). Shapes are static (gamma_max slots with
masks), so a call compiles once. Speculation is switched off for a call (plain
`sampling.sample`) when it holds more than `max_spec_rows` rows, or when the expected gain
(`expected_speedup`) of the acceptance estimate is below `min_expected_speedup`;
`experiments/benchmarks/bench_rollout_reuse.py` measures where speculation pays.

Papers: SPEC-RL (arXiv 2509.23232; ShopeeLLM/Spec-RL, `spec_cut`); EfficientRollout
(arXiv 2606.18967); speculative sampling (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling.config import (SampleOutput, SamplingConfig, bucket_length, check_prompts, left_pad_to,
                                          mask_after_eos, process_logits)
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.generate import sample
from rollouts_jax.sampling.resume import continue_from


@flax.struct.dataclass
class Drafts:
  """Draft rollouts to verify: `[B, N, T]`, T = the sampling config's `max_new_tokens`.

  Attributes:
    ids: int32 [B, N, T], the drafted completions (ignored where `mask` is False).
    mask: bool [B, N, T], True on a left-aligned run of each row (its draft tokens; an empty
      row is sampled afresh). Tokens after a draft's first EOS are ignored.
    logprobs: float32 [B, N, T], the behaviour log-prob each draft token had when it was
      sampled, under the *sampling* distribution (temperature / top-k / top-p applied),
      exactly what `SampleOutput.logprobs` holds.

  >>> d = Drafts.from_output(SampleOutput(*(jnp.zeros((1, 2, 3)),) * 5, lengths=jnp.zeros((1, 2))))
  >>> d.ids.shape, d.ids.dtype, d.mask.dtype
  ((1, 2, 3), dtype('int32'), dtype('bool'))
  """
  ids: jax.Array
  mask: jax.Array
  logprobs: jax.Array

  @classmethod
  def from_output(cls, out: SampleOutput) -> "Drafts":
    """Drafts from a `SampleOutput` (its tokens, mask and sampling log-probs)."""
    return cls(ids=jnp.asarray(out.completion_ids, jnp.int32), mask=jnp.asarray(out.completion_mask, bool),
               logprobs=jnp.asarray(out.logprobs, jnp.float32))

  @classmethod
  def from_batch(cls, batch) -> "Drafts":
    """Drafts from a `sampling.RolloutBatch` (its tokens, mask and behaviour log-probs)."""
    return cls(ids=jnp.asarray(batch.completion_ids, jnp.int32), mask=jnp.asarray(batch.completion_mask, bool),
               logprobs=jnp.asarray(batch.behaviour_logprobs, jnp.float32))


# ------------------------------------------------------------------------------ small pieces


def _draw(u_R: jax.Array, weights_RxV: jax.Array) -> jax.Array:
  """One index per row from unnormalised non-negative `weights`, by inverting the CDF at `u * total`.

  A zero-weight index is never returned (unless a row is all zeros: index 0).
  """
  cdf = jnp.cumsum(weights_RxV, axis=-1)
  target = u_R[:, None] * cdf[:, -1:]
  above = cdf > target
  V = weights_RxV.shape[-1]
  last_positive = V - 1 - jnp.argmax((weights_RxV > 0)[:, ::-1], axis=-1)
  return jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1), last_positive).astype(jnp.int32)


def _take(x_RxTxV: jax.Array, ids_RxT: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_RxTxV, ids_RxT[..., None], axis=-1)[..., 0]


def _sampling_logp(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """Log of the sampling distribution (temperature / top-k / top-p / min-p), any leading shape."""
  shape = logits.shape
  flat = process_logits(logits.reshape(-1, shape[-1]), config)
  return jax.nn.log_softmax(flat, axis=-1).reshape(shape)


def _residual_weights(p_RxV: jax.Array, q_RxV: jax.Array) -> jax.Array:
  """max(0, p - q) (unnormalised); p itself where that has no mass (p == q up to rounding)."""
  r = jnp.maximum(p_RxV - q_RxV, 0.0)
  return jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_RxV)


def _eos_cut(ids, mask, eos_ids):
  """`mask` cut after each row's first EOS (an EOS at a masked-out slot does not count)."""
  if not eos_ids:
    return mask
  return mask & mask_after_eos(jnp.where(mask, ids, -1), eos_ids)


# ----------------------------------------------------------------------------- SPEC-RL verify


@functools.partial(jax.jit, static_argnames=("cfg", "config", "residual", "num_chunks"))
def _verify_jit(cfg: ModelConfig, config: SamplingConfig, params, draft_params, prompt_ids_BxP, prompt_mask_BxP,
                ids_BxNxT, mask_BxNxT, old_lp_BxNxT, key, log_lenience, residual: bool, num_chunks: int):
  """Scores every draft token once, finds each row's cut and draws its replacement.

  Returns per-row [B, N] `accepted` (tokens kept), `rejected` (a replacement follows), the
  replacement's token / sampling lp / policy lp / entropy, per-token [B, N, T] sampling lp /
  policy lp / entropy of the draft tokens under `params`, and the mean |stored - recomputed|
  draft log-prob (0 without a drafter).
  """
  B, N, T = ids_BxNxT.shape
  P = prompt_ids_BxP.shape[1]
  R = B * N
  ids_RxT = jnp.where(mask_BxNxT, ids_BxNxT, 0).reshape(R, T)
  mask_RxT = mask_BxNxT.reshape(R, T)
  old_RxT = old_lp_BxNxT.reshape(R, T)
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(R))
  u_Rx1pT = jax.vmap(lambda k: jax.random.uniform(k, (T + 1,), jnp.float32))(row_keys)
  greedy = config.is_greedy
  split = lambda x, axis=0: jnp.moveaxis(x.reshape(x.shape[:axis] + (num_chunks, R // num_chunks) + x.shape[axis + 1:]),
                                         axis, 0)

  # Each prompt runs once (a prefill into a cache of P + T - 1 slots, copied per sample); the
  # drafts then run through the cache in one teacher-forced pass: the same logits as the
  # update's layout (`teacher_forced_rows`) without recomputing the prompt N times.
  def prefill(p):
    cache = models.init_cache(cfg, B, max(P + T - 1, P), p["embed"].dtype)
    first_Bx1xV, cache = models.forward_with_cache(cfg, p, prompt_ids_BxP, cache, prompt_mask_BxP, last_only=True)
    rep = lambda x: jnp.repeat(x, N, axis=0)
    chunks = (split(jnp.repeat(cache.k, N, axis=1), 1), split(jnp.repeat(cache.v, N, axis=1), 1),
              split(rep(cache.mask)), split(rep(cache.next_pos)))
    return split(rep(first_Bx1xV[:, 0])), chunks

  prefilled = (prefill(params), None if draft_params is None else prefill(draft_params))

  def rows(xs):
    ids, mask, old, u, pre = xs
    r = ids.shape[0]

    def logits_of(p, pre_p):
      first_rxV, (k, v, cmask, next_pos) = pre_p
      cache = models.KVCache(k=k, v=v, mask=cmask, next_pos=next_pos, index=jnp.asarray(P, jnp.int32))
      if T == 1:
        return first_rxV[:, None].astype(jnp.float32)
      rest, _ = models.forward_with_cache(cfg, p, ids[:, :T - 1], cache)
      return jnp.concatenate([first_rxV[:, None], rest], axis=1).astype(jnp.float32)   # [r, T, V]

    logits = logits_of(params, pre[0])
    policy_logp = jax.nn.log_softmax(logits, axis=-1)
    plp = _take(policy_logp, ids)
    ent = -jnp.sum(jnp.exp(policy_logp) * policy_logp, axis=-1)
    gap = jnp.zeros((), jnp.float32)
    if greedy:
      samp_logp = None
      lp = jnp.zeros_like(plp)
      accept = ids == jnp.argmax(logits, axis=-1)
    else:
      samp_logp = _sampling_logp(logits, config)
      lp = _take(samp_logp, ids)
      if draft_params is not None:
        q_logp = _sampling_logp(logits_of(draft_params, pre[1]), config)
        q_lp = _take(q_logp, ids)
        gap = jnp.sum(jnp.where(mask & jnp.isfinite(q_lp), jnp.abs(q_lp - old), 0.0))
      else:
        q_logp, q_lp = None, old
      log_ratio = lp - q_lp + log_lenience
      ok = jnp.isfinite(lp) & jnp.isfinite(q_lp)
      accept = ok & (jnp.log(u[:, :T]) < jnp.where(ok, log_ratio, -jnp.inf))
    kept = jnp.cumprod((accept & mask).astype(jnp.int32), axis=-1)
    accepted = jnp.sum(kept, axis=-1)
    length = jnp.sum(mask, axis=-1)
    rejected = accepted < length
    at = jnp.minimum(accepted, T - 1)
    pick = lambda x: jnp.take_along_axis(x, at[:, None, None], axis=1)[:, 0]   # [r, T, V] -> [r, V]
    if greedy:
      rep = jnp.argmax(pick(logits), axis=-1).astype(jnp.int32)
      rep_lp = jnp.zeros((r,), jnp.float32)
    else:
      p_RxV = jnp.exp(pick(samp_logp))
      weights = _residual_weights(p_RxV, jnp.exp(pick(q_logp))) if residual else p_RxV
      rep = _draw(u[:, T], weights)
      rep_lp = jnp.take_along_axis(pick(samp_logp), rep[:, None], axis=-1)[:, 0]
    rep_plp = jnp.take_along_axis(pick(policy_logp), rep[:, None], axis=-1)[:, 0]
    rep_ent = jnp.take_along_axis(ent, at[:, None], axis=-1)[:, 0]
    return accepted, rejected, rep, rep_lp, rep_plp, rep_ent, lp, plp, ent, gap

  outs = jax.lax.map(rows, (split(ids_RxT), split(mask_RxT), split(old_RxT), split(u_Rx1pT), prefilled))
  *per_row, gap = outs
  per_row = [x.reshape((B, N) + x.shape[2:]) for x in per_row]
  gap = jnp.sum(gap) / jnp.maximum(jnp.sum(mask_RxT), 1)
  return (*per_row, gap)


@jax.jit
def _assemble_prefix(ids, accepted, rejected, rep, rep_lp, rep_plp, rep_ent, lp, plp, ent):
  """Accepted draft tokens, then the replacement token where there was a rejection: [B, N, T] each."""
  T = ids.shape[-1]
  t = jnp.arange(T)
  keep = t < accepted[..., None]
  at_cut = (t == accepted[..., None]) & rejected[..., None]
  put = lambda draft, new: jnp.where(keep, draft, jnp.where(at_cut, new[..., None], jnp.zeros((), draft.dtype)))
  return (put(ids, rep), keep | at_cut, put(lp, rep_lp), put(plp, rep_plp), put(ent, rep_ent))


def _row_bucket(n: int) -> int:
  """Continued rows are padded to a power of two (at least 8), so row counts share compilations."""
  return max(8, 1 << max(n - 1, 0).bit_length())


def speculative_sample(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, key: jax.Array,
                       config: SamplingConfig, *, drafts: Drafts, lenience: float = 1.0, residual: bool = True,
                       draft_params: Params | None = None, num_chunks: int = 1
                       ) -> tuple[SampleOutput, dict[str, Any]]:
  """SPEC-RL: verifies draft rollouts with the policy in one forward, keeps accepted prefixes, continues.

  Args:
    cfg, params: the model and the current policy.
    prompt_ids, prompt_mask: int32 / bool [B, P], left-padded, as for `sampling.sample`.
    key: PRNG key (the acceptance uniforms, replacements and continuations all derive from it).
    config: the SamplingConfig; N = `num_samples` and T = `max_new_tokens` must match the drafts.
      The drafts are assumed sampled with the same temperature / top-k / top-p / min-p.
    drafts: `Drafts` [B, N, T] (e.g. `Drafts.from_output(last_epoch_output)`).
    lenience: SPEC-RL's l: accept with probability min(1, l * p_new / p_old). 1 is exact
      speculative sampling (with `residual=True`); > 1 accepts more, off-policy.
    residual: draw the replacement at the first rejection from max(0, p_new - q) normalised
      (exact; needs `draft_params`); False: SPEC-RL's free draw from p_new (no drafter needed).
    draft_params: the policy that sampled the drafts (same `cfg`). Needed by `residual=True`;
      when given, its recomputed sampling log-probs replace `drafts.logprobs` in the ratio.
    num_chunks: rows are verified in this many sequential chunks (must divide B * N; memory).

  Returns:
    (out, stats). `out` is a `SampleOutput` [B, N, T] with `sampling.sample`'s meanings:
    `logprobs` are under the sampling distribution of `params` (also for reused tokens),
    `policy_logprobs` and `entropy` those of `params`, the mask up to and including EOS.
    `stats` holds Python numbers: `draft_tokens`, `accepted_tokens`, `fully_accepted_rows`
    (non-empty drafts accepted whole), `rejected_rows` (rows cut at a rejection: each gets one
    replacement token), `rows_continued` (rows decoded further),
    `decode_steps` (decoding steps of the continuation: its longest continued row),
    `generated_tokens` (tokens decoded by the continuation), `draft_logprob_gap` (mean
    |drafts.logprobs - the drafter's recomputed ones|; 0 without `draft_params`: a large value
    means `draft_params` or the config is not what sampled the drafts).

  Raises:
    ValueError: drafts of the wrong shape or dtype, a draft mask that is not left-aligned,
      `residual=True` without `draft_params`, a non-positive lenience, and every error
      `sampling.sample` raises for its prompts.

  out, stats = speculative_sample(cfg, params, ids, mask, key, config, drafts=Drafts.from_output(last),
                                  draft_params=last_params)
  stats["accepted_tokens"] <= stats["draft_tokens"]
  # True
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
  if not isinstance(drafts, Drafts):
    raise TypeError(f"drafts must be a speculative.Drafts, got {type(drafts).__name__}.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} "
                     f"and {prompt_mask.shape}.")
  B = int(prompt_ids.shape[0])
  N, T = config.num_samples, config.max_new_tokens
  for name in ("ids", "mask", "logprobs"):
    shape = tuple(getattr(drafts, name).shape)
    if shape != (B, N, T):
      raise ValueError(f"drafts.{name} must be [B, N, T] = {(B, N, T)} (prompts, config.num_samples, "
                       f"config.max_new_tokens); got {shape}.")
  if not jnp.issubdtype(drafts.ids.dtype, jnp.integer):
    raise ValueError(f"drafts.ids must hold integer token ids, got dtype {drafts.ids.dtype}.")
  if not float(lenience) > 0:
    raise ValueError(f"lenience must be > 0, got {lenience}.")
  if residual and draft_params is None and not config.is_greedy:
    raise ValueError("residual=True (exact speculative sampling) needs the drafter's whole distribution: pass "
                     "draft_params= (the policy that sampled the drafts), or residual=False for SPEC-RL's "
                     "free draw from the new policy after a rejection (not exact).")
  if num_chunks < 1 or (B * N) % num_chunks:
    raise ValueError(f"num_chunks={num_chunks} must divide B * N = {B * N}.")
  dmask = np.asarray(jax.device_get(drafts.mask), bool)
  if (dmask[..., 1:] & ~dmask[..., :-1]).any():
    raise ValueError("drafts.mask must be True on a left-aligned run of each row (right-pad the drafts).")
  dids = np.asarray(jax.device_get(drafts.ids))
  if dmask.any() and (dids[dmask].min() < 0 or dids[dmask].max() >= cfg.vocab_size):
    raise ValueError(f"draft token ids must be in [0, vocab_size={cfg.vocab_size}).")
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  P = bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  ids, pmask = left_pad_to(prompt_ids, prompt_mask, P, config.pad_id)
  ids, pmask = jnp.asarray(ids, jnp.int32), jnp.asarray(pmask, bool)
  d_ids = jnp.asarray(dids, jnp.int32)
  d_mask = _eos_cut(d_ids, jnp.asarray(dmask), config.eos_ids)
  k_verify, k_continue = jax.random.split(key)
  (accepted, rejected, rep, rep_lp, rep_plp, rep_ent, lp, plp, ent, gap) = _verify_jit(
      cfg, config, params, draft_params if (residual or draft_params is not None) and not config.is_greedy else None,
      ids, pmask, d_ids, d_mask, jnp.asarray(drafts.logprobs, jnp.float32), k_verify,
      jnp.float32(math.log(float(lenience))), bool(residual), int(num_chunks))
  pre_ids, pre_mask, pre_lp, pre_plp, pre_ent = _assemble_prefix(d_ids, accepted, rejected, rep, rep_lp, rep_plp,
                                                                 rep_ent, lp, plp, ent)
  pre_ids = jnp.where(pre_mask, pre_ids, config.pad_id)
  # A row is finished when its prefix ends in EOS or holds T tokens (else it is continued).
  finished = np.asarray(pre_mask.sum(-1) >= T)
  if config.eos_ids:
    finished = finished | np.asarray(jnp.any(jnp.isin(pre_ids, jnp.asarray(config.eos_ids)) & pre_mask, axis=-1))
  lengths0 = np.asarray(pre_mask.sum(-1))
  d_len = np.asarray(d_mask.sum(-1))
  acc = np.asarray(accepted)
  stats = dict(draft_tokens=int(d_len.sum()), accepted_tokens=int(acc.sum()),
               fully_accepted_rows=int(((acc == d_len) & (d_len > 0)).sum()),
               rejected_rows=int(np.asarray(rejected).sum()), rows_continued=int((~finished).sum()),
               decode_steps=0, generated_tokens=0,
               draft_logprob_gap=float(gap))
  out = SampleOutput(completion_ids=pre_ids, completion_mask=pre_mask, logprobs=pre_lp, policy_logprobs=pre_plp,
                     entropy=pre_ent, lengths=jnp.asarray(lengths0, jnp.int32))
  todo = np.nonzero(~finished.reshape(-1))[0]
  if todo.size == 0:
    return out, stats
  # Only the rows that still need tokens are continued, padded to a power-of-two row count
  # (padding rows are marked finished), each as its own prompt with one sample.
  rows = _row_bucket(todo.size)
  sel = np.concatenate([todo, np.full(rows - todo.size, todo[0])])
  flat = lambda x: jnp.asarray(x).reshape((B * N,) + tuple(x.shape[2:]))[sel][:, None]
  cont = continue_from(
      cfg, params, jnp.repeat(ids, N, axis=0)[sel], jnp.repeat(pmask, N, axis=0)[sel], flat(pre_ids), flat(pre_mask),
      k_continue, config.replace(num_samples=1), prefix_logprobs=flat(pre_lp), prefix_policy_logprobs=flat(pre_plp),
      prefix_entropy=flat(pre_ent), finished=jnp.asarray(np.arange(rows) >= todo.size)[:, None])
  new_len = np.asarray(cont.lengths)[:todo.size, 0]
  made = new_len - lengths0.reshape(-1)[todo]
  stats.update(decode_steps=int(made.max()), generated_tokens=int(made.sum()))
  idx = jnp.asarray(todo)
  merge = lambda full, part: full.reshape((B * N,) + full.shape[2:]).at[idx].set(part[:todo.size, 0]).reshape(
      full.shape)
  out = jax.tree_util.tree_map(merge, out, cont)
  return out, stats


# ------------------------------------------------------------------- EfficientRollout pieces


def expected_tokens(alpha: float, gamma: int) -> float:
  """Expected tokens committed per verification round: (1 - a^(g+1)) / (1 - a) (Leviathan et al.).

  >>> expected_tokens(0.0, 4), expected_tokens(1.0, 4), round(expected_tokens(0.5, 2), 3)
  (1.0, 5.0, 1.75)
  """
  alpha = min(max(float(alpha), 0.0), 1.0)
  return float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _tokens_per_cost(alpha, gamma, draft_cost):
  """Vectorised (jnp) E[tokens] / (gamma * draft_cost + 1), the verify forward's cost being 1."""
  alpha = jnp.clip(alpha, 0.0, 1.0 - 1e-6)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha) / (gamma * draft_cost + 1.0)


def choose_gamma(alpha, gamma_max: int, draft_cost: float):
  """EfficientRollout's draft length: the gamma in 1..gamma_max maximising tokens per unit cost.

  Tokens per round (1 - a^(g+1)) / (1 - a) over cost g * c_draft + c_verify, costs in units
  of one verification forward (`draft_cost` = c_draft / c_verify). Works on a traced `alpha`.

  >>> int(choose_gamma(0.9, 8, 0.1)), int(choose_gamma(0.3, 8, 0.5))
  (8, 1)
  """
  gammas = jnp.arange(1, gamma_max + 1, dtype=jnp.float32)
  return (jnp.argmax(_tokens_per_cost(jnp.asarray(alpha, jnp.float32), gammas, draft_cost)) + 1).astype(jnp.int32)


def expected_speedup(alpha: float, gamma_max: int, draft_cost: float, verify_cost: float = 1.0) -> float:
  """Expected tokens per unit time of speculation over plain decoding (one token per plain step).

  Costs are relative to one plain decoding step: `draft_cost` per drafter step and
  `verify_cost` per verification forward of gamma_max + 1 tokens. < 1: speculation does not pay.

  >>> round(expected_speedup(0.9, 4, 0.3, 1.2), 2)
  1.71
  """
  g = int(choose_gamma(alpha, gamma_max, draft_cost / verify_cost))
  return expected_tokens(alpha, g) / (g * draft_cost + verify_cost)


# ----------------------------------------------------------------- EfficientRollout's engine


@flax.struct.dataclass
class _SpecState:
  n_R: jax.Array            # committed completion tokens per row
  done_R: jax.Array
  tokens: jax.Array         # [R, 2 + T + G + 1]: the prompt's last two tokens, then the completion
  lp: jax.Array             # [R, T + G + 1] sampling log-probs of the completion
  plp: jax.Array
  ent: jax.Array
  tk: tuple                 # target cache, per layer [R, S, K, Dh]
  tv: tuple
  dk: tuple                 # drafter cache
  dv: tuple
  ema: jax.Array
  rounds: jax.Array
  drafted: jax.Array
  tested: jax.Array
  accepted: jax.Array
  draft_steps: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "config", "gamma_max", "draft_cost", "ema_decay"))
def _self_spec_jit(cfg: ModelConfig, config: SamplingConfig, params, draft_params, prompt_ids_BxP, prompt_mask_BxP,
                   key, ema0, gamma_max: int, draft_cost: float, ema_decay: float):
  B, P = prompt_ids_BxP.shape
  N, T, G = config.num_samples, config.max_new_tokens, gamma_max
  R = B * N
  S = P + T + G + 2        # slot P + j holds completion token j (j >= -2: the prompt's last two)
  W = T + G + 1            # completion buffer width (writes past T are cut at the end)
  L, K, Dh, V = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  dtype = params["embed"].dtype
  rep = lambda x: jnp.repeat(x, N, axis=0)
  prompt_ids_BxP = jnp.where(prompt_mask_BxP, prompt_ids_BxP, 0)
  pmask_S = jnp.concatenate([rep(prompt_mask_BxP), jnp.ones((R, S - P), bool)], axis=1)   # [R, S]
  plen_R = rep(jnp.sum(prompt_mask_BxP, axis=1, dtype=jnp.int32))
  slots_S = jnp.arange(S)
  t_layers, d_layers = engine.layer_params(cfg, params), engine.layer_params(cfg, draft_params)
  greedy = config.is_greedy

  # Prefill both caches with the prompts (at [B, P], then one copy per sample).
  vis_p = (slots_S[None, None, :] <= jnp.arange(P)[None, :, None]) & jnp.concatenate(
      [prompt_mask_BxP, jnp.zeros((B, S - P), bool)], axis=1)[:, None, :]
  pos_p = models.positions_from_mask(prompt_mask_BxP)
  empty = tuple(jnp.zeros((B, S, K, Dh), dtype) for _ in range(L))

  def prefill(p, layers):
    _, k, v = engine.tokens_forward(cfg, p, layers, empty, empty, prompt_ids_BxP, pos_p, jnp.zeros((B,), jnp.int32),
                                    vis_p)
    return tuple(rep(x) for x in k), tuple(rep(x) for x in v)

  tk, tv = prefill(params, t_layers)
  dk, dv = prefill(draft_params, d_layers)
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(R))
  tokens0 = jnp.concatenate([rep(prompt_ids_BxP[:, -2:]), jnp.full((R, W), config.pad_id, jnp.int32)], axis=1)
  zeros = jnp.zeros((R, W), jnp.float32)
  state = _SpecState(n_R=jnp.zeros((R,), jnp.int32), done_R=jnp.zeros((R,), bool), tokens=tokens0, lp=zeros,
                     plp=zeros, ent=zeros, tk=tk, tv=tv, dk=dk, dv=dv, ema=jnp.asarray(ema0, jnp.float32),
                     rounds=jnp.zeros((), jnp.int32), drafted=jnp.zeros((), jnp.int32),
                     tested=jnp.zeros((), jnp.int32), accepted=jnp.zeros((), jnp.int32),
                     draft_steps=jnp.zeros((), jnp.int32))

  def visible(j_RxM):   # queries at completion indices j see the prompt and completion slots <= j
    return (slots_S[None, None, :] <= (P + j_RxM)[..., None]) & pmask_S[:, None, :]

  def token_at(tokens, j_RxM):   # completion index j >= -2 -> token id
    return jnp.take_along_axis(tokens, j_RxM + 2, axis=1)

  def choose(logits_RxV, u_R):
    if greedy:
      return jnp.argmax(logits_RxV, axis=-1).astype(jnp.int32)
    return _draw(u_R, jnp.exp(_sampling_logp(logits_RxV, config)))

  def round_body(s: _SpecState) -> _SpecState:
    gamma = choose_gamma(s.ema, G, draft_cost)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, s.rounds), (2 * G + 1,), jnp.float32))(row_keys)
    n = s.n_R
    # Draft: re-feed the last two committed tokens (the one before may be missing from the
    # drafter's cache after a fully accepted round), then feed each draft token.
    j0 = n[:, None] + jnp.arange(-2, 0)[None]
    logits, dk, dv = engine.tokens_forward(cfg, draft_params, d_layers, s.dk, s.dv, token_at(s.tokens, j0),
                                           plen_R[:, None] + j0, P + n - 2, visible(j0))
    d0 = choose(logits[:, -1], u[:, 0])
    drafts = jnp.zeros((R, G), jnp.int32).at[:, 0].set(d0)
    qs = jnp.zeros((R, G, V), jnp.float32).at[:, 0].set(
        logits[:, -1] if greedy else _sampling_logp(logits[:, -1], config))

    def draft_step(i, carry):
      drafts, qs, dk, dv = carry
      j = (n + i - 1)[:, None]
      tok = jnp.take_along_axis(drafts, jnp.full((R, 1), i - 1), axis=1)
      lg, dk, dv = engine.tokens_forward(cfg, draft_params, d_layers, dk, dv, tok, plen_R[:, None] + j, P + n + i - 1,
                                         visible(j))
      d = choose(lg[:, 0], jax.lax.dynamic_index_in_dim(u, i, axis=1, keepdims=False))
      drafts = jax.lax.dynamic_update_index_in_dim(drafts, d, i, axis=1)
      qs = jax.lax.dynamic_update_index_in_dim(qs, lg[:, 0] if greedy else _sampling_logp(lg[:, 0], config), i, axis=1)
      return drafts, qs, dk, dv

    drafts, qs, dk, dv = jax.lax.fori_loop(1, gamma, draft_step, (drafts, qs, dk, dv))
    # Verify: the last committed token and the G draft slots in one forward of the target.
    jv = n[:, None] - 1 + jnp.arange(G + 1)[None]
    feed = jnp.concatenate([token_at(s.tokens, n[:, None] - 1), drafts], axis=1)
    logits, tk, tv = engine.tokens_forward(cfg, params, t_layers, s.tk, s.tv, feed, plen_R[:, None] + jv, P + n - 1,
                                           visible(jv))                             # [R, G + 1, V]
    policy_logp = jax.nn.log_softmax(logits, axis=-1)
    ent = -jnp.sum(jnp.exp(policy_logp) * policy_logp, axis=-1)
    live_slot = jnp.arange(G)[None] < gamma
    if greedy:
      accept = drafts == jnp.argmax(logits[:, :G], axis=-1)
      samp_logp = None
    else:
      samp_logp = _sampling_logp(logits, config)
      p_lp, q_lp = _take(samp_logp[:, :G], drafts), _take(qs, drafts)
      ok = jnp.isfinite(p_lp) & jnp.isfinite(q_lp)
      accept = ok & (jnp.log(u[:, G:2 * G]) < jnp.where(ok, p_lp - q_lp, -jnp.inf))
    a = jnp.sum(jnp.cumprod((accept & live_slot).astype(jnp.int32), axis=1), axis=1)      # leading accepted
    pick = lambda x: jnp.take_along_axis(x, a[:, None, None], axis=1)[:, 0]
    if greedy:
      last = jnp.argmax(pick(logits), axis=-1).astype(jnp.int32)
    else:
      p_RxV = jnp.exp(pick(samp_logp))
      q_RxV = jnp.exp(jnp.take_along_axis(qs, jnp.minimum(a, G - 1)[:, None, None], axis=1)[:, 0])
      weights = jnp.where((a < gamma)[:, None], _residual_weights(p_RxV, q_RxV), p_RxV)   # residual or bonus
      last = _draw(u[:, 2 * G], weights)
    slot = jnp.arange(G + 1)[None]
    new = jnp.where(slot < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])      # [R, G + 1]
    count = a + 1
    if config.eos_ids:
      is_eos = jnp.isin(new, jnp.asarray(config.eos_ids, jnp.int32)) & (slot < count[:, None])
      count = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, count)
      ended = jnp.any(is_eos, axis=1)
    else:
      ended = jnp.zeros((R,), bool)
    count = jnp.where(s.done_R, 0, jnp.minimum(count, T - n))
    new_lp = jnp.zeros((R, G + 1), jnp.float32) if greedy else _take(samp_logp, new)
    new_plp = _take(policy_logp, new)
    write = lambda buf, vals, off: jax.vmap(
        lambda b, x, o: jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (o,)))(buf, vals, off)
    keep = slot < count[:, None]
    merge = lambda buf, vals, off: write(buf, jnp.where(keep, vals, jax.vmap(
        lambda b, o: jax.lax.dynamic_slice(b, (o,), (G + 1,)))(buf, off)), off)
    n_new = n + count
    live = ~s.done_R
    tested = jnp.where(live, jnp.minimum(a + 1, gamma), 0)
    acc = jnp.where(live, a, 0)
    sum_tested = jnp.sum(tested)
    rate = jnp.sum(acc) / jnp.maximum(sum_tested, 1)
    ema = jnp.where(sum_tested > 0, ema_decay * s.ema + (1 - ema_decay) * rate, s.ema)
    return _SpecState(
        n_R=n_new, done_R=s.done_R | (n_new >= T) | (ended & live), tokens=merge(s.tokens, new, n + 2),
        lp=merge(s.lp, new_lp, n), plp=merge(s.plp, new_plp, n), ent=merge(s.ent, ent, n),
        tk=tk, tv=tv, dk=dk, dv=dv, ema=ema, rounds=s.rounds + 1,
        drafted=s.drafted + jnp.sum(jnp.where(live, gamma, 0)), tested=s.tested + sum_tested,
        accepted=s.accepted + jnp.sum(acc), draft_steps=s.draft_steps + gamma)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_R), round_body, state)
  mask = jnp.arange(T)[None] < state.n_R[:, None]
  group = lambda x: x[:, :T].reshape(B, N, T)
  zero = lambda x: jnp.where(mask.reshape(B, N, T), group(x), jnp.zeros((), x.dtype))
  tokens = jnp.where(mask.reshape(B, N, T), group(state.tokens[:, 2:]), config.pad_id)
  out = SampleOutput(completion_ids=tokens, completion_mask=mask.reshape(B, N, T), logprobs=zero(state.lp),
                     policy_logprobs=zero(state.plp), entropy=zero(state.ent),
                     lengths=state.n_R.reshape(B, N))
  stats = dict(rounds=state.rounds, draft_tokens=state.drafted, tested_tokens=state.tested,
               accepted_tokens=state.accepted, draft_steps=state.draft_steps, acceptance_ema=state.ema)
  return out, stats


def self_speculative_sample(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, key: jax.Array,
                            config: SamplingConfig, *, draft_params: Params | None = None, fmt: str = "nvfp4",
                            gamma_max: int = 4, draft_cost: float = 0.5, acceptance_ema: float = 0.7,
                            ema_decay: float = 0.8, max_spec_rows: int | None = None,
                            min_expected_speedup: float = 0.0) -> tuple[SampleOutput, dict[str, Any]]:
  """EfficientRollout: self-speculative sampling with the FP4 copy of the policy as drafter.

  Each round the drafter proposes gamma tokens per row (autoregressively, with its own KV
  cache), the policy scores the last committed token and the gamma_max draft slots in one
  forward (its own KV cache), and the exact rule (accept with min(1, p/q); at the first
  rejection a replacement from max(0, p - q) normalised; when all gamma are accepted a bonus
  token from p) commits 1 to gamma + 1 tokens, all at the sampling temperature / filters of
  `config`. So the output is distributed exactly as `sampling.sample(params)`'s (tested), for
  any drafter. gamma is re-chosen every round by `choose_gamma` from an EMA of the per-token
  acceptance rate (accepted / tested drafts of the live rows).

  The switch: speculation is skipped for the call (plain `sampling.sample`, `stats["speculated"]`
  False) when `B * N > max_spec_rows`, or when `expected_speedup(acceptance_ema, gamma_max,
  draft_cost)` is below `min_expected_speedup` (pass the EMA returned by the previous call).
  The static shapes compute every row every round, so it is the call's row count, not the
  number of unfinished rows, that sets a round's cost.

  Args:
    cfg, params: the model and the (full-precision) policy.
    prompt_ids, prompt_mask: int32 / bool [B, P], left-padded, as for `sampling.sample`.
    key: PRNG key.
    config: the SamplingConfig (`sample_chunk`, `length_segments` and the attention
      implementation do not apply here).
    draft_params: the drafter (same `cfg`); default `models.quantize_params(cfg, params, fmt)`.
    fmt: the FP4 format of the default drafter (`"nvfp4"` or `"mxfp4"`).
    gamma_max: the most draft tokens per round (static: the verification width is gamma_max + 1).
    draft_cost: one drafter step's cost over one verification forward's (`choose_gamma`).
    acceptance_ema: the acceptance-rate estimate to start from (the previous call's).
    ema_decay: the EMA's weight on its past value, per round.
    max_spec_rows: speculate only when B * N <= this (None: no limit).
    min_expected_speedup: speculate only when `expected_speedup` of the starting estimate
      (with `verify_cost` 1) is at least this (0: always).

  Returns:
    (out, stats): a `SampleOutput` [B, N, T] with `sampling.sample`'s meanings (log-probs and
    entropies of the full-precision policy) and Python numbers `speculated`, `rounds`
    (verification forwards), `draft_steps` (drafter forwards), `draft_tokens`,
    `tested_tokens`, `accepted_tokens`, `acceptance_rate` (accepted / tested), `acceptance_ema`
    (to pass to the next call) and `decode_steps` (forwards of the policy over the batch:
    rounds when speculating, the longest row otherwise).

  Raises:
    ValueError: bad gamma_max / draft_cost / EMA settings, and every error `sampling.sample`
      raises for its prompts.

  out, stats = self_speculative_sample(cfg, params, ids, mask, key, config)
  stats["accepted_tokens"] <= stats["tested_tokens"] <= stats["draft_tokens"]
  # True
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
  if int(gamma_max) < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}.")
  if not float(draft_cost) >= 0:
    raise ValueError(f"draft_cost must be >= 0, got {draft_cost}.")
  if not 0.0 <= float(acceptance_ema) <= 1.0 or not 0.0 <= float(ema_decay) < 1.0:
    raise ValueError(f"acceptance_ema must be in [0, 1] and ema_decay in [0, 1); got {acceptance_ema}, {ema_decay}.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} "
                     f"and {prompt_mask.shape}.")
  rows = int(prompt_ids.shape[0]) * config.num_samples
  gain = expected_speedup(acceptance_ema, int(gamma_max), float(draft_cost))
  if (max_spec_rows is not None and rows > max_spec_rows) or gain < min_expected_speedup:
    out = sample(cfg, params, prompt_ids, prompt_mask, key, config)
    return out, dict(speculated=False, rounds=0, draft_steps=0, draft_tokens=0, tested_tokens=0, accepted_tokens=0,
                     acceptance_rate=float("nan"), acceptance_ema=float(acceptance_ema),
                     decode_steps=int(np.asarray(out.lengths).max()))
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  P = bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  ids, pmask = left_pad_to(prompt_ids, prompt_mask, max(P, 2), config.pad_id)
  if draft_params is None:
    draft_params = models.quantize_params(cfg, params, fmt)
  out, st = _self_spec_jit(cfg, config, params, draft_params, jnp.asarray(ids, jnp.int32), jnp.asarray(pmask, bool),
                           key, jnp.float32(acceptance_ema), int(gamma_max), float(draft_cost), float(ema_decay))
  st = {k: v.item() for k, v in jax.device_get(st).items()}
  stats = dict(speculated=True, **st, decode_steps=st["rounds"],
               acceptance_rate=st["accepted_tokens"] / max(st["tested_tokens"], 1))
  return out, stats


__all__ = ["Drafts", "choose_gamma", "expected_speedup", "expected_tokens", "self_speculative_sample",
           "speculative_sample"]
