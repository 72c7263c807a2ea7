"""`multiturn`: multi-turn and tool-using rollouts, each trajectory one `RolloutBatch` row.

Every conversation continues from its KV cache (`sampling.multiturn`): the policy decodes a
turn; the environment (`rollouts_jax.envs`, `rollout.env`) reads the turn's text and answers;
the observation is rendered (`rollout.env_render`), encoded once by the tokenizer and
appended to the row, and only its tokens run through the model before the next turn. Earlier
turns are never re-encoded, so the ids the update trains on are exactly the sampled ids and
the observation ids, in order. Policy tokens carry their behaviour log-probs and
`completion_mask` True; observation tokens carry log-prob 0 and `completion_mask` False (the
trainer's forward sees them as context; the loss and the KL skip them). Rows finish at
different turns; T = `rollout.max_new_tokens` slots hold every turn, so no turn count changes
a shape.

The environment's rewards are the batch's rewards (the sum of each trajectory's turn rewards;
`Generator.scores`: FILTER does not re-score the text), and with `rollout.turn_credit="turn"`
the per-turn rewards become per-token advantages (`advantages.turns`).

>>> from rollouts_jax.rollout import generators
>>> "multiturn" in generators.names()
True
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import envs as envs_lib
from rollouts_jax.advantages import turns as turns_lib
from rollouts_jax.rollout import generators
from rollouts_jax.sampling import multiturn as mt
from rollouts_jax.sampling.config import SamplingConfig
from rollouts_jax.types import RolloutBatch


@dataclasses.dataclass
class Episodes:
  """What `run_episodes` returns (host arrays; R = B * N rows, K = max_turns, T slots).

  Attributes:
    prompt_ids, prompt_mask: [B, P'] the prompts as bucketed by the sampler.
    tokens, mask, logprobs, policy_logprobs, entropy: [R, T] (mask: policy tokens).
    length: [R] tokens per row (policy + observation).
    turn_rewards, turn_mask: [R, K] each turn's reward, and which turns happened.
    turn_ids: [R, T] the turn of each policy token (-1: observation or padding).
    obs_ids: per row, the observation ids appended after each of its turns (in order).
    states: per row, the environment's final state.
    truncated: [R] rows cut by the token budget or the turn limit before the environment ended them.
    recomputed_tokens: tokens run through the model after the first prefill (observations, or
      with mode "reprefill" the prompts and whole histories again).
  """
  prompt_ids: np.ndarray
  prompt_mask: np.ndarray
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  policy_logprobs: np.ndarray
  entropy: np.ndarray
  length: np.ndarray
  turn_rewards: np.ndarray
  turn_mask: np.ndarray
  turn_ids: np.ndarray
  obs_ids: list
  states: list
  truncated: np.ndarray
  recomputed_tokens: int


def _bucket(n: int, cap: int) -> int:
  """Observation widths compile in powers of two (at least 8, at most `cap`)."""
  return min(max(8, 1 << max(int(n) - 1, 0).bit_length()), cap)


def run_episodes(cfg, params, prompt_ids, prompt_mask, examples: Sequence[dict], env: envs_lib.Env, tokenizer,
                 config: SamplingConfig, key: jax.Array, settings: envs_lib.EnvSettings, *,
                 mode: str = "kv") -> Episodes:
  """N episodes of `env` per prompt, decoded turn by turn from the KV cache.

  Args:
    cfg, params: the policy.
    prompt_ids, prompt_mask: [B, P] left-padded prompts (the environment's first message).
    examples: the B examples behind the prompts (`env.reset` reads them).
    env: the environment.
    tokenizer: the policy's tokenizer (decodes turns, encodes observations).
    config: the sampler's settings (N samples, T = max_new_tokens for all turns together).
    key: PRNG key.
    settings: max turns, the per-turn budget, stop strings, the renderer.
    mode: "kv" (observations appended to the cache) or "reprefill" (the baseline).

  Returns:
    `Episodes`.
  """
  B = int(np.asarray(prompt_ids).shape[0])
  N, T, K = config.num_samples, config.max_new_tokens, int(settings.max_turns)
  R = B * N
  render = envs_lib.renderer(settings.render, tokenizer, env)
  stops = envs_lib.stop_sequences(tokenizer, tuple(env.stop_strings) + tuple(settings.stop_strings))
  eos = set(config.eos_ids)
  conv = mt.start(cfg, params, np.asarray(prompt_ids), np.asarray(prompt_mask), config)
  P = int(conv.prompt_ids.shape[1])
  states = [env.reset(examples[r // N]) for r in range(R)]
  active = np.ones(R, bool)
  truncated = np.zeros(R, bool)
  turn_rewards = np.zeros((R, K), np.float32)
  turn_mask = np.zeros((R, K), bool)
  turn_ids = np.full((R, T), -1, np.int32)
  obs_record: list[list[list[int]]] = [[] for _ in range(R)]
  begin = np.zeros(R, np.int64)
  recomputed = 0
  for k in range(K):
    conv = mt.decode_turn(cfg, params, conv, key, config, turn_tokens=settings.turn_tokens, stop_ids=stops)
    tokens, length = (np.asarray(x) for x in jax.device_get((conv.tokens, conv.length)))
    obs_len = np.zeros(R, np.int32)
    obs = {}
    rows = np.flatnonzero(active)
    segs = {r: tokens[r, begin[r]:length[r]] for r in rows}
    texts = [tokenizer.decode(segs[r].tolist(), skip_special=True) for r in rows]
    if getattr(env, "concurrent", False) and len(rows) > 1:   # tools in subprocesses: side by side
      with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(rows))) as pool:
        results = list(pool.map(env.step, [states[r] for r in rows], texts))
    else:
      results = [env.step(states[r], t) for r, t in zip(rows, texts)]
    for r, res in zip(rows, results):
      seg = segs[r]
      turn_ids[r, begin[r]:length[r]] = k
      turn_mask[r, k] = True
      states[r] = res.state
      turn_rewards[r, k] = float(res.reward)
      if res.done:
        active[r] = False
        continue
      if k == K - 1 or length[r] >= T:
        active[r], truncated[r] = False, True
        continue
      ended_eos = bool(seg.size) and int(seg[-1]) in eos
      ids = list(tokenizer.encode(render.observation(res.observation, ended_eos)))
      if length[r] + len(ids) + 1 > T:      # no room for the observation and one more token
        active[r], truncated[r] = False, True
        continue
      obs[r] = ids
      obs_len[r] = len(ids)
    if not active.any():
      break
    O = _bucket(int(obs_len.max(initial=1)), T)
    arr = np.full((R, O), config.pad_id, np.int32)
    for r, ids in obs.items():
      arr[r, :len(ids)] = ids
      obs_record[r].append(ids)
    conv = mt.append(cfg, params, conv, arr, obs_len, mode=mode, config=config)
    conv = conv.replace(done=jnp.asarray(~active))
    recomputed += int(obs_len.sum()) if mode == "kv" else int((length + obs_len).sum() + R * P)
    begin = length + obs_len
  host = jax.device_get(conv)
  return Episodes(prompt_ids=np.asarray(host.prompt_ids), prompt_mask=np.asarray(host.prompt_mask),
                  tokens=np.asarray(host.tokens), mask=np.asarray(host.mask), logprobs=np.asarray(host.logprobs),
                  policy_logprobs=np.asarray(host.policy_logprobs), entropy=np.asarray(host.entropy),
                  length=np.asarray(host.length), turn_rewards=turn_rewards, turn_mask=turn_mask, turn_ids=turn_ids,
                  obs_ids=obs_record, states=states, truncated=truncated, recomputed_tokens=recomputed)


def to_batch(ep: Episodes, B: int, N: int, *, prompt_index, version: int, credit: str = "trajectory",
             gamma: float = 1.0, budget=None) -> RolloutBatch:
  """The episodes as a `RolloutBatch` [B, N, T], rewards the sum of each trajectory's turn rewards.

  With a selector's `budget` (int [B]) only each group's first budget[b] samples are live
  (`sample_mask`), and turn credit is normalised among them alone.
  """
  T = ep.tokens.shape[1]
  K = ep.turn_rewards.shape[1]
  g = lambda x: x.reshape((B, N) + x.shape[1:])
  tr, tm = g(ep.turn_rewards), g(ep.turn_mask)
  live = np.ones((B, N), bool) if budget is None else np.arange(N)[None, :] < np.asarray(budget)[:, None]
  adv = turns_lib.credit(credit, tr, tm, g(ep.turn_ids), gamma=gamma, sample_mask=live)
  del K
  return RolloutBatch(
      prompt_ids=ep.prompt_ids.astype(np.int32), prompt_mask=ep.prompt_mask.astype(bool),
      completion_ids=g(ep.tokens).astype(np.int32), completion_mask=g(ep.mask).astype(bool),
      behaviour_logprobs=g(ep.logprobs).astype(np.float32), policy_version=np.full((B, N, T), version, np.int32),
      rewards=turns_lib.trajectory_rewards(tr, tm), sample_mask=live,
      prompt_index=np.asarray(prompt_index, np.int32), entropy=g(ep.entropy).astype(np.float32),
      token_advantages=adv)


def episode_stats(ep: Episodes, env: envs_lib.Env) -> dict[str, float]:
  """The step's environment statistics: tool use, accuracy, turns, observation tokens, truncation."""
  R = ep.tokens.shape[0]
  obs_tokens = float(sum(len(ids) for row in ep.obs_ids for ids in row))
  return {
      "generated_tokens": float(ep.mask.sum()),
      "rollouts": float(R),
      "rollout/decode_steps": float(ep.mask.sum(-1).max(initial=0)),
      "env/tool_use_frac": generators.Mean(np.mean([env.used_tool(s) for s in ep.states])),
      "env/accuracy": generators.Mean(np.mean([env.solved(s) for s in ep.states])),
      "env/turns": generators.Mean(float(ep.turn_mask.sum(-1).mean())),
      "env/truncated_frac": generators.Mean(float(ep.truncated.mean())),
      "env/observation_tokens": obs_tokens,
      "env/recomputed_tokens": float(ep.recomputed_tokens),
  }


@generators.register("multiturn")
def multiturn(ctx: generators.GeneratorContext, mode: str = "kv") -> generators.Generator:
  """Multi-turn rollouts in the environment of the run's `rollout.env` settings (`ctx.env`).

  Args:
    ctx: the build context; needs `env` (`envs.EnvSettings`), and to generate, `tokenizer` and
      `examples` (the prompt pool, read by `Prompts.index`).
    mode: "kv" (continue from the KV cache) or "reprefill" (re-run every history each turn: the
      baseline, for comparisons only).

  Returns:
    A `Generator` whose batches carry the environment's rewards (`scores=True`) and, with
    `rollout.turn_credit="turn"`, per-token advantages.
  """
  if mode not in mt.MODES:
    raise generators.setting_error("multiturn", "mode", f"must be one of {', '.join(mt.MODES)}, got {mode!r}")
  settings = ctx.env
  if not isinstance(settings, envs_lib.EnvSettings):
    raise ValueError("Config key rollout.env: rollout.generator='multiturn' needs an environment "
                     f"(rollout.env, one of {', '.join(envs_lib.names())}).")
  env = settings.check(ctx.sampling.max_new_tokens)
  turn_credit = settings.credit != "trajectory"

  def init():
    return None

  def generate(state, params, prompts: generators.Prompts, key, *, version: int):
    if ctx.tokenizer is None or ctx.examples is None:
      raise ValueError("The multiturn generator needs the tokenizer and the prompt pool in its context.")
    examples = [ctx.examples[int(i)] for i in np.asarray(prompts.index)]
    ep = run_episodes(ctx.cfg, params, prompts.ids, prompts.mask, examples, env, ctx.tokenizer, ctx.sampling, key,
                      settings, mode=mode)
    B, N = len(examples), ctx.sampling.num_samples
    batch = to_batch(ep, B, N, prompt_index=prompts.index, version=version, credit=settings.credit,
                     gamma=settings.gamma, budget=prompts.budget)
    return batch, state, episode_stats(ep, env)

  def update(state, batch, *, version: int, **extra):
    del batch, version, extra
    return state

  return generators.Generator(init, generate, update, fields=("token_advantages",) if turn_credit else (),
                              scores=True)
