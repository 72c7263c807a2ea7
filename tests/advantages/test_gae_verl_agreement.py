"""GAE (`rl.advantage="gae"`) and PPO's clipped value loss: verl's values, edge cases, properties.

verl is not a test dependency (its package imports ray, pandas and tensordict at the top), so
its outputs are written here as numbers: VERL_GAE is what verl 0.9.1's
`core_algos.compute_gae_advantage_return` returned (torch float32, the mask as float) on each
case below, at every position; VERL_VALUE what its `compute_value_loss` (loss_agg_mode
"token-mean") returned, with d loss / d vpreds. The functions were run from the verl 0.9.1
wheel's own source. `test_matches_verl_when_installed` recomputes them where verl imports.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax import advantages as adv
from rollouts_jax import losses

# name -> (token rewards [R, T], values [R, T], mask [R, T])
CASES = {
    "holes": (
        [[-0.04, -1.258, 2.574, 0.482, 0.644, -0.208],
         [0.058, 0.337, 0.195, -0.609, 0.615, 0.49],
         [-0.118, -0.719, -0.879, -1.008, 0.277, -0.351],
         [0.871, -0.888, 0.726, 0.027, -0.569, 1.045]],
        [[0.151, 0.79, 1.091, 0.494, -0.487, 0.186],
         [1.004, -0.623, 0.546, -0.196, -0.482, -0.562],
         [-1.081, -0.265, 0.379, -1.977, -0.4, 0.207],
         [-0.398, 0.737, -0.811, 0.7, 0.791, 0.374]],
        [[1, 1, 1, 1, 0, 0],
         [1, 1, 0, 0, 1, 1],
         [1, 1, 1, 1, 1, 1],
         [1, 0, 1, 0, 1, 0]]),
    "all_masked_row": (
        [[-0.751, 1.736, -0.265, 0.488, -0.988],
         [-0.722, 0.363, -1.401, 0.418, 1.709],
         [-1.43, -0.313, 0.813, -0.377, 0.786]],
        [[0.139, -1.698, -2.6, -0.289, 0.868],
         [-0.881, 1.18, -1.625, 0.6, -0.233],
         [-0.16, -0.398, -0.703, -0.134, -1.146]],
        [[1, 1, 1, 0, 0],
         [0, 0, 0, 0, 0],
         [1, 1, 1, 1, 1]]),
    "one_token": (
        [[0.87],
         [-1.208],
         [0.552],
         [-1.096]],
        [[-1.36],
         [0.587],
         [0.32],
         [0.038]],
        [[1],
         [1],
         [0],
         [1]]),
    "outcome_middle_masked": (
        [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
         [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0],
         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]],
        [[1.737, -0.779, 0.912, 0.311, 1.698, -1.084, -0.376],
         [-0.536, -0.891, -1.519, -0.253, -0.303, -0.936, -0.259],
         [-1.734, 1.385, 0.478, 0.175, 0.688, -0.369, -0.676]],
        [[1, 1, 0, 0, 1, 1, 0],
         [1, 0, 1, 0, 0, 0, 0],
         [0, 1, 1, 0, 1, 1, 1]]),
}

# verl 0.9.1's compute_gae_advantage_return(rewards, values, mask, gamma, lam) on each case:
# "case/gamma/lam" -> (advantages, returns), every position.
VERL_GAE = {
    "holes/1.0/0.95": (
        [[0.833163857, 0.444472045, 1.18555713, -0.203239679, -0.194812521, -0.194812521],
         [-0.00527431956, 1.16454542, 0.882741034, 0.882741034, 0.882741034, 0.543969035],
         [-1.25996208, -1.83200169, -1.86272764, 0.440880179, 0.0537186377, -0.586675763],
         [0.81799227, 0.532732785, 0.532732785, -1.14989126, -1.14989126, -0.194812521]],
        [[1.61480379, 1.70031977, 3.05659986, 0.481999993, -0.486999989, 0.186000004],
         [1.27389598, 1.31268001, 2.08039999, 1.33840001, 1.05239999, 0.490000069],
         [-2.59773731, -2.59630251, -1.99605513, -1.07179499, -0.0460999906, -0.351000011],
         [1.04419994, 1.773, 0.225000024, -0.660000026, -0.569000006, 0.374000013]]),
    "holes/0.99/0.9": (
        [[0.745028734, 0.37702021, 1.23626065, -0.198620081, -0.189894617, -0.189894617],
         [-0.160271198, 1.11869025, 0.884757936, 0.884757936, 0.884757936, 0.575038612],
         [-1.11643994, -1.80157137, -1.93443656, 0.476014555, 0.0898673087, -0.595629156],
         [0.867074251, 0.615997314, 0.615997314, -1.17878163, -1.17878163, -0.189894617]],
        [[1.43678474, 1.56966865, 3.05236769, 0.481999993, -0.486999989, 0.186000004],
         [1.04474056, 1.1766752, 2.02395201, 1.28195202, 0.99595201, 0.490000069],
         [-2.35526252, -2.48151255, -2.02023983, -1.06118608, -0.0152480304, -0.351000011],
         [1.05563188, 1.84532988, 0.297329903, -0.660000026, -0.569000006, 0.374000013]]),
    "holes/1.0/1.0": (
        [[0.895351887, 0.486977428, 1.13942218, -0.20841819, -0.200237066, -0.200237066],
         [0.137916178, 1.20759833, 0.881716907, 0.881716907, 0.881716907, 0.516974986],
         [-1.37081993, -1.84668863, -1.79555655, 0.409938604, 0.0220168792, -0.580659449],
         [0.771953404, 0.459707141, 0.459707141, -1.12743127, -1.12743127, -0.200237066]],
        [[1.7579999, 1.79799986, 3.05599976, 0.481999993, -0.486999989, 0.186000004],
         [1.5, 1.44200003, 2.13300014, 1.39100015, 1.10500014, 0.490000069],
         [-2.79799986, -2.67999983, -1.96099997, -1.08200002, -0.0739999712, -0.351000011],
         [1.02800012, 1.70500004, 0.157000065, -0.660000026, -0.569000006, 0.374000013]]),
    "all_masked_row/1.0/0.95": (
        [[-0.81226027, 1.4526366, 0.859886885, -1.06980383, -1.06980383],
         [-1.06980383, -1.06980383, -1.06980383, -1.06980383, -1.06980383],
         [-1.58640969, -0.162579849, 0.422776788, -0.700889945, 0.526839614]],
        [[0.450637639, 1.35424995, -0.264999866, -0.289000005, 0.867999971],
         [-0.880999982, 1.17999995, -1.625, 0.600000024, -0.232999995],
         [-0.785112858, 0.699775934, 1.10308003, 0.312400043, 0.786000013]]),
    "all_masked_row/0.99/0.9": (
        [[-0.870250344, 1.38504231, 0.912785649, -0.908431232, -0.908431232],
         [-0.908431232, -0.908431232, -0.908431232, -0.908431232, -0.908431232],
         [-1.58462119, -0.210691258, 0.409497917, -0.640223444, 0.598459959]],
        [[0.187952101, 1.24248505, -0.264999866, -0.289000005, 0.867999971],
         [-0.880999982, 1.17999995, -1.625, 0.600000024, -0.232999995],
         [-1.02694976, 0.496579289, 0.98672992, 0.209871829, 0.786000013]]),
    "all_masked_row/1.0/1.0": (
        [[-0.744841814, 1.52866662, 0.796013474, -1.25523949, -1.25523949],
         [-1.25523949, -1.25523949, -1.25523949, -1.25523949, -1.25523949],
         [-1.57237101, -0.107064903, 0.435836315, -0.778224289, 0.441985667]],
        [[0.720000327, 1.47100019, -0.264999866, -0.289000005, 0.867999971],
         [-0.880999982, 1.17999995, -1.625, 0.600000024, -0.232999995],
         [-0.520999908, 0.909000039, 1.22200012, 0.409000099, 0.786000013]]),
    "one_token/1.0/0.95": (
        [[1.14108431],
         [-0.723659635],
         [0.107946649],
         [-0.417424649]],
        [[0.870000005],
         [-1.20799994],
         [0.319999993],
         [-1.09599996]]),
    "one_token/0.99/0.9": (
        [[1.14108431],
         [-0.723659635],
         [0.107946649],
         [-0.417424649]],
        [[0.870000005],
         [-1.20799994],
         [0.319999993],
         [-1.09599996]]),
    "one_token/1.0/1.0": (
        [[1.14108431],
         [-0.723659635],
         [0.107946649],
         [-0.417424649]],
        [[0.870000005],
         [-1.20799994],
         [0.319999993],
         [-1.09599996]]),
    "outcome_middle_masked/1.0/0.95": (
        [[-0.517694175, 1.18496239, -0.462306201, -0.462306201, -0.462306201, 1.42650545, 0.0626763254],
         [0.674599767, 1.38396752, 1.38396752, 0.0626763254, 0.0626763254, 0.0626763254, 0.0626763254],
         [-1.36957753, -1.36957753, -0.820152283, -1.01128018, -1.01128018, -0.339666307, -0.149358526]],
        [[0.850164413, 0.935910046, 0.109800041, -0.49119997, 0.895799994, 1.00000012, -0.375999987],
         [0.399049997, 1.12800002, 0.5, -0.252999991, -0.303000003, -0.93599999, -0.259000003],
         [-3.9225564, -0.803556442, -0.871006906, -1.46606004, -0.953059971, -0.983799934, -1]]),
    "outcome_middle_masked/0.99/0.9": (
        [[-0.638565481, 1.17494833, -0.55227828, -0.55227828, -0.55227828, 1.47093165, 0.0646858141],
         [0.625509977, 1.42707086, 1.42707086, 0.0646858141, 0.0646858141, 0.0646858141, 0.0646858141],
         [-1.27379644, -1.27379644, -0.74701947, -1.00014818, -1.00014818, -0.332709551, -0.153943583]],
        [[0.694809794, 0.866364539, -0.00231605768, -0.603316069, 0.783683896, 1.00000012, -0.375999987],
         [0.295118928, 1.12800002, 0.5, -0.252999991, -0.303000003, -0.93599999, -0.259000003],
         [-3.71757698, -0.598577023, -0.72491473, -1.40304136, -0.890041292, -0.957924008, -1]]),
    "outcome_middle_masked/1.0/1.0": (
        [[-0.408792257, 1.1882906, -0.384036183, -0.384036183, -0.384036183, 1.38189554, 0.0590336658],
         [0.716656029, 1.34063542, 1.34063542, 0.0590336658, 0.0590336658, 0.0590336658, 0.0590336658],
         [-1.45489419, -1.45489419, -0.879157245, -1.01245904, -1.01245904, -0.3415066, -0.146632001]],
        [[1, 1, 0.214000046, -0.386999965, 1, 1.00000012, -0.375999987],
         [0.5, 1.12800002, 0.5, -0.252999991, -0.303000003, -0.93599999, -0.259000003],
         [-4.11899996, -1, -1, -1.51300013, -1, -1, -1]]),
}

V_PRED = [[-0.577, -0.776, -0.473, 1.028, -0.509],
          [1.358, 0.394, 1.87, -0.539, -0.731],
          [-0.642, -2.181, 0.727, 0.437, 0.107]]
V_RET = [[0.082, 0.924, -0.901, 0.338, 0.353],
          [0.775, 1.462, 0.469, -0.772, 0.535],
          [-0.255, 0.078, -1.009, -0.276, -0.046]]
V_OLD = [[-0.283, 0.509, 1.833, -0.024, -0.873],
          [-0.278, 1.136, 0.1, 1.014, 0.218],
          [1.006, -0.391, 1.324, 0.26, 0.624]]
V_MASK = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
# verl 0.9.1's compute_value_loss(V_PRED, V_RET, V_OLD, V_MASK, cliprange_value) (token-mean):
# cliprange_value -> (vf_loss, vf_clipfrac, d vf_loss / d vpreds).
VERL_VALUE = {
    0.5: (1.09028387, 0.272727281,
          [[-0.0599090979, -0.154545456, 0, 0, -0],
           [0.0530000068, -0.0970909223, 0.127363637, 0, -0.115090914],
           [0, -0.205363646, 0, 0.0648181811, 0]]),
    0.2: (1.2661711, 0.363636374,
          [[-0.0599090979, -0.154545456, 0, 0, 0],
           [0, -0.0970909223, 0.127363637, 0, -0.115090914],
           [0, -0.205363646, 0, 0.0648181811, 0]]),
}


def _gae(name, gamma, lam):
  rew, val, mask = (np.asarray(x, np.float32) for x in CASES[name])
  return adv.gae_advantages(jnp.asarray(rew), jnp.asarray(val), jnp.asarray(mask, bool), gamma=gamma, lam=lam)


@pytest.mark.parametrize("key", sorted(VERL_GAE))
def test_gae_matches_verl(key):
  name, gamma, lam = key.split("/")
  a, r = _gae(name, float(gamma), float(lam))
  verl_a, verl_r = VERL_GAE[key]
  np.testing.assert_allclose(np.asarray(r), verl_r, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(a), verl_a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clip", sorted(VERL_VALUE))
def test_value_loss_matches_verl(clip):
  args = [jnp.asarray(np.asarray(x, np.float32)) for x in (V_RET, V_OLD)] + [jnp.asarray(np.asarray(V_MASK, bool))]
  fn = lambda v: losses.value_loss(v, *args, cliprange_value=clip)
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(np.asarray(V_PRED, np.float32)))
  verl_loss, verl_frac, verl_grad = VERL_VALUE[clip]
  assert float(loss) == pytest.approx(verl_loss, rel=1e-6)
  assert float(m["vf_clipfrac"]) == pytest.approx(verl_frac, rel=1e-6)
  np.testing.assert_allclose(np.asarray(grad), verl_grad, rtol=1e-5, atol=1e-7)


def _compressed_gae(rew, val, mask, gamma, lam):
  """GAE by its definition on each row's valid tokens only (masked tokens removed), by hand."""
  out = np.zeros_like(rew)
  for i in range(rew.shape[0]):
    idx = np.flatnonzero(mask[i])
    r, v = rew[i, idx].astype(np.float64), val[i, idx].astype(np.float64)
    v_next = np.append(v[1:], 0.0)
    delta = r + gamma * v_next - v
    for j, t in enumerate(idx):
      out[i, t] = sum((gamma * lam) ** l * delta[j + l] for l in range(len(idx) - j))
  return out


@pytest.mark.parametrize("name,gamma,lam", list(itertools.product(sorted(CASES), (1.0, 0.9), (1.0, 0.95, 0.0))))
def test_raw_gae_is_its_definition_over_the_valid_tokens(name, gamma, lam):
  rew, val, mask = (np.asarray(x, np.float32) for x in CASES[name])
  raw, returns = adv.token_gae.gae(jnp.asarray(rew), jnp.asarray(val), jnp.asarray(mask, bool), gamma=gamma, lam=lam)
  m = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(raw)[m], _compressed_gae(rew, val, mask, gamma, lam)[m], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(returns), np.asarray(raw) + val, rtol=1e-6, atol=1e-6)


def test_gamma_one_lambda_one_gives_returns_to_go_minus_values():
  rng = np.random.default_rng(0)
  R, T = 6, 9
  rew = rng.normal(size=(R, T)).astype(np.float32)
  val = rng.normal(size=(R, T)).astype(np.float32)
  mask = rng.random((R, T)) < 0.7
  mask[0] = False          # an all-masked row
  mask[1] = np.arange(T) == 4   # one valid token
  raw, returns = adv.token_gae.gae(jnp.asarray(rew), jnp.asarray(val), jnp.asarray(mask), gamma=1.0, lam=1.0)
  to_go = np.flip(np.cumsum(np.flip(np.where(mask, rew, 0.0), 1), 1), 1)   # rewards of valid tokens from t on
  np.testing.assert_allclose(np.asarray(raw)[mask], (to_go - val)[mask], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(returns)[mask], to_go[mask], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(raw)[0] == 0)   # nothing valid: no advantage
  # Whitened over the valid tokens: mean 0, unbiased variance 1 there.
  white, _ = adv.gae_advantages(jnp.asarray(rew), jnp.asarray(val), jnp.asarray(mask), gamma=1.0, lam=1.0)
  w = np.asarray(white)[mask].astype(np.float64)
  assert abs(w.mean()) < 1e-5 and w.var(ddof=1) == pytest.approx(1.0, rel=1e-4)


def test_whitening_degenerate_masks_stay_finite():
  x = jnp.array([[3.0, 1.0]])
  assert np.all(np.asarray(adv.masked_whiten(x, jnp.array([[True, False]])))[0, 0] == 0.0)   # one token
  assert np.all(np.isfinite(np.asarray(adv.masked_whiten(x, jnp.zeros((1, 2), bool)))))       # none


def test_outcome_reward_sits_on_the_last_loss_token():
  mask = jnp.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], bool)
  out = np.asarray(adv.outcome_token_rewards(jnp.array([2.0, 5.0, -1.0]), mask))
  expected = np.zeros((3, 5), np.float32)
  expected[0, 3], expected[2, 0] = 2.0, -1.0
  np.testing.assert_array_equal(out, expected)


def test_recipe_passes_outcome_rewards_and_checks_its_settings():
  rewards = jnp.array([[1.0, 0.0, 0.5]])
  values, mask = adv.apply(adv.build("gae", gamma=0.99, lam=0.9), rewards, mask=jnp.array([[True, True, False]]))
  assert values.tolist() == [[1.0, 0.0, 0.0]] and mask.tolist() == [[True, True, False]]
  for bad in ({"lam": 1.5}, {"gamma": -0.1}, {"beta": 1.0}):
    with pytest.raises(ValueError, match="rl.advantage_kwargs"):
      adv.build("gae", **bad)
