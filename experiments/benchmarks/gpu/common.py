"""What the sections of bench_gpu.py share: the constants, the plan, the models, the JSON results, timing."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from experiments.benchmarks import timing

REPO = pathlib.Path(__file__).resolve().parents[3]
SECTIONS = ("lowering", "matmul", "sampler", "rl_step")
MODEL_NAMES = ("qwen2.5-0.5b", "default-small")
SCHEMA_VERSION = 1
FULL_MS = [1, 8, 32, 128, 256]       # decode rows of the accelerator run
FULL_SWEEP_MS = [1, 128]             # rows at which it sweeps block sizes


# ----------------------------------------------------------------------------------------------
# The plan (full run on the accelerator, or tiny dry run on CPU)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SamplerShape:
  name: str
  batch: int
  num_samples: int
  prompt_len: int
  new_tokens: int


@dataclasses.dataclass
class Plan:
  dry_run: bool
  ms: list[int]
  sweep_ms: list[int]
  reps: int
  stack_bytes: float
  sampler_shapes: list[SamplerShape]
  sampler_reps: int
  rl_shape: SamplerShape
  rl_micro_batch: int
  rl_reps: int
  budget_s: float
  wide_calls: int
  max_shapes: tuple[int | None, int | None] = (None, None)  # layer shapes of (first, other) models
  max_sampler_shapes: tuple[int | None, int | None] = (None, None)  # sampler shapes (first, other)


def sweep_max(args) -> int:
  return args.sweep_max if args.sweep_max is not None else (2 if args.dry_run else 6)


def make_plan(args) -> Plan:
  ints = lambda s: [int(v) for v in s.split(",") if v.strip()]
  dry = args.dry_run
  t = args.new_tokens or (3 if dry else 128)
  if dry:
    shapes = [SamplerShape("batch64_n8", 2, 2, 8, t), SamplerShape("n256_prompt256", 1, 4, 16, t)]
    rl = SamplerShape("rl_batch64_n8", 2, 2, 8, t)
  else:
    shapes = [SamplerShape("batch64_n8", 64, 8, 32, t), SamplerShape("n256_prompt256", 1, 256, 256, t)]
    rl = SamplerShape("rl_batch64_n8", 64, 8, 32, t)  # the sampler's first shape: its compile is reused
  return Plan(
      dry_run=dry, ms=ints(args.ms) if args.ms is not None else ([1] if dry else list(FULL_MS)),
      sweep_ms=ints(args.sweep_ms) if args.sweep_ms is not None else ([1] if dry else list(FULL_SWEEP_MS)),
      reps=args.reps or (2 if dry else 7),
      stack_bytes=(args.stack_mb if args.stack_mb is not None else (0.01 if dry else 512)) * 1e6,
      sampler_shapes=shapes, sampler_reps=1 if dry else 3, rl_shape=rl,
      rl_micro_batch=2 if dry else 32, rl_reps=1 if dry else 2,
      budget_s=args.time_budget_s or 300.0, wide_calls=2 if dry else 5,
      max_shapes=((args.max_layer_shapes,) * 2 if args.max_layer_shapes else (2, 1) if dry else (None, None)),
      max_sampler_shapes=(1, 0) if dry else (None, None))


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def qwen05b_config(tiny: bool):
  """Qwen2.5-0.5B's architecture (random weights), or a tiny model of the same kind."""
  from rollouts_jax import models
  if tiny:
    return models.ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=1e6,
                              tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=4096)
  return models.ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_layers=24, num_heads=14, num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)


def _char_vocab_size() -> tuple[int, str]:
  """The default character tokenizer's vocabulary size (the small model's vocabulary).

  `rollouts_jax.data` imports dataset builders that need tensorflow_datasets; where that is
  missing (the GPU image) the tokenizer module is loaded from its file alone.
  """
  try:
    from rollouts_jax.data import CharTokenizer
    return CharTokenizer.default().vocab_size, "rollouts_jax.data.CharTokenizer.default()"
  except ImportError:
    path = REPO / "rollouts_jax" / "data" / "tokenizers.py"
    spec = importlib.util.spec_from_file_location("_bench_gpu_tokenizers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod.CharTokenizer.default().vocab_size, "tokenizers.py CharTokenizer.default() (file)"


def default_small_config():
  """The default config's policy (configs/default.py model section, char-tokenizer vocabulary)."""
  from rollouts_jax import models
  from rollouts_jax.training import config as config_lib
  try:
    exp = config_lib.from_config_dict(config_lib.load_config_file(REPO / "configs" / "default.py"))
    source = "configs/default.py"
  except Exception as e:  # pylint: disable=broad-except  (no ml_collections on the GPU image, or a
    # config file mid-refactor): the model section's dataclass defaults, with the reason recorded
    exp = config_lib.ExperimentConfig()
    source = f"training.config.ExperimentConfig() defaults ({type(e).__name__}: {e})"
  m = exp.model
  vocab, vocab_source = _char_vocab_size()
  cfg = models.ModelConfig(
      model_type=m.model_type, vocab_size=vocab, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
      qkv_bias=m.model_type == "qwen2", qk_norm=m.model_type == "qwen3", max_position_embeddings=1024)
  return cfg, {"config_source": source, "vocab_source": vocab_source}


def build_models(names, dry: bool):
  out = {}
  for name in names:
    if name == "qwen2.5-0.5b":
      out[name] = (qwen05b_config(dry), {"architecture": "Qwen2.5-0.5B" + (" (tiny, dry run)" if dry else "")})
    elif name == "default-small":
      out[name] = default_small_config()
    else:
      raise ValueError(f"Unknown model {name!r}; expected one of {MODEL_NAMES}.")
  return out


def layer_shapes(cfg) -> dict[tuple[int, int], list[str]]:
  """Distinct per-layer linear weight shapes (K, N) -> the weight names that have them."""
  from rollouts_jax import models
  shapes = models.param_shapes(cfg)["layers"]
  out: dict[tuple[int, int], list[str]] = {}
  for name in models.LINEAR_WEIGHTS:
    out.setdefault(tuple(shapes[name][1:]), []).append(name)
  return out


# ----------------------------------------------------------------------------------------------
# Results: one JSON, rewritten after every measurement
# ----------------------------------------------------------------------------------------------

def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, float)):
    v = float(x)
    return v if math.isfinite(v) else str(v)
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


class Results:
  def __init__(self, path: pathlib.Path, header: dict):
    self.path = path
    self.data = dict(header)
    self.data["sections"] = {}

  def section(self, name: str) -> dict:
    return self.data["sections"].setdefault(name, {"status": "running", "records": [], "skipped": [],
                                                   "errors": []})

  def save(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(self.path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(self.data), indent=1) + "\n")
    os.replace(tmp, self.path)


class Budget:
  """A global deadline, shared out over the remaining sections by weight."""

  def __init__(self, total_s: float):
    self.start = time.monotonic()
    self.deadline = self.start + total_s

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def section_deadline(self, weight: float, remaining_weight: float) -> float:
    return time.monotonic() + max(self.left(), 0.0) * weight / max(remaining_weight, 1e-9)


def _scrub(text: str) -> str:
  """Error text without this machine's paths (the repository's become relative)."""
  text = text.replace(str(REPO) + os.sep, "")
  return re.sub(r"(/[^\s'\"]+)+/(site|dist)-packages/", "", text)


def _error_record(e: BaseException) -> dict:
  lines = traceback.format_exception_only(type(e), e)
  return {"error": _scrub(f"{type(e).__name__}: {''.join(lines).strip()[-1500:]}")}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def _block(x):
  import jax
  return jax.block_until_ready(x)


def first_call(fn, *args):
  """(output, seconds) of the first call: compile + one run."""
  return timing.first_call(fn, *args, block=_block)


def alternate(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
  """Times each zero-argument callable once per round, round after round (sides alternate)."""
  return timing.alternate(fns, reps, block=_block).times
