"""experiments/benchmarks/memory_real_lm.py: arguments, the table, a child stopped for memory, one real run (slow)."""

import json

import pytest

from conftest import load_script

mem = load_script("benchmarks.memory_real_lm")


def test_arguments():
  args = mem.parse_args(["--variants=plain,all_bf16", "--shape=2x3x4"])
  assert args.variant_list == ["plain", "all_bf16"] and args.shape_tuple == (2, 3, 4)
  assert mem.parse_args([]).variant_list == ["plain", "remat_micro", "all", "all_bf16"]
  assert mem.VARIANTS["all_bf16"] == mem.Variant(remat=True, micro_batch_size=16, logprob_chunk=16,
                                                 compute_dtype="bfloat16")
  with pytest.raises(ValueError, match="--variants"):
    mem.parse_args(["--variants=plain,fast"])
  with pytest.raises(ValueError, match="--shape"):
    mem.parse_args(["--shape=8x8"])


def test_table_reports_a_variant_out_of_memory():
  rows = [dict(variant="plain", options="none (float32)", status="out of memory", peak_rss_mb=20000.0,
               seconds=12.0),
          dict(variant="all", options=mem.VARIANTS["all"].describe(), status="ok", peak_rss_mb=4321.4,
               peak_rss_after_sample_mb=3000.0, compiled_temp_mb=512.0, seconds=80.0)]
  table = mem.markdown(rows, "8x8x96")
  assert "not a benchmark: measured beside other work" in table
  assert "| plain | none (float32) | out of memory | >= 20,000 | - | - | 12 |" in table
  assert "| all | remat, micro 16, logprob_chunk 16 | ok | 4,321 | 3,000 | 512 | 80 |" in table


def test_a_child_past_the_memory_floor_is_stopped_and_reported(tmp_path):
  # A floor above any machine's memory: the child is stopped at once, and the run goes on.
  out = tmp_path / "mem.json"
  result = mem.main(["--variants=plain", "--shape=1x2x4", f"--out={out}", "--min_free_mb=1e12"])
  (row,) = result["rows"]
  assert row["status"] == "out of memory" and "stopped after phase" in row["note"]
  assert json.loads(out.read_text())["rows"][0]["status"] == "out of memory"


@pytest.mark.slow
def test_one_variant_on_the_real_model(tmp_path):
  # About a minute on two CPU cores: loads SmolLM2, samples 1 x 2 x 4, compiles and runs rl_step.
  out = tmp_path / "mem.json"
  mem.main(["--variants=plain", "--shape=1x2x4", f"--out={out}"])
  (row,) = json.loads(out.read_text())["rows"]
  assert row["status"] == "ok" and row["phase"] == "done", row
  assert row["peak_rss_mb"] >= row["peak_rss_after_sample_mb"] >= row["rss_after_load_mb"] > 500
  assert row["state_float_dtypes"] == ["float32"] and row["generated_tokens"] == 8
  if row.get("compiled_temp_mb") is not None:
    assert row["compiled_temp_mb"] > 0
