"""Filter: verifiers, label-free rewards and test-time selection.

Verifiers score one completion against a reference and return 0.0 or 1.0, never raising on
model output (a malformed answer or a grader error scores 0 and is counted, see
:func:`failure_counts`)::

    r = rewards.math_reward(completion_text, reference_answer)      # math-verify
    r = rewards.gsm8k_reward(completion_text, gsm8k_answer_field)    # final number vs "#### N"
    r = rewards.arithmetic_reward(completion_text, "936")            # <answer>936</answer>, exact
    r = rewards.countdown_reward(completion_text, (numbers, target)) # safe parser, exact arithmetic
    r = rewards.format_reward(completion_text)                       # <think>..</think><answer>..</answer>

The RL loop scores a flat batch in worker processes with hard per-call deadlines::

    values, stats = rewards.score_batch("math", completions, references, timeout_s=10)

Label-free rewards (TTRL, DARE, Co-Reward) and selection rules (majority vote, best-of-N,
best-of-majority, soft self-consistency) work on one prompt's extracted answers::

    answers = rewards.extract_answers(completions_of_one_prompt, "boxed")
    r = rewards.ttrl_reward(answers)
"""
from rollouts_jax.rewards.arithmetic import arithmetic_reward
from rollouts_jax.graders.common import (
    GraderTimeout,
    failure_counts,
    record_failure,
    reset_failure_counts,
    time_limit,
)
from rollouts_jax.rewards.countdown import (
    countdown_reward,
    evaluate_expression,
    extract_countdown_answer,
    parse_countdown_reference,
    parse_expression,
)
from rollouts_jax.rewards.extract import (
    ANSWER_KINDS,
    extract_answer,
    extract_answers,
    find_answer_tag,
    find_boxed,
    find_hash_answer,
    find_last_number,
    normalize_answer,
    parse_number,
)
from rollouts_jax.rewards.format import FORMAT_STYLES, format_reward
from rollouts_jax.rewards.group import (GROUP_TERMS, GroupScorer, build_scorer, cat_prompt, cat_reward,
                                       parse_reward_spec, ttrl)
from rollouts_jax.rewards.gsm8k import gsm8k_answer, gsm8k_reference_number, gsm8k_reward
from rollouts_jax.rewards.label_free import (
    answer_counts,
    apply_per_prompt,
    canonicalize_answers,
    co_reward,
    dare_reward,
    majority_vote,
    ttrl_reward,
)
from rollouts_jax.rewards.math_verifier import math_equal, math_reward
from rollouts_jax.graders.pool import (
    GraderFailureError,
    check_grader_health,
    is_inline_safe,
    mark_inline_safe,
    merge_stats,
    summarize_stats,
    STATUS_NAMES,
    GraderPool,
    default_num_workers,
    score_batch,
    shutdown_default_pools,
)
from rollouts_jax.rewards.registry import get_reward_fn, register_reward_fn, reward_fn_names
from rollouts_jax.rewards.selection import (
    Selection,
    best_of_majority,
    best_of_n,
    majority_vote_select,
    sequence_scores,
    soft_self_consistency,
)

__all__ = [
    "ANSWER_KINDS", "FORMAT_STYLES", "STATUS_NAMES", "GraderPool", "GraderTimeout", "Selection",
    "answer_counts", "apply_per_prompt", "arithmetic_reward", "best_of_majority", "best_of_n", "canonicalize_answers",
    "co_reward", "countdown_reward", "dare_reward", "default_num_workers", "evaluate_expression",
    "extract_answer", "extract_answers", "extract_countdown_answer", "failure_counts",
    "find_answer_tag", "find_boxed", "find_hash_answer", "find_last_number", "format_reward",
    "get_reward_fn", "gsm8k_answer", "gsm8k_reference_number", "gsm8k_reward",
    "majority_vote", "majority_vote_select", "math_equal", "math_reward", "normalize_answer",
    "parse_countdown_reference", "parse_expression", "parse_number", "record_failure",
    "register_reward_fn", "reset_failure_counts", "reward_fn_names", "score_batch",
    "sequence_scores", "shutdown_default_pools", "soft_self_consistency", "time_limit",
    "ttrl_reward", "GraderFailureError", "check_grader_health", "is_inline_safe", "mark_inline_safe",
    "merge_stats", "summarize_stats", "GROUP_TERMS", "cat_prompt", "cat_reward", "GroupScorer", "build_scorer", "parse_reward_spec", "ttrl",
]
