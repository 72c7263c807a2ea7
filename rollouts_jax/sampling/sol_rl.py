"""Sol-RL's GENERATE pieces: gather a pool's subset, recompute its log-probs in full precision.

In the training loop Sol-RL is four composed calls, one per stage: sample a pool with the
FP4 copy of the policy (`sampling.sample`), score it (FILTER), select a subset
(`control.select_subset`), and recompute the subset's log-probs under the full-precision
policy (`recompute_batch`). The description below is the method's.

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling.batch import teacher_forced_rows
from rollouts_jax.sampling.config import SampleOutput, SamplingConfig, bucket_length, left_pad_to, process_logits


# ----------------------------------------------------------------------------- selection


def gather_samples(sample_output: SampleOutput, indices_BxK: Any) -> SampleOutput:
  """The samples `indices [B, k]` of each prompt: `[B, M, T]` fields become `[B, k, T]`.

  sub = gather_samples(out, np.array([[0, 3], [1, 2]]))
  sub.completion_ids.shape
  # (2, 2, T)
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
  tokens_RxL, attn_RxL = teacher_forced_rows(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxKxT)

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
    processed = jax.nn.log_softmax(process_logits(logits_rxTxV, config), axis=-1)
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

  full, stats = recompute_logprobs(cfg, params, ids, mask, out, config)
  """
  B, K, T = samples.completion_ids.shape
  if prompt_ids.shape[0] != B or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompts must be [B={B}, P] ids and mask; got {prompt_ids.shape} and {prompt_mask.shape}.")
  if num_chunks < 1 or (B * K) % num_chunks:
    raise ValueError(f"num_chunks={num_chunks} must divide B * k = {B * K}.")
  P = bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  ids, mask = left_pad_to(prompt_ids, prompt_mask, P, config.pad_id)
  plp, lp, ent, outside = _rescore_jit(
      cfg, config, params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), samples.completion_ids,
      samples.completion_mask, num_chunks)
  frac = float(jnp.sum(outside) / jnp.maximum(jnp.sum(samples.completion_mask), 1))
  return samples.replace(logprobs=lp, policy_logprobs=plp, entropy=ent), {"out_of_support_frac": frac}


# ------------------------------------------------------------------ the pipeline's recompute step


def recompute_batch(cfg: ModelConfig, params: Params, batch, *, temperature: float = 1.0, num_chunks: int = 1):
  """Sol-RL's stage 2 on a `RolloutBatch`: the trainer's log-probs of its tokens under `params`.

  Sets `old_logprobs` (the full-precision policy's tempered log-probs, the same function the
  update uses, so with one update per step the PPO ratio starts at exactly 1) and `entropy`,
  and keeps `behaviour_logprobs` (the FP4 explorer's), so `rl.tis_cap` can correct the
  explorer/trainer mismatch.

  Args:
    cfg, params: the full-precision policy.
    batch: a RolloutBatch `[B, K, T]` sampled by the explorer.
    temperature: the sampling temperature.
    num_chunks: rows are scored in this many sequential chunks (must divide B * K).

  Returns:
    (the batch with `old_logprobs` and `entropy` set, {"fp4_logprob_gap": mean |behaviour - old|
    over live tokens}).
  """
  B, K, T = batch.completion_ids.shape
  if num_chunks < 1 or (B * K) % num_chunks:
    raise ValueError(f"num_chunks={num_chunks} must divide B * k = {B * K}.")
  lp, ent = models.batch_logprobs(params, jnp.asarray(batch.prompt_ids, jnp.int32), jnp.asarray(batch.prompt_mask),
                                  jnp.asarray(batch.completion_ids, jnp.int32), jnp.asarray(batch.completion_mask),
                                  cfg=cfg, temperature=float(temperature), micro_rows=B * K // num_chunks,
                                  entropy=True)
  m = np.asarray(batch.completion_mask)
  lp, ent = np.where(m, np.asarray(lp), 0.0).astype(np.float32), np.where(m, np.asarray(ent), 0.0).astype(np.float32)
  gap = float((np.abs(lp - np.asarray(batch.behaviour_logprobs)) * m).sum() / max(m.sum(), 1))
  return batch.replace(old_logprobs=lp, entropy=ent), {"fp4_logprob_gap": gap}


__all__ = ["gather_samples", "recompute_batch", "recompute_logprobs"]
