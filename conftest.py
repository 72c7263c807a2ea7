"""Collection rules for `pytest` run from the repository root.

pytest.ini turns on `--doctest-modules`, which imports every collected `.py` file to look for
`>>>` examples. Under tests/ only test files and conftest.py are meant to be imported by pytest:
the helper scripts there (e.g. tests/sharding/multiprocess_worker.py, which sets XLA_FLAGS at
import time, and the multi-device suite that test_sharding.py runs in a subprocess) are left to
the tests that run them. Naming such a file on the command line still collects it.
"""
import fnmatch
import pathlib

_TESTS = pathlib.Path(__file__).resolve().parent / "tests"


def pytest_ignore_collect(collection_path, config):
  path = pathlib.Path(collection_path)
  if path.suffix != ".py" or path.name == "conftest.py" or _TESTS not in path.resolve().parents:
    return None
  patterns = config.getini("python_files")
  return None if any(fnmatch.fnmatch(path.name, p) for p in patterns) else True
