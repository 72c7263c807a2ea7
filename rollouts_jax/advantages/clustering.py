"""Cluster ids for `uniqueness_reweight`: group the samples of a prompt by strategy.

These run on the host (strings and model calls), before the jitted advantage step, and
return `int32[B, N]` numpy arrays. Ids are canonical: the id of a sample is the index of the
first sample of its prompt in the same cluster, so ids lie in [0, N) and relabeling the
clusters gives the same ids.

Uniqueness-Aware RL ("Rewarding the Rare", Hu et al., arXiv 2601.08763) clusters by an LLM
judge that reads the solutions of one problem and groups them by high-level strategy;
`cluster_by_judge` takes any such judge as a callable, and `llm_judge` builds one from a
text-completion function. `cluster_by_answer` is a cheap judge-free proxy.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np

Judge = Callable[..., Sequence[Any]]


def canonical_ids(labels: Sequence[Hashable]) -> np.ndarray:
  """Maps arbitrary labels of one group to canonical ids (index of the first equal label).

  Args:
    labels: N hashable labels.

  Returns:
    int32[N] ids.

  Example:
    >>> canonical_ids(["b", "a", "b", 7]).tolist()
    [0, 1, 0, 3]
  """
  first = {}
  out = np.empty(len(labels), dtype=np.int32)
  for i, label in enumerate(labels):
    out[i] = first.setdefault(label, i)
  return out


def _check_groups(groups: Sequence[Sequence[Any]], name: str) -> int:
  if len(groups) == 0:
    raise ValueError(f"{name} must hold at least one group.")
  sizes = {len(g) for g in groups}
  if len(sizes) != 1:
    raise ValueError(f"{name}: every group must have the same number of samples, got {sorted(sizes)}.")
  return sizes.pop()


def _default_normalize(answer: Any) -> Any:
  if isinstance(answer, str):
    return " ".join(answer.strip().lower().split())
  return answer


def cluster_by_answer(answers: Sequence[Sequence[Optional[Any]]],
                      normalize: Optional[Callable[[Any], Hashable]] = None) -> np.ndarray:
  """Clusters the samples of each prompt by their (normalized) final answer.

  Args:
    answers: B groups of N final answers (e.g. extracted by a verifier); None or "" means no
      answer, and such a sample forms its own cluster.
    normalize: maps an answer to a hashable key; default strips, lower-cases and collapses
      whitespace of strings.

  Returns:
    int32[B, N] canonical cluster ids.

  Example:
    >>> cluster_by_answer([["42", " 42", "7", None]]).tolist()
    [[0, 0, 2, 3]]
  """
  n = _check_groups(answers, "answers")
  normalize = normalize or _default_normalize
  out = np.empty((len(answers), n), dtype=np.int32)
  for b, group in enumerate(answers):
    keys = []
    for i, a in enumerate(group):
      keys.append(("__none__", i) if a is None or a == "" else ("answer", normalize(a)))
    out[b] = canonical_ids(keys)
  return out


def cluster_by_judge(samples: Sequence[Sequence[str]], judge: Judge,
                     problems: Optional[Sequence[str]] = None) -> np.ndarray:
  """Clusters the samples of each prompt with a pluggable judge.

  The judge is called once per prompt as `judge(texts)` or, when `problems` is given,
  `judge(texts, problem=problem)`, and returns N labels (any hashables; equal labels = same
  strategy). When the judge raises or returns something unusable (wrong length, an
  unhashable label) the prompt falls back to singletons -- every sample its own cluster --
  so uniqueness weighting reduces to plain GRPO there, as the paper's setup suggests for a
  failed judgement.

  Args:
    samples: B groups of N completion texts.
    judge: callable as above, e.g. `llm_judge(complete_fn)` or `pairwise_judge(same_fn)`.
    problems: optional B problem statements passed to the judge.

  Returns:
    int32[B, N] canonical cluster ids.

  Example:
    >>> judge = lambda texts: [t.split()[0] for t in texts]
    >>> cluster_by_judge([["alg x", "geo y", "alg z"]], judge).tolist()
    [[0, 1, 0]]
  """
  n = _check_groups(samples, "samples")
  if problems is not None and len(problems) != len(samples):
    raise ValueError(f"problems has {len(problems)} entries, samples has {len(samples)} groups.")
  out = np.empty((len(samples), n), dtype=np.int32)
  for b, group in enumerate(samples):
    try:
      labels = judge(list(group)) if problems is None else judge(list(group), problem=problems[b])
      labels = list(labels)
      if len(labels) != n:
        raise ValueError("wrong number of labels")
      out[b] = canonical_ids(labels)
    except Exception:  # noqa: BLE001 -- any judge failure means "no clustering" for this prompt.
      out[b] = np.arange(n, dtype=np.int32)
  return out


def pairwise_judge(same_strategy: Callable[[str, str], bool]) -> Judge:
  """Builds a group judge from a pairwise predicate (greedy clustering by representatives).

  Each sample joins the first existing cluster whose representative (its first member) the
  predicate calls the same strategy, else starts a new cluster; N (N-1)/2 calls at most.

  Args:
    same_strategy: `(text_a, text_b) -> bool`, e.g. a small LLM asked a yes/no question.

  Returns:
    A judge for `cluster_by_judge`.

  Example:
    >>> judge = pairwise_judge(lambda a, b: a[0] == b[0])
    >>> list(judge(["ab", "cd", "ax"]))
    [0, 1, 0]
  """

  def judge(texts: Sequence[str], problem: Optional[str] = None) -> list:
    del problem
    reps: list = []
    labels = []
    for i, text in enumerate(texts):
      for r in reps:
        if same_strategy(texts[r], text):
          labels.append(r)
          break
      else:
        reps.append(i)
        labels.append(i)
    return labels

  return judge


JUDGE_PROMPT = (
    "You will see {n} solutions to the same problem. Group them by high-level solution "
    "strategy, ignoring wording, notation, presentation and whether the final answer is "
    "right. Reply with one line per solution, in order, of the form "
    "'Solution <k>: <strategy number>', and nothing else.\n\n"
    "Problem:\n{problem}\n\n{solutions}")

_LINE = re.compile(r"solution\s*(\d+)\s*[:\-=]\s*(?:strategy\s*)?#?\s*(\d+)", re.IGNORECASE)


def parse_judge_reply(reply: str, n: int) -> list:
  """Parses 'Solution k: c' lines into N labels; raises ValueError if any is missing.

  Example:
    >>> parse_judge_reply("Solution 1: 2\\nSolution 2: 1\\nSolution 3: 2", 3)
    [2, 1, 2]
  """
  labels = {}
  for k, c in _LINE.findall(reply):
    labels.setdefault(int(k), int(c))
  if sorted(labels) != list(range(1, n + 1)):
    raise ValueError(f"judge reply does not label solutions 1..{n}: {reply[:200]!r}")
  return [labels[k] for k in range(1, n + 1)]


def llm_judge(complete: Callable[[str], str], template: str = JUDGE_PROMPT,
              max_chars: int = 4000) -> Judge:
  """Builds a group judge from a text-completion function (an LLM judge).

  Args:
    complete: `prompt -> reply`, e.g. a call into a served judge model or our own sampler.
    template: prompt with `{n}`, `{problem}` and `{solutions}` fields.
    max_chars: each solution is cut to this many characters.

  Returns:
    A judge for `cluster_by_judge`; an unparsable reply raises, which `cluster_by_judge`
    turns into singletons.

  Example:
    >>> fake = lambda prompt: "Solution 1: 1\\nSolution 2: 1"
    >>> cluster_by_judge([["x = 2", "x = 1 + 1"]], llm_judge(fake)).tolist()
    [[0, 0]]
  """

  def judge(texts: Sequence[str], problem: Optional[str] = None) -> list:
    solutions = "\n\n".join(f"Solution {k}:\n{t[:max_chars]}" for k, t in enumerate(texts, 1))
    prompt = template.format(n=len(texts), problem=problem or "(not given)", solutions=solutions)
    return parse_judge_reply(complete(prompt), len(texts))

  return judge
