"""Transform cases shared by the advantage property and jit tests."""
import jax.numpy as jnp
import numpy as np

from rollouts_jax import advantages as adv

# name -> (factory, all-equal groups must give zero, pivot transform)
CASES = {
    "group_mean_baseline": (adv.group_mean_baseline, True, False),
    "leave_one_out_baseline": (adv.leave_one_out_baseline, True, False),
    "median_none": (adv.group_median_baseline, True, True),
    "median_mad_compensate": (lambda: adv.group_median_baseline(scale="mad", compensate=True),
                              True, True),
    "median_std_then_group_std": (lambda: adv.chain(adv.group_median_baseline(scale="std"),
                                                    adv.scale_by_group_std()), True, True),
    "grpo": (adv.grpo, True, False),
    "dr_grpo": (adv.dr_grpo, True, False),
    "rloo": (adv.rloo, True, False),
    "mc_grpo": (adv.mc_grpo, True, True),
    "uniqueness_grpo": (adv.uniqueness_grpo, True, False),
    "grpo_novelty_clip": (lambda: adv.chain(adv.grpo(), adv.novelty_sharpen(), adv.clip(2.5)),
                          True, False),
    "mean_batch_std": (lambda: adv.chain(adv.group_mean_baseline(), adv.scale_by_batch_std()),
                       True, False),
    "reference_anchor": (adv.reference_anchor, False, False),
}


def make_extras(rng: np.random.Generator, b: int, n: int) -> dict:
  """Extra inputs every case accepts (unused ones are ignored)."""
  return dict(
      cluster_ids=jnp.asarray(rng.integers(0, 3, (b, n)), jnp.int32),
      seq_logprobs=jnp.asarray(-rng.random((b, n)) * 2, jnp.float32),
      ref_rewards=jnp.asarray(rng.integers(0, 2, (b, 4)), jnp.float32),
  )
