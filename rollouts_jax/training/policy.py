"""The initial policy: a tokenizer and a model from a local HF checkpoint, a random init or an SFT warm start.

Warm starts are cached by a hash of everything that changes them and reused by later runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from rollouts_jax import data as data_lib
from rollouts_jax.io import filelock
from rollouts_jax import models, tasks
from rollouts_jax.models import gguf
from rollouts_jax.training.config import DataConfig, ModelSectionConfig, SFTConfig, TokenizerConfig
from rollouts_jax.training.sft import tokenize_pairs, train_sft

log = logging.getLogger(__name__)


def prompt_instruction(task: tasks.Task, tokenizer_cfg: TokenizerConfig) -> bool:
  """Whether prompts carry the answer instruction (a char-level model on a synthetic task sees the bare question)."""
  return not (task.synthetic and tokenizer_cfg.kind == "char")


def model_config(m: ModelSectionConfig, tokenizer) -> models.ModelConfig:
  return models.ModelConfig(
      model_type=m.model_type, vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
      qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3", remat=m.remat,
      compute_dtype=m.compute_dtype, activation_dtype=m.activation_dtype,
      eos_token_ids=(tokenizer.eos_id,), pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
      max_position_embeddings=1024)


def make_tokenizer(tok: TokenizerConfig, m: ModelSectionConfig):
  if tok.kind == "char":
    return data_lib.CharTokenizer.load(tok.path) if tok.path else data_lib.CharTokenizer.default()
  if tok.path:
    return data_lib.load_tokenizer(gguf.resolve_path(tok.path) if tok.kind == "gguf" else tok.path)
  if m.init == "gguf" and m.path:
    return data_lib.HFTokenizer.from_gguf(gguf.resolve_path(m.path))
  if tok.kind == "hf" and m.path:
    return data_lib.HFTokenizer.from_dir(m.path)
  raise ValueError(f"Config key tokenizer.kind={tok.kind!r} needs tokenizer.path (or model.path for 'hf').")


def fit_vocabulary(cfg: models.ModelConfig, tokenizer) -> models.ModelConfig:
  """A checkpoint's config made to sample only ids the tokenizer can decode, and to stop on every
  end-of-turn id (a chat model's end-of-turn token as well as EOS)."""
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size} "
                     "embedding rows: they do not belong together.")
  if tokenizer.vocab_size < cfg.vocab_size:   # a padded embedding (e.g. Qwen's 151,936 rows for 151,665 ids)
    cfg = cfg.replace(vocab_limit=tokenizer.vocab_size)
  eos = tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + tuple(tokenizer.end_of_turn_ids)))
  return cfg.replace(eos_token_ids=eos)


def warm_start_key(data: DataConfig, tok: TokenizerConfig, m: ModelSectionConfig, sft: SFTConfig, seed: int) -> str:
  """A hash of everything that changes the warm start (not where files live, not logging)."""
  model = dataclasses.asdict(m)
  for key in ("compute_dtype", "activation_dtype"):   # defaults leave earlier warm starts' keys as they were
    if not model[key]:
      model.pop(key)
  model["hf_path"] = model.pop("path")   # the key's name before model.path held GGUF files too
  sft_key = {k: v for k, v in dataclasses.asdict(sft).items() if k not in ("cache_dir", "log_every")}
  if not sft_key["from_pretrained"]:   # the default leaves earlier warm starts' keys as they were
    sft_key.pop("from_pretrained")
  parts = {"data": dataclasses.asdict(data), "tokenizer": dataclasses.asdict(tok), "model": model,
           "sft": sft_key, "seed": seed}
  for k in ("data_dir", "manual_dir"):
    parts["data"].pop(k)
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(task: tasks.Task, train_examples: Sequence[dict], *, data: DataConfig, tok: TokenizerConfig,
               m: ModelSectionConfig, sft: SFTConfig, seed: int, log_fn: Callable[[int, dict], None] | None = None):
  """Returns (cfg, params, tokenizer, folder), running SFT unless a cached warm start matches."""
  root = pathlib.Path(sft.cache_dir) if sft.cache_dir else tasks.cache_root() / "warmstart"
  root.mkdir(parents=True, exist_ok=True)
  key = warm_start_key(data, tok, m, sft, seed)
  folder = root / f"{data.task}-{key}"
  dtype = jnp.dtype(m.dtype)
  if (folder / "done.json").exists():
    log.info("Reusing warm start %s", folder)
  built = {}

  def build(tmp: pathlib.Path):
    if sft.from_pretrained:   # the loaded GGUF / HF model, fine-tuned
      cfg, params, tokenizer = _pretrained(m, tok)
    else:
      tokenizer = make_tokenizer(tok, m)
      cfg = model_config(m, tokenizer)
      params = models.init_params(cfg, jax.random.key(seed), dtype)
    instruction = prompt_instruction(task, tok)
    prompts = [task.prompt(ex, tokenizer, data.template, instruction=instruction) for ex in train_examples]
    completions = [task.completion_segments(ex, tokenizer, data.template) for ex in train_examples]
    tokens, attn, loss_mask = tokenize_pairs(prompts, completions, tokenizer)
    log.info("SFT warm start: %d examples of %d tokens, %d steps", len(train_examples), tokens.shape[1], sft.steps)
    t0 = time.time()
    params = train_sft(cfg, params, tokens, attn, loss_mask, steps=sft.steps, batch_size=sft.batch_size,
                       learning_rate=sft.learning_rate, warmup_steps=sft.warmup_steps,
                       weight_decay=sft.weight_decay, grad_clip=sft.grad_clip, seed=seed,
                       log_fn=log_fn, log_every=sft.log_every)
    models.save_hf_checkpoint(tmp, cfg, params)
    if isinstance(tokenizer, data_lib.CharTokenizer):
      tokenizer.save(tmp / "tokenizer.json")
    (tmp / "done.json").write_text(json.dumps({"sft_seconds": time.time() - t0, "key": key}))
    built.update(cfg=cfg, params=params, tokenizer=tokenizer)

  # One process builds it; concurrent runs wait on the lock and reuse it.
  filelock.atomic_build(folder, build, done_file="done.json")
  if built:
    return built["cfg"], built["params"], built["tokenizer"], folder
  cfg, params = models.load_hf_checkpoint(folder, dtype=dtype)
  if sft.from_pretrained:   # the pretrained model's own tokenizer (a GGUF file's, an HF folder's)
    cfg, tokenizer = _with_tokenizer(cfg, m, tok)
    return cfg, params, tokenizer, folder
  cfg = cfg.replace(remat=m.remat, compute_dtype=m.compute_dtype, activation_dtype=m.activation_dtype)
  return cfg, params, data_lib.load_tokenizer(folder / "tokenizer.json"), folder


def _pretrained(m: ModelSectionConfig, tok: TokenizerConfig):
  """(cfg, params, tokenizer) of model.init 'hf' / 'gguf' as loaded from model.path."""
  dtype = jnp.dtype(m.dtype)
  if m.init == "hf":
    cfg, params = models.load_hf_checkpoint(m.path, dtype=dtype)
  else:
    cfg, params = models.load_gguf(gguf.resolve_path(m.path), dtype=dtype)
  cfg, tokenizer = _with_tokenizer(cfg, m, tok)
  return cfg, params, tokenizer


def _with_tokenizer(cfg: models.ModelConfig, m: ModelSectionConfig, tok: TokenizerConfig):
  """A pretrained model's loaded config with the run's model.* settings, fitted to its configured tokenizer."""
  tokenizer = make_tokenizer(tok, m)
  cfg = cfg.replace(remat=m.remat, compute_dtype=m.compute_dtype, activation_dtype=m.activation_dtype)
  return fit_vocabulary(cfg, tokenizer), tokenizer


def load_policy(task: tasks.Task, train_examples: Sequence[dict], *, data: DataConfig, tok: TokenizerConfig,
                m: ModelSectionConfig, sft: SFTConfig, seed: int, log_fn=None) -> tuple[Any, Any, Any]:
  """(cfg, params, tokenizer) of the configured initial policy (`sft.from_pretrained`: the loaded model's
  cached SFT warm start)."""
  dtype = jnp.dtype(m.dtype)
  if m.init in ("hf", "gguf") and not sft.from_pretrained:
    return _pretrained(m, tok)
  if m.init == "random":
    tokenizer = make_tokenizer(tok, m)
    cfg = model_config(m, tokenizer)
    return cfg, models.init_params(cfg, jax.random.key(seed), dtype), tokenizer
  cfg, params, tokenizer, _ = warm_start(task, train_examples, data=data, tok=tok, m=m, sft=sft, seed=seed,
                                         log_fn=log_fn)
  return cfg, params, tokenizer
