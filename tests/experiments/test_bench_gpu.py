"""experiments/benchmarks/bench_gpu.py: its dry run (CPU, tiny shapes) and the numbers in its JSON.

The accelerator run itself needs a GPU; here the same code runs with the Pallas kernel
interpreted, and the tests check properties of what it writes: the kernel output against
the float64 reference, byte counts against the formats' definitions, and every derived
figure (bytes/s, roofline fraction, speedups, tokens/s) against the times it came from.
"""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from rollouts_jax import models  # noqa: E402
from conftest import load_script  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "benchmarks" / "bench_gpu.py"


bench = load_script("benchmarks.bench_gpu")
# The sections' modules (`experiments/benchmarks/gpu/`).
common, matmul, sampler, rl_mod = (load_script(f"benchmarks.gpu.{m}")
                                   for m in ("common", "matmul", "sampler", "rl_step"))


def _close(a, b, rel=1e-9):
  return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def _fp4_weight_bytes(k, n, fmt):
  block = {"nvfp4": 16, "mxfp4": 32}[fmt]
  k_pad = -(-k // block) * block
  return k_pad // 2 * n + k_pad // block * n + 4  # codes, one-byte block scales, fp32 tensor scale


def _check_throughput(entry, bw):
  assert entry["time_s"] > 0
  assert _close(entry["bytes_per_s"], entry["bytes"] / entry["time_s"])
  assert _close(entry["roofline_fraction"], entry["bytes"] / entry["time_s"] / bw)


def _check_matmul_record(rec, bw):
  k, n, m, fmt = rec["k"], rec["n"], rec["m"], rec["fmt"]
  # The kernel's output matches x @ dequantize(W) for every setting it used.
  for key in ("check_default", "check_best", "check_wide"):
    if key in rec:
      assert rec[key]["max_err_normalized"] <= rec["tolerance"], (key, rec[key])
  assert rec["ok"] and rec["max_err_normalized"] <= rec["tolerance"]
  assert rec["bf16_max_err_normalized"] <= rec["tolerance"]
  for s in rec["sweep"]:
    if "time_s" in s:
      assert s["max_err_normalized"] <= rec["tolerance"]
  # Bytes follow the formats' definitions.
  assert rec["weight_bytes"]["bf16"] == 2 * k * n
  assert rec["weight_bytes"][fmt] == _fp4_weight_bytes(k, n, fmt)
  assert rec["io_bytes"] == 2 * m * k + 2 * m * n
  assert rec["working_set_bytes"]["bf16"] == rec["stack"] * 2 * k * n
  # Throughput and speedups come from the recorded times and bytes.
  assert _close(rec["io_bytes_wide"], 2 * m * k / rec["stack"] + 2 * m * n)
  for setting, io in (("in_scan", rec["io_bytes"]), ("wide", rec["io_bytes_wide"])):
    entries = {name: e for name, e in rec[setting].items() if isinstance(e, dict)}
    for name, e in entries.items():
      _check_throughput(e, bw)
      weight = rec["weight_bytes"]["bf16" if name == "bf16" else fmt]
      assert _close(e["bytes"], weight + io)
  s = rec["in_scan"]
  assert _close(s["speedup_vs_bf16"], s["bf16"]["time_s"] / s[s["fp4_kept"]]["time_s"])
  assert _close(rec["wide"]["speedup_vs_bf16"], rec["wide"]["bf16"]["time_s"] / rec["wide"]["fp4_default"]["time_s"])


@pytest.fixture(scope="module")
def matmul_dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench_gpu") / "dry.json"
  # M = 3 is not a multiple of the row block: the kernel pads and slices.
  data = bench.main(["--dry_run", f"--out={out}", "--sections=matmul", "--models=qwen2.5-0.5b", "--ms=3",
                     "--sweep_ms=3", "--sweep_max=1", "--max_layer_shapes=1", "--reps=1"])
  return data, json.loads(out.read_text())


def test_dry_run_json_is_marked_and_matches_what_main_returns(matmul_dry_run):
  data, on_disk = matmul_dry_run
  assert on_disk == json.loads(json.dumps(common._jsonable(data)))
  assert on_disk["dry_run"] is True and "not GPU" in on_disk["claims"]
  assert on_disk["env"]["backend"] == "cpu"
  assert on_disk["sections"]["matmul"]["status"] == "done"


def test_dry_run_matmul_matches_reference_and_its_numbers_agree(matmul_dry_run):
  _, data = matmul_dry_run
  bw = data["hbm_bandwidth_bytes_per_s"]
  assert bw == 4.8e12
  recs = data["sections"]["matmul"]["records"]
  assert {r["fmt"] for r in recs} == {"nvfp4", "mxfp4"}
  assert all(r["m"] == 3 for r in recs)
  for rec in recs:
    _check_matmul_record(rec, bw)
  # The summary's per-step sums are the layer-weighted sums of the records.
  summ = data["summary"]["matmul_decode_linear_layers"]["qwen2.5-0.5b"]
  L = data["models"]["qwen2.5-0.5b"]["num_layers"]
  for rec in recs:
    row = summ[rec["fmt"]][str(rec["m"])]
    count = len(rec["layers"]) * L
    s = rec["in_scan"]
    assert _close(row["bf16_s"], count * s["bf16"]["time_s"])
    assert _close(row["fp4_s"], count * s[s["fp4_kept"]]["time_s"])
  assert data["summary"]["kernel_matches_reference"] is True


def test_kv_cache_bytes_equal_the_model_cache():
  cfg = common.qwen05b_config(tiny=True)
  cache = models.init_cache(cfg, 6, 40, jnp.bfloat16)
  assert sampler.kv_cache_bytes(cfg, 6, 40, 2) == cache.k.nbytes + cache.v.nbytes


def test_kv_read_per_step_is_the_mean_over_steps_of_prompt_and_generated_caches():
  cfg = common.qwen05b_config(tiny=True)
  B, N, P, T = 3, 5, 7, 11
  per_step = [sampler.kv_cache_bytes(cfg, B, P, 2) + sampler.kv_cache_bytes(cfg, B * N, t, 2) for t in range(T)]
  assert _close(sampler.kv_read_bytes_per_step(cfg, B, N, P, T, 2), sum(per_step) / T)


def test_error_text_drops_machine_paths():
  text = f"NameError: at {SCRIPT}:12 and /opt/x/lib/python3.12/site-packages/jax/a.py"
  assert common._scrub(text) == "NameError: at experiments/benchmarks/bench_gpu.py:12 and jax/a.py"


def test_real_size_model_is_qwen25_05b():
  cfg = common.qwen05b_config(tiny=False)
  # Qwen2.5-0.5B has 494M parameters (tied embeddings, QKV bias).
  assert round(cfg.num_params() / 1e6) == 494
  shapes = common.layer_shapes(cfg)
  assert shapes == {(896, 896): ["q", "o"], (896, 128): ["k", "v"], (896, 4864): ["gate", "up"],
                    (4864, 896): ["down"]}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,k,n", [(1, 896, 128), (128, 896, 4864), (8, 4864, 896)])
def test_sweep_candidates_obey_the_triton_rules_and_need_no_padding(fmt, m, k, n):
  block = {"nvfp4": 16, "mxfp4": 32}[fmt]
  cands = matmul.sweep_candidates(m, k, n, fmt, limit=8)
  assert 1 < len(cands) <= 8
  assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
  for c in cands:
    bm, bn, bk = c["block_m"], c["block_n"], c["block_k"]
    assert all(v & (v - 1) == 0 for v in (bm, bn, bk))
    assert bm >= 16 and bn >= 16 and bk // 2 >= 16 and bk % block == 0
    assert n % bn == 0 and k % bk == 0


def test_checked_call_names_a_changed_signature():
  def rl_step(state, batch, ref, *, cfg, rl):
    return state + batch
  assert rl_mod.checked_call(rl_step, "rl_step", "(...)", 1, 2, None, cfg=0, rl=0) == 3
  with pytest.raises(rl_mod.TrainingAPIChanged, match=r"rl_step changed.*signature is now rl_step\(state, batch"):
    rl_mod.checked_call(rl_step, "rl_step", "(...)", 1, 2, None, cfg=0, rl=0, temperature=1.0)


def test_build_batch_fills_old_and_new_field_names_and_rejects_unknown_required_ones():
  @dataclasses.dataclass
  class Old:
    prompt_ids: object
    completion_ids: object
    rollout_logprobs: object
    group_mask: object

  @dataclasses.dataclass
  class New:
    prompt_ids: object
    completion_ids: object
    behaviour_logprobs: object
    sample_mask: object
    entropy: object = None

  @dataclasses.dataclass
  class Unknown:
    prompt_ids: object
    advantages: object

  data = {"prompt_ids": "P", "completion_ids": "C", "logprobs": "LP", "ones_BxN": "1", "entropy": "E"}
  data.update({k: None for k in ("prompt_mask", "completion_mask", "rewards", "zeros_BxN", "zeros_BxNxT",
                                 "prompt_index")})
  assert rl_mod.build_batch(Old, data) == Old("P", "C", "LP", "1")
  assert rl_mod.build_batch(New, data) == New("P", "C", "LP", "1", "E")
  with pytest.raises(rl_mod.TrainingAPIChanged, match=r"new required: \['advantages'\]"):
    rl_mod.build_batch(Unknown, data)


def test_imports_work_without_the_packages_the_gpu_image_lacks():
  # The GPU image has no tensorflow_datasets, ml_collections or math_verify.
  code = (
      "import sys, importlib.abc\n"
      "class B(importlib.abc.MetaPathFinder):\n"
      "  def find_spec(self, name, path, target=None):\n"
      "    if name.split('.')[0] in {'tensorflow_datasets', 'ml_collections', 'math_verify', 'tensorflow'}:\n"
      "      raise ImportError('blocked ' + name)\n"
      "sys.meta_path.insert(0, B())\n"
      "from experiments.benchmarks import bench_gpu\n"
      "from experiments.benchmarks.gpu import common, rl_step\n"
      "cfg, info = common.default_small_config()\n"
      "rl_step.training_api()\n"
      "from rollouts_jax import sampling, models\n"
      "print(cfg.vocab_size, cfg.hidden_size)\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]
  from rollouts_jax.data import CharTokenizer
  assert res.stdout.split()[0] == str(CharTokenizer.default().vocab_size)


@pytest.mark.slow
def test_full_dry_run_has_every_section_and_consistent_numbers(tmp_path):
  out = tmp_path / "dry.json"
  bench.main(["--dry_run", f"--out={out}"])
  data = json.loads(out.read_text())
  bw = data["hbm_bandwidth_bytes_per_s"]
  for name in common.SECTIONS:
    sec = data["sections"][name]
    assert sec["status"] == "done", (name, sec["status"], sec["errors"][:2], sec["skipped"][:2])
    assert sec["records"], name
  assert all(r["ok"] for r in data["sections"]["lowering"]["records"])
  for rec in data["sections"]["matmul"]["records"]:
    _check_matmul_record(rec, bw)
  samp = data["sections"]["sampler"]["records"]
  assert {r["weights"] for r in samp} == {"bf16", "nvfp4"}
  for r in samp:
    assert r["tokens"] == r["batch"] * r["num_samples"] * r["new_tokens"]
    assert _close(r["tokens_per_s"], r["tokens"] / r["time_s"])
    assert _close(r["step_s"], r["time_s"] / r["new_tokens"])
    assert r["step_bytes"] == r["weight_bytes"] + r["kv_read_bytes"]
    assert _close(r["roofline_fraction"], r["step_bytes"] / r["step_s"] / bw)
    assert r["kv_read_bytes"] < r["kv_full_cache_bytes"]
    assert r["sample_chunk"] == r["num_samples"]
  by_w = {r["weights"]: r for r in samp if r["model"] == "qwen2.5-0.5b"}
  assert by_w["nvfp4"]["weight_bytes"] < by_w["bf16"]["weight_bytes"]
  (rl,) = data["sections"]["rl_step"]["records"]
  assert rl["grad_norm_finite"]
  assert _close(rl["step_s"], rl["rollout_s"] + rl["update_s"], rel=1e-6)
