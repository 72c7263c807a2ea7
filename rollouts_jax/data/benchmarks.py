"""Reasoning benchmarks from local JSONL files (GSM8K, MATH-500, AIME 2024, AMC 2023).

Nothing is downloaded: the test sets ship inside the package (``benchmark_files/``, see its
README for sources and licences). The folder used (the ``manual_dir`` of the TFDS builders)
is, in order: the ``manual_dir`` argument (``data.manual_dir`` in a config), the environment
variable ``ROLLOUTS_JAX_BENCHMARKS``, and the packaged ``benchmark_files/``.
:func:`files_digest` fingerprints a benchmark's files; prepared TFDS datasets are keyed by it,
so an edited file is noticed and rebuilt.

Every record is normalized to ``question`` (the problem text), ``answer`` (the final answer
as a string: GSM8K's number after ``####`` without thousands commas, MATH-500's LaTeX,
AIME's integer, AMC's number with a ``.0`` dropped), ``solution`` (a worked solution, ``""``
when the file has none) and ``id`` (a string), plus the benchmark's other fields;
:func:`load_benchmark` also keeps the untouched JSON object under ``raw``.

>>> rows = load_benchmark("gsm8k", split="test")
>>> rows[0]["answer"]
'18'
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

__all__ = ["BENCHMARK_FILES", "BENCHMARKS_ENV", "BenchmarkFilesMissingError",
           "default_benchmarks_dir", "resolve_manual_dir", "benchmark_file", "files_digest",
           "normalize_record",
           "load_benchmark", "gsm8k_final_answer", "read_jsonl"]

#: The environment variable that names the benchmark folder.
BENCHMARKS_ENV = "ROLLOUTS_JAX_BENCHMARKS"

#: benchmark -> split -> file name inside the benchmark folder.
BENCHMARK_FILES: dict[str, dict[str, str]] = {
    "gsm8k": {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl"},
    "math500": {"test": "math500.jsonl"},
    "aime24": {"test": "aime24.jsonl"},
    "amc23": {"test": "amc23.jsonl"},
}


class BenchmarkFilesMissingError(FileNotFoundError):
  """A benchmark JSONL file is not where it should be."""


#: The benchmark files shipped with the package.
PACKAGED_DIR = pathlib.Path(__file__).resolve().parent / "benchmark_files"


def default_benchmarks_dir() -> pathlib.Path:
  """``$ROLLOUTS_JAX_BENCHMARKS``, else the packaged ``benchmark_files/``."""
  env = os.environ.get(BENCHMARKS_ENV)
  if env:
    return pathlib.Path(env)
  return PACKAGED_DIR


def resolve_manual_dir(manual_dir: str | os.PathLike | None) -> pathlib.Path:
  """The benchmark folder: ``manual_dir`` if given, else :func:`default_benchmarks_dir`."""
  return pathlib.Path(manual_dir) if manual_dir is not None else default_benchmarks_dir()


def benchmark_file(name: str, split: str, manual_dir: str | os.PathLike | None = None,
                   ) -> pathlib.Path:
  """The path of a benchmark split's JSONL file, checked to exist.

  Args:
    name: one of :data:`BENCHMARK_FILES`.
    split: a split of that benchmark.
    manual_dir: the benchmark folder (``None``: see :func:`resolve_manual_dir`).

  Returns:
    The file path.

  Raises:
    ValueError: unknown benchmark or split.
    BenchmarkFilesMissingError: the file is missing; the message says where to put it.
  """
  if name not in BENCHMARK_FILES:
    raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FILES)}")
  if split not in BENCHMARK_FILES[name]:
    raise ValueError(f"benchmark {name!r} has splits {sorted(BENCHMARK_FILES[name])}, "
                     f"not {split!r}")
  folder = resolve_manual_dir(manual_dir)
  path = folder / BENCHMARK_FILES[name][split]
  if not path.is_file():
    how = ("the manual_dir argument" if manual_dir is not None else
           f"the default folder (${BENCHMARKS_ENV} unset or pointing here)")
    raise BenchmarkFilesMissingError(
        f"benchmark {name!r} split {split!r} needs the file {path}, which does not exist. "
        f"This folder came from {how}. Put {BENCHMARK_FILES[name][split]} there (one JSON "
        f"object a line), or point manual_dir (builders: manual_dir=..., TFDS: "
        f"DownloadConfig(manual_dir=...)) or the environment variable {BENCHMARKS_ENV} at "
        f"the folder that holds the benchmark files.")
  return path


def files_digest(name: str, manual_dir: str | os.PathLike | None = None) -> str:
  """A 16-hex-digit SHA-256 of a benchmark's files (every split: name and bytes).

  Args:
    name: one of :data:`BENCHMARK_FILES`.
    manual_dir: the benchmark folder (``None``: see :func:`resolve_manual_dir`).

  Raises:
    BenchmarkFilesMissingError: a file is missing.

  >>> len(files_digest("amc23"))
  16
  """
  h = hashlib.sha256()
  for split in sorted(BENCHMARK_FILES.get(name, {})):
    path = benchmark_file(name, split, manual_dir)
    h.update(f"{split}:{path.name}:".encode())
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  if name not in BENCHMARK_FILES:
    raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FILES)}")
  return h.hexdigest()[:16]


def gsm8k_final_answer(answer_text: str) -> str:
  """The number after GSM8K's ``####`` marker, thousands commas removed.

  >>> gsm8k_final_answer("16 - 3 = <<16-3=13>>13\\n#### 1,300")
  '1300'
  """
  if "####" not in answer_text:
    raise ValueError(f"GSM8K answer has no '####' marker: {answer_text[-80:]!r}")
  return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def _number_string(value: Any) -> str:
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  return str(value).strip()


def normalize_record(name: str, record: dict, index: int) -> dict:
  """Normalizes one JSON object of a benchmark file (see the module docstring).

  Args:
    name: the benchmark.
    record: the parsed JSON object.
    index: its line number (0-based), the ``id`` where the file has none.

  Returns:
    A dict with ``question``, ``answer``, ``solution``, ``id`` and the benchmark's fields.
  """
  try:
    if name == "gsm8k":
      return {"question": record["question"], "answer": gsm8k_final_answer(record["answer"]),
              "solution": record["answer"], "id": str(index)}
    if name == "math500":
      return {"question": record["problem"], "answer": str(record["answer"]),
              "solution": record.get("solution", ""), "id": record["unique_id"],
              "subject": record.get("subject", ""), "level": int(record.get("level", 0))}
    if name in ("aime24", "amc23"):
      return {"question": record["problem"], "answer": _number_string(record["answer"]),
              "solution": record.get("solution") or "", "id": str(record.get("id", index)),
              "url": record.get("url", "")}
  except KeyError as e:
    raise ValueError(f"{name} record {index} lacks the field {e.args[0]!r}") from None
  raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FILES)}")


def read_jsonl(path: pathlib.Path):
  """Yields (line number, parsed object) of a JSONL file, skipping blank lines."""
  with open(path, encoding="utf-8") as f:
    for index, line in enumerate(f):
      if line.strip():
        try:
          yield index, json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{index + 1} is not valid JSON: {e}") from None


def load_benchmark(name: str, manual_dir: str | os.PathLike | None = None,
                   split: str = "test") -> list[dict]:
  """Reads a benchmark split as a list of normalized dicts (no TFDS involved).

  Args:
    name: ``"gsm8k"``, ``"math500"``, ``"aime24"`` or ``"amc23"``.
    manual_dir: the benchmark folder (``None``: ``$ROLLOUTS_JAX_BENCHMARKS`` or the default).
    split: ``"test"`` (all) or ``"train"`` (gsm8k).

  Returns:
    One dict per record in file order: ``question``, ``answer``, ``solution``, ``id``, the
    benchmark's extra fields, and ``raw`` (the JSON object as read).

  >>> len(load_benchmark("aime24"))
  30
  """
  path = benchmark_file(name, split, manual_dir)
  rows = []
  for index, record in read_jsonl(path):
    row = normalize_record(name, record, index)
    row["raw"] = record
    rows.append(row)
  return rows
