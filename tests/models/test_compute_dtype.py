"""bf16 compute over fp32 master weights (`ModelConfig.compute_dtype`): forward, gradients, the
RL update's state and the sampler's decode loop."""

import dataclasses

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax import models, sampling
from rollouts_jax.models import quantize as qlib
from rollouts_jax.sampling import generate
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import ExperimentConfig, ModelSectionConfig, RLConfig, validate

# Distinct sizes, so a weight's shape is never an activation's.
CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
BF16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
PARAMS = models.init_params(CFG, jax.random.key(0))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, size=(3, 9)), jnp.int32)


def _floating_leaves(tree):
  return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_config_is_hashable_and_validated():
  assert hash(BF16) != hash(CFG) and BF16 != CFG
  assert hash(BF16) == hash(dataclasses.replace(CFG, compute_dtype="bfloat16"))
  with pytest.raises(ValueError, match="compute_dtype"):
    dataclasses.replace(CFG, compute_dtype="float16")


def test_section_key_is_validated():
  with pytest.raises(ValueError, match="model.compute_dtype"):
    validate(ExperimentConfig(model=ModelSectionConfig(init="random", compute_dtype="bf16")))


def test_compute_params_casts_floats_and_is_a_noop_when_cast():
  cast = models.compute_params(BF16, PARAMS)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(cast))
  assert models.compute_params(BF16, cast) is cast
  assert models.compute_params(CFG, PARAMS) is PARAMS
  # Upward too: bf16 params computed in float32.
  up = models.compute_params(dataclasses.replace(CFG, compute_dtype="float32"), cast)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(up))


def test_fp4_weights_are_left_alone():
  q = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="xla")
  cast = models.compute_params(BF16, q)
  for name in qlib.LINEAR_WEIGHTS:
    assert cast["layers"][name] is q["layers"][name]
  assert cast["embed"].dtype == cast["lm_head"].dtype == cast["layers"]["input_norm"].dtype == jnp.bfloat16
  logits = models.forward(BF16, q, TOKENS)
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_forward_runs_in_bf16_and_stays_close_to_fp32():
  full = models.forward(CFG, PARAMS, TOKENS)
  half = models.forward(BF16, PARAMS, TOKENS)
  assert half.dtype == jnp.float32 and half.shape == full.shape
  assert models.forward(BF16, PARAMS, TOKENS, return_hidden=True).dtype == jnp.bfloat16
  assert models.forward(CFG, PARAMS, TOKENS, return_hidden=True).dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(full)))
  np.testing.assert_allclose(half, full, atol=0.05 * scale)
  assert not np.array_equal(np.asarray(half), np.asarray(full))   # it really ran in bf16
  # The same as running on params stored in bf16 (the cast is all there is to it).
  np.testing.assert_array_equal(half, models.forward(CFG, jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS),
                                                     TOKENS))


def test_gradients_are_fp32_and_close_to_the_fp32_ones():
  mask = jnp.ones(TOKENS.shape, bool)

  def loss(cfg, p):
    lp, ent = models.token_logprobs(cfg, p, TOKENS, mask, 4)
    return -jnp.mean(lp) + 0.1 * jnp.mean(ent)

  g_full = jax.grad(lambda p: loss(CFG, p))(PARAMS)
  g_half = jax.grad(lambda p: loss(BF16, p))(PARAMS)
  assert jax.tree_util.tree_structure(g_half) == jax.tree_util.tree_structure(PARAMS)
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(g_half))
  flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)])
  a, b = flat(g_full), flat(g_half)
  cos = float(jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
  assert cos > 0.98, cos


def _rollouts(B=2, N=4, P=5, T=6, seed=0):
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(1, P + 1, size=B)
  pmask = np.arange(P)[None] >= (P - prompt_lens)[:, None]
  lengths = rng.integers(1, T + 1, size=(B, N))
  cmask = np.arange(T)[None, None] < lengths[..., None]
  V = CFG.vocab_size
  return rl.Rollouts(
      prompt_ids=jnp.asarray(np.where(pmask, rng.integers(3, V, (B, P)), 0), jnp.int32),
      prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, V, (B, N, T)), jnp.int32),
      completion_mask=jnp.asarray(cmask),
      behaviour_logprobs=jnp.zeros((B, N, T)), policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(rng.integers(0, 2, (B, N)), jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


def test_rl_step_keeps_fp32_params_and_optimizer_state():
  conf = RLConfig(steps=5, learning_rate=1e-2, warmup_steps=0, micro_batch_size=4, logprob_chunk=4, kl_coef=0.0)
  state = rl.init_train_state(PARAMS, rl.rl_optimizer(conf))
  state, metrics = rl.rl_step(state, _rollouts(), None, cfg=dataclasses.replace(BF16, remat=True), rl=conf)
  assert int(state.step) == 1 and float(metrics["nonfinite"]) == 0.0
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.params))
  assert all(x.dtype == jnp.float32 for x in _floating_leaves(state.opt_state))
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  assert float(optax.global_norm(mu)) > 0
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, PARAMS)
  assert max(jax.tree_util.tree_leaves(moved)) > 0


def _walk(jaxpr, in_while=False):
  """(equation, inside a while body) for every equation of a jaxpr and of the jaxprs it calls."""
  for eqn in jaxpr.eqns:
    yield eqn, in_while
    for name, value in eqn.params.items():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax_core.Jaxpr):
          yield from _walk(inner, in_while or (eqn.primitive.name == "while" and name == "body_jaxpr"))


def _decode_loops(cfg, config):
  ids, mask = jnp.asarray(TOKENS[:2, :5]), jnp.ones((2, 5), bool)
  run = lambda p: generate.sample_jit(cfg, config, p, ids, mask, jax.random.key(0))
  jaxpr = jax.make_jaxpr(run)(PARAMS)
  eqns = list(_walk(jaxpr.jaxpr))
  loops = [e for e, _ in eqns if e.primitive.name == "while"]
  weight_shapes = {tuple(s[1:]) for s in jax.tree_util.tree_leaves(
      models.param_shapes(cfg)["layers"], is_leaf=lambda x: isinstance(x, tuple))}
  weight_shapes |= {s for k, s in models.param_shapes(cfg).items() if k != "layers"}
  weight_casts = [e for e, in_while in eqns if in_while and e.primitive.name == "convert_element_type"
                  and tuple(e.invars[0].aval.shape) in weight_shapes]
  return loops, weight_casts


@pytest.mark.parametrize("cache_dtype", [None, "float32"])
def test_sampler_decodes_with_bf16_weights_and_cache(cache_dtype):
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=4, prompt_buckets=(), cache_dtype=cache_dtype)
  loops, weight_casts = _decode_loops(BF16, config)
  assert loops
  for loop in loops:   # the generated keys / values carried by the loop: [R, K, Dh, T] and [R, K, T, Dh]
    caches = [v.aval for v in loop.outvars if v.aval.ndim == 4]
    assert caches and all(a.dtype == jnp.dtype(cache_dtype or "bfloat16") for a in caches)
  assert not weight_casts, weight_casts   # the weights were cast once, before the loop
  out = sampling.sample(BF16, PARAMS, TOKENS[:2, :5], jnp.ones((2, 5), bool), jax.random.key(0), config)
  assert out.completion_ids.shape == (2, 2, 4) and out.logprobs.dtype == jnp.float32


def test_decode_loop_check_sees_weights_cast_inside_the_loop(monkeypatch):
  # With only the embedding cast at the sampler's entry, the activations are bf16 and every
  # decoding step converts the fp32 layer weights and output head again.
  embed_only = lambda cfg, params: {**params, "embed": params["embed"].astype(jnp.bfloat16)}
  monkeypatch.setattr(models, "compute_params", embed_only)
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=5, prompt_buckets=())
  _, weight_casts = _decode_loops(BF16, config)
  assert weight_casts


def _load(tmp_path, **model):
  from rollouts_jax import tasks  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import policy  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training.config import DataConfig, SFTConfig, TokenizerConfig  # pylint: disable=g-import-not-at-top
  m = ModelSectionConfig(hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2, **model)
  return policy.load_policy(tasks.get("arithmetic"), [], data=DataConfig(), tok=TokenizerConfig(), m=m,
                            sft=SFTConfig(cache_dir=str(tmp_path)), seed=0)


def test_policy_sets_the_compute_dtype_for_random_and_checkpoint_inits(tmp_path):
  cfg, params, tokenizer = _load(tmp_path, init="random", compute_dtype="bfloat16")
  assert cfg.compute_dtype == "bfloat16" and params["embed"].dtype == jnp.float32
  models.save_hf_checkpoint(tmp_path / "ckpt", cfg, params)
  cfg2, params2, _ = _load(tmp_path, init="hf", path=str(tmp_path / "ckpt"), compute_dtype="bfloat16")
  assert cfg2.compute_dtype == "bfloat16" and params2["embed"].dtype == jnp.float32
  assert _load(tmp_path, init="hf", path=str(tmp_path / "ckpt"))[0].compute_dtype == ""
  assert tokenizer.vocab_size == cfg.vocab_size


def test_warm_start_key_changes_only_when_the_compute_dtype_is_set():
  from rollouts_jax.training import policy  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training.config import DataConfig, SFTConfig, TokenizerConfig  # pylint: disable=g-import-not-at-top
  args = dict(data=DataConfig(), tok=TokenizerConfig(), sft=SFTConfig(), seed=0)
  m = ModelSectionConfig()
  # The key of a default config is the one it had before the dtype options (and model.path's
  # rename) existed, so cached warm starts are reused: the value the previous version computed.
  assert policy.warm_start_key(m=m, **args) == "263777d3a52d43e1"
  assert policy.warm_start_key(m=dataclasses.replace(m, compute_dtype="bfloat16"), **args) != "263777d3a52d43e1"
  assert policy.warm_start_key(m=dataclasses.replace(m, activation_dtype="float32"), **args) != "263777d3a52d43e1"


def test_continue_from_runs_in_bf16():
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=6, prompt_buckets=())
  ids, mask = TOKENS[:1, :4], jnp.ones((1, 4), bool)
  full = sampling.sample(BF16, PARAMS, ids, mask, jax.random.key(1), config)
  part = full.completion_ids[:, :, :2]
  resumed = sampling.continue_from(BF16, PARAMS, ids, mask, part, jnp.ones_like(part, bool), jax.random.key(1), config)
  assert bool((resumed.completion_ids[:, :, :2] == part).all())
  assert resumed.completion_ids.shape == (1, 2, 6) and resumed.logprobs.dtype == jnp.float32
