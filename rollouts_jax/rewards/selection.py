"""Test-time selection among the N samples of one prompt.

Majority vote (self-consistency), best-of-N, best-of-majority (BoM) and soft self-consistency.
Each returns a :class:`Selection`: the chosen sample indices (best first), their answers and
the per-sample scores it ranked by. Answers are compared as exact strings (extract and
normalise them with :func:`rollouts_jax.rewards.extract_answer`); None or "" means no answer,
and such a sample is never chosen.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from rollouts_jax.rewards.label_free import answer_counts

Answers = Sequence[Optional[str]]
SEQUENCE_AGGREGATES = ("mean", "min", "product")


class Selection(NamedTuple):
    """What a selection rule chose.

    Attributes:
        indices: int64[k] chosen sample indices, best first (empty when no sample qualifies).
        answers: the answers of those samples.
        scores: float32[N] per-sample score the rule ranked by (NaN where a sample cannot be
            chosen).
    """

    indices: np.ndarray
    answers: list
    scores: np.ndarray

    @property
    def index(self) -> int:
        """The chosen sample, or -1."""
        return int(self.indices[0]) if len(self.indices) else -1

    @property
    def answer(self) -> Optional[str]:
        """The chosen answer, or None."""
        return self.answers[0] if self.answers else None


def _selection(indices: Sequence[int], answers, scores: np.ndarray) -> Selection:
    idx = np.asarray(list(indices), np.int64)
    picked = [answers[i] for i in idx] if answers is not None else [None] * len(idx)
    return Selection(idx, picked, np.asarray(scores, np.float32))


def majority_vote_select(answers: Answers) -> Selection:
    """Self-consistency: the most frequent answer; ties go to the answer seen first.

    ``scores`` holds each sample's vote share n(a_i)/N. The chosen index is the first sample
    giving the winning answer.

    Reference: Wang et al., 2023, "Self-Consistency Improves Chain of Thought Reasoning in
    Language Models".

    >>> s = majority_vote_select(["3", "4", "4", None]); s.index, s.answer, s.scores.tolist()
    (1, '4', [0.25, 0.5, 0.5, nan])
    """
    labels, counts, inverse = answer_counts(answers)
    scores = np.full(len(answers), np.nan)
    if not labels:
        return _selection([], answers, scores)
    valid = inverse >= 0
    scores[valid] = counts[inverse[valid]] / len(answers)
    winner = int(np.argmax(counts))
    return _selection([int(np.flatnonzero(inverse == winner)[0])], answers, scores)


def best_of_n(scores: Sequence[float], answers: Optional[Answers] = None) -> Selection:
    """Best-of-N: the sample with the highest score (a reward model's, a verifier's...).

    NaN scores and, when ``answers`` is given, samples without an answer are skipped; ties
    go to the lower index.

    >>> best_of_n([0.2, 0.9, 0.9, 0.1]).index
    1
    """
    s = np.asarray(scores, np.float64)
    if s.ndim != 1 or (answers is not None and len(answers) != len(s)):
        raise ValueError("scores must be float[N], and answers (if given) of length N")
    usable = ~np.isnan(s)
    if answers is not None:
        usable &= answer_counts(answers)[2] >= 0
    out = np.where(usable, s, np.nan)
    if not usable.any():
        return _selection([], answers, out)
    return _selection([int(np.argmax(np.where(usable, s, -np.inf)))], answers, out)


def best_of_majority(answers: Answers, scores: Sequence[float], *, alpha: float = 0.1, k: int = 1,
                     agg: str = "mean") -> Selection:
    """Best-of-Majority (BoM): among frequent answers, the ones a reward model scores best.

    π̂(y) = n(y)/N over all N samples; candidates S = {y : π̂(y) ≥ α} (if none reaches α, the
    most frequent answer); each candidate's score r̂(y) = ``agg`` (mean or max) of its samples'
    reward-model scores; the top ``k`` candidates by r̂ (ties: higher π̂, then first seen) are
    returned, each as its best-scoring sample. |S| < k returns all of S.

    Args:
        answers: N extracted answers.
        scores: float[N] reward-model scores.
        alpha: the frequency threshold (the paper ties it to the coverage coefficient;
            0.1 is our default).
        k: answers to submit (pass@k).
        agg: ``"mean"`` or ``"max"`` of the scores of an answer's samples.

    Returns:
        A :class:`Selection` with up to ``k`` indices; ``scores`` holds r̂(a_i) per sample
        (NaN without an answer).

    Reference: Di et al., 2025, "Best-of-Majority: Minimax-Optimal Strategy for Pass@k
    Inference Scaling" (arXiv 2510.03199).

    >>> best_of_majority(["a", "a", "b", "b", "c"], [0.1, 0.3, 0.6, 0.6, 0.99], alpha=0.3).answer
    'b'
    """
    if agg not in ("mean", "max"):
        raise ValueError(f"agg must be 'mean' or 'max', got {agg!r}")
    if k < 1 or not 0 <= alpha <= 1:
        raise ValueError(f"need k >= 1 and 0 <= alpha <= 1, got k={k}, alpha={alpha}")
    s = np.asarray(scores, np.float64)
    if s.shape != (len(answers),) or not np.all(np.isfinite(s)):
        raise ValueError(f"scores must be finite float[{len(answers)}], got shape {s.shape}")
    labels, counts, inverse = answer_counts(answers)
    per_sample = np.full(len(answers), np.nan)
    if not labels:
        return _selection([], answers, per_sample)
    valid = inverse >= 0
    if agg == "mean":
        r_hat = np.bincount(inverse[valid], weights=s[valid], minlength=len(labels)) / counts
    else:
        r_hat = np.full(len(labels), -np.inf)
        np.maximum.at(r_hat, inverse[valid], s[valid])
    per_sample[valid] = r_hat[inverse[valid]]
    freq = counts / len(answers)
    candidates = np.flatnonzero(freq >= alpha)
    if candidates.size == 0:
        candidates = np.asarray([int(np.argmax(counts))])
    order = sorted(candidates.tolist(), key=lambda y: (-r_hat[y], -counts[y], y))[:k]
    picks = []
    for y in order:
        members = np.flatnonzero(inverse == y)
        picks.append(int(members[np.argmax(s[members])]))
    return _selection(picks, answers, per_sample)


def sequence_scores(token_logprobs, mask=None, *, agg: str = "mean") -> np.ndarray:
    """Per-sample likelihood score from token log-probabilities (Soft-SC's aggregate).

    ``"mean"``: mean token probability; ``"min"``: smallest token probability;
    ``"product"``: sequence probability exp(Σ log p). Restrict ``mask`` to the answer span
    to score only the answer, as Soft-SC does.

    Args:
        token_logprobs: float[N, T] log p(t | context) of the sampled tokens.
        mask: bool[N, T] tokens to include (default all).
        agg: one of :data:`SEQUENCE_AGGREGATES`.

    Returns:
        float32[N]; NaN for a sample with no included token.

    >>> sequence_scores(np.log([[0.5, 1.0], [0.9, 0.1]]), agg="min").tolist()
    [0.5, 0.10000000149011612]
    """
    if agg not in SEQUENCE_AGGREGATES:
        raise ValueError(f"agg must be one of {SEQUENCE_AGGREGATES}, got {agg!r}")
    lp = np.asarray(token_logprobs, np.float64)
    if lp.ndim != 2:
        raise ValueError(f"token_logprobs must be float[N, T], got shape {lp.shape}")
    m = np.ones(lp.shape, bool) if mask is None else np.asarray(mask, bool)
    if m.shape != lp.shape:
        raise ValueError(f"mask shape {m.shape} differs from token_logprobs shape {lp.shape}")
    n_tok = m.sum(axis=1)
    lp = np.where(m, lp, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        if agg == "mean":
            out = np.where(m, np.exp(lp), 0.0).sum(axis=1) / n_tok
        elif agg == "min":
            out = np.where(m, np.exp(lp), np.inf).min(axis=1)
        else:
            out = np.exp(lp.sum(axis=1))
    return np.where(n_tok > 0, out, np.nan).astype(np.float32)


def soft_self_consistency(answers: Optional[Answers], token_logprobs, mask=None, *,
                          agg: str = "mean", combine: str = "max") -> Selection:
    """Soft self-consistency: pick the answer with the highest likelihood-based score.

    Each sample gets s_i = :func:`sequence_scores` (mean, min or product of its token
    probabilities). An answer's score combines its samples' s_i: ``"max"`` (the paper's rule,
    argmax over sampled answers; identical actions have identical likelihoods in its agent
    setting), ``"sum"`` (likelihood-weighted votes, which also rewards frequency) or
    ``"mean"``. The best-scoring sample of the winning answer is returned; ties go to the
    answer seen first. With ``answers=None`` every sample is its own answer.

    Args:
        answers: N extracted answers, or None.
        token_logprobs: float[N, T] log-probabilities of the sampled tokens.
        mask: bool[N, T] tokens that count (e.g. the answer span), default all.
        agg: per-sample aggregate, one of :data:`SEQUENCE_AGGREGATES`.
        combine: ``"max"``, ``"sum"`` or ``"mean"`` over an answer's samples.

    Returns:
        A :class:`Selection`; ``scores`` holds s_i (NaN where not choosable).

    Reference: Wang, Prasad, Stengel-Eskin & Bansal, 2024, "Soft Self-Consistency Improves
    Language Model Agents" (ACL 2024).

    >>> lp = np.log([[0.9, 0.9], [0.5, 0.5], [0.5, 0.6]])
    >>> soft_self_consistency(["a", "b", "b"], lp).answer, soft_self_consistency(["a", "b", "b"], lp, combine="sum").answer
    ('a', 'b')
    """
    if combine not in ("max", "sum", "mean"):
        raise ValueError(f"combine must be 'max', 'sum' or 'mean', got {combine!r}")
    s = sequence_scores(token_logprobs, mask, agg=agg).astype(np.float64)
    if answers is None:
        answers = [str(i) for i in range(len(s))]
    if len(answers) != len(s):
        raise ValueError(f"{len(answers)} answers for {len(s)} rows of token_logprobs")
    labels, counts, inverse = answer_counts(answers)
    usable = (inverse >= 0) & np.isfinite(s)
    out = np.where(usable, s, np.nan)
    if not usable.any():
        return _selection([], answers, out)
    totals = np.zeros(len(labels))
    best = np.full(len(labels), -np.inf)
    n_usable = np.zeros(len(labels))
    for i in np.flatnonzero(usable):
        y = inverse[i]
        totals[y] += s[i]
        best[y] = max(best[y], s[i])
        n_usable[y] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        answer_score = {"max": best, "sum": totals, "mean": totals / n_usable}[combine]
    answer_score = np.where(n_usable > 0, answer_score, -np.inf)
    winner = int(np.argmax(answer_score))
    members = np.flatnonzero((inverse == winner) & usable)
    return _selection([int(members[np.argmax(s[members])])], answers, out)
