r"""Multi-turn decoding: KV-cache continuation vs re-prefilling the whole history every turn.

  python -m experiments.benchmarks.bench_multiturn                                  # a random Llama-style model, char vocabulary
  python -m experiments.benchmarks.bench_multiturn --model=smollm2 --render=chatml  # SmolLM2-135M-Instruct from its GGUF file
  python -m experiments.benchmarks.bench_multiturn --prompts=2 --samples=2 --turns=3 --reps=1 --out=/tmp/b.json   # a quick check

Both sides run the same episodes of the `guess` environment (the policy guesses, the environment
answers higher / lower; secrets up to `--max_value` so that episodes rarely end early) with the
same key, `rollout.multiturn.run_episodes` with mode "kv" (each observation's tokens run through
the model against the cache: nothing earlier is recomputed) and mode "reprefill" (after each
observation the prompt and every row's whole history run again, as an engine without a cache
between turns would). Both draw the same tokens (checked, and reported as `same_tokens`).
Reported: tokens recomputed after the first prefill per side and their ratio, policy and
observation tokens, wall time (medians over `--reps`, sides alternated in one process after a
warm-up call of each) and the ratio, the machine load before and after.
Writes `--out` (default experiments/benchmarks/results/bench_multiturn.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

from experiments.benchmarks import timing

HERE = pathlib.Path(__file__).resolve().parent


def _model(args):
  import jax  # pylint: disable=g-import-not-at-top
  from rollouts_jax import data, models  # pylint: disable=g-import-not-at-top
  if args.model == "smollm2":
    path = models.smollm2_path()
    cfg, params = models.load_gguf(path, dtype=jax.numpy.float32)
    return cfg, params, data.load_tokenizer(path)
  tok = data.CharTokenizer.default()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_layers=args.layers, num_heads=max(args.hidden // 32, 1),
                           num_kv_heads=max(args.hidden // 64, 1), eos_token_ids=(tok.eos_id,), pad_token_id=tok.pad_id,
                           max_position_embeddings=4096)
  return cfg, models.init_params(cfg, jax.random.key(args.seed)), tok


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=("random", "smollm2"), default="random")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--render", choices=("plain", "chatml"), default="plain")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--turns", type=int, default=6)
  p.add_argument("--turn_tokens", type=int, default=24)
  p.add_argument("--max_new_tokens", type=int, default=320)
  p.add_argument("--max_value", type=int, default=1000000)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=str(HERE / "results" / "bench_multiturn.json"))
  args = p.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import data, envs, sampling  # pylint: disable=g-import-not-at-top
  from rollouts_jax.envs import guess  # pylint: disable=g-import-not-at-top
  from rollouts_jax.rollout import multiturn  # pylint: disable=g-import-not-at-top

  cfg, params, tok = _model(args)
  env = guess.GuessEnv(max_value=args.max_value)
  examples = guess.examples(args.prompts, args.max_value, args.seed)
  texts = [env.prompt(ex) for ex in examples]
  if args.render == "chatml":
    texts = [tok.apply_chat_template([{"role": "user", "content": t.strip()}], add_generation_prompt=True) for t in texts]
  ids, mask = data.pad_left([tok.encode(t) for t in texts], (16, 32, 64, 128), pad_id=tok.pad_id)
  stop = tok.end_of_turn_ids
  conf = sampling.SamplingConfig(num_samples=args.samples, max_new_tokens=args.max_new_tokens,
                                 eos_id=stop[0] if len(stop) == 1 else stop, pad_id=tok.pad_id)
  settings = envs.EnvSettings(name="guess", max_turns=args.turns, turn_tokens=args.turn_tokens, render=args.render)
  key = jax.random.key(args.seed + 1)

  def run(mode):
    return multiturn.run_episodes(cfg, params, np.asarray(ids), np.asarray(mask), examples, env, tok, conf, key,
                                  settings, mode=mode)

  load_before = os.getloadavg()
  warm = {m: run(m) for m in ("kv", "reprefill")}          # compile both
  times = timing.alternate({m: lambda m=m: run(m) for m in ("kv", "reprefill")}, args.reps, abba=True).times
  kv, re = warm["kv"], warm["reprefill"]
  med = {m: statistics.median(v) for m, v in times.items()}
  result = {
      "args": vars(args), "device": str(jax.devices()[0]), "load_before": load_before, "load_after": os.getloadavg(),
      "same_tokens": bool((kv.tokens == re.tokens).all()),
      "max_logprob_diff": float(np.abs(kv.logprobs - re.logprobs).max()),
      "turns_mean": float(kv.turn_mask.sum(1).mean()),
      "policy_tokens": int(kv.mask.sum()),
      "observation_tokens": int(sum(len(o) for row in kv.obs_ids for o in row)),
      "recomputed_tokens": {"kv": kv.recomputed_tokens, "reprefill": re.recomputed_tokens},
      "recomputed_ratio": re.recomputed_tokens / max(kv.recomputed_tokens, 1),
      "time_s": times, "median_s": med, "time_ratio_reprefill_over_kv": med["reprefill"] / med["kv"],
  }
  print(json.dumps({k: v for k, v in result.items() if k not in ("args", "time_s")}, indent=1))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
