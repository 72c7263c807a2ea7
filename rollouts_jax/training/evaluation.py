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

from rollouts_jax import rewards, sampling, tasks
from rollouts_jax.training import eval_metrics


def decode_completions(tokenizer, ids_BxNxT: np.ndarray, mask_BxNxT: np.ndarray) -> list[list[str]]:
  """Texts of the completions `[B][N]`: EOS, end-of-turn ids, padding and special tokens dropped."""
  B, N, T = ids_BxNxT.shape
  stop = set(tokenizer.end_of_turn_ids)
  out = []
  for b in range(B):
    row = []
    for j in range(N):
      toks = [int(t) for t in ids_BxNxT[b, j][mask_BxNxT[b, j]] if int(t) not in stop]
      row.append(tokenizer.decode(toks, skip_special=True))
    out.append(row)
  return out


@dataclasses.dataclass
class Prompter:
  """Formats, tokenizes and left-pads a task's prompts (buckets keep the shapes few)."""
  task: tasks.Task
  tokenizer: Any
  template: str = "plain"
  instruction: bool = True
  max_prompt_len: int = 64
  buckets: tuple[int, ...] = sampling.DEFAULT_PROMPT_BUCKETS

  def __call__(self, examples: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    from rollouts_jax import data as data_lib  # pylint: disable=g-import-not-at-top
    texts = [self.task.prompt(ex, self.tokenizer, self.template, instruction=self.instruction) for ex in examples]
    ids = [self.tokenizer.encode(t) for t in texts]
    longest = max(len(x) for x in ids)
    if longest > self.max_prompt_len:
      raise ValueError(f"A prompt has {longest} tokens, more than data.max_prompt_len={self.max_prompt_len}.")
    ids, mask = data_lib.pad_left(ids, self.buckets, pad_id=self.tokenizer.pad_id)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


@dataclasses.dataclass
class Evaluator:
  """Evaluates a policy on held-out examples with the task's verifier."""
  cfg: Any
  prompter: Prompter
  sampling_config: sampling.SamplingConfig
  k: int = 4
  batch_size: int = 100
  num_workers: int = 2
  timeout_s: float = 5.0

  def __post_init__(self):
    self.scorer = rewards.build_scorer("task", self.prompter.task, timeout_s=self.timeout_s,
                                       num_workers=self.num_workers)

  def __call__(self, params, examples: Sequence[dict], key: jax.Array, *, greedy: bool = True) -> dict[str, float]:
    task, k = self.prompter.task, self.k
    conf = self.sampling_config.replace(num_samples=k)
    correct, answers, greedy_correct = [], [], []
    for start in range(0, len(examples), self.batch_size):
      chunk = list(examples[start:start + self.batch_size])
      ids, mask = self.prompter(chunk)
      refs = [task.reference(ex) for ex in chunk]
      out = jax.device_get(sampling.sample(self.cfg, params, ids, mask, jax.random.fold_in(key, start), conf))
      texts = decode_completions(self.prompter.tokenizer, np.asarray(out.completion_ids),
                                 np.asarray(out.completion_mask))
      r, info = self.scorer(texts, refs)
      correct.append(r >= 1.0)
      # Answers the task judges the same share one representative before the vote.
      answers += [rewards.canonicalize_answers(row, task.same) for row in info["answers"]]
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
    if greedy:
      result["eval/greedy_accuracy"] = float(np.concatenate(greedy_correct).mean())
    return result

