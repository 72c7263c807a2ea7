"""Held-out evaluation: pass@1, pass@k (unbiased), maj@k and greedy accuracy.

Correctness is the task's own verifier, and maj@k votes on the task's extracted answers:
the same extractor the reward grades, so a vote never counts an answer the verifier did not
see (answers the task judges the `same` are merged before voting).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from rollouts_jax import rewards, sampling
from rollouts_jax.rollout.prompter import Prompter, decode_completions  # noqa: F401  (the evaluation's too)
from rollouts_jax.training import eval_metrics


@dataclasses.dataclass
class Evaluator:
  """Evaluates a policy on held-out examples with the task's verifier.

  The settings after `sampling_config` are keyword-only with no defaults: they are the config's
  `eval.k / batch_size / selection` and `reward.num_workers / timeout_s` (`training.build.evaluator`),
  whose defaults live in the config sections alone. `deeplook` (a `sampling.deeplook.DeepLookConfig`,
  None: off) also decodes with DeepLook, voting with `deeplook_vote` weights.
  """
  cfg: Any
  prompter: Prompter
  sampling_config: sampling.SamplingConfig
  _: dataclasses.KW_ONLY
  k: int
  batch_size: int
  num_workers: int
  timeout_s: float
  selection: tuple[str, ...]
  deeplook: Any = None
  deeplook_vote: str = ""

  def __post_init__(self):
    if self.deeplook is not None and self.deeplook_vote not in DEEPLOOK_VOTES:
      raise ValueError(f"Config key eval.deeplook_kwargs: vote_weight must be one of {', '.join(DEEPLOOK_VOTES)}; "
                       f"got {self.deeplook_vote!r}.")
    unknown = [rule for rule in self.selection if rule not in SELECTION_RULES]
    if unknown:
      raise ValueError(f"Config key eval.selection: unknown rule(s) {', '.join(map(repr, unknown))}; "
                       f"rules: {', '.join(SELECTION_RULES)}.")
    self.scorer = rewards.build_scorer("task", self.prompter.task, timeout_s=self.timeout_s,
                                       num_workers=self.num_workers)

  def __call__(self, params, examples: Sequence[dict], key: jax.Array, *, greedy: bool = True) -> dict[str, float]:
    task, k = self.prompter.task, self.k
    conf = self.sampling_config.replace(num_samples=k)
    correct, answers, greedy_correct, scores, looked, look_tokens, plain_tokens = [], [], [], [], [], 0, 0
    for start in range(0, len(examples), self.batch_size):
      chunk = list(examples[start:start + self.batch_size])
      ids, mask = self.prompter(chunk)
      refs = [task.reference(ex) for ex in chunk]
      out = jax.device_get(sampling.sample(self.cfg, params, ids, mask, jax.random.fold_in(key, start), conf))
      texts = decode_completions(self.prompter.tokenizer, np.asarray(out.completion_ids),
                                 np.asarray(out.completion_mask))
      r, info = self.scorer(texts, refs)
      correct.append(r >= 1.0)
      plain_tokens += int(np.asarray(out.lengths).sum())
      if self.deeplook is not None:
        hits, spent = self._deeplook(params, ids, mask, refs, jax.random.fold_in(key, start + (1 << 24)), conf)
        looked += hits
        look_tokens += spent
      # Answers the task judges the same share one representative before the vote.
      answers += [rewards.canonicalize_answers(row, task.same) for row in info["answers"]]
      if self.selection:   # each sample's mean token log-prob under the sampler: the rules' score
        scores.append(np.stack([rewards.sequence_scores(np.asarray(out.logprobs)[b], np.asarray(out.completion_mask)[b])
                                for b in range(len(chunk))]))
      if greedy:
        g = jax.device_get(sampling.sample(self.cfg, params, ids, mask, key, conf.replace(num_samples=1, greedy=True)))
        gtexts = decode_completions(self.prompter.tokenizer, np.asarray(g.completion_ids),
                                    np.asarray(g.completion_mask))
        gr, _ = self.scorer(gtexts, refs)
        greedy_correct.append(gr[:, 0] >= 1.0)
    correct = np.concatenate(correct)
    result = {"eval/pass@1": float(eval_metrics.mean_pass_at_k(correct, 1)),
              f"eval/pass@{k}": float(eval_metrics.mean_pass_at_k(correct, k)),
              f"eval/maj@{k}": float(eval_metrics.maj_at_k(answers, correct.tolist(), k))}
    if self.selection:
      result.update(selection_accuracy(self.selection, answers, correct, np.concatenate(scores), k))
    if self.deeplook is not None:
      result[f"eval/deeplook@{k}"] = float(np.mean(looked))
      result["eval/deeplook_tokens_per_prompt"] = look_tokens / len(examples)
      result["eval/tokens_per_prompt"] = plain_tokens / len(examples)
    if greedy:
      result["eval/greedy_accuracy"] = float(np.concatenate(greedy_correct).mean())
    return result


  def _deeplook(self, params, ids, mask, refs, key, conf) -> tuple[list[bool], int]:
    """DeepLook (k samples with confidence-triggered lookahead) answered by a weighted vote:
    whether each prompt's voted answer is right, and the tokens decoded (losing continuations too)."""
    from rollouts_jax.sampling import deeplook  # pylint: disable=g-import-not-at-top
    out, info = jax.device_get(deeplook.deeplook_sample(self.cfg, params, ids, mask, key, conf, self.deeplook))
    texts = decode_completions(self.prompter.tokenizer, np.asarray(out.completion_ids), np.asarray(out.completion_mask))
    r, rinfo = self.scorer(texts, refs)
    weights = {"confidence": np.asarray(info.confidence), "likelihood": np.exp(np.asarray(info.mean_logprob)),
               "none": np.ones(np.asarray(out.lengths).shape)}[self.deeplook_vote]
    hits = []
    for b, row in enumerate(rinfo["answers"]):
      row = rewards.canonicalize_answers(row, self.prompter.task.same)
      voted = deeplook.weighted_vote(row, weights[b])
      hits.append(voted is not None and bool(r[b][row.index(voted)] >= 1.0))
    return hits, int(np.asarray(info.generated_tokens).sum())


#: DeepLook's vote weights (`eval.deeplook_kwargs` vote_weight=): DeepConf's mean token
#: confidence, exp(mean token log-prob), or one vote each.
DEEPLOOK_VOTES = ("likelihood", "confidence", "none")

#: Test-time selection rules of `eval.selection`, each over a prompt's k samples.
SELECTION_RULES = ("bon", "bom", "soft_sc")


def selection_accuracy(rules: Sequence[str], answers: Sequence[Sequence], correct_BxN: np.ndarray,
                       scores_BxN: np.ndarray, k: int) -> dict[str, float]:
  """{"eval/RULE@k": the share of prompts whose selected sample is correct} for each rule.

  The score of a sample is its mean token log-prob under the sampler (no reward model is
  involved): `bon` is best-of-N by that score, `bom` best-of-majority (arXiv 2510.03199;
  alpha 0.1) with it as the reward, `soft_sc` soft self-consistency (the answer whose best
  sample scores highest). A prompt with no choosable sample counts as wrong.

  >>> import numpy as np
  >>> selection_accuracy(["bon", "soft_sc"], [["1", "2", "2"]], np.array([[True, False, False]]),
  ...                    np.array([[-0.1, -0.5, -0.6]]), 3)
  {'eval/bon@3': 1.0, 'eval/soft_sc@3': 1.0}
  """
  out = {}
  for rule in rules:
    hits = []
    for b, row in enumerate(answers):
      s = np.asarray(scores_BxN[b], np.float64)
      if rule == "bon":
        pick = rewards.best_of_n(s, row).index
      elif rule == "bom":
        usable = [a if np.isfinite(x) else None for a, x in zip(row, s)]
        pick = rewards.best_of_majority(usable, np.nan_to_num(s, nan=-1e9)).index
      else:
        pick = rewards.soft_self_consistency(row, s[:, None]).index
      hits.append(pick >= 0 and bool(correct_BxN[b, pick]))
    out[f"eval/{rule}@{k}"] = float(np.mean(hits))
  return out

