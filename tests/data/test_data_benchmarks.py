"""The plain benchmark loader: normalized fields against the raw files, clear missing-file errors."""
import json
import os
import pathlib

import pytest

from rollouts_jax.data.benchmarks import default_benchmarks_dir

from rollouts_jax.data import benchmarks

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = default_benchmarks_dir()  # $ROLLOUTS_JAX_BENCHMARKS, else the files shipped in the package
needs_benchmarks = pytest.mark.skipif(not (BENCHMARKS / "gsm8k_test.jsonl").is_file(),
                                      reason=f"benchmark files not in {BENCHMARKS}")


@needs_benchmarks
@pytest.mark.parametrize("name,split,size", [("gsm8k", "test", 1319), ("gsm8k", "train", 7473),
                                             ("math500", "test", 500), ("aime24", "test", 30),
                                             ("amc23", "test", 40)])
def test_sizes_and_fields(name, split, size):
  rows = benchmarks.load_benchmark(name, BENCHMARKS, split)
  assert len(rows) == size
  assert len({r["id"] for r in rows}) == size
  for r in rows:
    assert r["question"] and isinstance(r["question"], str)
    assert r["answer"] and isinstance(r["answer"], str) and r["answer"] == r["answer"].strip()
    assert isinstance(r["solution"], str) and isinstance(r["raw"], dict)


@needs_benchmarks
def test_gsm8k_answer_is_the_number_after_the_marker():
  rows = benchmarks.load_benchmark("gsm8k", BENCHMARKS, "test")
  assert rows[0]["answer"] == "18"  # Janet's ducks: the first test problem
  for r in rows:
    raw_final = r["raw"]["answer"].split("####")[-1].strip()
    assert r["answer"] == raw_final.replace(",", "")
    float(r["answer"])  # a plain number once commas are gone
    assert r["solution"] == r["raw"]["answer"]
  assert any("," in r["raw"]["answer"].split("####")[-1] for r in rows)


@needs_benchmarks
def test_other_benchmarks_by_hand():
  amc = benchmarks.load_benchmark("amc23", BENCHMARKS)
  assert amc[0]["raw"]["answer"] == 27.0 and amc[0]["answer"] == "27"
  aime = benchmarks.load_benchmark("aime24", BENCHMARKS)
  assert all(r["answer"].isdigit() for r in aime)
  assert all(r["question"] == r["raw"]["problem"] for r in aime)
  math = benchmarks.load_benchmark("math500", BENCHMARKS)
  assert math[0]["answer"] == math[0]["raw"]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
  assert all(1 <= r["level"] <= 5 for r in math)


def test_env_var_and_default_dir(monkeypatch, tmp_path):
  monkeypatch.setenv(benchmarks.BENCHMARKS_ENV, str(tmp_path))
  assert benchmarks.default_benchmarks_dir() == tmp_path
  (tmp_path / "aime24.jsonl").write_text(
      json.dumps({"id": 1, "problem": "P?", "solution": "S", "answer": "042", "url": "x"})
      + "\n\n")
  rows = benchmarks.load_benchmark("aime24")  # found through the environment variable
  assert [(r["id"], r["question"], r["answer"], r["solution"]) for r in rows] == [
      ("1", "P?", "042", "S")]
  monkeypatch.delenv(benchmarks.BENCHMARKS_ENV)
  assert benchmarks.default_benchmarks_dir() == benchmarks.PACKAGED_DIR
  assert benchmarks.PACKAGED_DIR.parent == pathlib.Path(benchmarks.__file__).resolve().parent


def test_missing_file_error_says_where(tmp_path, monkeypatch):
  monkeypatch.setenv(benchmarks.BENCHMARKS_ENV, str(tmp_path / "env_dir"))
  with pytest.raises(benchmarks.BenchmarkFilesMissingError) as info:
    benchmarks.load_benchmark("gsm8k", split="train")
  msg = str(info.value)
  assert str(tmp_path / "env_dir" / "gsm8k_train.jsonl") in msg
  assert "ROLLOUTS_JAX_BENCHMARKS" in msg and "manual_dir" in msg
  assert isinstance(info.value, FileNotFoundError)
  with pytest.raises(benchmarks.BenchmarkFilesMissingError, match="math500.jsonl"):
    benchmarks.load_benchmark("math500", tmp_path)


def test_bad_names_and_records(tmp_path):
  with pytest.raises(ValueError, match="unknown benchmark"):
    benchmarks.load_benchmark("mmlu", tmp_path)
  with pytest.raises(ValueError, match="splits"):
    benchmarks.load_benchmark("math500", tmp_path, split="train")
  (tmp_path / "amc23.jsonl").write_text('{"id": 0, "answer": 1.0}\n')
  with pytest.raises(ValueError, match="lacks the field 'problem'"):
    benchmarks.load_benchmark("amc23", tmp_path)
  (tmp_path / "amc23.jsonl").write_text('{"id": 0, \n')
  with pytest.raises(ValueError, match="not valid JSON"):
    benchmarks.load_benchmark("amc23", tmp_path)
  with pytest.raises(ValueError, match="####"):
    benchmarks.gsm8k_final_answer("no marker")
