"""experiments/benchmarks/bench_lora.py at the tiniest shape on a random model: what its numbers stand on (no timing asserted)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from conftest import load_script  # noqa: E402

bench = load_script("benchmarks.bench_lora")


def test_tiny_run_reports_bytes_and_ratios_its_numbers_give(tmp_path):
  out = tmp_path / "bench.json"
  r = bench.main(["--tiny", "--shape=2x2x4", "--prompt_len=4", "--micro=2", "--repeats=2", f"--output={out}"])
  assert out.exists()
  full, lo = r["bytes"]["full"], r["bytes"]["lora"]
  assert full["trained_param_count"] == r["params"]
  # Adam: two float32 moments per trained parameter (+ counters).
  assert 8 * full["trained_param_count"] <= full["optimizer_state"] <= 8 * full["trained_param_count"] + 64
  assert 8 * lo["trained_param_count"] <= lo["optimizer_state"] <= 8 * lo["trained_param_count"] + 64
  assert r["optimizer_state_ratio"] == pytest.approx(lo["optimizer_state"] / full["optimizer_state"])
  # Rank 4 on every projection of 2 layers: 2 * sum(r * (in + out)).
  d, f, kv = 32, 64, 16
  assert lo["trained_param_count"] == 2 * 4 * ((d + d) * 2 + (d + kv) * 2 + (d + f) * 2 + (f + d))
  assert len(r["step_s"]["full"]) == len(r["step_s"]["lora"]) == 2
  assert r["step_time_ratio_lora_over_full"] == pytest.approx(r["median_step_s"]["lora"] / r["median_step_s"]["full"])
  assert r["nonfinite"] == {"full": 0.0, "lora": 0.0}
  assert "optimizer state lora / full" in bench.report(r)
  jax.clear_caches()
