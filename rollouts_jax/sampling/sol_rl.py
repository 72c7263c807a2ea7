"""Sol-RL two-stage rollouts: explore a large pool with an FP4 policy, train on a contrastive subset.

Per prompt, stage 1 samples a pool of M completions with the FP4 copy of the policy and
scores them; a subset of k is selected (best k/2 and worst k - k/2 by reward, by default);
stage 2 recomputes the subset's log-probabilities under the full-precision policy
(a teacher-forced forward over prompt + completion), so the trainer's importance ratios
refer to the full-precision policy. Only the subset is trained on.

The selection is a host-side function (numpy; device arrays are fetched): rewards come
from a host verifier anyway, and exact de-duplication of completions is a sort over rows.

Language-model adaptation of the paper's stage 2: the paper regenerates the selected
diffusion seeds in BF16 (the seed fixes an image's semantics); a sampled token sequence has
no such seed, so the FP4 tokens are kept and only their log-probabilities are recomputed.

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916), `select_indices_by_mode` in
NVlabs/Sana `train_scripts/sol_rl/train_utils.py`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling import sampler
from rollouts_jax.sampling.sampler import SampleOutput, SamplingConfig

MODES = ("contrastive", "random", "deviation")


# ----------------------------------------------------------------------------- selection


def _first_occurrence_M(ids_MxT: np.ndarray) -> np.ndarray:
  """True at the first of each set of identical rows (exact, by sorting rows)."""
  _, first = np.unique(ids_MxT, axis=0, return_index=True)
  out = np.zeros(ids_MxT.shape[0], bool)
  out[first] = True
  return out


def _order_desc(r_M: np.ndarray) -> np.ndarray:
  """Indices by descending reward, ties by ascending index."""
  return np.lexsort((np.arange(r_M.shape[0]), -r_M))


def _order_asc(r_M: np.ndarray) -> np.ndarray:
  """Indices by ascending reward, ties by ascending index."""
  return np.lexsort((np.arange(r_M.shape[0]), r_M))


def _contrastive(r_M: np.ndarray, cand: np.ndarray, k: int) -> list[int]:
  """Best k//2 then worst k - k//2 of the candidate indices `cand`, never picking one twice."""
  n_best = k // 2
  best = cand[_order_desc(r_M[cand])][:n_best]
  rest = np.setdiff1d(cand, best, assume_unique=True)
  worst = rest[_order_asc(r_M[rest])][:k - n_best]
  return best.tolist() + worst.tolist()


def _deviation(r_M: np.ndarray, cand: np.ndarray, k: int) -> list[int]:
  """The k candidates farthest from the group mean, ties by ascending index."""
  dev = np.abs(r_M[cand] - r_M.mean())
  return cand[_order_desc(dev)][:k].tolist()


def _random(cand: np.ndarray, k: int, rng_key: jax.Array) -> list[int]:
  perm = np.asarray(jax.random.permutation(rng_key, cand.shape[0]))
  return cand[perm][:k].tolist()


def select_subset(rewards_BxM: Any, k: int, mode: str = "contrastive", key: jax.Array | None = None,
                  completion_ids: Any = None) -> np.ndarray:
  """Indices of the k pool samples of each prompt to train on.

  Modes (Sol-RL `select_indices_by_mode`):
    * `"contrastive"` (the paper's `best_worst`): the `k // 2` highest rewards, then the
      `k - k // 2` lowest among the samples not already taken (odd k: one extra worst).
      Ties go to the lower index, and the worst half is drawn from what the best half left,
      so equal rewards never select one sample twice (an all-equal group gives `0..k-1`).
    * `"deviation"` (`mean_deviation`): the k largest `|r - mean(r)|` (group mean over the
      whole pool), ties to the lower index.
    * `"random"`: k distinct samples uniformly at random (needs `key`).

  With `completion_ids`, identical completions count once: a sample whose token row equals
  an earlier one of its group is taken only after every distinct completion has been, so
  the subset holds as many distinct completions as the pool allows.

  Args:
    rewards_BxM: float `[B, M]` pool rewards (host or device), finite.
    k: subset size per prompt, `1 <= k <= M`.
    mode: one of `MODES`.
    key: PRNG key, required by `"random"`; one permutation per prompt (`fold_in(key, b)`).
    completion_ids: optional int `[B, M, T]` pool tokens (pad after EOS), for de-duplication.

  Returns:
    int32 `[B, k]` numpy indices into the pool, distinct within each row. Contrastive rows
    list the best half (descending reward) then the worst half (ascending).

  Raises:
    ValueError: k outside `[1, M]`, an unknown mode, a missing key, non-finite rewards or
      mismatched shapes.

  >>> select_subset(np.array([[0.2, 1.0, 0.0, 0.5, 1.0]]), 3).tolist()
  [[1, 2, 0]]

  Paper: Sol-RL (arXiv 2604.06916), 24 trained of 96 explored per prompt.
  """
  r = np.asarray(rewards_BxM, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [B, M]; got shape {r.shape}.")
  B, M = r.shape
  if mode not in MODES:
    raise ValueError(f"Unknown selection mode {mode!r}; expected one of {MODES}.")
  if not 1 <= int(k) <= M:
    raise ValueError(f"Cannot select k={k} samples from a pool of M={M} per prompt (need 1 <= k <= M).")
  k = int(k)
  if not np.all(np.isfinite(r)):
    raise ValueError("rewards must be finite (score failures before selecting).")
  if mode == "random" and key is None:
    raise ValueError("mode='random' needs a PRNG key.")
  if completion_ids is not None:
    ids = np.asarray(completion_ids)
    if ids.ndim != 3 or ids.shape[:2] != (B, M):
      raise ValueError(f"completion_ids must be [B, M, T] = [{B}, {M}, T]; got shape {ids.shape}.")
  out = np.empty((B, k), np.int32)
  for b in range(B):
    distinct = _first_occurrence_M(ids[b]) if completion_ids is not None else np.ones(M, bool)
    tiers = [np.flatnonzero(distinct), np.flatnonzero(~distinct)]
    chosen: list[int] = []
    for t, cand in enumerate(tiers):
      need = k - len(chosen)
      if need == 0:
        break
      if cand.size == 0:
        continue
      take = min(need, cand.size)
      if mode == "contrastive":
        chosen += _contrastive(r[b], cand, take)
      elif mode == "deviation":
        chosen += _deviation(r[b], cand, take)
      else:
        chosen += _random(cand, take, jax.random.fold_in(jax.random.fold_in(key, b), t))
    out[b] = chosen
  return out


def gather_samples(sample_output: SampleOutput, indices_BxK: Any) -> SampleOutput:
  """The samples `indices [B, k]` of each prompt: `[B, M, T]` fields become `[B, k, T]`.

  >>> sub = gather_samples(out, np.array([[0, 3], [1, 2]]))  # doctest: +SKIP
  >>> sub.completion_ids.shape  # doctest: +SKIP
  (2, 2, T)
  """
  idx = jnp.asarray(indices_BxK, jnp.int32)
  B, M = sample_output.lengths.shape
  if idx.ndim != 2 or idx.shape[0] != B:
    raise ValueError(f"indices must be [B, k] with B={B}; got shape {idx.shape}.")
  if isinstance(indices_BxK, np.ndarray) and (indices_BxK.min() < 0 or indices_BxK.max() >= M):
    raise ValueError(f"indices must lie in [0, {M}); got range [{indices_BxK.min()}, {indices_BxK.max()}].")

  def take(x):
    i = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, i, axis=1)
  return jax.tree_util.tree_map(take, sample_output)


# ------------------------------------------------------------------- full-precision logprobs


@functools.partial(jax.jit, static_argnames=("cfg", "config", "num_chunks"))
def _rescore_jit(cfg: ModelConfig, config: SamplingConfig, params: Params, prompt_ids_BxP, prompt_mask_BxP,
                 completion_ids_BxKxT, completion_mask_BxKxT, num_chunks: int):
  B, K, T = completion_ids_BxKxT.shape
  P = prompt_ids_BxP.shape[1]
  R = B * K
  rep = lambda x: jnp.repeat(x, K, axis=0)
  # The trainer's layout (training.rl_step): prompt mask, then every completion slot visible.
  tokens_RxL = jnp.concatenate([rep(prompt_ids_BxP), completion_ids_BxKxT.reshape(R, T)], axis=1)
  attn_RxL = jnp.concatenate([rep(prompt_mask_BxP), jnp.ones((R, T), bool)], axis=1)

  def score(xs):
    tokens, attn = xs
    hidden = models.forward(cfg, params, tokens, attn, return_hidden=True)
    logits_rxTxV = models.unembed(cfg, params, hidden[:, P - 1:-1])
    targets = tokens[:, P:, None]
    policy_logp = jax.nn.log_softmax(logits_rxTxV, axis=-1)
    plp = jnp.take_along_axis(policy_logp, targets, axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(policy_logp) * policy_logp, axis=-1)
    if config.is_greedy:
      return plp, jnp.zeros_like(plp), ent, jnp.zeros(plp.shape, bool)
    processed = jax.nn.log_softmax(sampler.process_logits(logits_rxTxV, config), axis=-1)
    lp = jnp.take_along_axis(processed, targets, axis=-1)[..., 0]
    outside = jnp.isneginf(lp)
    # A token that the full-precision filters (top-k / top-p / min-p) exclude has no finite
    # sampling log-prob; fall back to the temperature-only one and count it.
    tempered = jax.nn.log_softmax(logits_rxTxV / config.temperature, axis=-1)
    lp = jnp.where(outside, jnp.take_along_axis(tempered, targets, axis=-1)[..., 0], lp)
    return plp, lp, ent, outside

  split = lambda x: x.reshape((num_chunks, R // num_chunks) + x.shape[1:])
  plp, lp, ent, outside = jax.lax.map(score, (split(tokens_RxL), split(attn_RxL)))
  mask = completion_mask_BxKxT
  shape = lambda x: x.reshape(B, K, T)
  zero = lambda x: jnp.where(mask, shape(x), jnp.zeros((), x.dtype))
  return zero(plp), zero(lp), zero(ent), zero(outside)


def recompute_logprobs(cfg: ModelConfig, params: Params, prompt_ids: Any, prompt_mask: Any,
                       samples: SampleOutput, config: SamplingConfig, *, num_chunks: int = 1
                       ) -> tuple[SampleOutput, dict[str, float]]:
  """`samples` with `logprobs`, `policy_logprobs` and `entropy` recomputed under `params`.

  One teacher-forced forward over prompt + completion (the trainer's layout: prompt mask,
  then all completion slots visible). `policy_logprobs` is `log_softmax(logits)` at each
  token; `logprobs` uses the sampling distribution of `config` exactly as the sampler does
  (0 under greedy decoding). A token outside the support of the recomputed top-k / top-p /
  min-p filter gets its temperature-only log-prob instead of -inf (counted in the stats).
  Prompts are left-padded to `config.prompt_buckets` so shapes repeat across steps.

  Args:
    cfg: model configuration.
    params: the policy to score under (full precision in Sol-RL).
    prompt_ids, prompt_mask: `[B, P]`, left-padded, as given to the sampler.
    samples: a SampleOutput `[B, k, T]` for these prompts.
    config: the SamplingConfig the samples were drawn with.
    num_chunks: rows are scored in this many sequential chunks (must divide B * k).

  Returns:
    (the rescored SampleOutput, {"out_of_support_frac": ...}).

  >>> full, stats = recompute_logprobs(cfg, params, ids, mask, out, config)  # doctest: +SKIP
  """
  B, K, T = samples.completion_ids.shape
  if prompt_ids.shape[0] != B or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompts must be [B={B}, P] ids and mask; got {prompt_ids.shape} and {prompt_mask.shape}.")
  if num_chunks < 1 or (B * K) % num_chunks:
    raise ValueError(f"num_chunks={num_chunks} must divide B * k = {B * K}.")
  P = sampler.bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  ids, mask = sampler.left_pad_to(prompt_ids, prompt_mask, P, config.pad_id)
  plp, lp, ent, outside = _rescore_jit(
      cfg, config, params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), samples.completion_ids,
      samples.completion_mask, num_chunks)
  frac = float(jnp.sum(outside) / jnp.maximum(jnp.sum(samples.completion_mask), 1))
  return samples.replace(logprobs=lp, policy_logprobs=plp, entropy=ent), {"out_of_support_frac": frac}


# ----------------------------------------------------------------------------- two stages


def two_stage_sample(cfg: ModelConfig, params_full: Params, params_fp4: Params, prompt_ids: Any,
                     prompt_mask: Any, key: jax.Array, config_pool: SamplingConfig, k: int,
                     reward_fn_host: Callable[[SampleOutput], Any], mode: str = "contrastive", *,
                     dedup: bool = True, num_chunks: int = 1
                     ) -> tuple[SampleOutput, np.ndarray, dict[str, float]]:
  """Sol-RL rollouts: an FP4 pool of M = `config_pool.num_samples`, a subset of k to train on.

  1. Sample M completions per prompt with `params_fp4` (`models.quantize_params`).
  2. Score them on the host: `reward_fn_host(pool) -> [B, M]`.
  3. Select k per prompt (`select_subset`; with `dedup`, identical completions count once).
  4. Recompute the subset's `logprobs` / `policy_logprobs` / `entropy` under `params_full`.

  Args:
    cfg: model configuration.
    params_full: the full-precision policy (the one being trained).
    params_fp4: its quantized copy, used only to explore.
    prompt_ids, prompt_mask: `[B, P]`, left-padded.
    key: PRNG key (the pool uses it; `"random"` selection a key folded from it).
    config_pool: SamplingConfig of the pool (`num_samples` = M).
    k: samples kept per prompt, `1 <= k <= M`.
    reward_fn_host: maps the pool SampleOutput to rewards `[B, M]` (host callback).
    mode: `"contrastive"`, `"random"` or `"deviation"` (see `select_subset`).
    dedup: pass the pool's tokens to the selection so that duplicates count once.
    num_chunks: see `recompute_logprobs`.

  Returns:
    (subset SampleOutput `[B, k, T]` with full-precision log-probs, rewards `[B, k]`
    float32, pool statistics: reward mean / std of the pool and of the subset, the mean
    number of distinct completions per prompt, the mean absolute FP4-vs-full gap of the
    policy log-probs on subset tokens, and `out_of_support_frac`).

  Raises:
    ValueError: k outside `[1, M]`, rewards of the wrong shape, or a bad mode.

  >>> qparams = models.quantize_params(cfg, params, "nvfp4")  # doctest: +SKIP
  >>> sub, r, stats = two_stage_sample(cfg, params, qparams, ids, mask, key,
  ...     SamplingConfig(num_samples=96, max_new_tokens=64, eos_id=2), 24, score_fn)  # doctest: +SKIP

  Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916).
  """
  M = config_pool.num_samples
  if not 1 <= int(k) <= M:
    raise ValueError(f"Cannot select k={k} samples from a pool of M={M} per prompt (need 1 <= k <= M).")
  if mode not in MODES:
    raise ValueError(f"Unknown selection mode {mode!r}; expected one of {MODES}.")
  pool_key, select_key = jax.random.split(key)
  pool = sampler.sample(cfg, params_fp4, prompt_ids, prompt_mask, pool_key, config_pool)
  rewards = np.asarray(reward_fn_host(pool), np.float32)
  B = pool.lengths.shape[0]
  if rewards.shape != (B, M):
    raise ValueError(f"reward_fn_host must return [B, M] = [{B}, {M}] rewards; got shape {rewards.shape}.")
  pool_ids = np.asarray(pool.completion_ids)
  idx = select_subset(rewards, k, mode, key=select_key, completion_ids=pool_ids if dedup else None)
  subset = gather_samples(pool, idx)
  full, rescore_stats = recompute_logprobs(cfg, params_full, prompt_ids, prompt_mask, subset, config_pool,
                                           num_chunks=num_chunks)
  sub_rewards = np.take_along_axis(rewards, idx, axis=1)
  mask = np.asarray(subset.completion_mask)
  gap = np.abs(np.asarray(subset.policy_logprobs) - np.asarray(full.policy_logprobs))
  distinct = np.mean([np.unique(pool_ids[b], axis=0).shape[0] for b in range(B)])
  stats = {
      "pool_reward_mean": float(rewards.mean()), "pool_reward_std": float(rewards.std()),
      "subset_reward_mean": float(sub_rewards.mean()), "subset_reward_std": float(sub_rewards.std()),
      "pool_distinct_per_prompt": float(distinct),
      "fp4_logprob_gap": float((gap * mask).sum() / max(mask.sum(), 1)),
      "pool_size": float(M), "subset_size": float(k), **rescore_stats,
  }
  return full, sub_rewards, stats


__all__ = ["MODES", "gather_samples", "recompute_logprobs", "select_subset", "two_stage_sample"]
