"""The RL loop: sample -> score -> advantages -> update, with checkpoints, metrics and evaluation.

Every random choice of step s derives from (seed, s), and the prompt stream's position
is checkpointed, so a killed run resumed from its workdir continues to the same result
as a run that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax import advantages as advantages_lib
from rollouts_jax import data as data_lib
from rollouts_jax import models, rewards, sampling
from rollouts_jax.training import eval_metrics
from rollouts_jax.training.checkpoint import Checkpointer
from rollouts_jax.training.config import ExperimentConfig
from rollouts_jax.training.metrics import MetricsLogger, plot_curves
from rollouts_jax.training.rl_step import Rollouts, TrainState, init_train_state, rl_optimizer, rl_step
from rollouts_jax.training.sft import tokenize_pairs, train_sft

log = logging.getLogger(__name__)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_SYNTHETIC = ("arithmetic", "countdown")


class TrainingStopped(RuntimeError):
  """Raised when too many consecutive updates were non-finite."""


def cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("ROLLOUTS_JAX_CACHE", pathlib.Path.home() / ".cache" / "rollouts_jax"))


# ----------------------------------------------------------------------------------------------
# Data, tokenizer, rewards
# ----------------------------------------------------------------------------------------------

def load_task(exp: ExperimentConfig) -> tuple[Sequence[dict], Sequence[dict]]:
  """(train, test) examples of the configured task."""
  d = exp.data
  data_dir = d.data_dir or str(cache_root() / "tfds")
  if d.task == "arithmetic":
    kw = dict(seed=d.seed, num_train=d.num_train, num_test=d.num_test, digits=d.difficulty, ops=d.ops)
  elif d.task == "countdown":
    kw = dict(seed=d.seed, num_train=d.num_train, num_test=d.num_test, difficulty=d.difficulty)
  else:
    kw = dict(manual_dir=d.manual_dir or None)
  test = data_lib.load_dataset(d.task, "test", data_dir=data_dir, **kw)
  if d.task in _SYNTHETIC or "train" in data_lib.BENCHMARK_FILES.get(d.task, {}):
    return data_lib.load_dataset(d.task, "train", data_dir=data_dir, **kw), test
  log.warning("%s has no train split: training prompts come from its test split (test-time RL).", d.task)
  return test, test


def reference_of(example: dict, task: str) -> Any:
  """What the task's reward compares a completion with."""
  if task == "countdown":
    return {"numbers": [int(x) for x in example["numbers"]], "target": int(example["target"])}
  return str(example["answer"])


def reward_name(exp: ExperimentConfig) -> str:
  return exp.reward.name


def score(exp: ExperimentConfig, texts: Sequence[str], refs: Sequence[Any]) -> tuple[np.ndarray, dict]:
  return rewards.score_batch(reward_name(exp), list(texts), list(refs), timeout_s=exp.reward.timeout_s,
                             num_workers=exp.reward.num_workers)


def decode_completions(tokenizer, ids_BxNxT: np.ndarray, mask_BxNxT: np.ndarray) -> list[str]:
  """Texts of the completions (flattened prompt-major), EOS and padding dropped."""
  flat_ids = ids_BxNxT.reshape(-1, ids_BxNxT.shape[-1])
  flat_mask = mask_BxNxT.reshape(flat_ids.shape)
  out = []
  for ids, m in zip(flat_ids, flat_mask):
    toks = [int(t) for t in ids[m] if int(t) != tokenizer.eos_id]
    out.append(tokenizer.decode(toks))
  return out


def answers_of(texts: Sequence[str], task: str) -> list[str | None]:
  if data_lib.ANSWER_FORMATS.get(task) == "tags":
    return [data_lib.parse_answer(t) for t in texts]
  return [rewards.extract_answer(t, "boxed") for t in texts]


def prompt_batch(exp: ExperimentConfig, examples: Sequence[dict], tokenizer) -> data_lib.PromptBatch:
  synthetic = exp.data.task in _SYNTHETIC and exp.tokenizer.kind == "char"
  kw = {"instruction": False} if synthetic else {}
  batch = data_lib.make_prompt_batch(examples, exp.data.task, tokenizer, buckets=PROMPT_BUCKETS,
                                     template=exp.data.template, **kw)
  if batch.prompt_ids.shape[1] > exp.data.max_prompt_len:
    longest = int(batch.prompt_mask.sum(1).max())
    if longest > exp.data.max_prompt_len:
      raise ValueError(f"A prompt has {longest} tokens, more than data.max_prompt_len={exp.data.max_prompt_len}.")
  return batch


# ----------------------------------------------------------------------------------------------
# Policy: warm start, HF checkpoint or random
# ----------------------------------------------------------------------------------------------

def model_config(exp: ExperimentConfig, tokenizer) -> models.ModelConfig:
  m = exp.model
  return models.ModelConfig(
      model_type=m.model_type, vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
      qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3", remat=m.remat,
      eos_token_ids=(tokenizer.eos_id,), pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
      max_position_embeddings=1024)


def _warm_start_key(exp: ExperimentConfig) -> str:
  parts = {"data": dataclasses.asdict(exp.data), "tokenizer": dataclasses.asdict(exp.tokenizer),
           "model": dataclasses.asdict(exp.model),
           "sft": {k: v for k, v in dataclasses.asdict(exp.sft).items() if k not in ("cache_dir", "log_every")},
           "seed": exp.seed}
  for k in ("data_dir", "manual_dir"):
    parts["data"].pop(k)
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _make_tokenizer(exp: ExperimentConfig, train_examples) -> Any:
  kind = exp.tokenizer.kind
  if kind == "char":
    return data_lib.CharTokenizer.load(exp.tokenizer.path) if exp.tokenizer.path else data_lib.CharTokenizer.default()
  if exp.tokenizer.path:
    return data_lib.load_tokenizer(exp.tokenizer.path)
  if kind == "hf" and exp.model.hf_path:
    return data_lib.HFTokenizer.from_dir(exp.model.hf_path)
  raise ValueError(f"tokenizer.kind={kind!r} needs tokenizer.path (or model.hf_path for 'hf').")


def warm_start(exp: ExperimentConfig, train_examples, log_fn=None):
  """Returns (cfg, params, tokenizer, folder), running SFT unless a cached warm start matches."""
  root = pathlib.Path(exp.sft.cache_dir) if exp.sft.cache_dir else cache_root() / "warmstart"
  folder = root / f"{exp.data.task}-{_warm_start_key(exp)}"
  dtype = jnp.dtype(exp.model.dtype)
  if (folder / "done.json").exists():
    log.info("Reusing warm start %s", folder)
    tokenizer = data_lib.load_tokenizer(folder / "tokenizer.json")
    cfg, params = models.load_hf_checkpoint(folder, dtype=dtype)
    return cfg.replace(remat=exp.model.remat), params, tokenizer, folder
  tokenizer = _make_tokenizer(exp, train_examples)
  cfg = model_config(exp, tokenizer)
  params = models.init_params(cfg, jax.random.key(exp.seed), dtype)
  n = len(train_examples)
  synthetic = {"instruction": False} if exp.data.task in _SYNTHETIC and exp.tokenizer.kind == "char" else {}
  prompts = [data_lib.format_prompt(ex, exp.data.task, exp.data.template, tokenizer, **synthetic)
             for ex in train_examples]
  completions = [data_lib.format_completion(ex, exp.data.task) for ex in train_examples]
  tokens, attn, loss_mask = tokenize_pairs(prompts, completions, tokenizer)
  log.info("SFT warm start: %d examples of %d tokens, %d steps", n, tokens.shape[1], exp.sft.steps)
  t0 = time.time()
  params = train_sft(cfg, params, tokens, attn, loss_mask, steps=exp.sft.steps, batch_size=exp.sft.batch_size,
                     learning_rate=exp.sft.learning_rate, warmup_steps=exp.sft.warmup_steps,
                     weight_decay=exp.sft.weight_decay, grad_clip=exp.sft.grad_clip, seed=exp.seed,
                     log_fn=log_fn, log_every=exp.sft.log_every)
  root.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
  models.save_hf_checkpoint(tmp, cfg, params)
  tokenizer.save(tmp / "tokenizer.json") if isinstance(tokenizer, data_lib.CharTokenizer) else None
  (tmp / "done.json").write_text(json.dumps({"sft_seconds": time.time() - t0, "key": _warm_start_key(exp)}))
  if folder.exists():
    shutil.rmtree(folder)
  tmp.rename(folder)
  return cfg, params, tokenizer, folder


def load_policy(exp: ExperimentConfig, train_examples, log_fn=None):
  """(cfg, params, tokenizer) of the configured initial policy."""
  dtype = jnp.dtype(exp.model.dtype)
  if exp.model.init == "hf":
    cfg, params = models.load_hf_checkpoint(exp.model.hf_path, dtype=dtype)
    tokenizer = _make_tokenizer(exp, train_examples)
    return cfg.replace(remat=exp.model.remat), params, tokenizer
  if exp.model.init == "random":
    tokenizer = _make_tokenizer(exp, train_examples)
    cfg = model_config(exp, tokenizer)
    return cfg, models.init_params(cfg, jax.random.key(exp.seed), dtype), tokenizer
  cfg, params, tokenizer, _ = warm_start(exp, train_examples, log_fn)
  return cfg, params, tokenizer


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

def evaluate(exp: ExperimentConfig, cfg, params, tokenizer, examples: Sequence[dict], *, k: int | None = None,
             temperature: float | None = None, key=None, greedy: bool = True) -> dict[str, float]:
  """pass@1, pass@k (unbiased), maj@k and greedy accuracy on `examples`."""
  k = k or exp.eval.k
  temperature = exp.eval.temperature if temperature is None else temperature
  key = jax.random.key(exp.seed + 1) if key is None else key
  conf = sampling.SamplingConfig(num_samples=k, max_new_tokens=exp.rl.max_new_tokens, temperature=temperature,
                                 top_k=exp.rl.top_k, top_p=exp.rl.top_p, eos_id=tokenizer.eos_id,
                                 pad_id=tokenizer.pad_id, prompt_buckets=PROMPT_BUCKETS,
                                 sample_chunk=exp.rl.sample_chunk)
  correct, answers, greedy_correct = [], [], []
  bs = exp.eval.batch_size
  for start in range(0, len(examples), bs):
    chunk = list(examples[start:start + bs])
    pb = prompt_batch(exp, chunk, tokenizer)
    refs = [reference_of(ex, exp.data.task) for ex in chunk]
    out = sampling.sample(cfg, params, pb.prompt_ids, pb.prompt_mask, jax.random.fold_in(key, start), conf)
    texts = decode_completions(tokenizer, np.asarray(out.completion_ids), np.asarray(out.completion_mask))
    r, _ = score(exp, texts, [ref for ref in refs for _ in range(k)])
    correct.append(r.reshape(len(chunk), k) >= 1.0)
    ans = answers_of(texts, exp.data.task)
    answers += [ans[i * k:(i + 1) * k] for i in range(len(chunk))]
    if greedy:
      g = sampling.sample(cfg, params, pb.prompt_ids, pb.prompt_mask, key, conf.replace(num_samples=1, greedy=True))
      gtexts = decode_completions(tokenizer, np.asarray(g.completion_ids), np.asarray(g.completion_mask))
      gr, _ = score(exp, gtexts, refs)
      greedy_correct.append(gr >= 1.0)
  correct = np.concatenate(correct)
  result = {"eval/pass@1": float(eval_metrics.mean_pass_at_k(correct, 1)),
            f"eval/pass@{k}": float(eval_metrics.mean_pass_at_k(correct, k)),
            f"eval/maj@{k}": float(eval_metrics.maj_at_k(answers, correct.tolist(), k))}
  if greedy:
    result["eval/greedy_accuracy"] = float(np.concatenate(greedy_correct).mean())
  return result


# ----------------------------------------------------------------------------------------------
# Rollouts
# ----------------------------------------------------------------------------------------------

def sampling_config(exp: ExperimentConfig, tokenizer) -> sampling.SamplingConfig:
  rl = exp.rl
  return sampling.SamplingConfig(num_samples=rl.num_samples, max_new_tokens=rl.max_new_tokens,
                                 temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                 eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, sample_chunk=rl.sample_chunk,
                                 prompt_buckets=PROMPT_BUCKETS)


def _generate(exp, cfg, params, tokenizer, examples, key):
  """Samples and scores one batch of prompts; returns host arrays and texts.

  With `rl.fp4_rollouts`, the batch is Sol-RL's: a pool sampled by an FP4 copy of the policy,
  scored, and a subset of `num_samples` per prompt kept, its log-probs recomputed in full
  precision.
  """
  pb = prompt_batch(exp, examples, tokenizer)
  N = exp.rl.num_samples
  conf = sampling_config(exp, tokenizer)
  t0 = time.perf_counter()
  extra: dict[str, float] = {}
  stats_box: list[dict] = []
  scored_texts: list[str] = []

  def score_out(out):
    texts = decode_completions(tokenizer, np.asarray(out.completion_ids), np.asarray(out.completion_mask))
    refs = [reference_of(ex, exp.data.task) for ex in examples for _ in range(out.completion_ids.shape[1])]
    r, stats = score(exp, texts, refs)
    stats_box.append(stats)
    scored_texts[:] = texts
    return r.reshape(len(examples), -1)

  if exp.rl.fp4_rollouts:
    from rollouts_jax.sampling import sol_rl  # pylint: disable=g-import-not-at-top
    params_fp4 = models.quantize_params(cfg, params, exp.rl.fp4_rollouts)
    pool_conf = conf.replace(num_samples=exp.rl.sol_pool_size or N)
    out, r, pool_stats = sol_rl.two_stage_sample(cfg, params, params_fp4, pb.prompt_ids, pb.prompt_mask, key,
                                                 pool_conf, N, score_out, mode=exp.rl.sol_select)
    out = jax.device_get(out)
    extra = {f"sol/{k}": float(v) for k, v in pool_stats.items()}
    t_sample = time.perf_counter() - t0
    t_score = sum(s.get("wall_s", 0.0) for s in stats_box)
    texts = decode_completions(tokenizer, out.completion_ids, out.completion_mask)  # the kept subset
  else:
    out = jax.device_get(sampling.sample(cfg, params, pb.prompt_ids, pb.prompt_mask, key, conf))
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = score_out(out)
    t_score = time.perf_counter() - t0
    texts = list(scored_texts)  # already decoded for scoring
  r = np.asarray(r, np.float32)
  if exp.rl.overlong_buffer > 0:
    from rollouts_jax import losses  # pylint: disable=g-import-not-at-top
    r = r + np.asarray(losses.overlong_penalty(jnp.asarray(out.lengths), max_len=exp.rl.max_new_tokens,
                                               cache_len=exp.rl.overlong_buffer))
  stats = {"failures": sum(s.get("failures", 0) for s in stats_box)}
  return dict(pb=pb, out=out, texts=texts, rewards=r, stats=stats, t_sample=t_sample, t_score=t_score,
              extra=extra)


def _pad_prompts(ids_list, mask_list):
  P = max(x.shape[1] for x in ids_list)
  ids = [np.pad(x, ((0, 0), (P - x.shape[1], 0))) for x in ids_list]
  masks = [np.pad(m, ((0, 0), (P - m.shape[1], 0))) for m in mask_list]
  return np.concatenate(ids), np.concatenate(masks)


def collect_rollouts(exp, cfg, params, tokenizer, stream, key) -> tuple[Rollouts, dict]:
  """One batch of grouped rollouts; with dynamic sampling, all-equal groups are dropped and refilled."""
  B, N = exp.rl.prompts_per_step, exp.rl.num_samples
  parts = [_generate(exp, cfg, params, tokenizer, next(stream), key)]
  if exp.rl.dynamic_sampling:
    for refill in range(exp.rl.max_refills):
      informative = sum(int(np.ptp(p["rewards"][i]) > 0) for p in parts for i in range(len(p["rewards"])))
      if informative >= B:
        break
      parts.append(_generate(exp, cfg, params, tokenizer, next(stream), jax.random.fold_in(key, refill + 1)))
  ids, pmask = _pad_prompts([p["pb"].prompt_ids for p in parts], [p["pb"].prompt_mask for p in parts])
  cat = lambda f: np.concatenate([f(p) for p in parts])
  comp_ids, comp_mask = cat(lambda p: p["out"].completion_ids), cat(lambda p: p["out"].completion_mask)
  lp, ent, lengths = cat(lambda p: p["out"].logprobs), cat(lambda p: p["out"].entropy), cat(lambda p: p["out"].lengths)
  r = cat(lambda p: p["rewards"])
  texts = [t for p in parts for t in p["texts"]]
  keep = np.arange(len(r))
  group_mask = np.ones((len(r), N), bool)
  if exp.rl.dynamic_sampling:
    informative = np.ptp(r, axis=1) > 0
    keep = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:B]
    group_mask = np.repeat(informative[keep][:, None], N, axis=1)
  keep = keep[:B]
  group_mask = group_mask[:B]
  # The update runs on completions cut to the longest one kept (rounded up to a multiple of 8,
  # so few shapes compile): positions past every row's end carry no loss, only compute.
  T = comp_ids.shape[-1]
  T_used = min(T, max(8, -(-int(lengths[keep].max(initial=0)) // 8) * 8))
  comp_ids, comp_mask, lp = comp_ids[..., :T_used], comp_mask[..., :T_used], lp[..., :T_used]
  ent = ent[..., :T_used]
  answers = answers_of([texts[i * N + j] for i in keep for j in range(N)], exp.data.task)
  cluster_ids = np.asarray(advantages_lib.cluster_by_answer([answers[i * N:(i + 1) * N] for i in range(B)]),
                           np.int32).reshape(B, N) if exp.rl.advantage.startswith("uniqueness") else np.zeros((B, N), np.int32)
  rollouts = Rollouts(prompt_ids=jnp.asarray(ids[keep]), prompt_mask=jnp.asarray(pmask[keep]),
                      completion_ids=jnp.asarray(comp_ids[keep]), completion_mask=jnp.asarray(comp_mask[keep]),
                      rollout_logprobs=jnp.asarray(lp[keep]), rewards=jnp.asarray(r[keep], jnp.float32),
                      group_mask=jnp.asarray(group_mask), cluster_ids=jnp.asarray(cluster_ids))
  m = comp_mask[keep]
  info = {
      "reward_mean": float(r[keep].mean()), "reward_std": float(r[keep].std()),
      # Over every sampled group, before dynamic sampling drops any (equal to reward_mean without it).
      "reward_mean_sampled": float(r.mean()),
      "accuracy": float((r[keep] >= 1.0).mean()),
      "response_length": float(lengths[keep].mean()),
      "entropy": float((ent[keep] * m).sum() / max(m.sum(), 1)),
      "informative_groups": float((np.ptp(r[keep], axis=1) > 0).mean()),
      "generated_tokens": float(lengths.sum()),
      "grader_failures": float(sum(p["stats"].get("failures", 0) for p in parts)),
      "time/sample": sum(p["t_sample"] for p in parts), "time/score": sum(p["t_score"] for p in parts),
      "refills": float(len(parts) - 1),
  }
  for k in parts[0]["extra"]:
    info[k] = float(np.mean([p["extra"][k] for p in parts]))
  return rollouts, info


# ----------------------------------------------------------------------------------------------
# The main loop
# ----------------------------------------------------------------------------------------------

def _abstract(tree):
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class _Placement:
  """Where params, optimizer state and batches live: one device, or meshes with logical rules.

  With `mesh.rollout_shape`, training and rollouts run on disjoint device blocks and the
  policy is handed off (resharded) to the rollout mesh before each generation.
  """

  def __init__(self, exp: ExperimentConfig, cfg: models.ModelConfig):
    from rollouts_jax import sharding  # pylint: disable=g-import-not-at-top
    self.sharding, self.cfg = sharding, cfg
    shape = tuple(exp.mesh.shape)
    self.active = int(np.prod(shape)) != 1 or bool(exp.mesh.rollout_shape)
    if self.active:
      self.roles = sharding.RolloutTrainMeshes.create(sharding.MeshConfig(
          shape, exp.mesh.preset, tuple(exp.mesh.rollout_shape) or None, exp.mesh.rollout_preset or None))
      self.mesh = self.roles.train_mesh
      self.param_shardings = self.roles.train_shardings(cfg)
      log.info("Training mesh: %s", sharding.describe(self.mesh))
      if self.roles.separate:
        log.info("Rollout mesh: %s", sharding.describe(self.roles.rollout_mesh))

  def state(self, state: TrainState) -> TrainState:
    if not self.active:
      return state
    params = self.sharding.shard_params(state.params, self.param_shardings)
    opt_shardings = self.sharding.tree_shardings_like(state.opt_state, self.param_shardings, state.params)
    opt_state = jax.tree_util.tree_map(jax.device_put, state.opt_state, opt_shardings)
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return TrainState(step=jax.device_put(state.step, replicated), params=params, opt_state=opt_state)

  def params(self, params):
    return self.sharding.shard_params(params, self.param_shardings) if self.active else params

  def rollout_params(self, params):
    """The policy as the sampler sees it (a copy on the rollout mesh when roles are separate)."""
    return self.roles.to_rollout(self.cfg, params) if self.active and self.roles.separate else params

  def batch(self, rollouts: Rollouts) -> Rollouts:
    return self.sharding.shard_batch(rollouts, self.mesh) if self.active else rollouts

  def rollout_context(self):
    import contextlib  # pylint: disable=g-import-not-at-top
    return self.roles.rollout_context() if self.active else contextlib.nullcontext()


def train(exp: ExperimentConfig, workdir: str | os.PathLike, *, progress: bool = True) -> dict[str, Any]:
  """Runs (or resumes) an experiment in `workdir`; returns a summary dict.

  The summary holds the evaluation before and after RL and the final step. Writes
  `metrics.jsonl`, TensorBoard events under `tb/`, orbax checkpoints under `checkpoints/`,
  PNG learning curves under `plots/` and `summary.json` to the workdir.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(exp), indent=2, default=str))
  logger = MetricsLogger(workdir, total_steps=exp.rl.steps if progress else None, desc="rl")
  train_examples, test_examples = load_task(exp)
  with MetricsLogger(workdir / "sft", total_steps=None, desc="sft") as sft_logger:  # its own step axis
    cfg, params, tokenizer = load_policy(exp, train_examples, log_fn=sft_logger.log)
  placement = _Placement(exp, cfg)
  params = placement.params(params)
  ref_params = params if exp.rl.kl_coef > 0 else None
  tx = rl_optimizer(exp.rl)
  state = placement.state(init_train_state(params, tx))
  stream = data_lib.PromptStream(train_examples, batch_size=exp.rl.prompts_per_step, seed=exp.seed,
                                 shard_index=jax.process_index(), num_shards=jax.process_count())
  ckpt = Checkpointer(workdir / "checkpoints", save_every=exp.checkpoint.every, keep=exp.checkpoint.keep)
  eval_examples = list(test_examples[:exp.eval.num_examples])
  start, nonfinite_run, summary = 0, 0, {}
  latest = ckpt.latest_step()
  if latest is not None:
    state, meta, _ = ckpt.restore(_abstract(state))
    stream.restore(meta["stream"])
    start, nonfinite_run, summary = meta["rl_step"], meta["nonfinite_run"], meta["summary"]
    logger.truncate_after(start)
    log.info("Resumed from step %d", start)
  else:
    before = evaluate(exp, cfg, state.params, tokenizer, eval_examples)
    summary["before"] = before
    logger.log(0, before)
  base_key = jax.random.key(exp.seed)
  for step in range(start, exp.rl.steps):
    t0 = time.perf_counter()
    with placement.rollout_context():
      rollouts, info = collect_rollouts(exp, cfg, placement.rollout_params(state.params), tokenizer, stream,
                                        jax.random.fold_in(base_key, step))
    t1 = time.perf_counter()
    state, m = rl_step(state, placement.batch(rollouts), ref_params, cfg=cfg, rl=exp.rl)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    t2 = time.perf_counter()
    info.update(m)
    info["time/update"] = t2 - t1
    info["time/step"] = t2 - t0
    info["tokens_per_s"] = info["generated_tokens"] / max(info["time/sample"], 1e-9)
    nonfinite_run = nonfinite_run + 1 if m["nonfinite"] > 0 else 0
    if m["nonfinite"] > 0:
      log.warning("Step %d: non-finite loss or gradient; update skipped (%d in a row).", step + 1, nonfinite_run)
    if exp.eval.every and (step + 1) % exp.eval.every == 0 and step + 1 < exp.rl.steps:
      info.update(evaluate(exp, cfg, state.params, tokenizer, eval_examples, greedy=False))
    logger.log(step + 1, info)
    done = step + 1 == exp.rl.steps
    if done:
      summary["after"] = evaluate(exp, cfg, state.params, tokenizer, eval_examples)
      logger.log(step + 1, summary["after"])
    meta = {"rl_step": step + 1, "stream": stream.state(), "nonfinite_run": nonfinite_run, "summary": summary}
    ckpt.save(step + 1, state, meta, force=done or nonfinite_run >= exp.rl.max_nonfinite_steps)
    if nonfinite_run >= exp.rl.max_nonfinite_steps:
      logger.close()
      ckpt.close()
      raise TrainingStopped(f"{nonfinite_run} consecutive non-finite updates (rl.max_nonfinite_steps="
                            f"{exp.rl.max_nonfinite_steps}); stopping at step {step + 1}.")
    if exp.stop_after_step >= 0 and step + 1 >= exp.stop_after_step and not done:
      logger.close()
      ckpt.close()
      return {"stopped_at": step + 1, "params": state.params}
  logger.close()
  ckpt.close()
  plots = plot_curves(workdir / "metrics.jsonl", workdir / "plots")
  summary.update(final_step=exp.rl.steps, plots=[str(p) for p in plots])
  (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
  return dict(summary, params=state.params)


def latest_params(exp: ExperimentConfig, workdir: str | os.PathLike, params_template):
  """The params of the latest checkpoint in `workdir` (structure from `params_template`)."""
  state = init_train_state(params_template, rl_optimizer(exp.rl))
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", save_every=exp.checkpoint.every,
                      keep=exp.checkpoint.keep)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints.")
  state, _, _ = ckpt.restore(_abstract(state))
  ckpt.close()
  return state.params
