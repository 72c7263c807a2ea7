"""experiments/benchmarks/bench_real_lm.py: its helpers (fast) and one end-to-end run at the tiniest shapes (slow).

The end-to-end run loads SmolLM2-135M twice over (ours and transformers'), compiles our sampler
and update and trains TRL for two steps, in this process and in the peak-memory children: a
few minutes on a CPU, so it is marked slow. It checks what the numbers stand on (the same
weights and tokens on both sides, every side producing B*N*T tokens, each child importing only
its own side's framework) and that every reported ratio is the one its times give; no timing
is asserted.
"""
import doctest
import json
import math
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rollouts_jax.models import ModelConfig  # noqa: E402
from conftest import load_script  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]

bench = load_script("benchmarks.bench_real_lm")
real_lm = load_script("benchmarks.real_lm")

# SmolLM2-135M's shape (tied embeddings); transformers counts 134,515,008 parameters for it.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, tie_word_embeddings=True)


def test_doctests():
  assert doctest.testmod(bench).failed == 0 and doctest.testmod(real_lm).failed == 0


def test_the_benchmarks_share_one_experiment():
  """bench_real_lm (ours against TRL) and memory_real_lm run the same GRPO experiment at a shape."""
  mem = load_script("benchmarks.memory_real_lm")
  assert bench.grpo_experiment is mem.grpo_experiment is real_lm.grpo_experiment
  exp = real_lm.grpo_experiment(2, 8, 4, 0, rl__steps=5, model__remat=True)
  assert (exp.control.prompts_per_step, exp.rollout.num_samples, exp.rollout.max_new_tokens) == (2, 8, 4)
  assert exp.data.task == "gsm8k" and exp.rl.steps == 5 and exp.model.remat and not exp.control.dynamic_sampling
  with pytest.raises(ValueError, match="--grpo_shape must be BxNxT"):
    bench.parse_args(["--grpo_shape=8x8"])


def test_parse_args_defaults_and_shapes():
  args = bench.parse_args([])
  assert args.shape_list == [(4, 8, 64), (16, 8, 128)]
  assert args.grpo == (8, 8, 96)
  assert args.repeats == 3 and args.only == "all"
  assert args.out.endswith("experiments/benchmarks/results/bench_real_lm.json")
  with pytest.raises(ValueError):
    bench.parse_shape("4x8")


def test_left_pad_puts_real_tokens_right():
  ids, mask = bench.left_pad([[5, 6, 7], [8]], pad_id=2)
  assert ids.tolist() == [[5, 6, 7], [2, 2, 8]]
  assert mask.tolist() == [[True, True, True], [False, False, True]]
  assert ids.dtype == np.int32


def test_decode_flops_count_smollm2():
  assert SMOLLM2.num_params() == 134_515_008
  # Tied: the output head is the embedding, so the matmul params are all params.
  per_token = bench.decode_flops_per_token(SMOLLM2, context=150.0)
  assert per_token == 2 * 134_515_008 + 2 * 2 * 30 * 9 * 64 * 150.0
  # Untied: the input embedding is a gather (not counted), the head is counted once.
  untied = SMOLLM2.replace(tie_word_embeddings=False)
  assert bench.decode_flops_per_token(untied, 0.0) == 2 * (untied.num_params() - 49152 * 576)


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path):
  out = tmp_path / "bench.json"
  B, N, T = 1, 2, 4
  GB, GN, GT = 2, 2, 8
  cmd = [sys.executable, "-m", "experiments.benchmarks.bench_real_lm", "--only=all", f"--shapes={B}x{N}x{T}", f"--grpo_shape={GB}x{GN}x{GT}",
         "--grpo_micro=0", "--repeats=1", "--matmul_size=256", f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-4000:]
  r = json.loads(out.read_text())
  assert "| B x N x T |" in proc.stdout and "| side | s / step |" in proc.stdout  # the markdown tables

  # The same weights and the same prompt tokens on both sides.
  assert r["weights_max_abs_logit_diff"] < 1e-3
  assert r["hf_tokenization_matches"] is True

  (s,) = r["sampler"]
  assert s["tokens"] == s["ours_tokens"] == s["generate_tokens"] == B * N * T
  for side in ("ours", "generate"):
    assert s[f"{side}_first_call_s"] > 0 and len(s[f"{side}_s"]) == 1
    assert math.isclose(s[f"{side}_tokens_per_s"], B * N * T / s[f"{side}_median_s"])
  assert math.isclose(s["ratio_ours_over_generate"], s["ours_tokens_per_s"] / s["generate_tokens_per_s"])

  g = r["grpo"]
  assert g["ours_tokens_per_step"] == GB * GN * GT and g["ours_completion_width"] == GT
  assert g["ours_nonfinite_steps"] == 0
  assert math.isclose(g["ours_update_over_sample"], g["ours_update_median_s"] / g["ours_sample_median_s"])
  assert 0 < g["ours_sample_median_s"] <= g["ours_collect_median_s"] < g["ours_step_median_s"]
  if "trl_skipped" not in g:
    assert g["trl_mean_completion_length"] == GT  # TRL's completions are exactly T tokens too
    assert len(g["trl_step_s"]) == len(g["ours_step_s"]) == 1
    assert 0 < g["trl_generate_median_s"] <= g["trl_generate_and_score_median_s"] < g["trl_step_median_s"]
    assert math.isclose(g["ratio_trl_over_ours_step_s"], g["trl_step_median_s"] / g["ours_step_median_s"])

  sides = {row["side"]: row for row in r["rss"]}
  for side, framework, other in (("ours_sampler", "jax", "torch"), ("generate", "torch", "jax"),
                                 ("ours_grpo", "jax", "torch"), ("trl_grpo", "torch", "jax")):
    row = sides[side]
    if "skipped" in row:
      continue
    assert row["peak_rss_mb"] >= row["rss_after_load_mb"] > 100  # the model alone is ~540 MB of float32
    assert framework in row["imported"] and other not in row["imported"]
  assert sides["ours_sampler"]["tokens"] == sides["generate"]["tokens"] == B * N * T

  fl = r["flops"]
  assert fl["matmul_peak_gflops"] > 0
  (f,) = fl["shapes"]
  context = s["prompt_tokens_mean"] + (T + 1) / 2
  assert math.isclose(f["decode_flops"], B * N * T * bench.decode_flops_per_token(SMOLLM2, context))
  assert math.isclose(f["ours_fraction_of_peak"], f["decode_flops"] / s["ours_median_s"] / (fl["matmul_peak_gflops"] * 1e9))
  assert 0 < f["ours_fraction_of_peak"]
