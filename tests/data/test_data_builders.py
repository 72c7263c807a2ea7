"""TFDS builders: array_record without TensorFlow, determinism, reuse vs rebuild, benchmarks."""
import importlib.util
import os
import pathlib

import pytest

from rollouts_jax.data.benchmarks import default_benchmarks_dir
import tensorflow_datasets as tfds

from rollouts_jax.data import arithmetic, benchmarks, builders, countdown

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = default_benchmarks_dir()  # $ROLLOUTS_JAX_BENCHMARKS, else the files shipped in the package
needs_benchmarks = pytest.mark.skipif(not (BENCHMARKS / "gsm8k_test.jsonl").is_file(),
                                      reason=f"benchmark files not in {BENCHMARKS}")

SMALL = dict(num_train=40, num_test=10)


def _files(builder):
  folder = pathlib.Path(builder.data_dir)
  return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
          for p in folder.iterdir() if "array_record" in p.name}


def test_tensorflow_is_not_needed():
  assert importlib.util.find_spec("tensorflow") is None


def test_countdown_builds_array_record_and_reads_back(tmp_path):
  builder = builders.prepare(builders.get_builder("countdown", data_dir=tmp_path, seed=5,
                                                  difficulty=3, **SMALL))
  files = _files(builder)
  assert files and all(".array_record-" in name for name in files)
  assert builder.info.file_format.value == "array_record"
  assert str(tmp_path) in str(builder.data_dir)  # nothing written under ~/tensorflow_datasets
  train = builders.ExampleSource(builder.as_data_source(split="train"))
  test = builders.load_dataset("countdown", "test", data_dir=tmp_path, seed=5, difficulty=3,
                               **SMALL)
  assert (len(train), len(test)) == (40, 10)
  records = list(train) + list(test)
  for ex in records:
    assert isinstance(ex["solution"], str) and isinstance(ex["target"], int)
    assert countdown.check_solution(ex["solution"], ex["numbers"], ex["target"])
    assert len(ex["numbers"]) == 4 and ex["difficulty"] == 3
  # train and test share no instance
  assert not ({countdown.countdown_key(e) for e in train} &
              {countdown.countdown_key(e) for e in test})
  # the stored records are the generator's (in TFDS' deterministic shuffled order)
  gen_test = countdown.generate_countdown(5, "test", 10, difficulty=3)
  key = lambda e: (e["target"], tuple(e["numbers"]))
  assert sorted(map(key, test)) == sorted(map(key, gen_test))
  # the plain TFDS entry point reads the same files
  name = f"countdown/{builder.builder_config.name}"
  plain = tfds.data_source(name, split="test", data_dir=str(tmp_path))
  assert [builders.decode_example(plain[i]) for i in range(len(plain))] == list(test)


def test_same_config_same_examples_and_different_seed_differs(tmp_path):
  a = builders.load_dataset("arithmetic", "train", data_dir=tmp_path / "a", digits=3, **SMALL)
  b = builders.load_dataset("arithmetic", "train", data_dir=tmp_path / "b", digits=3, **SMALL)
  c = builders.load_dataset("arithmetic", "train", data_dir=tmp_path / "a", digits=3, seed=1,
                            **SMALL)
  assert list(a) == list(b)
  assert list(a) != list(c)
  for ex in a:
    assert ex["answer"] == str(ex["a"] + ex["b"]) and ex["op"] == "+"
    assert ex["solution"] == arithmetic.worked_solution(ex["a"], "+", ex["b"])
  # each parameter set has its own folder
  names = {p.name for p in (tmp_path / "a" / "arithmetic").iterdir() if not p.name.startswith(".")}
  assert names == {"add_d1-3_seed0_train40_test10", "add_d1-3_seed1_train40_test10"}


def test_rebuild_only_when_asked(tmp_path, monkeypatch):
  calls = []
  real = countdown.generate_countdown

  def counting(*args, **kwargs):
    calls.append(args[1])
    return real(*args, **kwargs)

  monkeypatch.setattr(builders.countdown_lib, "generate_countdown", counting)
  first = builders.prepare(builders.get_builder("countdown", data_dir=tmp_path, **SMALL))
  assert sorted(calls) == ["test", "train"]
  before = _files(first)
  records = list(builders.ExampleSource(first.as_data_source(split="train")))

  again = builders.prepare(builders.get_builder("countdown", data_dir=tmp_path, **SMALL))
  assert len(calls) == 2  # reused: the generator did not run
  assert _files(again) == before  # same files, untouched

  rebuilt = builders.prepare(builders.get_builder("countdown", data_dir=tmp_path, **SMALL),
                             rebuild=True)
  assert len(calls) == 4
  after = _files(rebuilt)
  assert after.keys() == before.keys() and after != before  # rewritten
  assert list(builders.ExampleSource(rebuilt.as_data_source(split="train"))) == records


def test_config_validation():
  with pytest.raises(ValueError, match="difficulty"):
    builders.CountdownConfig(difficulty=7)
  with pytest.raises(ValueError, match="num_train"):
    builders.CountdownConfig(num_train=-1)
  with pytest.raises(ValueError, match="ops"):
    builders.ArithmeticConfig(ops="-")
  with pytest.raises(ValueError, match="unknown countdown config keys"):
    builders.get_builder("countdown", data_dir=None, digits=3)
  with pytest.raises(ValueError, match="unknown dataset"):
    builders.get_builder("mnist", data_dir=None)
  assert builders.CountdownConfig(seed=2, difficulty=1, num_train=5, num_test=3).name == (
      "d1_seed2_train5_test3")


def test_parameters_of_a_predefined_config(tmp_path):
  # the same parameters as a predefined config give that config (TFDS refuses a look-alike)
  for name, (builder_cls, _) in builders.SYNTHETIC_BUILDERS.items():
    for predefined in builder_cls.BUILDER_CONFIGS:
      params = builders._config_params(predefined)
      del params["name"]
      for key in ("version", "release_notes", "supported_versions", "tags"):
        params.pop(key)
      builder = builders.get_builder(name, data_dir=tmp_path, **params)
      assert builder.builder_config is predefined
  with pytest.raises(ValueError, match="Cannot name a custom BuilderConfig"):
    builders.Countdown(data_dir=tmp_path, config=builders.CountdownConfig(
        name=builders.Countdown.BUILDER_CONFIGS[0].name, seed=99))


def test_split_without_examples_is_left_out(tmp_path):
  src = builders.load_dataset("arithmetic", "train", data_dir=tmp_path, digits=2, num_train=5,
                              num_test=0)
  assert len(src) == 5
  with pytest.raises(ValueError, match=r"splits \['train'\], not 'test'"):
    builders.load_dataset("arithmetic", "test", data_dir=tmp_path, digits=2, num_train=5,
                          num_test=0)
  with pytest.raises(ValueError, match="both 0"):
    builders.ArithmeticConfig(num_train=0, num_test=0)


@needs_benchmarks
@pytest.mark.parametrize("name,split,size", [("aime24", "test", 30), ("amc23", "test", 40),
                                             ("math500", "test", 500)])
def test_benchmark_builders_match_plain_loader(tmp_path, name, split, size):
  src = builders.load_dataset(name, split, data_dir=tmp_path, manual_dir=BENCHMARKS)
  plain = benchmarks.load_benchmark(name, BENCHMARKS, split)
  assert len(src) == len(plain) == size
  by_id = {row["id"]: row for row in plain}
  assert len(by_id) == size
  for rec in src:
    row = by_id[rec["id"]]
    for key, value in rec.items():
      assert row[key] == value, (name, key)


@needs_benchmarks
def test_gsm8k_builder_both_splits(tmp_path):
  builder = builders.prepare(builders.get_builder("gsm8k", data_dir=tmp_path),
                             manual_dir=BENCHMARKS)
  assert {k: v.num_examples for k, v in builder.info.splits.items()} == {
      "train": 7473, "test": 1319}
  test = builders.ExampleSource(builder.as_data_source(split="test"))
  assert all("," not in test[i]["answer"] for i in range(0, len(test), 50))


def test_benchmark_builder_missing_files(tmp_path):
  empty = tmp_path / "nothing_here"
  empty.mkdir()
  with pytest.raises(benchmarks.BenchmarkFilesMissingError) as info:
    builders.load_dataset("amc23", "test", data_dir=tmp_path / "tfds", manual_dir=empty)
  message = str(info.value)
  assert str(empty / "amc23.jsonl") in message and "ROLLOUTS_JAX_BENCHMARKS" in message
  assert "manual_dir" in message
  with pytest.raises(ValueError, match="only for the benchmark builders"):
    builders.prepare(builders.get_builder("countdown", data_dir=tmp_path, **SMALL),
                     manual_dir=empty)


def test_benchmark_builder_reads_tfds_manual_dir(tmp_path):
  # the plain TFDS route: DownloadConfig(manual_dir=...) with a hand-made file
  manual = tmp_path / "manual"
  manual.mkdir()
  (manual / "amc23.jsonl").write_text(
      '{"id": 3, "problem": "What is $1+1$?", "answer": 2.0, "url": "u"}\n'
      '{"id": 4, "problem": "What is $1/2$?", "answer": 0.5, "url": "v"}\n')
  # The builder is keyed by the content of the files it will read: made for other files, it
  # refuses to build (rather than caching these files under the other files' name).
  other = builders.get_builder("amc23", data_dir=tmp_path / "tfds")
  with pytest.raises(ValueError, match="not the ones this builder was created for"):
    other.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
  builder = builders.get_builder("amc23", data_dir=tmp_path / "tfds", manual_dir=manual)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
  rows = sorted(builders.ExampleSource(builder.as_data_source(split="test")),
                key=lambda r: r["id"])
  assert [(r["id"], r["question"], r["answer"]) for r in rows] == [
      ("3", "What is $1+1$?", "2"), ("4", "What is $1/2$?", "0.5")]
