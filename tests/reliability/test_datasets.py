"""Items 5 and 6 of issue 18: dataset caches under concurrency and change.

5: two processes preparing the same TFDS dataset at once both succeed and read the same
   records (one builds, the other waits for it and reuses the files).
6: a benchmark file whose content changed is noticed: its prepared dataset is keyed by the
   files' content, so the changed file is read, and the old cache is left for the old content.
Also: the benchmark test sets ship inside the package.
"""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

from rollouts_jax.data import benchmarks, builders

REPO = pathlib.Path(__file__).resolve().parents[2]

_PREPARE = textwrap.dedent("""
    import os, sys, time, json, pathlib
    from rollouts_jax.data import builders
    barrier = pathlib.Path(sys.argv[2])
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < 2:  # both processes start preparing at the same moment
      time.sleep(0.001)
    src = builders.load_dataset("countdown", "train", data_dir=sys.argv[1], difficulty=2,
                                num_train=800, num_test=50, seed=7)
    print(json.dumps([len(src), src[0], src[len(src) - 1]]), flush=True)
""")


def test_concurrent_prepare_of_one_dataset_both_succeed(tmp_path):
  barrier = tmp_path / "barrier"
  barrier.mkdir()
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  procs = [subprocess.Popen([sys.executable, "-c", _PREPARE, str(tmp_path / "tfds"), str(barrier)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-1500:] for _, e in outs)
  first, second = (json.loads(o.strip().splitlines()[-1]) for o, _ in outs)
  assert first == second and first[0] == 800


def _write_amc(folder: pathlib.Path, answers):
  folder.mkdir(parents=True, exist_ok=True)
  rows = [{"id": i, "problem": f"What is {a} + 0?", "answer": float(a), "url": "u"} for i, a in enumerate(answers)]
  (folder / "amc23.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_changed_benchmark_file_is_noticed(tmp_path):
  manual = tmp_path / "bench"
  _write_amc(manual, [1, 2, 3])
  first = builders.load_dataset("amc23", "test", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert sorted(r["answer"] for r in first) == ["1", "2", "3"]
  _write_amc(manual, [1, 2, 30, 40])  # the file is corrected in place
  second = builders.load_dataset("amc23", "test", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert sorted(r["answer"] for r in second) == ["1", "2", "30", "40"]
  # Unchanged content reuses its cache; each content has its own folder.
  again = builders.get_builder("amc23", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert again.is_prepared()
  assert len(list((tmp_path / "tfds" / "amc23").iterdir())) == 2
  _write_amc(manual, [1, 2, 3])  # back to the first content: its cache is used again
  assert builders.get_builder("amc23", data_dir=tmp_path / "tfds", manual_dir=manual).is_prepared()
  assert benchmarks.files_digest("amc23", manual) == benchmarks.files_digest("amc23", manual)


def test_benchmarks_ship_with_the_package(monkeypatch):
  monkeypatch.delenv(benchmarks.BENCHMARKS_ENV, raising=False)
  folder = benchmarks.default_benchmarks_dir()
  assert folder == pathlib.Path(benchmarks.__file__).parent / "benchmark_files"
  for name, splits in benchmarks.BENCHMARK_FILES.items():
    for split in splits:
      assert benchmarks.benchmark_file(name, split).is_file()
  assert len(benchmarks.load_benchmark("aime24")) == 30
  assert (folder / "README.md").is_file()
