"""FP4 policies: structure, forward equivalence, the sampler on FP4 params, recompiles, bytes, skip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax.kernels import fp4
from rollouts_jax import models, sampling
from rollouts_jax.models import quantize as qlib
from rollouts_jax.sampling import generate

CFG = models.ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2)
PARAMS = models.init_params(CFG, jax.random.key(0))
TOKENS = np.random.default_rng(0).integers(3, CFG.vocab_size, size=(3, 9)).astype(np.int32)


def _has_pallas_call(fn, *args) -> bool:
  """True when the traced program of fn(*args) contains a Pallas kernel call (at any depth)."""
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("fmt", fp4.FORMATS)
def test_structure_layers_stacked_rest_shared(fmt):
  q = models.quantize_params(CFG, PARAMS, fmt, implementation="xla")
  L = CFG.num_layers
  for name in qlib.LINEAR_WEIGHTS:
    w, full = q["layers"][name], PARAMS["layers"][name]
    assert isinstance(w, qlib.FP4Weight) and isinstance(w, fp4.FP4Tensor)
    K, N = full.shape[1:]
    assert (w.fmt, w.shape, w.implementation) == (fmt, (K, N), "xla")
    block = 16 if fmt == "nvfp4" else 32
    K_pad = -(-K // block) * block
    assert w.codes.shape == (L, K_pad // 2, N) and w.block_scales.shape == (L, K_pad // block, N)
    # Layer l of the stack is exactly the 2-D quantization of layer l.
    for l in range(L):
      ref = fp4.quantize(full[l], fmt)
      np.testing.assert_array_equal(w.codes[l], ref.codes)
      np.testing.assert_array_equal(np.asarray(w.block_scales[l], np.float32),
                                    np.asarray(ref.block_scales, np.float32))
  for name in ("input_norm", "post_norm"):
    assert q["layers"][name] is PARAMS["layers"][name]
  assert q["embed"] is PARAMS["embed"] and q["final_norm"] is PARAMS["final_norm"]
  assert q["lm_head"] is PARAMS["lm_head"]  # skipped by default


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", fp4.FORMATS)
def test_forward_equals_dequantized_model_and_is_close_to_full(fmt, implementation):
  q = models.quantize_params(CFG, PARAMS, fmt, skip=("embed",), implementation=implementation)
  assert isinstance(q["lm_head"], qlib.FP4Weight)
  logits_q = models.forward(CFG, q, TOKENS)
  logits_deq = models.forward(CFG, qlib.dequantize_params(q), TOKENS)
  logits_full = models.forward(CFG, PARAMS, TOKENS)
  np.testing.assert_allclose(logits_q, logits_deq, atol=1e-5, rtol=1e-5)
  rel = float(jnp.linalg.norm(logits_q - logits_full) / jnp.linalg.norm(logits_full))
  # FP4 weights carry ~10% relative error each; the logits stay within a bounded distance.
  assert 0 < rel < 0.2, rel


SAMPLE_CONF = sampling.SamplingConfig(num_samples=2, max_new_tokens=6, greedy=True, eos_id=5, pad_id=0,
                                      prompt_buckets=())
PEAKED = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 3 else x, PARAMS)  # input-dependent argmax


def _prompts(P=6):
  lens = np.array([6, 4, 1])
  mask = np.arange(P)[None] >= (P - lens)[:, None]
  return np.where(mask, TOKENS[:, :P], 0), mask


def test_sampler_runs_unchanged_on_fp4_params_greedy():
  q = models.quantize_params(CFG, PEAKED, "nvfp4", implementation="xla")
  ids, mask = _prompts()
  B, (N, T, eos) = ids.shape[0], (SAMPLE_CONF.num_samples, SAMPLE_CONF.max_new_tokens, SAMPLE_CONF.eos_id)
  out = sampling.sample(CFG, q, ids, mask, jax.random.key(0), SAMPLE_CONF)
  assert out.completion_ids.shape == out.completion_mask.shape == out.logprobs.shape == (B, N, T)
  assert out.lengths.shape == (B, N)
  ids_o, mask_o = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
  np.testing.assert_array_equal(mask_o, np.asarray(sampling.mask_after_eos(ids_o, (eos,))))
  np.testing.assert_array_equal(np.where(mask_o, ids_o, 0), ids_o)  # pad after EOS
  np.testing.assert_array_equal(out.lengths, mask_o.sum(-1))
  np.testing.assert_array_equal(ids_o[:, 0], ids_o[:, 1])
  # Greedy: each kept token is the argmax of the FP4 policy's teacher-forced forward.
  seq = jnp.concatenate([ids, ids_o[:, 0]], axis=1)
  attn = jnp.concatenate([mask, np.ones((B, T), bool)], axis=1)
  logits = models.forward(CFG, q, seq, attn)[:, ids.shape[1] - 1:-1]
  argmax = np.asarray(jnp.argmax(logits, axis=-1))
  np.testing.assert_array_equal(np.where(mask_o[:, 0], argmax, 0), ids_o[:, 0])
  assert len({tuple(r) for r in ids_o[:, 0].tolist()}) > 1  # the rows really differ


def test_sampler_does_not_recompile_for_new_fp4_params():
  ids, mask = _prompts()
  q1 = models.quantize_params(CFG, PEAKED, "nvfp4", implementation="xla")
  sampling.sample(CFG, q1, ids, mask, jax.random.key(0), SAMPLE_CONF)
  before = generate.sample_jit._cache_size()
  q2 = models.quantize_params(CFG, models.init_params(CFG, jax.random.key(2)), "nvfp4", implementation="xla")
  sampling.sample(CFG, q2, ids, mask, jax.random.key(0), SAMPLE_CONF)
  assert generate.sample_jit._cache_size() == before


def test_fp4_params_are_a_pytree_under_jit_without_recompiles():
  traces = []

  @jax.jit
  def logits_of(p, tokens):
    traces.append(1)
    return models.forward(CFG, p, tokens)

  other = models.init_params(CFG, jax.random.key(1))
  n_quantize = qlib._quantize_jit._cache_size()
  q1 = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="xla")
  q2 = models.quantize_params(CFG, other, "nvfp4", implementation="xla")
  assert qlib._quantize_jit._cache_size() <= n_quantize + 1
  assert jax.tree_util.tree_structure(q1) == jax.tree_util.tree_structure(q2)
  a, b = logits_of(q1, TOKENS), logits_of(q2, TOKENS)
  assert len(traces) == 1
  assert not np.allclose(a, b)  # the second call really used the new params
  # The implementation is static: another one is another structure (a new trace).
  q3 = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="pallas")
  assert jax.tree_util.tree_structure(q3) != jax.tree_util.tree_structure(q1)
  # quantize_params itself traces (re-quantizing inside a jitted update works).
  jq = jax.jit(lambda p: models.quantize_params(CFG, p, "mxfp4", implementation="xla"))
  np.testing.assert_array_equal(jq(PARAMS)["layers"]["up"].codes,
                                models.quantize_params(CFG, PARAMS, "mxfp4")["layers"]["up"].codes)


@pytest.mark.parametrize("fmt,per_block", [("nvfp4", 16), ("mxfp4", 32)])
def test_bytes_per_quantized_weight(fmt, per_block):
  q = models.quantize_params(CFG, PARAMS, fmt, implementation="xla")
  L = CFG.num_layers
  for name in qlib.LINEAR_WEIGHTS:
    K, N = PARAMS["layers"][name].shape[1:]
    # Half a byte per code, one byte per block scale, one fp32 tensor scale per layer.
    expected = L * (K * N // 2 + K * N // per_block + 4)
    assert q["layers"][name].nbytes == qlib.param_bytes(q["layers"][name]) == expected
  n_linear = sum(PARAMS["layers"][n].size for n in qlib.LINEAR_WEIGHTS)
  per_param = sum(qlib.param_bytes(q["layers"][n]) for n in qlib.LINEAR_WEIGHTS) / n_linear
  # nvfp4 ~0.56, mxfp4 ~0.53 (plus 4 bytes of tensor scale per layer and weight).
  assert per_param == pytest.approx(0.5 + 1 / per_block, abs=5e-3)
  assert qlib.param_bytes(q) < qlib.param_bytes(PARAMS)


def test_skip_is_honoured():
  q = models.quantize_params(CFG, PARAMS, "nvfp4", skip=("embed", "lm_head", "down", "q"),
                             implementation="xla")
  for name in ("down", "q"):
    assert q["layers"][name] is PARAMS["layers"][name]
  for name in ("k", "v", "o", "gate", "up"):
    assert isinstance(q["layers"][name], qlib.FP4Weight)
  assert q["lm_head"] is PARAMS["lm_head"]
  # Nothing skipped but the embedding (never quantized): the head is quantized too.
  q_all = models.quantize_params(CFG, PARAMS, "nvfp4", skip=(), implementation="xla")
  assert q_all["embed"] is PARAMS["embed"] and isinstance(q_all["lm_head"], qlib.FP4Weight)
  # A mixed model still runs and matches its dequantized twin.
  np.testing.assert_allclose(models.forward(CFG, q, TOKENS),
                             models.forward(CFG, qlib.dequantize_params(q), TOKENS), atol=1e-5)


def test_tied_embeddings_keep_the_head_in_full_precision():
  cfg = CFG.replace(tie_word_embeddings=True)
  params = models.init_params(cfg, jax.random.key(3))
  q = models.quantize_params(cfg, params, "mxfp4", skip=(), implementation="xla")
  assert "lm_head" not in q and q["embed"] is params["embed"]
  assert models.forward(cfg, q, TOKENS).shape == (3, 9, cfg.vocab_size)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="format"):
    models.quantize_params(CFG, PARAMS, "int4")
  with pytest.raises(ValueError, match="implementation"):
    models.quantize_params(CFG, PARAMS, "nvfp4", implementation="cuda")
  with pytest.raises(ValueError, match="skip names unknown"):
    models.quantize_params(CFG, PARAMS, "nvfp4", skip=("mlp",))
  q = models.quantize_params(CFG, PARAMS, "nvfp4")
  with pytest.raises(ValueError, match="already quantized"):
    models.quantize_params(CFG, q, "nvfp4")
  with pytest.raises(ValueError, match="expected"):
    models.quantize_params(CFG.replace(hidden_size=64), PARAMS)
  with pytest.raises(ValueError, match="mxfp4 only"):
    models.quantize_params(CFG, PARAMS, "nvfp4", scale_rounding="ceil")


def test_default_implementation_is_xla_on_cpu():
  assert jax.default_backend() == "cpu"
  assert models.quantize_params(CFG, PARAMS)["layers"]["q"].implementation == "xla"


def test_dense_runs_the_kernel_for_pallas_weights():
  q = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="pallas")
  w = jax.tree_util.tree_map(lambda x: x[0], q["layers"]["up"])
  assert _has_pallas_call(models.dense, jnp.ones((2, CFG.hidden_size)), w)


def test_dense_uses_xla_for_xla_weights():
  q = models.quantize_params(CFG, PARAMS, "nvfp4", implementation="xla")
  w = jax.tree_util.tree_map(lambda x: x[0], q["layers"]["up"])
  assert not _has_pallas_call(models.dense, jnp.ones((2, CFG.hidden_size)), w)
