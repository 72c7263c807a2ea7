r"""Evaluates a policy on a test split: pass@1, pass@k (unbiased estimator), maj@k, greedy accuracy.

  # the final policy of a training run (its config and latest intact checkpoint):
  python -m experiments.launch.evaluate --workdir=/tmp/rollouts_default
  # a Hugging Face checkpoint folder on a benchmark:
  python -m experiments.launch.evaluate --config=configs/gsm8k_qwen.py:/path/to/ckpt --config.eval.k=8

  # the final policy of a run as a Hugging Face folder (e.g. a teacher for rollout.teacher_path);
  # a LoRA run (lora.rank > 0) writes base + adapters merged, and the adapters alone under lora_adapter/:
  python -m experiments.launch.evaluate --workdir=/tmp/rollouts_default --export_hf=/tmp/teacher_hf

  # DeepLook decoding against plain sampling, accuracy against generated tokens:
  python -m experiments.launch.evaluate --decoder=deeplook --deeplook_samples=4 --compare_k=1,4,8

With `--decoder=deeplook` the test prompts are decoded with `sampling.deeplook` (N =
`--deeplook_samples`, settings `--deeplook_*`) and answered by a confidence-weighted vote;
plain sampling with k = each of `--compare_k` is run beside it. Each entry reports `accuracy`
(DeepLook: the vote weighted by `--vote_weight`; plain: maj@k), `maj_unweighted`,
`likelihood_weighted` (the vote weighted by exp(mean token log-prob), on either side), pass@1
and the generated tokens per prompt (losing lookahead continuations included).

Params holding NaN or inf are refused (exit status 2) instead of being scored; a damaged
latest checkpoint is skipped for the newest intact one. Ctrl-C exits cleanly (status 130).
"""

import dataclasses
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from rollouts_jax.io import interrupts

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "..", "..", "configs", "default.py"),
                                "Experiment config file (path[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "A training workdir: evaluates its latest checkpoint with its config.")
flags.DEFINE_integer("num_examples", 0, "Override eval.num_examples (0: keep).")
flags.DEFINE_string("selection", None, "Override eval.selection: test-time rules over the k samples (bon,bom,soft_sc).")
flags.DEFINE_enum("decoder", "sample", ["sample", "deeplook"], "sample: pass@k / maj@k; deeplook: see above.")
flags.DEFINE_integer("deeplook_samples", 4, "DeepLook: samples per prompt (voters).")
flags.DEFINE_integer("deeplook_k", 4, "DeepLook: continuations compared per lookahead.")
flags.DEFINE_integer("deeplook_horizon", 4, "DeepLook: tokens per lookahead continuation.")
flags.DEFINE_integer("deeplook_window", 2, "DeepLook: positions in the segment confidence.")
flags.DEFINE_integer("deeplook_history", 6, "DeepLook: positions of recent history.")
flags.DEFINE_float("deeplook_margin", 1.0, "DeepLook: expand when segment confidence < history - margin.")
flags.DEFINE_integer("deeplook_max", 4, "DeepLook: lookaheads per sample at most.")
flags.DEFINE_enum("deeplook_rank_by", "confidence", ["confidence", "logprob"], "DeepLook: what ranks continuations.")
flags.DEFINE_enum("vote_weight", "confidence", ["confidence", "likelihood", "none"],
                  "DeepLook: vote weight, the mean token confidence or exp(mean token log-prob).")
flags.DEFINE_list("compare_k", ["1", "4", "8"], "DeepLook: plain maj@k baselines to run beside it.")
flags.DEFINE_string("output", None, "DeepLook: also write the result JSON here.")
flags.DEFINE_string("export_hf", None, "Write the policy (with --workdir: its latest intact checkpoint) to this folder "
                    "in Hugging Face layout (config.json + safetensors) and exit without evaluating.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  interrupts.install()
  try:
    _run()
  except KeyboardInterrupt:
    print("Interrupted: evaluation stopped.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)  # no interpreter teardown while XLA threads may still run


def _run():
  from rollouts_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  if FLAGS.workdir:
    with open(os.path.join(FLAGS.workdir, "config.json")) as f:
      exp = config_lib.from_config_dict(config_lib.upgrade(json.load(f)))
  else:
    exp = config_lib.from_config_dict(FLAGS.config)
  if FLAGS.num_examples:
    exp = dataclasses.replace(exp, eval=dataclasses.replace(exp.eval, num_examples=FLAGS.num_examples))
  if FLAGS.selection is not None:
    exp = config_lib.from_config_dict(dict(dataclasses.asdict(exp), eval=dict(dataclasses.asdict(exp.eval),
                                                                                selection=FLAGS.selection)))
  train, test = loop.load_task(exp)
  cfg, params, tokenizer = loop.load_policy(exp, train)
  where = "the initial policy"
  try:
    if FLAGS.workdir:
      where = f"the latest intact checkpoint of {FLAGS.workdir}"
      params = loop.latest_params(exp, FLAGS.workdir, params)
    checkpoint.check_finite(params, f"The params of {where}")
  except (checkpoint.NonFiniteStateError, checkpoint.CheckpointDamagedError) as e:
    print(f"Refused to evaluate: {e}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.export_hf:
    from rollouts_jax import models  # pylint: disable=g-import-not-at-top
    models.save_hf_checkpoint(FLAGS.export_hf, cfg, params)   # a LoRA policy: base + adapters, merged
    print(f"Wrote {where} to {FLAGS.export_hf} (Hugging Face layout).")
    if models.lora.is_lora(params):   # and the adapters alone, in PEFT's layout
      folder = models.lora.save_adapters(os.path.join(FLAGS.export_hf, "lora_adapter"), models.lora.adapters_of(params),
                                         rank=exp.lora.rank, alpha=exp.lora.alpha, base_model=exp.model.path)
      print(f"Wrote its LoRA adapters alone to {folder}.")
    return
  examples = list(test[:exp.eval.num_examples])
  if FLAGS.decoder == "deeplook":
    result = _deeplook_vs_plain(exp, cfg, params, tokenizer, examples)
    if FLAGS.output:
      with open(FLAGS.output, "w") as f:
        json.dump(result, f, indent=2)
  else:
    result = loop.evaluate(exp, cfg, params, tokenizer, examples)
  print(json.dumps(result, indent=2))


def _deeplook_vs_plain(exp, cfg, params, tokenizer, examples) -> dict:
  """DeepLook (confidence-weighted vote) and plain maj@k: accuracy and generated tokens per prompt."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import rewards, sampling, tasks  # pylint: disable=g-import-not-at-top
  from rollouts_jax.sampling import deeplook  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import eval_metrics, evaluation, loop  # pylint: disable=g-import-not-at-top
  task = tasks.get(exp.data.task)
  prompter = loop.prompter(exp, tokenizer)
  scorer = rewards.build_scorer("task", task, timeout_s=exp.reward.timeout_s, num_workers=exp.reward.num_workers)
  base = loop.sampling_config(exp, tokenizer).replace(temperature=exp.eval.temperature)
  look = deeplook.DeepLookConfig(k=FLAGS.deeplook_k, horizon=FLAGS.deeplook_horizon, window=FLAGS.deeplook_window,
                                 history=FLAGS.deeplook_history, margin=FLAGS.deeplook_margin,
                                 max_lookaheads=FLAGS.deeplook_max, rank_by=FLAGS.deeplook_rank_by)
  key = jax.random.key(exp.seed + 1)

  def run(n, decoder):
    conf = base.replace(num_samples=n)
    acc, lik_acc, plain_acc, tokens, pass1, looks = [], [], [], 0, [], []
    for start in range(0, len(examples), exp.eval.batch_size):
      chunk = examples[start:start + exp.eval.batch_size]
      ids, mask = prompter(chunk)
      refs = [task.reference(ex) for ex in chunk]
      k = jax.random.fold_in(key, start)
      if decoder == "deeplook":
        out, info = jax.device_get(deeplook.deeplook_sample(cfg, params, ids, mask, k, conf, look))
        weights = {"confidence": np.asarray(info.confidence), "likelihood": np.exp(np.asarray(info.mean_logprob)),
                   "none": np.ones(out.lengths.shape)}[FLAGS.vote_weight]
        spent = int(np.asarray(info.generated_tokens).sum())
        looks.append(np.asarray(info.lookaheads))
      else:
        out = jax.device_get(sampling.sample(cfg, params, ids, mask, k, conf))
        weights, spent = np.ones(out.lengths.shape), int(np.asarray(out.lengths).sum())
      texts = evaluation.decode_completions(tokenizer, np.asarray(out.completion_ids), np.asarray(out.completion_mask))
      r, info_r = scorer(texts, refs)
      correct = np.asarray(r) >= 1.0
      tokens += spent
      pass1.append(correct.mean(1))
      answers = [rewards.canonicalize_answers(row, task.same) for row in info_r["answers"]]
      plain_acc.append(eval_metrics.maj_at_k(answers, correct.tolist(), n) * len(chunk))
      m = np.asarray(out.completion_mask)
      likelihood = np.exp(np.where(m, np.asarray(out.policy_logprobs), 0).sum(-1) / np.maximum(m.sum(-1), 1))
      for b, row in enumerate(answers):
        voted = deeplook.weighted_vote(row, weights[b])
        acc.append(voted is not None and bool(correct[b][row.index(voted)]))
        voted = deeplook.weighted_vote(row, likelihood[b])
        lik_acc.append(voted is not None and bool(correct[b][row.index(voted)]))
    res = {"samples": n, "accuracy": float(np.mean(acc)), "maj_unweighted": float(np.sum(plain_acc) / len(examples)),
           "likelihood_weighted": float(np.mean(lik_acc)),
           "pass@1": float(np.concatenate(pass1).mean()), "tokens_per_prompt": tokens / len(examples)}
    if looks:
      res["lookaheads_per_sample"] = float(np.concatenate(looks).mean())
    return res

  result = {"examples": len(examples), "deeplook": dict(look.__dict__, vote_weight=FLAGS.vote_weight),
            "deeplook_result": run(FLAGS.deeplook_samples, "deeplook"),
            "plain": [run(int(k), "sample") for k in FLAGS.compare_k]}
  return result


if __name__ == "__main__":
  app.run(main)
