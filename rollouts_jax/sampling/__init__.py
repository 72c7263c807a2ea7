"""GENERATE: the pure-functional sampler, the rollout batch type and the FP4 explorer's pieces.

Modules: `config` (SamplingConfig, SampleOutput, logit processing, prompt checks), `engine`
(the decode step and its state, shared by every sampler here), `generate` (`sample`),
`resume` (`continue_from`), `tree`, `deeplook`, `speculative`, `sol_rl`, `multiturn`.

>>> from rollouts_jax import sampling
>>> b = sampling.RolloutBatch.empty(2, 4, 8, 16)
>>> b.shape
(2, 4, 16)
"""

from rollouts_jax.sampling.batch import RolloutBatch, concat, from_samples
from rollouts_jax.sampling.config import (DEFAULT_PROMPT_BUCKETS, SampleOutput, SamplingConfig, bucket_length,
                                          finished_rows, left_pad_to, mask_after_eos, process_logits)
from rollouts_jax.sampling.generate import sample
from rollouts_jax.sampling.resume import continue_from
from rollouts_jax.sampling import deeplook, sol_rl, speculative, tree
from rollouts_jax.sampling.tree import TreeConfig, TreeInfo, tree_sample
from rollouts_jax.sampling.speculative import Drafts, self_speculative_sample, speculative_sample

__all__ = ["DEFAULT_PROMPT_BUCKETS", "Drafts", "RolloutBatch", "SampleOutput", "SamplingConfig", "bucket_length",
           "concat", "continue_from", "finished_rows", "from_samples", "left_pad_to", "mask_after_eos",
           "process_logits", "sample", "self_speculative_sample", "sol_rl", "speculative", "speculative_sample",
           "TreeConfig", "TreeInfo", "deeplook", "tree", "tree_sample"]
