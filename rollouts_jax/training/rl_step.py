"""The RL update as one jitted function: (train state, rollout batch) -> (train state, metrics).

Its static arguments are the model config and the update settings (`RLConfig`, the
sampling temperature and the generation budget) and nothing else, so a setting that only
the loop reads never recompiles it.

Advantages come from the configured transform chain over rewards [B, N] (with every extra
the batch carries: cluster ids, sequence log-probs, reference rewards); the policy loss
runs over micro-batches of rows (so large N fits), gradients are accumulated per
minibatch, and each minibatch is one optimizer update; `ppo_epochs` passes are made
over the batch. A non-finite loss or gradient skips the update (params and optimizer
state stay as they were) and is reported in the metrics, as is the gap between the
sampler's log-probs and the trainer's. With a LoRA policy (`models.lora`, `lora.rank` > 0)
only the adapters are differentiated, clipped and optimized (`lora.partition`); the base
rides in the state unchanged.

With `rl.advantage="gae"` (PPO with a learned value function) the train state also holds a
critic (`CriticState`: a full-parameter value model initialised from the policy's trunk,
`models.value`, with its own optimizer, also under LoRA): the token advantages are GAE over the
critic's values before the update (`advantages.gae_advantages`), and each minibatch also takes
one critic step on the clipped value loss (`losses.value_loss`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from rollouts_jax import advantages as advantages_lib
from rollouts_jax import losses, models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.models.scoring import batch_logprobs  # noqa: F401  (the update's scorer, in one place)
from rollouts_jax.models import lora as lora_lib
from rollouts_jax.models import value as value_lib
from rollouts_jax.sampling.batch import RolloutBatch, teacher_forced_rows
from rollouts_jax.training.config import RLConfig, parse_kwargs

_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean")


@flax.struct.dataclass
class CriticState:
  """PPO's value model: its params (`models.value.init_critic`), optimizer state and updates applied."""
  step: jax.Array       # int32 scalar: critic updates applied
  params: Params
  opt_state: Any


@flax.struct.dataclass
class TrainState:
  step: jax.Array       # int32 scalar: optimizer updates applied
  params: Params
  opt_state: Any
  critic: Any = None    # a CriticState with rl.advantage="gae" (`uses_critic`), else None


# The batch type of the update is the pipeline's one rollout batch.
Rollouts = RolloutBatch


def make_optimizer(learning_rate: float, total_updates: int, warmup_steps: int = 0,
                   weight_decay: float = 0.0, grad_clip: float = 0.0, eps: float = 1e-8,
                   freeze: tuple[str, ...] = ()) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay to 10%, after global-norm clipping.

  Parameters whose path contains a name in `freeze` (e.g. "embed") get no update.
  """
  warmup = max(min(warmup_steps, total_updates - 1), 0)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else learning_rate, peak_value=learning_rate, warmup_steps=warmup,
      decay_steps=max(total_updates, warmup + 1), end_value=0.1 * learning_rate)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=0.9, b2=0.99, eps=eps, weight_decay=weight_decay))
  if freeze:
    frozen = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) in freeze for k in path), params)
    parts.append(optax.masked(optax.set_to_zero(), frozen))
  return optax.chain(*parts)


def rl_optimizer(rl: RLConfig) -> optax.GradientTransformation:
  """The update's optimizer (`make_optimizer` from the config).

  With `rl.kl_ctrl="adaptive"` the KL controller's state rides along as the last element of
  the chain (`losses.kl_coef_state`): it is part of the optimizer state, hence of the train
  state, and is checkpointed and restored with it (a resumed run continues bitwise).
  """
  tx = make_optimizer(rl.learning_rate, rl.steps * rl.ppo_epochs * rl.num_minibatches,
                      rl.warmup_steps, rl.weight_decay, rl.grad_clip, rl.adam_eps,
                      tuple(n.strip() for n in rl.freeze.split(",") if n.strip()))
  if rl.kl_ctrl == "adaptive":
    tx = optax.chain(tx, losses.kl_coef_state(kl_controller(rl)))
  return tx


def kl_controller(rl: RLConfig) -> losses.KLController:
  """The KL coefficient controller of the config (`rl.kl_ctrl`, starting from `rl.kl_coef`)."""
  return losses.build_kl_controller(rl.kl_ctrl, rl.kl_coef, rl.kl_target, rl.kl_horizon)


def kl_coef_of(state: TrainState, rl: RLConfig) -> jax.Array:
  """The KL coefficient the next update uses: `rl.kl_coef`, or the adaptive controller's current one.

  >>> conf = RLConfig(kl_coef=0.05, kl_ctrl="adaptive")
  >>> state = init_train_state({"w": jnp.zeros(2)}, rl_optimizer(conf))
  >>> round(float(kl_coef_of(state, conf)), 6)
  0.05
  """
  if rl.kl_ctrl == "adaptive":
    return state.opt_state[-1].kl_coef
  return jnp.asarray(rl.kl_coef, jnp.float32)


def loss_kwargs(rl: RLConfig) -> dict[str, float]:
  """`rl.loss_kwargs` for `rl.loss_kind`, checked and merged over the kind's defaults."""
  return losses.check_kind_kwargs(rl.loss_kind, parse_kwargs(rl.loss_kwargs, "rl.loss_kwargs"), "rl.loss_kwargs")


def uses_critic(rl: RLConfig) -> bool:
  """Whether the update trains a value model (`rl.advantage` in `advantages.CRITIC_RECIPES`)."""
  return rl.advantage in advantages_lib.CRITIC_RECIPES


def critic_optimizer(rl: RLConfig) -> optax.GradientTransformation:
  """The critic's own optimizer: `make_optimizer` with `rl.critic_learning_rate` and `rl.critic_grad_clip`
  (the policy's schedule length, warmup, weight decay and Adam epsilon)."""
  return make_optimizer(rl.critic_learning_rate, rl.steps * rl.ppo_epochs * rl.num_minibatches,
                        rl.warmup_steps, rl.weight_decay, rl.critic_grad_clip, rl.adam_eps)


def init_train_state(params: Params, tx: optax.GradientTransformation,
                     critic_tx: optax.GradientTransformation | None = None) -> TrainState:
  """A fresh train state. Params are copied: the jitted steps donate the state, and the
  caller's arrays (e.g. the KL reference) must survive that.

  With a LoRA policy (`models.lora.apply`) the optimizer state covers the adapters alone
  (`lora.partition`); the frozen base rides in `params` and is never updated. With `critic_tx`
  the state holds a critic initialised from the policy (`models.value.init_critic`: the
  trunk with adapters merged and a zero value head, trained in full) and its optimizer state.
  """
  params = jax.tree_util.tree_map(jnp.copy, params)
  critic = None
  if critic_tx is not None:
    critic_params = value_lib.init_critic(params)
    critic = CriticState(step=jnp.zeros((), jnp.int32), params=critic_params, opt_state=critic_tx.init(critic_params))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(lora_lib.partition(params)[0]),
                    critic=critic)


def train_state_init(rl: RLConfig):
  """`params -> TrainState` for this config: the policy's optimizer, and a critic when `uses_critic(rl)`."""
  return functools.partial(init_train_state, tx=rl_optimizer(rl),
                           critic_tx=critic_optimizer(rl) if uses_critic(rl) else None)


def gae_settings(rl: RLConfig) -> advantages_lib.GAESettings:
  """gamma and lambda of `rl.advantage="gae"` from `rl.advantage_kwargs` (verl's defaults 1.0, 0.95)."""
  return advantages_lib.GAESettings(**parse_kwargs(rl.advantage_kwargs, "rl.advantage_kwargs")).check()


def advantage_transform(rl: RLConfig) -> advantages_lib.AdvantageTransform:
  """The named advantage recipe of the config with its keyword arguments (`rl.advantage_kwargs`)."""
  return advantages_lib.build(rl.advantage, **parse_kwargs(rl.advantage_kwargs, "rl.advantage_kwargs"))


def completion_logprobs(cfg: ModelConfig, params: Params, tokens_RxL: jax.Array, mask_RxL: jax.Array,
                        prompt_len: int, temperature: float = 1.0, chunk: int = 0, share: int = 1):
  """Log-probs and entropies of tokens [prompt_len:] (see `models.token_logprobs`; `chunk`: positions
  per chunk of the output head, 0 = all at once; `share`: rows per shared prompt)."""
  return models.token_logprobs(cfg, params, tokens_RxL, mask_RxL, prompt_len, temperature=temperature,
                               chunk=chunk, share=share)


def _rows(r: RolloutBatch):
  """Flattens [B, N] groups into R = B * N rows of prompt + completion."""
  tokens, attn = teacher_forced_rows(r.prompt_ids, r.prompt_mask, r.completion_ids)
  return tokens, attn, r.prompt_ids.shape[1]


def _weight(mask_rxT, total_tokens, total_seqs, total_rows, agg):
  """This micro-batch's share of a minibatch aggregate, so that summing shares is exact."""
  if agg == "token-mean":
    return jnp.sum(mask_rxT) / jnp.maximum(total_tokens, 1)
  if agg in _SEQ_MODES:
    return jnp.sum(jnp.any(mask_rxT, axis=1)) / jnp.maximum(total_seqs, 1)
  return mask_rxT.shape[0] / total_rows


def _split(x, n):
  return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def echo_shaped(adv_BxNxT: jax.Array, rollouts: RolloutBatch, sample_mask_BxN: jax.Array, lam: float) -> jax.Array:
  """ECHO's hybrid shaping of (per-sample [B, N, 1] or per-token [B, N, T]) advantages, per token.

  A_t ((1 - lam) + lam H_t / mean_t H) (c if A_t > 0 else 1), with c the response's confidence
  normalised within its group (`advantages.echo_hybrid_advantages`, applied token by token).
  """
  return advantages_lib.echo_hybrid_advantages(adv_BxNxT, rollouts.entropy, rollouts.confidence,
                                               rollouts.completion_mask, lam=lam, sample_mask_BxN=sample_mask_BxN)


def _advantage_extras(rollouts: RolloutBatch) -> dict[str, Any]:
  extra = {"lengths": rollouts.lengths}   # completion lengths (OPO, REINFORCE++'s token whitening)
  for name in ("cluster_ids", "seq_logprobs", "ref_rewards", "ref_mask", "source_ids"):
    if getattr(rollouts, name) is not None:
      extra[name] = getattr(rollouts, name)
  return extra


@functools.partial(jax.jit, static_argnames=("cfg", "rl", "temperature", "max_len"), donate_argnums=(0,))
def rl_step(state: TrainState, rollouts: RolloutBatch, ref_params: Params | None, *, cfg: ModelConfig,
            rl: RLConfig, temperature: float = 1.0, max_len: int = 0) -> tuple[TrainState, dict[str, jax.Array]]:
  """One RL update on a batch of rollouts.

  With `rollouts.teacher_logprobs` (full-vocabulary on-policy distillation) the loss is the
  KL to the teacher over the vocabulary at every loss position (`losses.full_reverse_kl`, or
  `losses.full_forward_kl` with `rl.distill_kl="forward"`, aggregated by `rl.agg`) in place of
  the policy-gradient loss.

  The PPO ratio is taken against `rollouts.old_logprobs` when the batch has them (Sol-RL's
  full-precision recomputation, replayed groups); else against the policy before this update
  (exactly the current one when there is a single update per step, so no extra forward).
  With `rl.tis_cap > 0`, each token's loss is weighted by min(exp(old - behaviour), cap), the
  truncated importance correction for the behaviour policy (an FP4 explorer, a stale policy).

  Args:
    state: the train state (donated).
    rollouts: the batch, grouped [B, N].
    ref_params: reference policy for the KL penalty (None when rl.kl_coef == 0).
    cfg: model configuration (static).
    rl: the update settings (static).
    temperature: the sampling temperature; training log-probs use the same one (static).
    max_len: the generation budget, the constant divisor of "seq-mean-token-sum-norm"
      (static; 0: the batch width).
  Returns:
    (new state, metrics): scalars averaged over the updates of this step, and
    `mismatch_mean` / `mismatch_max` / `mismatch_frac_gt_0.1` (`logprob_mismatch`): the batch's
    behaviour log-probs against the trainer's under the params before this step's update.

  With `rl.logprob_chunk` = C > 0 every log-prob pass sends the completion positions through
  the output head C at a time (`models.scoring.hidden_logprobs`): at most [rows, C, V] logits
  in the forward and the backward.

  With `rl.kl_ctrl="adaptive"` the KL coefficient of this step is the controller's (kept in
  the optimizer state, `kl_coef_of`), reported as `kl_coef`; after the step the controller
  moves it with the step's mean `kl` metric and the number of valid samples as n_steps
  (`losses.adaptive_kl_controller`).

  With `rl.advantage="gae"` (`state.critic` set): the old values V(s_t) come from the critic
  before the update; each sample's outcome reward sits on its last loss token; the token
  advantages and returns are `advantages.gae_advantages` over the loss mask (masked tokens
  skipped, advantages whitened over the batch's loss tokens). Each minibatch update also steps
  the critic on `rl.critic_loss_coef * losses.value_loss(v, returns, old values, clip
  rl.critic_cliprange_value)` (token-mean), reported as `vf_loss`, `vf_clipfrac`,
  `critic_grad_norm`. For the first `rl.critic_warmup` steps' worth of critic updates only the
  critic moves. A non-finite policy or critic gradient skips both.
  """
  tx = rl_optimizer(rl)
  B, N, T = rollouts.completion_ids.shape
  R = B * N
  # The constant divisor of "seq-mean-token-sum-norm" is the generation budget, not the
  # (possibly trimmed) width of this batch.
  max_len = max(T, max_len)
  adv_BxN, sample_mask_BxN = advantages_lib.apply(
      advantage_transform(rl), rollouts.rewards, mask=rollouts.sample_mask, **_advantage_extras(rollouts))
  tokens, attn, P = _rows(rollouts)
  if rollouts.token_advantages is not None:   # per-token advantages (tree node values, distillation)
    adv_R = rollouts.token_advantages.reshape(R, T).astype(jnp.float32)
  else:
    adv_R = adv_BxN.reshape(R)
  loss_mask_RxT = rollouts.completion_mask.reshape(R, T) & sample_mask_BxN.reshape(R, 1)
  full_kl = rollouts.teacher_logprobs is not None   # full-vocabulary distillation: no policy gradient
  teacher_R = None
  if full_kl:
    teacher_R = rollouts.teacher_logprobs.reshape(R, T, -1).astype(jnp.float32)
  if rl.echo_shaping > 0:   # ECHO's entropy-confidence hybrid shaping, per token
    adv_R = echo_shaped(adv_R.reshape(B, N, -1) if adv_R.ndim == 2 else adv_R.reshape(B, N, 1), rollouts,
                        sample_mask_BxN, rl.echo_shaping).reshape(R, T)
  conf_R = None
  if rl.echo_clip:
    conf_R = advantages_lib.normalized_confidence(rollouts.confidence, sample_mask_BxN).reshape(R)
  rollout_lp = rollouts.behaviour_logprobs.reshape(R, T)
  M = rl.num_minibatches
  rows_per_mb = R // M
  micro = rl.micro_batch_size or rows_per_mb
  n_micro = rows_per_mb // micro
  one_update = rl.ppo_epochs * M == 1
  chunk = rl.logprob_chunk
  # Rows per shared prompt: a group's N rows are consecutive and every micro-batch starts at a multiple of
  # `micro`, so blocks of gcd(micro, N) rows never cross a group.
  share = models.share_of(micro, N) if rl.shared_prompt else 1
  kind_kwargs = loss_kwargs(rl)
  kl_coef = kl_coef_of(state, rl)   # the coefficient of this step (constant over its updates)
  use_critic = uses_critic(rl)
  old_values = returns_R = None
  train_policy = jnp.bool_(True)
  if use_critic:   # PPO with a value model: token advantages by GAE over the critic's old values
    if state.critic is None:
      raise ValueError(f"rl.advantage={rl.advantage!r} needs a critic in the train state: build it with "
                       "train_state_init(rl) (init_train_state(params, tx, critic_tx=critic_optimizer(rl))).")
    if rollouts.token_advantages is not None or full_kl:
      raise ValueError(f"rl.advantage={rl.advantage!r} computes its own token advantages; this batch carries "
                       "token_advantages or teacher log-probs (tree rollouts, turn credit, distillation).")
    gs = gae_settings(rl)
    old_values = jax.lax.stop_gradient(jax.lax.scan(
        lambda _, xs: (None, value_lib.completion_values(cfg, state.critic.params, xs[0], xs[1], P, share)), None,
        (_split(tokens, R // micro), _split(attn, R // micro)))[1].reshape(R, T))
    token_rewards = advantages_lib.outcome_token_rewards(adv_BxN.reshape(R), loss_mask_RxT)
    adv_R, returns_R = advantages_lib.gae_advantages(token_rewards, old_values, loss_mask_RxT, gamma=gs.gamma,
                                                     lam=gs.lam)
    ctx = critic_optimizer(rl)
    train_policy = state.critic.step >= rl.critic_warmup * rl.ppo_epochs * M
  if rollouts.old_logprobs is not None:
    old_lp = rollouts.old_logprobs.reshape(R, T)
  elif one_update:
    old_lp = None  # the policy that sampled is the one being updated: ratio 1 by construction
  else:
    old_lp = models.rows_logprobs(cfg, state.params, tokens, attn, P, R // micro, temperature, chunk=chunk,
                                  share=share)
  # The trainer's log-probs of the batch's tokens under the params before this update, which the
  # sampler's are compared with. With one minibatch they come from the first epoch's forward
  # passes (no extra cost); else from the old log-probs computed above from the same params.
  # A batch's own old_logprobs are not used: they may be another policy's (a moving average) or
  # the sampler's own (replay), so with several minibatches they cost one more forward.
  trainer_lp = None
  if M > 1:
    trainer_lp = old_lp if rollouts.old_logprobs is None else models.rows_logprobs(
        cfg, state.params, tokens, attn, P, R // micro, temperature, chunk=chunk, share=share)
  ref_lp = None
  if rl.kl_coef > 0:
    if ref_params is None:
      raise ValueError("rl.kl_coef > 0 needs ref_params.")
    ref_lp = models.rows_logprobs(cfg, ref_params, tokens, attn, P, R // micro, temperature, chunk=chunk,
                                  share=share)

  def micro_loss(params, mb, totals):
    if full_kl:   # one forward gives the vocabulary log-probs, the sampled token's and the entropy
      logp = models.vocab_logprobs(cfg, params, mb["tokens"], mb["attn"], P, temperature=temperature, share=share)
      lp, ent = models.pick_and_entropy(logp, mb["tokens"][:, P:])
      total = losses.distill.DIRECTIONS[rl.distill_kl](logp, mb["teacher"], mb["mask"], agg=rl.agg, max_len=max_len)
      m = {"distill_kl": total, "ratio_max": jnp.ones(()), "ratio_min": jnp.ones(())}
    else:
      lp, ent = completion_logprobs(cfg, params, mb["tokens"], mb["attn"], P, temperature, chunk, share)
      old = jax.lax.stop_gradient(lp) if mb.get("old") is None else mb["old"]
      common = dict(agg=rl.agg, dual_clip=rl.dual_clip or None, max_len=max_len,
                    rollout_logprobs=mb["rollout"] if rl.tis_cap > 0 else None, tis_cap=rl.tis_cap or None,
                    tis_mode=rl.tis_mode)
      if rl.echo_clip:
        pg, m = losses.echo_policy_loss(lp, old, mb["adv"], mb["mask"], mb["conf"], rl.echo_eps_lo, rl.echo_eps_hi,
                                        **common)
      else:
        pg, m = losses.policy_loss(lp, old, mb["adv"], mb["mask"], kind=rl.loss_kind, clip_low=rl.clip_low,
                                   clip_high=rl.clip_high, kind_kwargs=kind_kwargs, **common)
      total = pg
      m = dict(m, pg_loss=pg)
    if rl.kl_coef > 0:
      kl = losses.kl_penalty(lp, mb["ref"], kind=rl.kl_kind, mask=mb["mask"], agg=rl.agg, max_len=max_len)
      total = total + kl_coef * kl
      m["kl"] = kl
    ent_mean = losses.aggregate(ent, mb["mask"], rl.agg, max_len=max_len)
    if rl.entropy_coef > 0:
      total = total - rl.entropy_coef * ent_mean
    m["policy_entropy"] = ent_mean
    w = _weight(mb["mask"], *totals, rl.agg)
    m = {k: v * w for k, v in m.items()} | {"ratio_max": m["ratio_max"], "ratio_min": m["ratio_min"]}
    return total * w, (m, jax.lax.stop_gradient(lp))

  def critic_micro_loss(critic_params, mb, n_tokens):
    v = value_lib.completion_values(cfg, critic_params, mb["tokens"], mb["attn"], P, share)
    vf, m = losses.value_loss(v, mb["returns"], mb["values"], mb["mask"], rl.critic_cliprange_value)
    w = jnp.sum(mb["mask"]) / jnp.maximum(n_tokens, 1)   # this micro-batch's share of the token-mean
    vpred = jnp.sum(jnp.where(mb["mask"], v, 0.0)) / jnp.maximum(jnp.sum(mb["mask"]), 1)
    return rl.critic_loss_coef * vf * w, {"vf_loss": vf * w, "vf_clipfrac": m["vf_clipfrac"] * w, "vpred_mean": vpred * w}

  critic_grad_fn = jax.grad(critic_micro_loss, has_aux=True)

  def minibatch_update(st: TrainState, idx):
    # The trainable part: the adapters with LoRA (the frozen base gets no gradient, no optimizer
    # state, no update), else every parameter (`combine` is then the identity).
    trainable, combine = lora_lib.partition(st.params)
    grad_fn = jax.grad(lambda t, xs, totals: micro_loss(combine(t), xs, totals), has_aux=True)
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, idx * rows_per_mb, rows_per_mb, axis=0)
    mb = {"tokens": sl(tokens), "attn": sl(attn), "adv": sl(adv_R), "mask": sl(loss_mask_RxT),
          "rollout": sl(rollout_lp)}
    if old_lp is not None:
      mb["old"] = sl(old_lp)
    if ref_lp is not None:
      mb["ref"] = sl(ref_lp)
    if conf_R is not None:
      mb["conf"] = sl(conf_R)
    if teacher_R is not None:
      mb["teacher"] = sl(teacher_R)
    if use_critic:
      mb["returns"], mb["values"] = sl(returns_R), sl(old_values)
    totals = (jnp.sum(mb["mask"]), jnp.sum(jnp.any(mb["mask"], axis=1)), rows_per_mb)
    micro_batches = jax.tree_util.tree_map(lambda x: _split(x, n_micro), mb)

    def acc(carry, xs):
      g_sum, m_sum, cg_sum = carry
      g, (m, lp) = grad_fn(trainable, xs, totals)
      if use_critic:
        cg, cm = critic_grad_fn(st.critic.params, xs, totals[0])
        m = dict(m, **cm)
        cg_sum = jax.tree_util.tree_map(jnp.add, cg_sum, cg)
      m_new = {k: (jnp.maximum(m_sum[k], v) if k == "ratio_max" else
                   jnp.minimum(m_sum[k], v) if k == "ratio_min" else m_sum[k] + v) for k, v in m.items()}
      return (jax.tree_util.tree_map(jnp.add, g_sum, g), m_new, cg_sum), lp

    first = jax.tree_util.tree_map(lambda x: x[0], micro_batches)
    m_shape = jax.eval_shape(lambda: grad_fn(trainable, first, totals)[1][0])
    if use_critic:
      m_shape = dict(m_shape, **jax.eval_shape(lambda: critic_grad_fn(st.critic.params, first, totals[0])[1]))
    m0 = {k: (jnp.full((), -jnp.inf) if k == "ratio_max" else jnp.full((), jnp.inf) if k == "ratio_min"
              else jnp.zeros((), v.dtype)) for k, v in m_shape.items()}
    g0 = jax.tree_util.tree_map(jnp.zeros_like, trainable)
    cg0 = jax.tree_util.tree_map(jnp.zeros_like, st.critic.params) if use_critic else ()
    (grads, m, critic_grads), lp = jax.lax.scan(acc, (g0, m0, cg0), micro_batches)
    grad_norm = optax.global_norm(grads)
    loss = m["distill_kl" if full_kl else "pg_loss"] + (kl_coef * m["kl"] if rl.kl_coef > 0 else 0.0)
    ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
    critic = st.critic
    if use_critic:   # the critic's own step; a non-finite side skips both
      critic_norm = optax.global_norm(critic_grads)
      ok = ok & jnp.isfinite(critic_norm) & jnp.isfinite(m["vf_loss"])
      c_updates, c_opt = ctx.update(critic_grads, critic.opt_state, critic.params)
      c_params = optax.apply_updates(critic.params, c_updates)
      keep_c = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
      critic = CriticState(step=critic.step + ok.astype(jnp.int32), params=keep_c(c_params, critic.params),
                           opt_state=keep_c(c_opt, critic.opt_state))
      m = dict(m, critic_grad_norm=critic_norm, policy_frozen=(~train_policy).astype(jnp.float32))
    step_policy = ok & train_policy   # critic warmup: only the critic moves
    updates, new_opt = tx.update(grads, st.opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(step_policy, a, b), new, old)
    st = TrainState(step=st.step + step_policy.astype(jnp.int32), params=combine(keep(new_trainable, trainable)),
                    opt_state=keep(new_opt, st.opt_state), critic=critic)
    m = dict(m, loss=loss, grad_norm=grad_norm, nonfinite=(~ok).astype(jnp.float32))
    return st, (m, lp.reshape(rows_per_mb, T))

  all_metrics = []
  for epoch in range(rl.ppo_epochs):
    state, (m, lp) = jax.lax.scan(minibatch_update, state, jnp.arange(M))
    all_metrics.append(m)
    if epoch == 0 and M == 1:   # the only minibatch of the first epoch: the params before the update
      trainer_lp = lp.reshape(R, T)
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *all_metrics)
  metrics = {k: (jnp.max(v) if k in ("ratio_max", "nonfinite") else jnp.min(v) if k == "ratio_min"
                 else jnp.mean(v)) for k, v in stacked.items()}
  if rl.kl_ctrl == "adaptive":   # the controller sees this step's KL; its next coefficient is checkpointed
    ctrl_state = kl_controller(rl).update(state.opt_state[-1], metrics["kl"],
                                          jnp.sum(rollouts.sample_mask).astype(jnp.float32))
    state = state.replace(opt_state=state.opt_state[:-1] + (ctrl_state,))
    metrics["kl_coef"] = kl_coef
  valid = rollouts.sample_mask
  metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(adv_BxN) * sample_mask_BxN) / jnp.maximum(
      jnp.sum(sample_mask_BxN), 1)
  if use_critic:   # over the loss tokens: the token advantages, the old values and the returns
    n_tok = jnp.maximum(jnp.sum(loss_mask_RxT), 1)
    tok_mean = lambda x: jnp.sum(jnp.where(loss_mask_RxT, x, 0.0)) / n_tok
    metrics.update(advantage_abs_mean=tok_mean(jnp.abs(adv_R)), values_mean=tok_mean(old_values),
                   returns_mean=tok_mean(returns_R))
  metrics["tokens_in_loss"] = jnp.sum(loss_mask_RxT).astype(jnp.float32)
  metrics["groups"] = jnp.sum(jnp.any(valid, axis=1)).astype(jnp.float32)
  metrics.update(logprob_mismatch(rollout_lp, trainer_lp, loss_mask_RxT))
  return state, metrics


def logprob_mismatch(sampler_lp: jax.Array, trainer_lp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """How far the sampler's log-probs of its tokens are from the trainer's, over the tokens of `mask`.

  {"mismatch_mean": mean |diff|, "mismatch_max": max |diff|, "mismatch_frac_gt_0.1": the fraction
  of tokens with |diff| > 0.1} (0 without tokens). In the update, `trainer_lp` is under the params
  before it: for a batch the trained policy sampled, this is the engines' numerical gap; for one
  of another policy (an FP4 explorer, replayed or stale groups, partial rollouts) it includes the
  gap between the policies.

  >>> m = logprob_mismatch(jnp.array([[-1.0, -2.0, 0.0]]), jnp.array([[-1.05, -2.5, -9.0]]),
  ...                      jnp.array([[True, True, False]]))
  >>> [round(float(m[k]), 4) for k in ("mismatch_mean", "mismatch_max", "mismatch_frac_gt_0.1")]
  [0.275, 0.5, 0.5]
  """
  diff = jnp.where(mask, jnp.abs(sampler_lp.astype(jnp.float32) - trainer_lp.astype(jnp.float32)), 0.0)
  count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  return {"mismatch_mean": jnp.sum(diff) / count, "mismatch_max": jnp.max(diff, initial=0.0),
          "mismatch_frac_gt_0.1": jnp.sum(mask & (diff > 0.1)).astype(jnp.float32) / count}
