"""Shared test set-up: fp32 matmuls on CPU and the benchmark folder (packaged unless overridden)."""
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = pathlib.Path(__file__).resolve().parents[1]
# $ROLLOUTS_JAX_BENCHMARKS, else the files shipped in the package (rollouts_jax.data.benchmarks.PACKAGED_DIR).
BENCHMARKS = pathlib.Path(os.environ.get("ROLLOUTS_JAX_BENCHMARKS") or REPO / "rollouts_jax" / "data" / "benchmark_files")


import gc  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402


def load_script(name: str):
  """The script module `experiments.<name>` (a dotted name: "studies.reproduce", "benchmarks.bench_gpu").

  Tests may import it directly too (`from experiments.studies import reproduce`); pytest.ini puts
  the repository root on sys.path.
  """
  return importlib.import_module(f"experiments.{name}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module.

  The default suite compiles thousands of programs in one process; kept alive, they made
  XLA:CPU crash (segfault or abort inside a later compilation) late in a full run.
  """
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A module's dataset / warm-start cache (`ROLLOUTS_JAX_CACHE`): built by its first test, reused by the rest.

  Kept here rather than in a second conftest.py: test files import `load_script` with
  `from conftest import ...`, which a nested conftest.py would shadow.
  """
  root = tmp_path_factory.mktemp("cache")
  mp = pytest.MonkeyPatch()
  mp.setenv("ROLLOUTS_JAX_CACHE", str(root))
  yield root
  mp.undo()


def moved_from_warm_start(exp, params) -> float:
  """The largest change of any parameter of `params` (a tree) from `exp`'s warm start.

  The smoke model's rewards are all zero, so its updates are zero unless a test adds a gradient
  (an entropy bonus); a test that compares the params of two runs checks this is > 0 first.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import loop  # pylint: disable=g-import-not-at-top
  start = loop.load_policy(exp, loop.load_task(exp)[0])[1]
  diffs = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params, start)
  return max(jax.tree_util.tree_leaves(diffs))
