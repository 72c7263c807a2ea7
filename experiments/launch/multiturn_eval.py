r"""Held-out multi-turn episodes before and after RL: accuracy, tool use and turns, with the tool running.

  python -m experiments.launch.multiturn_eval --workdir=/tmp/multiturn_calculator
  python -m experiments.launch.multiturn_eval --workdir=/tmp/multiturn_calculator --num_examples=200 --samples=4

The run's own evaluation (`eval/*` in metrics.jsonl) samples single turns, so a tool call there is
never answered; this script plays whole episodes in the run's environment (`rollout.env*`, the
calculator runs) on the test split, with the warm start ("before") and the latest intact
checkpoint ("after"), `--samples` episodes per problem at the rollout temperature, the same key
for both. Reported per policy: `accuracy` (episodes that end with the right answer),
`tool_use_frac` (episodes that called the tool), `accuracy_with_tool` / `accuracy_without_tool`,
`turns` (mean policy turns) and `truncated_frac`. Writes `--out` (default WORKDIR/multiturn_eval.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib



def episodes_summary(exp, cfg, params, tokenizer, examples, samples: int, seed: int) -> dict:
  """Whole episodes of the run's environment on `examples`: accuracy, tool use, turns."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.rollout import multiturn  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top
  settings = config_lib.env_settings(exp.rollout)
  env = settings.check(exp.rollout.max_new_tokens)
  conf = loop.sampling_config(exp, tokenizer).replace(num_samples=samples)
  prompter = loop.prompter(exp, tokenizer)
  solved, used, turns, cut = [], [], [], []
  B = exp.eval.batch_size
  for start in range(0, len(examples), B):
    chunk = examples[start:start + B]
    ids, mask = prompter(chunk)
    ep = multiturn.run_episodes(cfg, params, np.asarray(ids), np.asarray(mask), chunk, env, tokenizer, conf,
                                jax.random.fold_in(jax.random.key(seed), start), settings)
    solved += [env.solved(s) for s in ep.states]
    used += [env.used_tool(s) for s in ep.states]
    turns += ep.turn_mask.sum(1).tolist()
    cut += ep.truncated.tolist()
  solved, used = np.asarray(solved, bool), np.asarray(used, bool)
  rate = lambda x: float(x.mean()) if x.size else float("nan")
  return {"episodes": int(solved.size), "accuracy": rate(solved), "tool_use_frac": rate(used),
          "accuracy_with_tool": rate(solved[used]), "accuracy_without_tool": rate(solved[~used]),
          "turns": float(np.mean(turns)), "truncated_frac": float(np.mean(cut))}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True)
  p.add_argument("--num_examples", type=int, default=200)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(config_lib.upgrade(json.loads((pathlib.Path(args.workdir) / "config.json").read_text())))
  if not exp.rollout.env:
    raise SystemExit(f"{args.workdir} is not a multi-turn run (rollout.env is empty).")
  train, test = loop.load_task(exp)
  cfg, params, tokenizer = loop.load_policy(exp, train)
  examples = list(test[:args.num_examples])
  result = {"before": episodes_summary(exp, cfg, params, tokenizer, examples, args.samples, exp.seed + 1)}
  after = loop.latest_params(exp, args.workdir, params)
  result["after"] = episodes_summary(exp, cfg, after, tokenizer, examples, args.samples, exp.seed + 1)
  print(json.dumps(result, indent=1))
  out = pathlib.Path(args.out or pathlib.Path(args.workdir) / "multiturn_eval.json")
  out.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
