"""experiments/benchmarks/bench_shared_prompt.py: arguments and a tiny run (its numbers are what its times give)."""
import json

import pytest

from conftest import load_script

bench = load_script("benchmarks.bench_shared_prompt")


def test_arguments_are_checked():
  args = bench.parse_args([])
  assert (args.B, args.N, args.T, args.micro, args.chunk) == (8, 8, 96, 16, None)
  with pytest.raises(ValueError, match="--shape must be BxNxT"):
    bench.parse_args(["--shape=8x8"])
  with pytest.raises(ValueError, match="--micro=5 must divide the batch's 64 rows"):
    bench.parse_args(["--micro=5"])


def test_a_tiny_run_reports_its_own_ratio_and_equal_updates(tmp_path):
  out = tmp_path / "r.json"
  result = bench.main(["--tiny", "--shape=2x4x4", "--micro=4", "--repeats=1", f"--out={out}"])
  assert json.loads(out.read_text())["shape"] == "2x4x4"
  med = result["median_step_s"]
  assert result["speedup_shared_over_rows"] == pytest.approx(med["rows"] / med["shared"])
  P = result["prompt_len"]
  assert result["rows_per_shared_prompt"] == 4
  assert result["logprob_chunk"] == 8   # configs/smollm2_addition.py's, as the docstring says
  assert min(result["matmul_peak_gflops"].values()) > 0
  assert result["layer_tokens_per_step"] == {"rows": 8 * (P + 4), "shared": 8 * 4 + 2 * P}
  assert result["max_param_diff_after_first_step"] <= 1e-6 < result["max_param_change_first_step"]
  assert set(result["first_step_relative_difference"]) == {"loss", "grad_norm", "policy_entropy"}
  assert max(result["first_step_relative_difference"].values()) <= 1e-4
