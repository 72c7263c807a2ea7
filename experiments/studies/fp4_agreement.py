r"""Do greedy rollouts of an FP4 policy agree with the full-precision ones?

  python -m experiments.studies.fp4_agreement                                  # SFT a tiny policy (~3 min on CPU)
  python -m experiments.studies.fp4_agreement --warm_start=<hf folder>         # an existing warm start
  python -m experiments.studies.fp4_agreement --sft_steps=1500 --num_test=256  # a better-trained policy

Without `--warm_start`, a small Llama-style policy with the character tokenizer is trained
briefly by SFT on worked 3-digit addition (`rollouts_jax.data`, `training.sft`). A warm-start
folder (Hugging Face layout plus `tokenizer.json`, e.g. one cached by `experiments/launch/sft.py`)
is used as is. The policy is quantized to NVFP4 and MXFP4 (`models.quantize_params`: all
linear layers; the embedding and the output head stay full precision) and a held-out
batch is decoded greedily by each. Printed per format, against the full-precision
completions:

  * prefix agreement: tokens before the first disagreement / full-precision tokens;
  * position agreement: positions where both completions hold the same token / positions
    where either holds one (so a longer or shorter completion counts against it);
  * exact match: completions identical token for token;
  * teacher-forced top-1: on the full-precision completions, how often the FP4 policy's
    argmax is the full-precision token (agreement without compounding divergence);
  * answer accuracy of each policy, and the logits' relative error.

Paper: Sol-RL (FP4 Explore, BF16 Train; arXiv 2604.06916) relies on FP4 rollouts staying
close enough to the full-precision policy that their rewards rank samples alike.
"""

from __future__ import annotations

import os
import pathlib
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from rollouts_jax.kernels import fp4
from rollouts_jax import data, models, sampling
from rollouts_jax.models import quantize as quantize_lib
from rollouts_jax.training import sft

_WARM_START = flags.DEFINE_string("warm_start", "", "Warm-start folder (HF layout + tokenizer.json); "
                                  "empty: train a tiny policy by SFT.")
_TASK = flags.DEFINE_enum("task", "arithmetic", ["arithmetic", "countdown"], "Synthetic task.")
_DIFFICULTY = flags.DEFINE_integer("difficulty", 3, "Arithmetic digits / countdown difficulty.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "TFDS folder (default: $ROLLOUTS_JAX_CACHE/tfds or "
                                "~/.cache/rollouts_jax/tfds).")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 4000, "SFT examples.")
_NUM_TEST = flags.DEFINE_integer("num_test", 128, "Held-out prompts decoded greedily.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 400, "SFT updates (no --warm_start).")
_SFT_BATCH = flags.DEFINE_integer("sft_batch_size", 64, "SFT batch size.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "SFT peak learning rate.")
_HIDDEN = flags.DEFINE_integer("hidden_size", 128, "Model width (no --warm_start).")
_LAYERS = flags.DEFINE_integer("num_layers", 3, "Model depth (no --warm_start).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Completion budget.")
_FORMATS = flags.DEFINE_list("formats", list(fp4.FORMATS), "FP4 formats to compare.")
_IMPL = flags.DEFINE_enum("implementation", None, list(fp4.IMPLEMENTATIONS),
                          "FP4 matmul (default: xla on CPU, pallas on accelerators).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the model init and the SFT order.")


def agreement(ids_a, mask_a, ids_b, mask_b) -> dict[str, float]:
  """Token agreement of completions b with reference completions a, all `[R, T]`."""
  ids_a, ids_b = np.where(mask_a, ids_a, -1), np.where(mask_b, ids_b, -1)
  same = (ids_a == ids_b) & mask_a & mask_b
  prefix = np.cumprod(same | ~(mask_a | mask_b), axis=1).astype(bool) & mask_a
  union = mask_a | mask_b
  return {
      "prefix_agreement": prefix.sum() / max(mask_a.sum(), 1),
      "position_agreement": same.sum() / max(union.sum(), 1),
      "exact_match": float(np.mean(np.all(ids_a == ids_b, axis=1))),
  }


def _load_tokenizer(folder: pathlib.Path) -> data.Tokenizer:
  try:  # a warm start of the synthetic tasks saves its CharTokenizer as tokenizer.json
    return data.load_tokenizer(folder / "tokenizer.json")
  except (ValueError, KeyError, TypeError):
    return data.load_tokenizer(folder)


def _examples(split: str):
  data_dir = _DATA_DIR.value or str(pathlib.Path(os.environ.get(
      "ROLLOUTS_JAX_CACHE", pathlib.Path.home() / ".cache" / "rollouts_jax")) / "tfds")
  kw = {"digits" if _TASK.value == "arithmetic" else "difficulty": _DIFFICULTY.value}
  return data.load_dataset(_TASK.value, split, data_dir=data_dir, num_train=_NUM_TRAIN.value,
                           num_test=max(_NUM_TEST.value, 16), **kw)


def _train_policy(tokenizer):
  train = list(_examples("train"))
  cfg = models.ModelConfig(
      model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=_HIDDEN.value,
      intermediate_size=3 * _HIDDEN.value, num_layers=_LAYERS.value, num_heads=4, num_kv_heads=2,
      tie_word_embeddings=True, eos_token_ids=(tokenizer.eos_id,), pad_token_id=tokenizer.pad_id,
      max_position_embeddings=1024)
  params = models.init_params(cfg, jax.random.key(_SEED.value))
  prompts = [data.format_prompt(ex, _TASK.value, instruction=False) for ex in train]
  completions = [data.format_completion(ex, _TASK.value) for ex in train]
  tokens, attn, loss_mask = sft.tokenize_pairs(prompts, completions, tokenizer)
  log = lambda step, m: print(f"  sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
  params = sft.train_sft(cfg, params, tokens, attn, loss_mask, steps=_SFT_STEPS.value,
                         batch_size=_SFT_BATCH.value, learning_rate=_LR.value, warmup_steps=20,
                         seed=_SEED.value, log_fn=log, log_every=100)
  return cfg, params


def _accuracy(tokenizer, examples, ids, mask) -> float:
  texts = [tokenizer.decode(row[m]) for row, m in zip(ids, mask)]
  key = "answer" if _TASK.value == "arithmetic" else None
  if key is None:  # countdown: the expression must use the numbers and hit the target
    ok = [(a := data.parse_answer(t)) is not None and data.check_solution(a, ex["numbers"], ex["target"])
          for t, ex in zip(texts, examples)]
  else:
    ok = [data.parse_answer(t) == str(ex[key]) for t, ex in zip(texts, examples)]
  return float(np.mean(ok))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  t0 = time.time()
  if _WARM_START.value:
    folder = pathlib.Path(_WARM_START.value)
    cfg, params = models.load_hf_checkpoint(folder, dtype=jnp.float32)
    tokenizer = _load_tokenizer(folder)
    print(f"warm start {folder}: {cfg.num_layers} layers, width {cfg.hidden_size}")
  else:
    tokenizer = data.CharTokenizer.default()
    print(f"SFT of a tiny policy on {_TASK.value} ({_SFT_STEPS.value} steps)")
    cfg, params = _train_policy(tokenizer)
  print(f"  policy ready after {time.time() - t0:.0f}s")

  test = list(_examples("test"))[:_NUM_TEST.value]
  batch = data.make_prompt_batch(test, _TASK.value, tokenizer, instruction=False)
  conf = sampling.SamplingConfig(num_samples=1, max_new_tokens=_MAX_NEW.value, greedy=True,
                                 eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)

  def decode(p):
    out = sampling.sample(cfg, p, batch.prompt_ids, batch.prompt_mask, jax.random.key(0), conf)
    return np.asarray(out.completion_ids[:, 0]), np.asarray(out.completion_mask[:, 0])

  ids_f, mask_f = decode(params)
  # Teacher forcing on the full-precision completions.
  P = batch.prompt_ids.shape[1]
  seq = jnp.concatenate([jnp.asarray(batch.prompt_ids), jnp.asarray(ids_f)], axis=1)
  attn = jnp.concatenate([jnp.asarray(batch.prompt_mask), jnp.ones(ids_f.shape, bool)], axis=1)
  logits_f = models.forward(cfg, params, seq, attn)[:, P - 1:-1]

  n_linear = sum(params["layers"][n].size for n in quantize_lib.LINEAR_WEIGHTS)
  print(f"\n{len(test)} held-out prompts, greedy, max {_MAX_NEW.value} new tokens; "
        f"full-precision accuracy {_accuracy(tokenizer, test, ids_f, mask_f):.3f}, "
        f"mean length {mask_f.sum(1).mean():.1f}")
  header = (f"{'format':>6} {'bytes/w':>7} {'prefix agr':>10} {'position agr':>12} {'exact':>6} "
            f"{'TF top-1':>8} {'logit rel err':>13} {'accuracy':>8}")
  print(header)
  for fmt in _FORMATS.value:
    q = models.quantize_params(cfg, params, fmt, implementation=_IMPL.value)
    per_w = sum(quantize_lib.param_bytes(q["layers"][n]) for n in quantize_lib.LINEAR_WEIGHTS) / n_linear
    ids_q, mask_q = decode(q)
    a = agreement(ids_f, mask_f, ids_q, mask_q)
    logits_q = models.forward(cfg, q, seq, attn)[:, P - 1:-1]
    tf_top1 = float((np.asarray(jnp.argmax(logits_q, -1)) == ids_f)[mask_f].mean())
    rel = float(jnp.linalg.norm((logits_q - logits_f)[mask_f]) / jnp.linalg.norm(logits_f[mask_f]))
    print(f"{fmt:>6} {per_w:7.3f} {a['prefix_agreement']:10.3f} {a['position_agreement']:12.3f} "
          f"{a['exact_match']:6.3f} {tf_top1:8.3f} {rel:13.4f} "
          f"{_accuracy(tokenizer, test, ids_q, mask_q):8.3f}")
  print(f"\ntotal {time.time() - t0:.0f}s on {jax.default_backend()}")


if __name__ == "__main__":
  app.run(main)
