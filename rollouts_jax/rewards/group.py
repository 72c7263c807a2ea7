"""FILTER over groups: weighted sums of per-sample verifiers and label-free group rewards.

A config names the reward as a weighted sum of terms (`reward.name`)::

    "task"                              # the task's own verifier: grade(extract(text), reference)
    "countdown + 0.1*format_answer_tag" # a verifier plus a format bonus
    "ttrl"                              # majority-vote pseudo-labels, no references read
    "dare"  |  "co_reward"              # label-free, distribution-aware / two-view agreement

`build_scorer` turns the spec into a `GroupScorer` once; calling it scores a `[B][N]` grid of
completions. Group terms see only the task's extracted answers (and, for DARE, each sample's
mean token entropy; for Co-Reward, the answers of a rewritten question's samples): they
never receive references.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any, Optional, Sequence

import numpy as np

from rollouts_jax.graders import pool
from rollouts_jax.rewards import label_free, registry

GROUP_TERMS = ("ttrl", "dare", "co_reward", "cat")
_TERM_RE = re.compile(r"^\s*(?:(?P<w>[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)\s*\*\s*)?(?P<name>[A-Za-z_][\w]*)\s*$")


def parse_reward_spec(spec: str, key: str = "reward.name") -> list[tuple[str, float]]:
  """`"countdown + 0.1*format_answer_tag"` -> `[("countdown", 1.0), ("format_answer_tag", 0.1)]`.

  Every term must be "task", a label-free group reward or a registered verifier.

  >>> parse_reward_spec("task + 0.2*format_boxed")
  [('task', 1.0), ('format_boxed', 0.2)]
  >>> parse_reward_spec("tttrl")
  Traceback (most recent call last):
  ...
  ValueError: Config key reward.name: unknown reward term 'tttrl' in 'tttrl'; known: task, ttrl, dare, co_reward, cat, arithmetic, countdown, countdown_at_most_once, format, format_answer_tag, format_boxed, format_think_answer, gsm8k, math.
  """
  known = ["task", *GROUP_TERMS, *registry.reward_fn_names()]
  terms: list[tuple[str, float]] = []
  for part in spec.split("+"):
    m = _TERM_RE.match(part)
    if not m:
      raise ValueError(f"Config key {key}: cannot read reward term {part.strip()!r} in {spec!r} "
                       "(expected name or weight*name, joined by '+').")
    name, weight = m.group("name"), float(m.group("w") or 1.0)
    if name not in known:
      raise ValueError(f"Config key {key}: unknown reward term {name!r} in {spec!r}; known: {', '.join(known)}.")
    if any(name == t for t, _ in terms):
      raise ValueError(f"Config key {key}: reward term {name!r} appears twice in {spec!r}.")
    terms.append((name, weight))
  if not terms:
    raise ValueError(f"Config key {key} is empty.")
  groups = [t for t, _ in terms if t in GROUP_TERMS]
  if len(groups) > 1:
    raise ValueError(f"Config key {key}: at most one label-free group reward per spec, got {groups}.")
  return terms


@dataclasses.dataclass
class GroupScorer:
  """Scores `[B][N]` completions with a weighted sum of terms (build with `build_scorer`).

  Attributes:
    task: the `tasks.Task` whose extractor and verifier are used.
    terms: (name, weight) pairs.
    needs_labels: some term compares with references (False: label-free, references unused).
    needs_second_view: a Co-Reward term: the caller also samples a rewritten question per prompt.
  """
  task: Any
  terms: list[tuple[str, float]]
  timeout_s: float = 5.0
  num_workers: int = 2
  dare_alpha: float = 0.5
  dare_tau: float = 0.0

  @property
  def needs_labels(self) -> bool:
    return any(t not in GROUP_TERMS for t, _ in self.terms)

  @property
  def needs_second_view(self) -> bool:
    return any(t == "co_reward" for t, _ in self.terms)

  @property
  def needs_anchor(self) -> bool:
    """A CaT term: the caller also has the frozen anchor write one reference per group."""
    return any(t == "cat" for t, _ in self.terms)

  def answers(self, texts: Sequence[Sequence[str]]) -> list[list[Optional[str]]]:
    """The task's extracted answer of every completion, `[B][N]`."""
    return [[self.task.extract(t) for t in row] for row in texts]

  def __call__(self, texts: Sequence[Sequence[str]], references: Optional[Sequence[Any]] = None, *,
               entropy_BxN: Optional[np.ndarray] = None,
               second_view: Optional[Sequence[Sequence[str]]] = None,
               anchor_texts: Optional[Sequence[str]] = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Rewards `[B, N]` (float32) and info.

    Args:
      texts: B groups of N completions.
      references: B references (only read by verifier terms; None for label-free specs).
      entropy_BxN: mean token entropy of each sample (DARE's uncertainty).
      second_view: B groups of completions of the rewritten questions (Co-Reward).
      anchor_texts: B syntheses, one per group, written by the frozen anchor (CaT).

    Returns:
      (rewards, info) where info has `answers` ([B][N]), per-term means `reward/<term>`,
      `failures` (grader failures, see `rewards.score_batch`), `messages`, `wall_s`, and for
      Co-Reward `second_view_rewards` ([B, N']).
    """
    t0 = time.perf_counter()
    B = len(texts)
    N = len(texts[0]) if B else 0
    total = np.zeros((B, N), np.float32)
    info: dict[str, Any] = {"failures": 0, "messages": []}
    grader_stats = []
    answers = self.answers(texts)
    info["answers"] = answers
    for name, weight in self.terms:
      if name in GROUP_TERMS:
        r = self._group_term(name, answers, entropy_BxN, second_view, info, anchor_texts)
      else:
        if references is None or len(references) != B:
          raise ValueError(f"reward term {name!r} needs one reference per prompt.")
        if name == "task":
          fn = functools.partial(_safe_task_reward if self.task.inline_safe else _task_reward, self.task)
        else:
          fn = name
        flat_texts = [t for row in texts for t in row]
        flat_refs = [ref for ref in references for _ in range(N)]
        r, stats = pool.score_batch(fn, flat_texts, flat_refs, timeout_s=self.timeout_s,
                                    num_workers=self.num_workers)
        r = np.asarray(r, np.float32).reshape(B, N)
        grader_stats.append(stats)
      info[f"reward/{name}"] = float(np.mean(r)) if r.size else 0.0
      total = total + np.float32(weight) * r
    if grader_stats:
      merged = pool.merge_stats(grader_stats)
      info["grader"] = merged
      info["failures"] = int(merged["failures"])
      info["messages"] = list(merged.get("messages", []))
    info["wall_s"] = time.perf_counter() - t0
    return total, info

  def _group_term(self, name, answers, entropy_BxN, second_view, info, anchor_texts=None):
    if name == "cat":
      if anchor_texts is None or len(anchor_texts) != len(answers):
        raise ValueError("cat needs one anchor synthesis per group (anchor_texts).")
      refs = [self.task.extract(t) for t in anchor_texts]
      info["cat_references"] = refs
      info["cat_skipped_groups"] = sum(r is None for r in refs)
      return np.stack([cat_reward(a, ref, same=self.task.same) for a, ref in zip(answers, refs)])
    if name == "ttrl":
      return np.stack([label_free.ttrl_reward(a, same=self.task.same) for a in answers])
    if name == "dare":
      ent = None if entropy_BxN is None else np.asarray(entropy_BxN, np.float64)
      return np.stack([label_free.dare_reward(a, None if ent is None else ent[b], alpha=self.dare_alpha,
                                              tau=self.dare_tau) for b, a in enumerate(answers)])
    if second_view is None:
      raise ValueError("co_reward needs the completions of the rewritten questions (second_view).")
    other = self.answers(second_view)
    pairs = [label_free.co_reward(a, o) for a, o in zip(answers, other)]
    info["second_view_rewards"] = np.stack([p[1] for p in pairs]).astype(np.float32)
    info["second_view_answers"] = other
    return np.stack([p[0] for p in pairs]).astype(np.float32)


def _task_reward(task, text: str, reference: Any) -> float:
  """The task's own verifier (`task` travels to the grader worker pickled, so FILTER imports no task module)."""
  return task.reward(text, reference)


@pool.mark_inline_safe
def _safe_task_reward(task, text: str, reference: Any) -> float:
  """The reward of a task whose grader is pure Python over bounded text (may run in-process)."""
  return _task_reward(task, text, reference)


def build_scorer(spec: str, task, *, timeout_s: float = 5.0, num_workers: int = 2, dare_alpha: float = 0.5,
                 dare_tau: float = 0.0) -> GroupScorer:
  """The FILTER stage of a config: a `GroupScorer` for `spec` on `task`.

  >>> from rollouts_jax import tasks
  >>> s = build_scorer("ttrl", tasks.get("arithmetic"), num_workers=0)
  >>> r, info = s([["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>"]])
  >>> r.tolist(), s.needs_labels
  ([[1.0, 0.0, 1.0]], False)
  """
  return GroupScorer(task=task, terms=parse_reward_spec(spec), timeout_s=timeout_s, num_workers=num_workers,
                     dare_alpha=dare_alpha, dare_tau=dare_tau)


def ttrl(answers_BxN: Sequence[Sequence[Optional[str]]], *, same=None) -> np.ndarray:
  """TTRL over a batch: float32 [B, N], 1 where a sample agrees with its group's majority answer.

  >>> ttrl([["4", "5", "4"], [None, "7", "7"]]).tolist()
  [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
  """
  return label_free.apply_per_prompt(label_free.ttrl_reward, answers_BxN, same=same)


def cat_reward(answers_N: Sequence[Optional[str]], reference: Optional[str], *, same=None) -> np.ndarray:
  """CaT (Compute as Teacher, arXiv 2509.14234): 1 where a sample's answer agrees with the anchor's synthesis.

  The frozen anchor reads the group's rollouts and writes one reference; on verifiable tasks
  the reward is programmatic agreement with the reference's answer (`same`, the task's
  equivalence). A synthesis without a parsable answer gives the whole group 0.

  >>> cat_reward(["4", "5", None, "4"], "4").tolist()
  [1.0, 0.0, 0.0, 1.0]
  >>> cat_reward(["4", "5"], None).tolist()
  [0.0, 0.0]
  """
  same = same or (lambda a, b: a == b)
  return np.asarray([float(reference is not None and a is not None and same(a, reference)) for a in answers_N],
                    np.float32)


def cat_prompt(prompt_text: str, answers: Sequence[Optional[str]], max_candidates: int = 8) -> str:
  """The anchor's synthesis prompt: the group's distinct answers, then the original question.

  The anchor is shown the rollouts' answers (in first-seen order, at most `max_candidates`)
  and asked to write the answer the question needs, which may differ from all of them.

  >>> cat_prompt("What is 2+2? ", ["4", None, "5", "4"]).splitlines()
  ['Candidate answers: 4; 5. Reconcile them and answer.', 'What is 2+2? ']
  """
  seen: list[str] = []
  for a in answers:
    if a is not None and a not in seen and len(seen) < max_candidates:
      seen.append(a)
  listed = "; ".join(seen) if seen else "none"
  return f"Candidate answers: {listed}. Reconcile them and answer.\n{prompt_text}"
