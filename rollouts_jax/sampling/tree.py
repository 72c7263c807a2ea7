"""Tree rollouts: branch where the policy is uncertain, share the prefix, prune weak branches.

Each prompt owns `num_leaves` = M preallocated decode rows. Decoding starts with
`TreeConfig.init_rows` of them; at a position whose statistics pass ECHO's branching rule a
live row forks into `width` rows: the free rows receive a COPY of the row's KV-cache rows,
logits and outputs so far (a gather over rows, run under `lax.cond` only on steps where some
row forks; the shared prefix is never recomputed) and the family continues with the
top-`width` tokens of the sampling distribution at that position (the row itself takes the
first; or, with `branch_tokens="sample"`, each row draws its own token so that every leaf is
marginally a policy sample). Rows whose confidence stays low are pruned (ECHO's triggers) and their rows become
free again. Every row that is still in use at the end is a leaf, holding the full
root-to-leaf completion, so the rest of the pipeline treats leaves as samples.

Per-position statistics follow ECHO (arXiv 2602.02150, `deepconf_branching.py`) and DeepConf
(arXiv 2508.15260):

* H_t, the entropy of the unmodified policy at position t;
* C_t = -mean(log p) over the policy's top-`conf_top_k` tokens (large = peaked);
* G_t = mean C over the last `group_window` positions, T_t over the last `tail_window`;
* dH_t = H_t - mean(H over the previous `delta_window` positions).

Branch at t >= min_depth when H_t >= entropy_min and dH_t >= delta_entropy_min (and
G_t <= group_conf_max when set), with width
clip(round(1 + alpha (H_t - h_low)/(h_high - h_low) - beta (G_t - tau)/|tau|), 1, max_width).
Free rows go to the candidates of a prompt in order of decreasing entropy (a candidate may get
fewer children than it asked for), and only while the prompt's worst-case token spend stays
within `token_budget`. Prune a live row when (a) the running minimum of G falls below
`prune_group_conf`, (b) T_t fell on `decline_steps` consecutive steps and T_t <= `tail_conf_max`,
or (c) dH_t > 0 on `decline_steps` consecutive steps and dH_t > `spike_entropy_min`; a prompt
always keeps at least one row.

Note on thresholds: with C defined as above, Jensen gives C >= log(conf_top_k), so ECHO's
published G_t <= 1.2 (with top-5) and min G < 0.4 cannot fire as written; those two tests are
therefore off by default (None) and the other thresholds are knobs to set per model.

Shapes are static: B x M rows, per-row `active`/`parent`/`branch_step` state and an M x M
matrix of divergence steps per prompt (`TreeInfo.split`), from which tree advantages follow
(`advantages.tree`).
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import models
from rollouts_jax.models import ModelConfig, Params
from rollouts_jax.sampling import engine
from rollouts_jax.sampling.config import (SampleOutput, SamplingConfig, bucket_length, check_prompts, left_pad_to,
                                          process_logits)


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Static settings of `tree_sample` (hashable; a change recompiles).

  Attributes:
    init_rows: independent root rows per prompt at step 0 (1 <= init_rows <= num_leaves).
    min_depth: no branching or pruning before this position.
    min_gap: a row branches again only this many positions after its last branch.
    entropy_min: branch only where H_t >= entropy_min (nats).
    delta_entropy_min: branch only where dH_t >= delta_entropy_min.
    group_conf_max: branch only where G_t <= group_conf_max (None: no such test).
    max_width: the most rows a branch point splits into (1: no branching).
    branch_tokens: "top": the family continues with the top-`width` tokens of the sampling
      distribution (ECHO; distinct children, but leaves are no longer policy samples);
      "sample": every row of the family draws its token from its own stream as usual, so
      each leaf is marginally a sample of the policy (children may repeat a token).
    width_alpha, width_beta, width_h_low, width_h_high, width_tau: ECHO's width formula.
    conf_top_k: k of the token confidence C_t.
    group_window, tail_window, delta_window: windows of G_t, T_t and of the mean in dH_t.
    prune: whether pruning is on.
    prune_group_conf: prune when the running minimum of G is below this (None: off).
    decline_steps: consecutive steps of the tail-decline and entropy-spike triggers.
    tail_conf_max: the tail-decline trigger needs T_t <= this (None: off).
    spike_entropy_min: the entropy-spike trigger needs dH_t > this (None: off).
    token_budget: generated tokens per prompt that forks may not push the worst case past
      (None: num_leaves * max_new_tokens, i.e. only the rows limit).
  """
  init_rows: int = 1
  min_depth: int = 4
  min_gap: int = 4
  entropy_min: float = 3.5
  delta_entropy_min: float = 0.2
  group_conf_max: float | None = None
  max_width: int = 4
  branch_tokens: str = "top"
  width_alpha: float = 2.0
  width_beta: float = 1.0
  width_h_low: float = 1.0
  width_h_high: float = 3.5
  width_tau: float = 1.2
  conf_top_k: int = 5
  group_window: int = 4
  tail_window: int = 8
  delta_window: int = 4
  prune: bool = True
  prune_group_conf: float | None = None
  decline_steps: int = 3
  tail_conf_max: float | None = 1.0
  spike_entropy_min: float | None = 0.5
  token_budget: int | None = None

  def __post_init__(self):
    if int(self.init_rows) < 1:
      raise ValueError(f"init_rows must be >= 1, got {self.init_rows}.")
    if int(self.max_width) < 1:
      raise ValueError(f"max_width must be >= 1, got {self.max_width}.")
    if self.branch_tokens not in ("top", "sample"):
      raise ValueError(f"branch_tokens must be 'top' or 'sample', got {self.branch_tokens!r}.")
    if self.width_h_high <= self.width_h_low:
      raise ValueError("width_h_high must exceed width_h_low.")
    for name in ("group_window", "tail_window", "delta_window", "conf_top_k", "decline_steps"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")

  def replace(self, **kwargs) -> "TreeConfig":
    return dataclasses.replace(self, **kwargs)


@flax.struct.dataclass
class TreeInfo:
  """The shape of each prompt's tree (B prompts, M = num_leaves rows, T = max_new_tokens).

  Attributes:
    leaf_mask: bool [B, M]; True where the row ends as a leaf (unused and pruned rows: False).
    parent: int32 [B, M]; the row this row was copied from when it was created by a fork
      (-1 for a root row and for unused rows).
    branch_step: int32 [B, M]; the position of the first token where the row differs from
      its parent (-1 for roots and unused rows).
    split: int32 [B, M, M]; split[b, i, j] is the first position where leaves i and j may
      differ: they share tokens [0, split) (T on the diagonal, 0 between two roots).
      Only entries between leaves are meaningful.
    node_id: int32 [B, M, T]; the tree node (segment) each token belongs to, equal for the
      tokens that leaves share; unique within a prompt; -1 where completion_mask is False.
    branch_entropy: float32 [B, M]; H at the row's branch step (0 for roots / unused rows).
    confidence: float32 [B, M, T]; the token confidence C_t at each generated position.
    generated_tokens: int32 [B]; tokens actually decoded for the prompt (shared prefixes once;
      pruned rows' tokens included).
    num_branches: int32 [B]; forks performed.
    num_pruned: int32 [B]; rows pruned.
  """
  leaf_mask: jax.Array
  parent: jax.Array
  branch_step: jax.Array
  split: jax.Array
  node_id: jax.Array
  branch_entropy: jax.Array
  confidence: jax.Array
  generated_tokens: jax.Array
  num_branches: jax.Array
  num_pruned: jax.Array


@flax.struct.dataclass
class _TreeState:
  dec: engine.DecodeState
  conf_RxT: jax.Array
  active_R: jax.Array         # the row holds a path (root or forked), pruned or not
  pruned_R: jax.Array
  parent_R: jax.Array         # local row index within the prompt
  branch_step_R: jax.Array
  last_branch_R: jax.Array
  branch_ent_R: jax.Array
  min_group_R: jax.Array
  prev_tail_R: jax.Array
  tail_falls_R: jax.Array
  dh_rises_R: jax.Array
  split_BxMxM: jax.Array
  spent_B: jax.Array
  branches_B: jax.Array
  pruned_B: jax.Array


def token_stats(logits_RxV: jax.Array, conf_top_k: int):
  """(entropy H, DeepConf token confidence C) of the unmodified policy, per row.

  >>> h, c = token_stats(jnp.zeros((1, 8)), 5)
  >>> round(float(h[0]), 4), round(float(c[0]), 4)  # uniform over 8: H = C = log 8
  (2.0794, 2.0794)
  """
  logp = jax.nn.log_softmax(logits_RxV.astype(jnp.float32), axis=-1)
  h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  k = min(int(conf_top_k), logits_RxV.shape[-1])
  c = -jnp.mean(jax.lax.top_k(logp, k)[0], axis=-1)
  return h, c


def _window_mean(x_RxT, cur_R, t, w):
  """Mean of x over positions (t - w, t) together with the current value at t."""
  pos = jnp.arange(x_RxT.shape[1])
  sel = (pos < t) & (pos > t - w)
  total = jnp.sum(jnp.where(sel[None], x_RxT, 0.0), axis=1) + cur_R
  return total / (jnp.sum(sel) + 1).astype(jnp.float32)


def _prev_mean(x_RxT, t, w):
  """Mean of x over positions [t - w, t) (0 when t == 0)."""
  pos = jnp.arange(x_RxT.shape[1])
  sel = (pos < t) & (pos >= t - w)
  return jnp.sum(jnp.where(sel[None], x_RxT, 0.0), axis=1) / jnp.maximum(jnp.sum(sel), 1).astype(jnp.float32)


def _gather_rows(tree, src_R):
  return jax.tree_util.tree_map(lambda x: jnp.take(x, src_R, axis=0), tree)


def _tree_step(cfg: ModelConfig, config: SamplingConfig, tree: TreeConfig, params: Params, prefix,
               row_keys_R, view: int, B: int, M: int, st: _TreeState) -> _TreeState:
  d = st.dec
  t = d.step
  R, T = d.tokens_RxT.shape
  f32 = jnp.float32
  budget = tree.token_budget if tree.token_budget is not None else M * T
  live = ~d.done_R
  # ---------------------------------------------------------------- statistics at position t
  H, C = token_stats(d.logits_RxV, tree.conf_top_k)
  G = _window_mean(st.conf_RxT, C, t, tree.group_window)
  tail = _window_mean(st.conf_RxT, C, t, tree.tail_window)
  dH = jnp.where(t > 0, H - _prev_mean(d.entropy_RxT, t, tree.delta_window), 0.0)
  full = t + 1 >= tree.group_window
  min_group = jnp.where(live & full, jnp.minimum(st.min_group_R, G), st.min_group_R)
  tail_falls = jnp.where(live, jnp.where((t > 0) & (tail < st.prev_tail_R), st.tail_falls_R + 1, 0),
                         st.tail_falls_R)
  dh_rises = jnp.where(live, jnp.where(dH > 0, st.dh_rises_R + 1, 0), st.dh_rises_R)
  prev_tail = jnp.where(live, tail, st.prev_tail_R)
  conf_RxT = jax.lax.dynamic_update_index_in_dim(st.conf_RxT, jnp.where(live, C, 0.0), t, axis=1)
  by_prompt = lambda x: x.reshape(B, M)
  # ---------------------------------------------------------------- pruning
  deep = t >= tree.min_depth
  prune_now = jnp.zeros((R,), bool)
  if tree.prune:
    trig = jnp.zeros((R,), bool)
    if tree.prune_group_conf is not None:
      trig |= min_group < tree.prune_group_conf
    if tree.tail_conf_max is not None:
      trig |= (tail_falls >= tree.decline_steps) & (tail <= tree.tail_conf_max)
    if tree.spike_entropy_min is not None:
      trig |= (dh_rises >= tree.decline_steps) & (dH > tree.spike_entropy_min)
    prune_now = live & deep & trig
    keeps = st.active_R & ~st.pruned_R & ~prune_now
    ok = jnp.any(by_prompt(keeps), axis=1)  # never prune a prompt's last row
    prune_now &= jnp.repeat(ok, M)
  live_after = live & ~prune_now
  # ---------------------------------------------------------------- branching
  greedy = config.is_greedy
  sample_logp = jax.nn.log_softmax(process_logits(d.logits_RxV, config), axis=-1)
  max_w = 1 if greedy else min(int(tree.max_width), d.logits_RxV.shape[-1])
  extra = jnp.zeros((R,), jnp.int32)
  if max_w > 1:
    cand = live_after & deep & (t - st.last_branch_R >= tree.min_gap)
    cand &= (H >= tree.entropy_min) & (dH >= tree.delta_entropy_min)
    if tree.group_conf_max is not None:
      cand &= G <= tree.group_conf_max
    raw = (1.0 + tree.width_alpha * (H - tree.width_h_low) / (tree.width_h_high - tree.width_h_low)
           - tree.width_beta * (G - tree.width_tau) / abs(tree.width_tau))
    support = jnp.sum(sample_logp > -jnp.inf, axis=-1)
    width = jnp.clip(jnp.round(raw).astype(jnp.int32), 1, max_w)
    width = jnp.minimum(width, support)
    extra = jnp.where(cand, width - 1, 0)
  free = by_prompt(~st.active_R | st.pruned_R | prune_now)
  n_live = jnp.sum(by_prompt(live_after), axis=1)
  cap = jnp.maximum((budget - st.spent_B) // jnp.maximum(T - t, 1) - n_live, 0)
  n_free = jnp.minimum(jnp.sum(free, axis=1), cap)                         # [B]
  extra_BxM = by_prompt(extra)
  order = jnp.argsort(jnp.where(extra_BxM > 0, -by_prompt(H), jnp.inf), axis=1, stable=True)
  ex_sorted = jnp.take_along_axis(extra_BxM, order, axis=1)
  before = jnp.cumsum(ex_sorted, axis=1) - ex_sorted
  got_sorted = jnp.clip(n_free[:, None] - before, 0, ex_sorted)
  inv = jnp.argsort(order, axis=1)
  granted = jnp.take_along_axis(got_sorted, inv, axis=1)                    # [B, M]
  end = jnp.cumsum(granted, axis=1)
  start = end - granted
  total = end[:, -1]
  free_rank = jnp.cumsum(free, axis=1) - 1
  is_child = free & (free_rank < total[:, None])
  parent_local = jax.vmap(lambda e, k: jnp.searchsorted(e, k, side="right"))(end, free_rank)
  parent_local = jnp.clip(parent_local, 0, M - 1).astype(jnp.int32)
  local = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
  src_local = jnp.where(is_child, parent_local, local)
  child_rank = free_rank - jnp.take_along_axis(start, parent_local, axis=1) + 1
  rank_BxM = jnp.where(is_child, child_rank, jnp.where(granted > 0, 0, -1))
  src_R = (jnp.arange(B, dtype=jnp.int32)[:, None] * M + src_local).reshape(-1)
  is_child_R = is_child.reshape(-1)
  forked_R = is_child_R | (granted > 0).reshape(-1)

  dec = d.replace(done_R=d.done_R | prune_now)
  carry = dict(dec=dec, conf=conf_RxT, min_group=min_group, prev_tail=prev_tail, tail_falls=tail_falls,
               dh_rises=dh_rises, sample_logp=sample_logp, H=H)

  def fork(c):
    per_row = dict(c)
    per_row["dec"] = c["dec"].replace(step=jnp.zeros((R,), jnp.int32))  # placeholder so every leaf has rows
    g = _gather_rows(per_row, src_R)
    g["dec"] = g["dec"].replace(step=c["dec"].step)
    return g

  carry = jax.lax.cond(jnp.any(total > 0), fork, lambda c: c, carry)
  dec = carry["dec"]
  split = st.split_BxMxM
  if max_w > 1:
    same = src_local[:, :, None] == src_local[:, None, :]
    diag = jnp.eye(M, dtype=bool)[None]
    gathered = jax.vmap(lambda s, i: s[i][:, i])(split, src_local)
    split = jnp.where(same, jnp.where(diag, T, t), gathered).astype(jnp.int32)
  active = st.active_R | is_child_R
  pruned = (st.pruned_R | prune_now) & ~is_child_R
  parent_R = jnp.where(is_child_R, parent_local.reshape(-1), st.parent_R)
  branch_step = jnp.where(is_child_R, t, st.branch_step_R)
  branch_ent = jnp.where(is_child_R, carry["H"], st.branch_ent_R)
  last_branch = jnp.where(forked_R, t, st.last_branch_R)
  # ---------------------------------------------------------------- choose, write, forward
  u = engine.row_uniforms(row_keys_R, t)
  token, lp, plp, ent = engine.choose(dec.logits_RxV, u, config)
  if max_w > 1 and tree.branch_tokens == "top":
    rank_R = rank_BxM.reshape(-1)
    top = jax.lax.top_k(carry["sample_logp"], max_w)[1]
    forced = jnp.take_along_axis(top, jnp.clip(rank_R, 0, max_w - 1)[:, None], axis=1)[:, 0].astype(jnp.int32)
    use = rank_R >= 0
    token = jnp.where(use, forced, token)
    policy_logp = jax.nn.log_softmax(dec.logits_RxV.astype(f32), axis=-1)
    lp = jnp.where(use, jnp.take_along_axis(carry["sample_logp"], token[:, None], axis=1)[:, 0], lp)
    plp = jnp.where(use, jnp.take_along_axis(policy_logp, token[:, None], axis=1)[:, 0], plp)
  live = ~dec.done_R
  token = jnp.where(live, token, config.pad_id)
  zero = jnp.zeros_like(lp)
  put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, t, axis=1)
  done = dec.done_R
  if config.eos_ids:
    done = done | jnp.isin(token, jnp.asarray(config.eos_ids, jnp.int32))
  logits, kt, v = engine.decode_forward(cfg, config, params, prefix, dec, token, view)
  dec = engine.DecodeState(
      step=t + 1, kt=kt, v=v, logits_RxV=logits,
      tokens_RxT=put(dec.tokens_RxT, token),
      logprobs_RxT=put(dec.logprobs_RxT, jnp.where(live, lp, zero)),
      policy_logprobs_RxT=put(dec.policy_logprobs_RxT, jnp.where(live, plp, zero)),
      entropy_RxT=put(dec.entropy_RxT, jnp.where(live, ent, zero)),
      mask_RxT=put(dec.mask_RxT, live), done_R=done)
  return _TreeState(
      dec=dec, conf_RxT=carry["conf"], active_R=active, pruned_R=pruned, parent_R=parent_R,
      branch_step_R=branch_step, last_branch_R=last_branch, branch_ent_R=branch_ent,
      min_group_R=carry["min_group"], prev_tail_R=carry["prev_tail"], tail_falls_R=carry["tail_falls"],
      dh_rises_R=carry["dh_rises"], split_BxMxM=split,
      spent_B=st.spent_B + jnp.sum(by_prompt(live), axis=1, dtype=jnp.int32),
      branches_B=st.branches_B + jnp.sum(granted > 0, axis=1, dtype=jnp.int32),
      pruned_B=st.pruned_B + jnp.sum(by_prompt(prune_now), axis=1, dtype=jnp.int32))


def node_ids(split_BxMxM: jax.Array, leaf_mask_BxM: jax.Array, T: int) -> jax.Array:
  """The node of each (leaf, position): `min leaf below it * T + its segment's first position`.

  Leaves i and j share the node at position t iff split[i, j] > t.

  >>> split = jnp.array([[[3, 1], [1, 3]]])
  >>> node_ids(split, jnp.ones((1, 2), bool), 3).tolist()
  [[[0, 1, 1], [0, 4, 4]]]
  """
  valid = leaf_mask_BxM[:, None, :]
  pos = jnp.arange(T)[None, None, None, :]
  s = split_BxMxM[..., None]                                       # [B, M(i), M(j), 1]
  member = valid[..., None] & (s > pos)                            # [B, i, j, T]
  M = split_BxMxM.shape[1]
  first = jnp.min(jnp.where(member, jnp.arange(M)[None, None, :, None], M), axis=2)
  seg = jnp.max(jnp.where(valid[..., None] & (s <= pos), s, 0), axis=2)
  return (first * T + seg).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _tree_jit(cfg: ModelConfig, config: SamplingConfig, tree: TreeConfig, params: Params, prompt_ids,
              prompt_mask, key):
  B, P = prompt_ids.shape
  M, T = config.num_samples, config.max_new_tokens
  R = B * M
  L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  cache_dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else params["embed"].dtype
  prompt_ids = jnp.where(prompt_mask, prompt_ids, 0)
  cache = models.init_cache(cfg, B, P, cache_dtype)
  logits_Bx1xV, cache = models.forward_with_cache(cfg, params, prompt_ids, cache, prompt_mask, last_only=True)
  to_heads = lambda x: tuple(jnp.transpose(x[l], (0, 2, 1, 3)) for l in range(L))
  layer_params = engine.layer_params(cfg, params)
  rep = lambda x: jnp.repeat(x, M, axis=0)
  prefix = engine.Prefix(layers=layer_params, k=to_heads(cache.k), v=to_heads(cache.v), mask=prompt_mask,
                         positions_R=rep(cache.next_pos))
  # Row b * M + j draws from sample j of prompt b's stream, as in `sampling.sample`.
  sample_ids = (jnp.arange(B)[:, None] * M + jnp.arange(M)[None, :]).reshape(-1)
  row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(sample_ids)
  views = engine.cache_views(T, config.length_segments)
  zeros = jnp.zeros((R, T), jnp.float32)
  init_rows = min(int(tree.init_rows), M)
  active = jnp.tile(jnp.arange(M) < init_rows, B)
  dec = engine.DecodeState(
      step=jnp.zeros((), jnp.int32),
      kt=tuple(jnp.zeros((R, K, Dh, views[0]), cache_dtype) for _ in range(L)),
      v=tuple(jnp.zeros((R, K, views[0], Dh), cache_dtype) for _ in range(L)),
      logits_RxV=rep(logits_Bx1xV[:, 0]), tokens_RxT=jnp.full((R, T), config.pad_id, jnp.int32),
      logprobs_RxT=zeros, policy_logprobs_RxT=zeros, entropy_RxT=zeros, mask_RxT=jnp.zeros((R, T), bool),
      done_R=~active)
  eye = jnp.eye(M, dtype=bool)
  st = _TreeState(
      dec=dec, conf_RxT=zeros, active_R=active, pruned_R=jnp.zeros((R,), bool),
      parent_R=jnp.full((R,), -1, jnp.int32), branch_step_R=jnp.full((R,), -1, jnp.int32),
      last_branch_R=jnp.full((R,), -(2 ** 20), jnp.int32), branch_ent_R=jnp.zeros((R,), jnp.float32),
      min_group_R=jnp.full((R,), jnp.inf, jnp.float32), prev_tail_R=jnp.zeros((R,), jnp.float32),
      tail_falls_R=jnp.zeros((R,), jnp.int32), dh_rises_R=jnp.zeros((R,), jnp.int32),
      split_BxMxM=jnp.broadcast_to(jnp.where(eye, T, 0), (B, M, M)).astype(jnp.int32),
      spent_B=jnp.zeros((B,), jnp.int32), branches_B=jnp.zeros((B,), jnp.int32),
      pruned_B=jnp.zeros((B,), jnp.int32))
  for i, view in enumerate(views):
    if i:
      grow = view - views[i - 1]
      st = st.replace(dec=st.dec.replace(
          kt=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow))) for x in st.dec.kt),
          v=tuple(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0))) for x in st.dec.v)))
    cond = lambda s, view=view: (s.dec.step < view) & ~jnp.all(s.dec.done_R)
    body = functools.partial(_tree_step, cfg, config, tree, params, prefix, row_keys, view, B, M)
    st = jax.lax.while_loop(cond, body, st)
  d = st.dec
  leaf = (st.active_R & ~st.pruned_R).reshape(B, M)
  group = lambda x: x.reshape(B, M, T)
  mask = group(d.mask_RxT) & leaf[..., None]
  zero_out = lambda x: jnp.where(mask, group(x), 0)
  out = SampleOutput(
      completion_ids=jnp.where(mask | leaf[..., None], group(d.tokens_RxT), config.pad_id),
      completion_mask=mask, logprobs=zero_out(d.logprobs_RxT), policy_logprobs=zero_out(d.policy_logprobs_RxT),
      entropy=zero_out(d.entropy_RxT), lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32))
  nodes = jnp.where(mask, node_ids(st.split_BxMxM, leaf, T), -1)
  keep = lambda x, fill: jnp.where(leaf, x.reshape(B, M), fill)
  info = TreeInfo(
      leaf_mask=leaf, parent=keep(st.parent_R, -1), branch_step=keep(st.branch_step_R, -1),
      split=st.split_BxMxM, node_id=nodes, branch_entropy=keep(st.branch_ent_R, 0.0),
      confidence=zero_out(st.conf_RxT), generated_tokens=st.spent_B, num_branches=st.branches_B,
      num_pruned=st.pruned_B)
  return out, info


def tree_sample(cfg: ModelConfig, params: Params, prompt_ids, prompt_mask, key: jax.Array,
                config: SamplingConfig, tree: TreeConfig = TreeConfig()):
  """Grows one tree of at most `config.num_samples` leaves per prompt (ECHO / TreeRL style).

  Args:
    cfg: model configuration.
    params: params pytree.
    prompt_ids: int32 [B, P], left-padded (the same contract as `sampling.sample`).
    prompt_mask: bool [B, P].
    key: PRNG key. Row j of prompt b draws from the stream `sampling.sample` gives sample j.
    config: a SamplingConfig; `num_samples` is the number of leaf rows M per prompt
      (`sample_chunk` and `decode_memory_mb` are ignored: a prompt's rows decode together).
    tree: a TreeConfig.
  Returns:
    `(SampleOutput, TreeInfo)`. The SampleOutput is [B, M, T]: each leaf row holds a full
    root-to-leaf completion; rows that are not leaves are all padding with mask False.
    With `TreeConfig(init_rows=M)` (nothing to fork into) it equals `sampling.sample` with
    the same key.

  out, info = tree_sample(cfg, params, ids, mask, jax.random.key(0),
                          SamplingConfig(num_samples=8, max_new_tokens=32, eos_id=2),
                          TreeConfig(entropy_min=1.0))
  int(info.generated_tokens.sum()) <= int(out.lengths.sum())
  # True
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
  if not isinstance(tree, TreeConfig):
    raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}.")
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(f"prompt_ids and prompt_mask must both be [B, P]; got {prompt_ids.shape} "
                     f"and {prompt_mask.shape}.")
  if tree.init_rows > config.num_samples:
    raise ValueError(f"init_rows={tree.init_rows} exceeds num_samples={config.num_samples}.")
  P_bucket = bucket_length(int(prompt_ids.shape[1]), config.prompt_buckets)
  if config.cache_len is not None and P_bucket + config.max_new_tokens > config.cache_len:
    raise ValueError(f"Prompt bucket {P_bucket} + max_new_tokens {config.max_new_tokens} exceeds the "
                     f"cache length {config.cache_len}.")
  check_prompts(cfg, config, prompt_ids, prompt_mask)
  prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, P_bucket, config.pad_id)
  return _tree_jit(cfg, config, tree, params, jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, bool),
                   key)
