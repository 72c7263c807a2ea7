"""Label-free rewards over the N samples of one prompt: TTRL, DARE, Co-Reward.

Every function takes the extracted answers of one prompt's samples (strings; None or "" for
a sample without an answer, see :func:`rollouts_jax.rewards.extract_answer`) and compares them
as exact strings, as the papers' code does. To merge mathematically equal answers first
(``1/2`` and ``0.5``), map them through :func:`canonicalize_answers` with
:func:`rollouts_jax.rewards.math_equal`. For a batch use :func:`apply_per_prompt`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

Answers = Sequence[Optional[str]]
SameFn = Callable[[str, str], bool]


def _is_valid(answer) -> bool:
    return answer is not None and str(answer).strip() != ""


def answer_counts(answers: Answers) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Distinct valid answers in first-seen order, their counts, and each sample's answer index.

    Returns:
        ``(labels, counts, inverse)``: K distinct answers, int64[K] counts, int64[N] index into
        ``labels`` (-1 for a sample with no answer).

    >>> answer_counts(["4", None, "5", "4"])
    (['4', '5'], array([2, 1]), array([ 0, -1,  1,  0]))
    """
    index: dict[str, int] = {}
    inverse = np.full(len(answers), -1, np.int64)
    counts: list[int] = []
    for i, a in enumerate(answers):
        if not _is_valid(a):
            continue
        k = index.setdefault(a, len(index))
        if k == len(counts):
            counts.append(0)
        counts[k] += 1
        inverse[i] = k
    return list(index), np.asarray(counts, np.int64), inverse


def majority_vote(answers: Answers) -> tuple[Optional[str], int]:
    """The most frequent valid answer and its count; ties go to the answer seen first.

    Returns ``(None, 0)`` when no sample has an answer (TTRL's ``most_common`` would raise).

    >>> majority_vote(["5", "4", "4", "5", None])
    ('5', 2)
    """
    labels, counts, _ = answer_counts(answers)
    if not labels:
        return None, 0
    k = int(np.argmax(counts))  # argmax takes the first maximum = the first seen answer
    return labels[k], int(counts[k])


def canonicalize_answers(answers: Answers, same: SameFn) -> list[Optional[str]]:
    """Replaces each answer by the first earlier answer that ``same`` judges equal to it.

    Greedy, in sample order: an answer joins the first representative ``r`` with
    ``same(r, answer)``, else becomes a new representative. Calls ``same`` at most
    N x (distinct answers) times; exact duplicates are not re-checked.

    Args:
        answers: one prompt's answers (None for none).
        same: an equivalence test, e.g. :func:`rollouts_jax.rewards.math_equal`.

    >>> from fractions import Fraction
    >>> canonicalize_answers(["0.5", "1/2", "3", None], lambda a, b: Fraction(a) == Fraction(b))
    ['0.5', '0.5', '3', None]
    """
    reps: list[str] = []
    seen: dict[str, str] = {}
    out: list[Optional[str]] = []
    for a in answers:
        if not _is_valid(a):
            out.append(None)
            continue
        if a not in seen:
            seen[a] = next((r for r in reps if r == a or same(r, a)), a)
            if seen[a] == a and a not in reps:
                reps.append(a)
        out.append(seen[a])
    return out


def ttrl_reward(answers: Answers, *, same: Optional[SameFn] = None) -> np.ndarray:
    """TTRL: reward 1 for samples that agree with the majority-vote pseudo-label, else 0.

    ŷ = the most frequent extracted answer (ties: first seen; samples without an answer do
    not vote); r_i = 1[a_i = ŷ], or ``same(ŷ, a_i)`` when given (TTRL verifies against ŷ with
    its math checker while the vote itself counts exact strings). No answer at all gives all
    zeros; identical answers give all ones (and so zero GRPO advantage). TTRL votes with 64
    samples and trains on the first 32: call this on all 64 and slice the result.

    Args:
        answers: N extracted answers of one prompt.
        same: optional equivalence used to compare each answer with ŷ.

    Returns:
        float32[N] rewards in {0, 1}.

    Reference: Zuo et al., 2025, "TTRL: Test-Time Reinforcement Learning" (PRIME-RL/TTRL).

    >>> ttrl_reward(["4", "5", "4", None]).tolist()
    [1.0, 0.0, 1.0, 0.0]
    """
    label, _ = majority_vote(answers)
    rewards = np.zeros(len(answers), np.float32)
    if label is None:
        return rewards
    for i, a in enumerate(answers):
        if _is_valid(a) and (a == label or (same is not None and same(label, a))):
            rewards[i] = 1.0
    return rewards


def dare_reward(answers: Answers, uncertainties: Optional[Sequence[float]] = None, *,
                alpha: float = 0.5, tau: float = 0.1, eps: float = 1e-6,
                uncertainty_scale: Optional[float] = None, prune: bool = True,
                pruned_reward: float = 0.0) -> np.ndarray:
    """DARE: a reward from the whole empirical answer distribution, with an exploration bonus.

    Over the M samples that have an answer (answers y, counts n(y)):

    * uncertainty u(y) = mean of ``uncertainties`` (e.g. each trace's mean token entropy) over
      the samples answering y, normalised to [0, 1] by ``uncertainty_scale`` (clipped) or, if
      None, by the largest u(y) of the group; u = 0 when ``uncertainties`` is None;
    * p̂(y) = [n(y) / (u(y) + eps)] / Σ_y' [n(y') / (u(y') + eps)]  (= n(y)/M when u = 0);
    * bonus b(y) = (1 − n(y)/M) · (1 − u(y));
    * pruning (``prune``): keep answers with p̂(y) ≥ τ (the most likely answer is always kept,
      so τ above max p̂ keeps just the mode, or the tied modes); p̃ = p̂ renormalised over the
      kept answers;
      ñ, M̃ = Σ kept n, ũ (re-normalised over the kept answers when ``uncertainty_scale`` is
      None) and b̃ = (1 − n/M̃)(1 − ũ) are recomputed;
    * reward r_i = p̃(y_i) + α · b̃(y_i); a pruned sample gets ``pruned_reward`` (the paper
      leaves this open, hence the knob) and a sample without an answer gets 0.

    All samples agreeing gives p̃ = 1, b̃ = 0: reward 1 each. The defaults α = 0.5, τ = 0.1
    and the max-normalisation of u are our choices; the paper fixes α ∈ [0, 1] but we could
    not check its values.

    Args:
        answers: N extracted answers of one prompt.
        uncertainties: float[N] per-sample uncertainty (>= 0), or None.
        alpha: weight of the exploration bonus.
        tau: pruning threshold on p̂.
        eps: keeps n/(u + eps) finite at u = 0.
        uncertainty_scale: divide u by this (e.g. log of the vocabulary size) instead of by
            the group maximum.
        prune: apply distribution pruning.
        pruned_reward: reward of samples whose answer was pruned.

    Returns:
        float32[N] rewards.

    Raises:
        ValueError: ``uncertainties`` of the wrong length, negative or non-finite; α < 0; τ < 0.

    Reference: Du, Huang & Li, 2026, "Distribution-Aware Reward Estimation for Test-Time
    Reinforcement Learning" (arXiv 2601.21804).

    >>> dare_reward(["a", "a", "a", "b"], alpha=0.0, tau=0.0).tolist()
    [0.75, 0.75, 0.75, 0.25]
    """
    if alpha < 0 or tau < 0 or eps <= 0:
        raise ValueError(f"need alpha >= 0, tau >= 0, eps > 0; got {alpha}, {tau}, {eps}")
    labels, counts, inverse = answer_counts(answers)
    rewards = np.zeros(len(answers), np.float32)
    if not labels:
        return rewards
    counts_f = counts.astype(np.float64)
    valid = inverse >= 0
    if uncertainties is None:
        u_raw = np.zeros(len(labels))
    else:
        u = np.asarray(uncertainties, np.float64)
        if u.shape != (len(answers),):
            raise ValueError(f"uncertainties must have shape ({len(answers)},), got {u.shape}")
        if not np.all(np.isfinite(u[valid])) or np.any(u[valid] < 0):
            raise ValueError("uncertainties must be finite and >= 0 for samples with an answer")
        u_raw = np.bincount(inverse[valid], weights=u[valid], minlength=len(labels)) / counts_f

    def normalise(u_y: np.ndarray, keep: np.ndarray) -> np.ndarray:
        if uncertainty_scale is not None:
            return np.clip(u_y / float(uncertainty_scale), 0.0, 1.0)
        top = u_y[keep].max()
        # Pruned answers may exceed the kept maximum; their values are unused, so clip.
        return np.minimum(u_y, top) / top if top > 0 else np.zeros_like(u_y)

    keep = np.ones(len(labels), bool)
    u_norm = normalise(u_raw, keep)
    weight = counts_f / (u_norm + eps)
    p_hat = weight / weight.sum()
    if prune:
        keep = p_hat >= min(tau, p_hat.max())
        u_norm = normalise(u_raw, keep)
    p_kept = np.where(keep, p_hat, 0.0)
    p_tilde = p_kept / p_kept.sum()
    m_kept = counts_f[keep].sum()
    bonus = (1.0 - counts_f / m_kept) * (1.0 - u_norm)
    per_answer = np.where(keep, p_tilde + alpha * bonus, pruned_reward)
    rewards[valid] = per_answer[inverse[valid]]
    return rewards


def co_reward(answers: Answers, rephrased_answers: Answers) -> tuple[np.ndarray, np.ndarray]:
    """Co-Reward: each view of a question is rewarded by the other view's majority answer.

    The label for the original question's samples is the majority vote of the rephrased
    question's samples, and vice versa; a sample earns 1 when its answer equals that label
    exactly (and the label exists), else 0. If one view has no answers at all, every sample of
    the other view gets 0. Advantages are then computed per view (group = prompt within each).

    Args:
        answers: N answers of the original question's samples.
        rephrased_answers: N' answers of the rephrased question's samples.

    Returns:
        ``(rewards, rephrased_rewards)``: float32[N] and float32[N'] in {0, 1}.

    Reference: Zhang et al., 2025, "Co-Reward: Self-supervised Reinforcement Learning for Large
    Language Model Reasoning via Contrastive Agreement" (tmlr-group/Co-Reward).

    >>> [r.tolist() for r in co_reward(["4", "5", "4"], ["5", "5", None])]
    [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    """
    label_for_original, _ = majority_vote(rephrased_answers)
    label_for_rephrased, _ = majority_vote(answers)

    def score(values: Answers, label: Optional[str]) -> np.ndarray:
        return np.asarray([float(label is not None and _is_valid(a) and a == label) for a in values],
                          np.float32)

    return score(answers, label_for_original), score(rephrased_answers, label_for_rephrased)


def apply_per_prompt(fn: Callable[..., np.ndarray], answers_per_prompt: Sequence[Answers],
                     *arrays_per_prompt, **kwargs) -> np.ndarray:
    """Applies a per-prompt reward to B prompts and stacks the results to float32[B, N].

    Args:
        fn: e.g. :func:`ttrl_reward` or :func:`dare_reward`.
        answers_per_prompt: B lists of N answers.
        *arrays_per_prompt: per-sample arrays of shape [B, N] passed positionally after the
            answers (e.g. DARE's uncertainties).
        **kwargs: passed to ``fn``.

    >>> apply_per_prompt(ttrl_reward, [["1", "1", "2"], ["3", "4", "4"]]).tolist()
    [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    """
    rows = [fn(answers, *(a[b] for a in arrays_per_prompt), **kwargs)
            for b, answers in enumerate(answers_per_prompt)]
    return np.stack([np.asarray(r, np.float32) for r in rows])
