"""DeepLook: equivalence with the sampler, copied-cache correctness, token accounting, confidence selection, vote."""

import jax
import numpy as np

from rollouts_jax import sampling
from rollouts_jax.sampling import deeplook as dl
from tests.sampling import test_tree as tt


def test_k1_equals_sample():
  ids, mask = tt._prompts()
  ref = sampling.sample(tt.CFG, tt.PARAMS, ids, mask, jax.random.key(3), tt.CONF)
  out, info = dl.deeplook_sample(tt.CFG, tt.PARAMS, ids, mask, jax.random.key(3), tt.CONF, dl.DeepLookConfig(k=1))
  for f in ("completion_ids", "completion_mask", "logprobs", "policy_logprobs", "entropy", "lengths"):
    np.testing.assert_array_equal(np.asarray(getattr(out, f)), np.asarray(getattr(ref, f)), err_msg=f)
  np.testing.assert_array_equal(info.generated_tokens, np.asarray(ref.lengths).sum(1))
  assert not np.asarray(info.lookaheads).any()


def test_lookahead_picks_confident_continuations():
  """Always expanding (margin -inf) and keeping the most confident of 8 continuations raises the samples'
  confidence over plain sampling; kept samples are still exact model continuations; losers' tokens count."""
  ids, mask = tt._prompts()
  look = dl.DeepLookConfig(k=8, horizon=3, margin=-1e9, min_depth=1, gap=1, max_lookaheads=8)
  conf_look, conf_plain = [], []
  for seed in range(2):
    key = jax.random.key(20 + seed)
    out, info = jax.device_get(dl.deeplook_sample(tt.CFG, tt.PARAMS, ids, mask, key, tt.CONF, look))
    plain_out, plain = jax.device_get(dl.deeplook_sample(tt.CFG, tt.PARAMS, ids, mask, key, tt.CONF, look.replace(k=1)))
    live = out.lengths > 3
    conf_look.append(info.confidence[live])
    conf_plain.append(plain.confidence[plain_out.lengths > 3])
    assert info.lookaheads.max() >= 2
    assert np.all(info.generated_tokens >= out.lengths.sum(1))
    assert np.any(info.generated_tokens > out.lengths.sum(1))
    if seed == 0:
      tt._check_against_forward(ids, mask, out)
  conf_look, conf_plain = np.concatenate(conf_look), np.concatenate(conf_plain)
  z = tt._rank_sum_z(conf_look, conf_plain)
  assert z > 2.0, (z, conf_look.mean(), conf_plain.mean())  # one-sided p < 0.025


def test_select_rows_takes_the_most_confident_continuation():
  # two families of 3 rows; lookaheads started at positions 2 and 1; scored over [start, t=4)
  conf = np.array([[9, 9, 1, 1, 9], [0, 0, 2, 2, 0], [5, 5, 3, 0, 0],
                   [0, 1, 1, 1, 0], [9, 3, 3, 3, 9], [0, 2, 2, 2, 0]], np.float32)
  mask = np.ones(conf.shape, bool)
  mask[2, 3] = False  # row 2 ended at position 3: its score is over its own tokens (3)
  best = dl._select_rows(np.array([2, 1]), conf, mask, 4, 3)
  assert best.tolist() == [2, 1]


def test_weighted_vote_merges_equal_answers():
  same = lambda a, b: float(a) == float(b)
  assert dl.weighted_vote(["1.0", "2", "1", "2"], [1, 1.5, 1, 0.2], same=same) == "1.0"
  assert dl.weighted_vote(["1.0", "2", "1", "2"], [1, 1.5, 1, 0.2]) == "2"
  assert dl.weighted_vote([None, None], [1, 1]) is None
