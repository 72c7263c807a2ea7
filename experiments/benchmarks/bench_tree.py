r"""Tree rollouts vs independent sampling at an equal number of leaves, on the warm-start model.

  python -m experiments.benchmarks.bench_tree                    # default config's SFT warm start, arithmetic test prompts
  python -m experiments.benchmarks.bench_tree --profile          # the model's entropy / confidence percentiles only

Both sides decode the same prompts (`--prompts` of the arithmetic test split, `--leaves` leaves
each, the default config's rollout settings). The tree side is `sampling.tree.tree_sample`
with the thresholds below; the independent side is `sampling.sample` with N = leaves.
Reported:
  * generated tokens: the tokens each side decoded. For the tree, `TreeInfo.generated_tokens`
    (shared prefixes once); for independent sampling, the sum of completion lengths. A tree
    may end with fewer leaves than rows (nothing uncertain enough to fork at), so the
    independent side is also counted over the same number of leaves per prompt (its first L_b
    samples when the tree of prompt b has L_b leaves): `ratio_equal_leaves`.
  * wall time (medians over `--reps`, the two sides alternated in one process, after a warm-up
    call of each) and the machine load before and after.
  * leaf quality: mean reward (the task's verifier) and the fraction of prompts whose group
    has mixed rewards (informative for GRPO), per side.
Decoding keeps static shapes on both sides (every row runs every step until all rows end), so
on this engine the saved tokens show as work a paged engine would skip, not as wall time.
Writes experiments/benchmarks/results/bench_tree.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

from experiments.benchmarks import timing

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parents[1]


def _load(num_prompts: int):
  from rollouts_jax.training import config as config_lib, loop  # pylint: disable=g-import-not-at-top
  exp = config_lib.from_config_dict(config_lib.load_config_file(REPO / "configs" / "default.py"))
  train, test = loop.load_task(exp)
  cfg, params, tokenizer = loop.load_policy(exp, train)
  examples = list(test[:num_prompts])
  ids, mask = loop.prompter(exp, tokenizer)(examples)
  return exp, cfg, params, tokenizer, examples, ids, mask


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--leaves", type=int, default=8)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--entropy_min", type=float, default=0.5)
  p.add_argument("--delta_entropy_min", type=float, default=0.2)
  p.add_argument("--min_depth", type=int, default=1)
  p.add_argument("--min_gap", type=int, default=2)
  p.add_argument("--max_width", type=int, default=4)
  p.add_argument("--init_rows", type=int, default=1)
  p.add_argument("--branch_tokens", default="sample", choices=("top", "sample"))
  p.add_argument("--width_h_low", type=float, default=0.1)
  p.add_argument("--width_h_high", type=float, default=1.0)
  p.add_argument("--profile", action="store_true")
  p.add_argument("--out", default=str(RESULTS / "bench_tree.json"))
  args = p.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import rewards, sampling  # pylint: disable=g-import-not-at-top
  from rollouts_jax.sampling import tree as tree_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import evaluation, loop  # pylint: disable=g-import-not-at-top

  exp, cfg, params, tokenizer, examples, ids, mask = _load(args.prompts)
  conf = loop.sampling_config(exp, tokenizer).replace(num_samples=args.leaves)
  key = jax.random.key(args.seed)
  if args.profile:
    out, info = jax.device_get(tree_lib.tree_sample(cfg, params, ids, mask, key, conf,
                                                    tree_lib.TreeConfig(max_width=1, init_rows=args.leaves)))
    m = out.completion_mask
    q = [5, 25, 50, 75, 90, 95, 99]
    print("entropy percentiles", dict(zip(q, np.percentile(out.entropy[m], q).round(3).tolist())))
    print("confidence percentiles", dict(zip(q, np.percentile(info.confidence[m], q).round(3).tolist())))
    print("mean length", float(out.lengths.mean()))
    return
  tree = tree_lib.TreeConfig(
      init_rows=args.init_rows, min_depth=args.min_depth, min_gap=args.min_gap, entropy_min=args.entropy_min,
      delta_entropy_min=args.delta_entropy_min, max_width=args.max_width, branch_tokens=args.branch_tokens, width_h_low=args.width_h_low,
      width_h_high=args.width_h_high, width_beta=0.0, prune=False)
  task = rewards.build_scorer("task", loop.tasks.get(exp.data.task), timeout_s=5.0, num_workers=0)
  refs = [loop.tasks.get(exp.data.task).reference(ex) for ex in examples]

  def run(side, k):
    if side == "tree":
      res = tree_lib.tree_sample(cfg, params, ids, mask, k, conf, tree)
    else:
      res = sampling.sample(cfg, params, ids, mask, k, conf)
    return jax.block_until_ready(res)

  load_before = os.getloadavg()
  for side in ("tree", "independent"):
    run(side, key)  # compile
  stats = {"tree": [], "independent": []}

  def side(name):
    def call():   # the i-th call of each side runs on key fold_in(key, i)
      stats[name].append(run(name, jax.random.fold_in(key, len(stats[name]))))
    return call

  times = timing.alternate({s: side(s) for s in stats}, args.reps, abba=True).times
  stats = jax.device_get(stats)
  load_after = os.getloadavg()

  def quality(out, leaf_mask):
    texts = evaluation.decode_completions(tokenizer, np.asarray(out.completion_ids), np.asarray(out.completion_mask))
    r, _ = task(texts, refs)
    r = np.asarray(r, np.float64)
    mean = float(r[leaf_mask].mean())
    mixed = [len(set(r[b][leaf_mask[b]].tolist())) > 1 for b in range(len(refs))]
    return mean, float(np.mean(mixed))

  rows = []
  for rep in range(args.reps):
    out_t, info = stats["tree"][rep]
    out_i = stats["independent"][rep]
    leaves = info.leaf_mask.sum(1)
    indep_all = int(out_i.lengths.sum())
    indep_eq = int(sum(out_i.lengths[b, :leaves[b]].sum() for b in range(len(leaves))))
    tree_tokens = int(info.generated_tokens.sum())
    rt, mt = quality(out_t, info.leaf_mask)
    li = np.zeros_like(info.leaf_mask)
    for b in range(len(leaves)):
      li[b, :leaves[b]] = True
    ri, mi = quality(out_i, li)
    ra, ma = quality(out_i, np.ones_like(info.leaf_mask))
    rows.append(dict(tree_tokens=tree_tokens, tree_leaf_tokens=int(out_t.lengths.sum()), indep_tokens=indep_all,
                     indep_tokens_equal_leaves=indep_eq, mean_leaves=float(leaves.mean()),
                     full_trees=float(np.mean(leaves == args.leaves)), branches=float(info.num_branches.mean()),
                     ratio_equal_leaves=indep_eq / max(tree_tokens, 1), ratio_all=indep_all / max(tree_tokens, 1),
                     tree_reward=rt, tree_mixed=mt, indep_reward_equal_leaves=ri, indep_mixed_equal_leaves=mi,
                     indep_reward=ra, indep_mixed=ma))
  med = lambda k: statistics.median(r[k] for r in rows)
  result = dict(
      model="default config SFT warm start (arithmetic, char tokenizer)", prompts=args.prompts, leaves=args.leaves,
      max_new_tokens=conf.max_new_tokens, temperature=conf.temperature, tree=tree.__dict__, reps=args.reps,
      load_before=load_before, load_after=load_after, cpu_count=os.cpu_count(), backend=jax.default_backend(),
      wall_s=dict(tree=statistics.median(times["tree"]), independent=statistics.median(times["independent"])),
      wall_ratio_indep_over_tree=statistics.median(times["independent"]) / statistics.median(times["tree"]),
      medians={k: med(k) for k in rows[0]}, per_rep=rows)
  RESULTS.mkdir(exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
  m = result["medians"]
  print(f"load {load_before[0]:.2f} -> {load_after[0]:.2f}; leaves per prompt {m['mean_leaves']:.2f} of {args.leaves} "
        f"(full trees {m['full_trees']:.2f}), branches {m['branches']:.2f}")
  print(f"generated tokens: tree {m['tree_tokens']:.0f}, independent {m['indep_tokens']:.0f} "
        f"(equal leaves {m['indep_tokens_equal_leaves']:.0f}): ratio {m['ratio_equal_leaves']:.2f}x at equal leaves")
  print(f"wall: tree {result['wall_s']['tree']:.3f}s, independent {result['wall_s']['independent']:.3f}s "
        f"(independent / tree {result['wall_ratio_indep_over_tree']:.2f})")
  print(f"reward: tree {m['tree_reward']:.3f} (mixed groups {m['tree_mixed']:.2f}); independent at equal leaves "
        f"{m['indep_reward_equal_leaves']:.3f} ({m['indep_mixed_equal_leaves']:.2f}); all {args.leaves}: "
        f"{m['indep_reward']:.3f} ({m['indep_mixed']:.2f})")


if __name__ == "__main__":
  main()
