"""Decoder models: config, pure forward, KV cache, Hugging Face checkpoints and GGUF files."""

from rollouts_jax.models.config import (COMPUTE_DTYPES, SUPPORTED_MODEL_TYPES, ModelConfig, config_from_hf,
                                        config_to_hf)
from rollouts_jax.models.gguf import GGUFError, check_gguf, load_gguf, smollm2_path
from rollouts_jax.models.hf import load_hf_checkpoint, save_hf_checkpoint
from rollouts_jax.models import lora
from rollouts_jax.models.lora import merged as merge_lora
from rollouts_jax.models.quantize import LINEAR_WEIGHTS, param_bytes, quantize_params
from rollouts_jax.models.scoring import (batch_logprobs, completion_hidden, pick_and_entropy, rows_logprobs,
                                         share_of, token_logprobs, vocab_logprobs)
from rollouts_jax.models.transformer import (KVCache, Params, compute_params, dense, forward, forward_shared_prompt,
                                             forward_with_cache,
                                             init_cache, init_params, param_axes, param_shapes,
                                             positions_from_mask, rms_norm, unembed)

__all__ = [
    "COMPUTE_DTYPES", "SUPPORTED_MODEL_TYPES", "ModelConfig", "config_from_hf", "config_to_hf",
    "load_hf_checkpoint", "save_hf_checkpoint", "GGUFError", "check_gguf", "load_gguf", "smollm2_path",
    "KVCache", "Params", "compute_params", "dense", "forward", "forward_shared_prompt", "forward_with_cache", "init_cache",
    "init_params", "param_axes", "param_shapes", "positions_from_mask", "rms_norm", "unembed",
    "lora", "merge_lora", "LINEAR_WEIGHTS", "param_bytes", "quantize_params", "token_logprobs", "vocab_logprobs",
    "completion_hidden", "pick_and_entropy",
    "batch_logprobs", "rows_logprobs", "share_of",
]
