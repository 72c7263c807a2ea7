"""The multi-turn benchmark at toy sizes: both sides draw the same tokens; the KV side recomputes less."""

from experiments.benchmarks import bench_multiturn


def test_bench_multiturn_runs_at_toy_size(tmp_path):
  out = tmp_path / "b.json"
  r = bench_multiturn.main(["--prompts=2", "--samples=2", "--turns=3", "--turn_tokens=6",
                            "--max_new_tokens=96", "--hidden=32", "--layers=1", "--reps=1", f"--out={out}"])
  assert out.exists() and r["same_tokens"] and r["max_logprob_diff"] < 1e-4
  assert r["turns_mean"] >= 2 and r["recomputed_ratio"] > 2
