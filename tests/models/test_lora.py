"""LoRA adapters: the start equals the base, the merge math, only adapters train, adapters on disk."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollouts_jax import models
from rollouts_jax.models import lora
from rollouts_jax.training import rl_step as rl
from rollouts_jax.training.config import RLConfig

CFG = models.ModelConfig(model_type="llama", vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, tie_word_embeddings=True)


def _policy(rank=4, alpha=8.0, targets=lora.PROJECTIONS, seed=0, trained=False):
  base = models.init_params(CFG, jax.random.key(seed))
  adapters = lora.init_adapters(CFG, jax.random.key(seed + 1), rank, targets)
  if trained:   # a non-zero B, as after some updates
    adapters = {n: {"a": ab["a"], "b": 0.1 * jax.random.normal(jax.random.key(seed + 2 + i), ab["b"].shape)}
                for i, (n, ab) in enumerate(adapters.items())}
  return base, adapters, lora.apply(base, adapters, alpha, rank)


def _tokens(seed=0, B=2, L=7):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, L)), jnp.int32)


def test_the_start_is_the_base_exactly():
  base, adapters, policy = _policy()
  merged = lora.merge(base, adapters, 8.0, 4)
  jax.tree_util.tree_map(np.testing.assert_array_equal, merged, base)
  jax.tree_util.tree_map(np.testing.assert_array_equal, lora.merged(policy), base)
  # The applied form too: x W + s (x A) 0 is x W to the bit.
  np.testing.assert_array_equal(models.forward(CFG, policy, _tokens()), models.forward(CFG, base, _tokens()))
  # A is random (not zero): the adapters do start training.
  assert all(float(jnp.std(ab["a"])) > 0 for ab in adapters.values())


def test_merge_matches_a_numpy_reference():
  base, adapters, _ = _policy(rank=3, alpha=6.0, targets=("q", "v", "down"), trained=True)
  merged = lora.merge(base, adapters, 6.0, 3)
  for name in models.param_shapes(CFG)["layers"]:
    w = np.asarray(base["layers"][name], np.float64)
    if name in adapters:
      a, b = (np.asarray(adapters[name][k], np.float64) for k in ("a", "b"))
      want = w + (6.0 / 3) * np.stack([a[l] @ b[l] for l in range(CFG.num_layers)])
    else:
      want = w
    np.testing.assert_allclose(np.asarray(merged["layers"][name]), want, rtol=1e-6, atol=1e-7, err_msg=name)
  np.testing.assert_array_equal(merged["embed"], base["embed"])


def test_applied_and_merged_forwards_agree():
  base, adapters, policy = _policy(trained=True)
  applied = models.forward(CFG, policy, _tokens())
  merged = models.forward(CFG, lora.merge(base, adapters, 8.0, 4), _tokens())
  np.testing.assert_allclose(applied, merged, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(applied - models.forward(CFG, base, _tokens())))) > 1e-2


def test_partition_round_trips_and_is_the_identity_without_lora():
  base, adapters, policy = _policy()
  trainable, combine = lora.partition(policy)
  assert set(trainable) == set(lora.PROJECTIONS) and set(trainable["q"]) == {"a", "b"}
  jax.tree_util.tree_map(np.testing.assert_array_equal, combine(trainable), policy)
  jax.tree_util.tree_map(np.testing.assert_array_equal, lora.base_of(policy), base)
  plain, ident = lora.partition(base)
  assert plain is base and ident(base) is base


def _rollouts(B=2, N=4, P=5, T=6, seed=0):
  rng = np.random.default_rng(seed)
  pmask = np.ones((B, P), bool)
  return rl.Rollouts(
      prompt_ids=jnp.asarray(rng.integers(3, 24, (B, P)), jnp.int32), prompt_mask=jnp.asarray(pmask),
      completion_ids=jnp.asarray(rng.integers(3, 24, (B, N, T)), jnp.int32),
      completion_mask=jnp.ones((B, N, T), bool), behaviour_logprobs=jnp.zeros((B, N, T)),
      policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(np.tile([0.0, 1.0], (B, N // 2)), jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_a_lora_update_changes_only_the_adapters(kl):
  base, adapters, policy = _policy(targets=("q", "o", "up"))
  conf = RLConfig(steps=3, learning_rate=1e-2, warmup_steps=0, kl_coef=kl)
  state = rl.init_train_state(policy, rl.rl_optimizer(conf))
  # The optimizer state covers the adapters alone: no moment of the size of a base weight.
  moments = optax.tree_utils.tree_get(state.opt_state, "mu")
  assert jax.tree_util.tree_structure(moments) == jax.tree_util.tree_structure(adapters)
  n_opt = sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state))
  n_ad = sum(x.size for x in jax.tree_util.tree_leaves(adapters))
  assert n_opt <= 2 * n_ad + 2
  new, m = rl.rl_step(state, _rollouts(), base if kl else None, cfg=CFG, rl=conf)
  assert m["nonfinite"] == 0 and float(m["grad_norm"]) > 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, lora.base_of(new.params), base)
  moved = lora.adapters_of(new.params)
  for name, ab in adapters.items():
    assert float(jnp.max(jnp.abs(moved[name]["b"] - ab["b"]))) > 0, name   # B moved off zero
  # A second update (B now non-zero) also moves A.
  new2, _ = rl.rl_step(new, _rollouts(seed=1), base if kl else None, cfg=CFG, rl=conf)
  assert all(float(jnp.max(jnp.abs(lora.adapters_of(new2.params)[n]["a"] - adapters[n]["a"]))) > 0
             for n in adapters)
  jax.tree_util.tree_map(np.testing.assert_array_equal, lora.base_of(new2.params), base)


def test_lora_gradient_is_the_chain_rule_of_the_merged_weight():
  """d loss / dB = s A^T (d loss / dW) at the merged weight: the applied form differentiates right."""
  base, adapters, policy = _policy(targets=("v",), trained=True)
  tokens = _tokens(3)
  loss_w = lambda p: jnp.sum(jax.nn.log_softmax(models.forward(CFG, p, tokens))[..., 5])
  merged = lora.merge(base, adapters, 8.0, 4)
  g_w = jax.grad(loss_w)(merged)["layers"]["v"]
  trainable, combine = lora.partition(policy)
  g_b = jax.grad(lambda t: loss_w(combine(t)))(trainable)["v"]["b"]
  want = 2.0 * jnp.einsum("lir,lio->lro", adapters["v"]["a"], g_w)
  np.testing.assert_allclose(g_b, want, rtol=1e-4, atol=1e-5)


def test_unknown_targets_are_named():
  with pytest.raises(ValueError, match="unknown projection 'qkv'.*q, k, v, o, gate, up, down"):
    lora.init_adapters(CFG, jax.random.key(0), 4, "q,qkv")
  with pytest.raises(ValueError, match="rank must be > 0"):
    lora.init_adapters(CFG, jax.random.key(0), 0)


def test_adapters_alone_round_trip_through_safetensors(tmp_path):
  from safetensors.numpy import load_file
  _, adapters, _ = _policy(rank=3, alpha=5.0, targets=("k", "gate"), trained=True)
  folder = lora.save_adapters(tmp_path / "ad", adapters, rank=3, alpha=5.0)
  names = load_file(str(folder / lora.ADAPTER_FILE))
  # PEFT's names and torch's Linear layout: lora_A [r, in], lora_B [out, r].
  assert names["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (3, 32)
  assert names["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (48, 3)
  assert len(names) == 2 * 2 * CFG.num_layers
  back, rank, alpha = lora.load_adapters(folder)
  assert (rank, alpha) == (3, 5.0)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, adapters)


def test_hf_export_and_fp4_quantization_see_the_merged_policy(tmp_path):
  base, adapters, policy = _policy(trained=True)
  models.save_hf_checkpoint(tmp_path / "hf", CFG, policy)
  _, loaded = models.load_hf_checkpoint(tmp_path / "hf")
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, lora.merge(base, adapters, 8.0, 4))
  q_policy = models.quantize_params(CFG, policy, implementation="xla")
  q_merged = models.quantize_params(CFG, lora.merge(base, adapters, 8.0, 4), implementation="xla")
  np.testing.assert_array_equal(q_policy["layers"]["q"].codes, q_merged["layers"]["q"].codes)


def test_the_sampler_merges_float32_weights_and_applies_adapters_on_bf16_ones():
  from rollouts_jax import sampling
  base, adapters, policy = _policy(trained=True)
  plain = lora.sampling_params(policy)
  assert not lora.is_lora(plain)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), plain,
                         lora.merge(base, adapters, 8.0, 4))
  # bf16 weights: W + s A B rounded to bf16 would swallow small updates, so they stay applied.
  small = {n: {"a": ab["a"], "b": 1e-5 * ab["b"]} for n, ab in adapters.items()}
  base16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), base)
  policy16 = lora.apply(base16, small, 8.0, 4)
  kept = lora.sampling_params(policy16)
  assert lora.is_lora(kept)
  changed = lora.merged(policy16)["layers"]["q"] != base16["layers"]["q"]
  assert float(jnp.mean(changed)) < 0.1   # merged in bf16, the update is lost on most weights
  x = jnp.ones((1, 32), jnp.float32)
  layer0 = jax.tree_util.tree_map(lambda w: w[0], kept["layers"]["q"])   # a LoraWeight of layer 0
  assert float(jnp.max(jnp.abs(models.dense(x, layer0) - models.dense(x, base16["layers"]["q"][0])))) > 0
  # The sampler's log-probs of its own tokens: those of the policy (teacher-forced), not the base's.
  conf = sampling.SamplingConfig(num_samples=2, max_new_tokens=5, eos_id=None)
  ids, mask = _tokens(4, B=2, L=4), jnp.ones((2, 4), bool)
  out = sampling.sample(CFG, policy, ids, mask, jax.random.key(0), conf)
  lp = rl.batch_logprobs(policy, ids, mask, out.completion_ids, out.completion_mask, cfg=CFG)
  np.testing.assert_allclose(out.policy_logprobs, lp, atol=2e-5)
  lp_base = rl.batch_logprobs(base, ids, mask, out.completion_ids, out.completion_mask, cfg=CFG)
  assert float(jnp.max(jnp.abs(lp - lp_base))) > 1e-2
