"""GGUF loading: tiny files written here with gguf.GGUFWriter, bad files, and the shipped SmolLM2."""

import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import data, models, sampling
from rollouts_jax.models import gguf as gguf_lib
from rollouts_jax.models.transformer import param_shapes

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_GGUF_LAYER = {v: k for k, v in gguf_lib._LAYER_NAMES.items()}  # pylint: disable=protected-access


def _tiny_bpe():
  """A byte-level BPE trained here on a few lines, with two control tokens."""
  import tokenizers
  from tokenizers import decoders, models as tmodels, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(tmodels.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(["What is 12 + 7? The answer is 19.", "hello world, hello there"] * 20, trainer)
  import json
  model = json.loads(tok.to_str())["model"]
  vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
  tokens = [t for t, _ in vocab]
  assert [i for _, i in vocab] == list(range(len(tokens)))
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [3 if t in ("<|im_start|>", "<|im_end|>") else 1 for t in tokens]
  return tok, tokens, types, merges


def _permute(w, n_heads):
  """llama.cpp's row order for a Llama query / key projection ([out, in])."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, cfg, params, *, qtype=gguf.GGMLQuantizationType.F32, tokenizer=True, arch=None,
               drop=(), extra_tensor=None, raw=None):
  """Writes `params` of `cfg` as a GGUF file the way llama.cpp's converter lays it out."""
  arch = arch or cfg.model_type
  w = gguf.GGUFWriter(str(path), arch=arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_vocab_size(cfg.vocab_size)
  if tokenizer:
    _, tokens, types, merges = _tiny_bpe()
    assert len(tokens) <= cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
  host = jax.device_get(params)

  def put(name, arr, transposed):
    if name in drop:
      return
    a = np.asarray(arr, np.float32)
    a = a.T if transposed else a
    if raw is not None and name in raw:
      w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
    elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    else:
      w.add_tensor(name, np.ascontiguousarray(a))

  for key in param_shapes(cfg):
    if key != "layers":
      put(gguf_lib._TOP_NAMES[key], host[key], key in gguf_lib._TRANSPOSED)  # pylint: disable=protected-access
  for key in param_shapes(cfg)["layers"]:
    for i in range(cfg.num_layers):
      a = np.asarray(host["layers"][key][i], np.float32)
      if key in gguf_lib._TRANSPOSED:  # pylint: disable=protected-access
        a = a.T
      if cfg.model_type == "llama" and key in ("q", "q_bias"):
        a = _permute(a, cfg.num_heads)
      if cfg.model_type == "llama" and key in ("k", "k_bias"):
        a = _permute(a, cfg.num_kv_heads)
      put(f"blk.{i}.{gguf_lib._LAYER_NAMES[key]}", a, False)  # pylint: disable=protected-access
  if extra_tensor:
    w.add_tensor(extra_tensor, np.zeros((4,), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return pathlib.Path(path)


def _cfg(model_type="llama", **kw):
  base = dict(model_type=model_type, vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2,
              num_heads=4, num_kv_heads=2, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
              qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", max_position_embeddings=256)
  base.update(kw)
  return models.ModelConfig(**base)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_round_trip_logits(tmp_path, model_type, tied):
  cfg = _cfg(model_type, tie_word_embeddings=tied)
  params = models.init_params(cfg, jax.random.key(1))
  if cfg.qkv_bias:   # non-zero biases, so their order matters
    params["layers"]["q_bias"] = 0.1 * jax.random.normal(jax.random.key(2), params["layers"]["q_bias"].shape)
    params["layers"]["k_bias"] = 0.1 * jax.random.normal(jax.random.key(3), params["layers"]["k_bias"].shape)
  path = write_gguf(tmp_path / "m.gguf", cfg, params)
  got_cfg, got = models.load_gguf(path)
  assert got_cfg.model_type == model_type and got_cfg.tie_word_embeddings == tied
  assert (got_cfg.num_layers, got_cfg.num_heads, got_cfg.num_kv_heads, got_cfg.head_dim) == (2, 4, 2, 16)
  assert got_cfg.qkv_bias == cfg.qkv_bias and got_cfg.qk_norm == cfg.qk_norm
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))   # F32: bit-exact, q/k rows back in order
  toks = jnp.array([[5, 9, 17, 3, 250, 41]], jnp.int32)
  np.testing.assert_allclose(models.forward(got_cfg, got, toks), models.forward(cfg, params, toks), atol=1e-5)


def test_quantized_tensors_dequantize_within_their_error(tmp_path):
  cfg = _cfg()
  params = models.init_params(cfg, jax.random.key(4))
  path = write_gguf(tmp_path / "q8.gguf", cfg, params, qtype=gguf.GGMLQuantizationType.Q8_0)
  _, got = models.load_gguf(path)
  q = np.asarray(got["layers"]["q"]); ref = np.asarray(params["layers"]["q"])
  assert not np.array_equal(q, ref)                       # it really was quantized ...
  assert np.max(np.abs(q - ref)) < 0.02 * np.max(np.abs(ref))   # ... and came back in the right order
  _, bf = models.load_gguf(path, dtype=jnp.bfloat16)
  assert bf["embed"].dtype == jnp.bfloat16


def test_tokenizer_from_gguf_matches_the_trained_bpe(tmp_path):
  cfg = _cfg()
  path = write_gguf(tmp_path / "t.gguf", cfg, models.init_params(cfg, jax.random.key(0)))
  ref, tokens, _, _ = _tiny_bpe()
  tok = data.load_tokenizer(path)
  for text in ["What is 12 + 7?", "hello  there, world!\n", "zebra 123 ünï"]:
    assert tok.encode(text) == ref.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
  im_end = tokens.index("<|im_end|>")
  assert tok.eos_id == im_end and tok.end_of_turn_ids == (im_end,)
  assert tok.encode("<|im_start|>user") [0] == tokens.index("<|im_start|>")   # control tokens match whole
  prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert tok.decode(tok.encode("hi<|im_end|>"), skip_special=True) == "hi"


# ------------------------------------------------------------------------------------------------
# Bad files: a GGUFError that names the file, before anything is dequantized.


def _good(tmp_path, **kw):
  cfg = _cfg()
  return write_gguf(tmp_path / "m.gguf", cfg, models.init_params(cfg, jax.random.key(0)), **kw), cfg


def test_truncated_file(tmp_path):
  path, _ = _good(tmp_path)
  blob = path.read_bytes()
  for cut in (len(blob) - 1000, 2000, 10):
    bad = tmp_path / f"cut{cut}.gguf"
    bad.write_bytes(blob[:cut])
    with pytest.raises(models.GGUFError, match=f"cut{cut}.gguf"):
      models.load_gguf(bad)


def test_not_a_gguf_file(tmp_path):
  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
  with pytest.raises(models.GGUFError, match="not a GGUF file"):
    models.load_gguf(bad)
  with pytest.raises(models.GGUFError, match="does not exist"):
    models.load_gguf(tmp_path / "missing.gguf")


def test_unsupported_architecture(tmp_path):
  path, _ = _good(tmp_path, arch="gpt2")
  with pytest.raises(models.GGUFError, match="general.architecture='gpt2' is not supported"):
    models.load_gguf(path)


def test_unsupported_quantization_type(tmp_path):
  cfg = _cfg()
  q8_1 = gguf.GGMLQuantizationType.Q8_1
  block, size = gguf.constants.GGML_QUANT_SIZES[q8_1]
  blob = np.zeros((cfg.intermediate_size, cfg.hidden_size // block * size), np.uint8)
  path = write_gguf(tmp_path / "q.gguf", cfg, models.init_params(cfg, jax.random.key(0)),
                    raw={"blk.1.ffn_up.weight": (blob, q8_1)})
  with pytest.raises(models.GGUFError, match="blk.1.ffn_up.weight.*Q8_1"):
    models.load_gguf(path)


def test_missing_and_unknown_tensors(tmp_path):
  path, _ = _good(tmp_path, drop=("blk.1.attn_v.weight",))
  with pytest.raises(models.GGUFError, match="'blk.1.attn_v.weight' is missing"):
    models.load_gguf(path)
  path, _ = _good(tmp_path, extra_tensor="blk.0.attn_sinks")
  with pytest.raises(models.GGUFError, match="does not use"):
    models.load_gguf(path)


def test_wrong_shape(tmp_path):
  cfg = _cfg()
  wrong = np.zeros((cfg.intermediate_size + 1, cfg.hidden_size), np.float32)
  path = write_gguf(tmp_path / "s.gguf", cfg, models.init_params(cfg, jax.random.key(0)),
                    raw={"blk.0.ffn_gate.weight": (wrong, None)})
  with pytest.raises(models.GGUFError, match="ffn_gate.weight' has shape"):
    models.load_gguf(path)


def test_missing_tokenizer(tmp_path):
  path, _ = _good(tmp_path, tokenizer=False)
  models.load_gguf(path)   # the model alone is fine
  with pytest.raises(ValueError, match="has no tokenizer"):
    data.load_tokenizer(path)


def test_config_errors_name_the_key_before_building(tmp_path):
  from rollouts_jax.training import config as config_lib
  bad = tmp_path / "broken.gguf"
  bad.write_bytes(b"GGUF" + b"\x00" * 7)
  cd = config_lib.base_config_dict()
  cd.model.init = "gguf"
  cd.tokenizer.kind = "gguf"
  cd.model.path = str(bad)
  with pytest.raises(ValueError, match="model.path=.*broken.gguf"):
    config_lib.from_config_dict(cd)
  cd.model.path = str(tmp_path / "nope.gguf")
  with pytest.raises(ValueError, match="model.path=.*nope.gguf"):
    config_lib.from_config_dict(cd)
  path, _ = _good(tmp_path)
  cd.model.path = str(path)
  cd.tokenizer.kind = "char"
  with pytest.raises(ValueError, match="tokenizer.kind='gguf'"):
    config_lib.from_config_dict(cd)
  cd.tokenizer.kind = "gguf"
  assert config_lib.from_config_dict(cd).model.init == "gguf"


# ------------------------------------------------------------------------------------------------
# Real-model hygiene: padded vocabularies and end-of-turn ids.


def test_padded_vocabulary_rows_are_never_sampled_and_scored_alike():
  from rollouts_jax.training.policy import fit_vocabulary
  cfg = _cfg(vocab_size=64)
  params = models.init_params(cfg, jax.random.key(0))
  params["embed"] = params["embed"].at[40:].set(1.0)   # padded rows that would win every argmax

  class Tok:
    vocab_size, eos_id, end_of_turn_ids = 40, 3, (3, 7)

  fitted = fit_vocabulary(cfg, Tok())
  assert fitted.vocab_limit == 40 and set(fitted.eos_token_ids) >= {3, 7}
  prompt = jnp.array([[5, 6, 8, 9]] * 4, jnp.int32)
  conf = sampling.SamplingConfig(num_samples=16, max_new_tokens=12, temperature=1.0)
  raw = sampling.sample(cfg, params, prompt, prompt > 0, jax.random.key(1), conf)
  assert int(jnp.max(raw.completion_ids)) >= 40       # without the limit they are sampled
  out = sampling.sample(fitted, params, prompt, prompt > 0, jax.random.key(1), conf)
  assert int(jnp.max(out.completion_ids)) < 40
  B, N, T = out.completion_ids.shape
  toks = jnp.concatenate([jnp.repeat(prompt, N, 0), out.completion_ids.reshape(B * N, T)], 1)
  lp, _ = models.token_logprobs(fitted, params, toks, jnp.ones_like(toks, bool), prompt.shape[1])
  m = out.completion_mask.reshape(B * N, T)
  np.testing.assert_allclose(np.asarray(lp)[np.asarray(m)],
                             np.asarray(out.logprobs.reshape(B * N, T))[np.asarray(m)], atol=1e-4)


# ------------------------------------------------------------------------------------------------
# The shipped model against transformers (CI runs this one).


@pytest.fixture(scope="module")
def smollm2():
  path = models.smollm2_path()
  cfg, params = models.load_gguf(path)
  return path, cfg, params


def test_smollm2_config(smollm2):
  _, cfg, params = smollm2
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
  assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 1e5
  assert params["embed"].shape == (49152, 576)


def test_smollm2_matches_transformers(smollm2):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path, cfg, params = smollm2
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32)
  ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  tok = data.load_tokenizer(path)
  msgs = [{"role": "user", "content": "What is 47 + 28? Reply with just the result."}]
  text = tok.apply_chat_template(msgs)
  assert text == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  ids = tok.encode(text)
  assert ids == ref_tok.encode(text, add_special_tokens=False)
  with torch.no_grad():
    want = ref(torch.tensor([ids])).logits.numpy()
  got = np.asarray(models.forward(cfg, params, jnp.asarray([ids], jnp.int32)))
  assert np.max(np.abs(got - want)) < 1e-3, np.max(np.abs(got - want))
  # Greedy continuations agree token for token.
  with torch.no_grad():
    hf = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).numpy()[0, len(ids):]
  conf = sampling.SamplingConfig(num_samples=1, max_new_tokens=12, temperature=0.0, eos_id=tok.eos_id,
                                 pad_id=tok.pad_id)
  out = sampling.sample(cfg, params, jnp.asarray([ids], jnp.int32), jnp.ones((1, len(ids)), bool),
                        jax.random.key(0), conf)
  ours = np.asarray(out.completion_ids[0, 0])[np.asarray(out.completion_mask[0, 0])]
  assert ours.tolist() == hf[:len(ours)].tolist() and len(ours) == min(len(hf), 12)


def test_smollm2_tokenizer_on_task_text():
  transformers = pytest.importorskip("transformers")
  path = models.smollm2_path()
  tok = data.load_tokenizer(path)
  ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  import json
  texts = [json.loads(line)["question"] for line in
           (pathlib.Path(data.__file__).parent / "benchmark_files" / "gsm8k_test.jsonl").read_text().splitlines()[:100]]
  texts += ["What is 86 + 67? Reply with just the result.", "<answer>153</answer>", "It's 2024-12-04.\n\nok"]
  # The one known difference: transformers' GGUF reader does not know the `smollm` pre-tokenizer
  # (digits alone, then GPT-2's rule) and applies GPT-2's rule alone; a run of spaces before a
  # digit then splits differently. Ours follows the model's own rule.
  import re
  same = [t for t in texts if not re.search(r"\s\s\d", t)]
  assert len(same) >= len(texts) - 3
  for t in same:
    assert tok.encode(t) == ref.encode(t, add_special_tokens=False), t
  assert [tok.id_to_token(i) for i in tok.encode("and  2")] == ["and", "ĠĠ", "2"]
  assert tok.end_of_turn_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"


def _sampler_trainer_gaps(smollm2, arms):
  """|sampler - trainer (fp32)| log-probs of the sampler's own tokens, per sampling recipe in `arms`."""
  path, cfg, params = smollm2
  tok = data.load_tokenizer(path)
  prompts = [tok.apply_chat_template([{"role": "user", "content": f"Calculate {a} + {b}. Reply with just the result."}])
             for a, b in ((47, 28), (13, 69), (5, 91), (60, 33))]
  ids = [tok.encode(p) for p in prompts]
  P = max(map(len, ids))
  prompt = jnp.asarray([[tok.pad_id] * (P - len(x)) + x for x in ids], jnp.int32)
  pmask = jnp.asarray([[False] * (P - len(x)) + [True] * len(x) for x in ids])
  conf = sampling.SamplingConfig(num_samples=8, max_new_tokens=24, temperature=1.0, eos_id=tok.eos_id,
                                 pad_id=tok.pad_id)
  _, params_bf16 = models.load_gguf(path, dtype=jnp.bfloat16)
  recipes = {"fp32": (cfg, params), "bf16": (cfg.replace(activation_dtype="float32"), params_bf16),
             "all_bf16": (cfg, params_bf16)}
  gaps = {}
  for name in arms:
    c, p = recipes[name]
    out = sampling.sample(c, p, prompt, pmask, jax.random.key(3), conf)
    B, N, T = out.completion_ids.shape
    toks = jnp.concatenate([jnp.repeat(prompt, N, 0), out.completion_ids.reshape(B * N, T)], 1)
    attn = jnp.concatenate([jnp.repeat(pmask, N, 0), out.completion_mask.reshape(B * N, T)], 1)
    trainer, _ = models.token_logprobs(cfg, params, toks, attn, P)
    m = np.asarray(out.completion_mask.reshape(B * N, T))
    gaps[name] = np.abs(np.asarray(trainer) - np.asarray(out.logprobs.reshape(B * N, T)))[m]
  return gaps


def test_smollm2_sampler_trainer_mismatch(smollm2):
  """The gate RL practitioners check first: the sampler's log-probs of its own tokens against the
  trainer's (fp32). fp32 sampling: mean |diff| <= 1e-3. bf16 sampling (bf16 weights, matmul operands
  and KV cache, fp32 residual stream: `activation_dtype="float32"`): <= 0.02, the figure prime-rl
  gates on."""
  gaps = _sampler_trainer_gaps(smollm2, ("fp32", "bf16"))
  assert gaps["fp32"].mean() <= 1e-3, gaps["fp32"].mean()
  assert gaps["bf16"].mean() <= 0.02, gaps["bf16"].mean()
  assert gaps["bf16"].mean() > gaps["fp32"].mean()   # bf16 really sampled from a different distribution


@pytest.mark.slow
def test_smollm2_all_bf16_activations_miss_the_gate(smollm2):
  """All-bf16 activations miss it (about 0.025 here, measured): the residual stream of 30 layers
  rounded to bf16 is what moves the log-probs, so the mixed recipe is the one to sample with."""
  gaps = _sampler_trainer_gaps(smollm2, ("bf16", "all_bf16"))
  assert gaps["all_bf16"].mean() > gaps["bf16"].mean()
