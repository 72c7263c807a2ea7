"""Generate: the pure-functional sampler and its sampling policies."""

from rollouts_jax.sampling.sampler import (DEFAULT_PROMPT_BUCKETS, SampleOutput, SamplingConfig,
                                           bucket_length, left_pad_to, mask_after_eos,
                                           process_logits, sample)
from rollouts_jax.sampling import sol_rl

__all__ = ["DEFAULT_PROMPT_BUCKETS", "SampleOutput", "SamplingConfig", "bucket_length", "left_pad_to",
           "mask_after_eos", "process_logits", "sample", "sol_rl"]
