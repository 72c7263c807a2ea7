"""The decoder: parity with transformers, causality, KV cache, checkpoint errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3")


def _hf_model(family: str, seed: int = 0):
  """A small random HF model of the family, with randomized norms and biases."""
  torch.manual_seed(seed)
  common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5)
  if family == "llama":
    conf = transformers.LlamaConfig(
        **common, tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM(conf)
  elif family == "qwen2":
    conf = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    model = transformers.Qwen2ForCausalLM(conf)
  else:
    conf = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False, rope_theta=1e6)
    model = transformers.Qwen3ForCausalLM(conf)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
  model.config._attn_implementation = "eager"
  return model.eval()


def _left_padded_batch(vocab: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  lengths = np.array([11, 7, 3, 11])
  L = 11
  tokens = rng.integers(1, vocab, size=(4, L)).astype(np.int32)
  mask = np.arange(L)[None, :] >= (L - lengths)[:, None]
  tokens = np.where(mask, tokens, 0)
  return tokens, mask


def _hf_logits(model, tokens, mask):
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
  return out.logits.float().numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def hf_checkpoint(request, tmp_path_factory):
  model = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path, safe_serialization=True)
  return request.param, model, path


def test_logits_parity_with_transformers(hf_checkpoint):
  family, model, path = hf_checkpoint
  cfg, params = models.load_hf_checkpoint(path, dtype=jnp.float32)
  assert cfg.model_type == family
  tokens, mask = _left_padded_batch(cfg.vocab_size)
  ours = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  theirs = _hf_logits(model, tokens, mask)
  diff = np.abs(ours - theirs)[mask]
  assert diff.max() <= 1e-4, (family, diff.max())
  assert np.isfinite(ours).all()


def test_config_features_are_read(hf_checkpoint):
  family, _, path = hf_checkpoint
  cfg, _ = models.load_hf_checkpoint(path)
  if family == "llama":
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 50000.0
  if family == "qwen2":
    assert cfg.qkv_bias and cfg.tie_word_embeddings and not cfg.o_bias
  if family == "qwen3":
    assert cfg.qk_norm and cfg.head_dim == 24


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_save_transformers_load(family, tmp_path):
  base = _hf_model(family, seed=3)
  base.save_pretrained(tmp_path / "src", safe_serialization=True)
  cfg, _ = models.load_hf_checkpoint(tmp_path / "src")
  params = models.init_params(cfg, jax.random.key(7))
  # Randomize norms and biases so that every tensor's mapping matters.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.2 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if ("norm" in str(p) or "bias" in str(p)) else x, params)
  models.save_hf_checkpoint(tmp_path / "out", cfg, params, max_shard_bytes=60_000)
  assert (tmp_path / "out" / "model.safetensors.index.json").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
  tokens, mask = _left_padded_batch(cfg.vocab_size, seed=4)
  ours = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  theirs = _hf_logits(reloaded.eval(), tokens, mask)
  assert np.abs(ours - theirs)[mask].max() <= 1e-4
  cfg2, params2 = models.load_hf_checkpoint(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_bfloat16_load_and_save(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  cfg, params = models.load_hf_checkpoint(path, dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
  models.save_hf_checkpoint(tmp_path, cfg, params)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  _, again = models.load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
  tokens, mask = _left_padded_batch(cfg.vocab_size)
  _, p32 = models.load_hf_checkpoint(path)
  l16 = models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
  l32 = models.forward(cfg, p32, jnp.asarray(tokens), jnp.asarray(mask))
  assert l16.dtype == jnp.float32
  assert float(jnp.abs(l16 - l32)[mask].max()) < 0.1


def _small_cfg(**kw):
  base = dict(model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=48,
              num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True)
  base.update(kw)
  return models.ModelConfig(**base)


def test_causality():
  cfg = _small_cfg()
  params = models.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  base = models.forward(cfg, params, tokens)
  for t in (0, 5, 10):
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 7) % cfg.vocab_size)
    out = models.forward(cfg, params, changed)
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(base[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


@pytest.mark.parametrize("tie", [True, False])
def test_kv_cache_matches_full_forward_token_by_token(tie):
  cfg = _small_cfg(tie_word_embeddings=tie, model_type="qwen2", qk_norm=False, qkv_bias=True)
  params = models.init_params(cfg, jax.random.key(0))
  params["layers"]["q_bias"] = 0.1 * jnp.ones_like(params["layers"]["q_bias"])
  B, P, T = 3, 6, 5
  prompt_lens = jnp.array([6, 4, 1])
  prompt_mask = jnp.arange(P)[None] >= (P - prompt_lens)[:, None]
  full = jax.random.randint(jax.random.key(2), (B, P + T), 1, cfg.vocab_size)
  full = jnp.where(jnp.concatenate([prompt_mask, jnp.ones((B, T), bool)], 1), full, 0)
  full_mask = jnp.concatenate([prompt_mask, jnp.ones((B, T), bool)], axis=1)
  ref = models.forward(cfg, params, full, full_mask)

  cache = models.init_cache(cfg, B, P + T + 3)
  step = jax.jit(models.forward_with_cache, static_argnums=0)
  logits, cache = step(cfg, params, full[:, :P], cache, prompt_mask)
  np.testing.assert_allclose(logits[prompt_mask], ref[:, :P][prompt_mask], atol=1e-5)
  for t in range(T):
    logits, cache = step(cfg, params, full[:, P + t:P + t + 1], cache)
    np.testing.assert_allclose(logits[:, 0], ref[:, P + t], atol=1e-5)
  assert int(cache.index) == P + T
  np.testing.assert_array_equal(cache.next_pos, prompt_lens + T)


def test_prefill_last_only_equals_last_position():
  cfg = _small_cfg()
  params = models.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
  cache = models.init_cache(cfg, 2, 10)
  full, _ = models.forward_with_cache(cfg, params, tokens, cache)
  last, c2 = models.forward_with_cache(cfg, params, tokens, cache, last_only=True)
  np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-6)
  assert int(c2.index) == 7


def test_param_axes_cover_every_parameter():
  for fam, kw in (("llama", dict(qkv_bias=True, o_bias=True, qk_norm=False)),
                  ("qwen2", dict(qkv_bias=True, qk_norm=False)), ("qwen3", dict(qk_norm=True))):
    cfg = _small_cfg(model_type=fam, **kw)
    params = models.init_params(cfg, jax.random.key(0))
    axes = models.param_axes(cfg)
    pairs = jax.tree_util.tree_map(lambda x, a: (x.ndim, len(a)), params, axes,
                                   is_leaf=lambda a: isinstance(a, tuple) and all(isinstance(s, str) for s in a))
    leaves = jax.tree_util.tree_leaves(pairs, is_leaf=lambda t: isinstance(t, tuple))
    assert len(leaves) == len(jax.tree_util.tree_leaves(params))
    for ndim, naxes in leaves:
      assert ndim == naxes


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(path / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    models.load_hf_checkpoint(tmp_path)


def test_unsupported_model_type_lists_supported(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
  with pytest.raises(ValueError, match=r"gpt2.*llama, qwen2, qwen3"):
    models.load_hf_checkpoint(tmp_path)


def test_shape_mismatch_names_both_shapes(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  conf = json.loads((path / "config.json").read_text())
  conf["intermediate_size"] = 80
  (tmp_path / "config.json").write_text(json.dumps(conf))
  (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
  with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*\(96, 64\).*\(80, 64\)"):
    models.load_hf_checkpoint(tmp_path)


def test_bad_configs_raise():
  with pytest.raises(ValueError, match="num_kv_heads"):
    _small_cfg(num_kv_heads=3)
  with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
    _small_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0})
